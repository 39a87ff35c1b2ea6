"""Deploying new agent code under runs in flight (issue 41's numbers): how soon after a fenced
cutover a worker of the new version claims the runs, and what version matching costs a claim.

Two measurements, in one run, on one PostgreSQL server:

* **Cutover to first claim.** ``--runs`` (1,000) runs of agent ``rollout`` are held by one
  ``orchestrator serve`` of version 1 (``--concurrency`` as many: every run has a lease and
  sits in a step that sleeps for an hour, its checkpoint written by version 1's first step).
  A second ``serve`` of version 2 (which declares an upgrade from every older version) is
  started, and once it logged ``serving``, its LISTEN connection is open and ``--settle-seconds``
  plus a random delay (up to 1 s, from ``--seed``) have passed, ``AgentStore.cutover("rollout",
  2)`` cuts the agent over: in one transaction every run the version-1 worker holds gets its
  fence raised and is due at once, and ``orchestrator_runs`` is NOTIFYed. Then version 3 is
  started beside version 2's worker, which holds the runs now, and so on: ``--cutovers`` (20)
  cutovers, each of every run, each from the worker of the version before, whose ``serve`` is
  stopped after it. The workers are real ``serve`` processes with their defaults (claim batch
  50, poll 2 s, lease 45 s), the agent is this file (``serve --agents cutover``, the version from
  ``ORCHESTRATOR_BENCH_CUTOVER_VERSION``). Times are on the database clock: the cutover's commit
  is its audit row's time (the last clock reading in its transaction, so the commit itself is
  counted in the figures), the claims are the new worker's ``claimed`` events. Reported: p50,
  p99 and max over the cutovers of commit -> the first claim and commit -> every run claimed,
  and of the cutover statement itself (the clock read just before it -> its audit row).
  Target: p99 of commit -> first claim under 1 s.
* **The claim's cost with version matching.** Claims of 50 through ``RunStore.claim`` (due
  runs only, as a busy worker claims) by ``--tasks`` (4) tasks, each on a connection of its own
  opened for the measurement (as a newly started worker's are), until a queue of ``--queue``
  (20,000) runs whose checkpoint version 1 wrote is empty. Each arm has a database of its own
  and its queue is filled afresh (and analysed) before each measurement: ``versions=None`` (no
  matching: the claim as it was called before issue 41) against ``versions={"rollout": ["2",
  "1"]}`` in a database where the agent is cut over to 2 (a version-2 worker upgrading from 1
  after a deploy: the jsonb test on every candidate run and the cutover's row read). A third
  arm, for reference, sends the claim statement with its version conditions taken out (the
  statement as it was before issue 41); it is left out, with a line saying so, when those
  conditions are no longer where this expects them. After a warm-up round, ``--rounds`` (5)
  rounds in an order that rotates every round. Matching's cost as a multiple of an arm's is the
  median of the per-round ratios of the arm's runs/s to matching's. Also reported: the share of
  claims PostgreSQL ran with the statement's generic plan rather than one planned for their
  parameters (``pg_prepared_statements``), and the cores PostgreSQL and other programs used.
  Target: matching's cost at most 1.05x that of ``versions=None``.

Progress goes to stderr, the table to stdout (``--json`` for the report as JSON). Without
``--dsn`` an embedded PostgreSQL with the project's default, durable settings is started and
removed at the end, also on an error, SIGTERM or Ctrl-C; every ``serve`` started is killed and
every scratch database dropped. Every wait is bounded. About a minute and a half with the
defaults. From the repository root: ``.venv/bin/python benchmarks/cutover.py``.
"""

from __future__ import annotations

import asyncio
import os
import random
import re
import statistics
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import anyio
import asyncpg

from bench_main import benchmark_parser, run_and_report
from bench_report import (
    fmt,
    log,
    percentile,
    render_table,
    report_heading,
    server_line,
    verdict,
    workload,
)
from orchestrator.agent.steps import Agent, Finish, Next, Outcome, Step, StepContext
from orchestrator.db.agents import AgentStore
from orchestrator.db.connections import connect, create_pool
from orchestrator.db.executor import TransactionConnection
from orchestrator.db.migrations import migrate
from orchestrator.db.queries import query
from orchestrator.db.store import RunStore
from orchestrator.models import JSON, ClaimedRun
from serve_harness import (
    DURABILITY_SHOWN,
    SERVE_COMMAND,
    Child,
    CpuMeter,
    Server,
    child_env,
    cpu_shares,
    create_database,
    drop_database,
    queue_runs_sql,
    server_facts,
    settings_for,
)

TARGET_P99_SECONDS = 1.0
TARGET_COST_RATIO = 1.05
STARTUP_SECONDS = 60.0
CLAIMS_WITHIN_SECONDS = 60.0
"""A cutover's runs must all be claimed by the new worker within this long."""
BATCH = 50
CLAIMER_VERSIONS = {"rollout": ["2", "1"]}
"""A version-2 worker that upgrades checkpoints written by version 1."""

# -- the agent the ``serve`` processes run (``serve --agents cutover``) ----------------------------

AGENT = "rollout"
VERSION_ENV = "ORCHESTRATOR_BENCH_CUTOVER_VERSION"
HOLD_SECONDS = 3600.0


class Start(Step):
    """Writes the run's first checkpoint (under the worker's version) and moves on."""

    async def run(self, ctx: StepContext) -> Outcome:
        return Next(Hold, checkpoint={"shape": 1})


class Hold(Step):
    """Holds the run's lease for an hour: a run in flight, until a cutover takes it."""

    async def run(self, ctx: StepContext) -> Outcome:
        await anyio.sleep(HOLD_SECONDS)
        return Finish(result={"held": True})


def same_shape(checkpoint: JSON) -> JSON:
    """Every version reads what the older ones wrote: an upgrade that changes nothing."""
    return checkpoint


def rollout_agent(version: int) -> Agent:
    upgrades: dict[int | str, Callable[[JSON], JSON]] = dict.fromkeys(range(1, version), same_shape)
    return Agent(AGENT, first=Start, steps=[Hold], version=version, upgrades=upgrades)


rollout = rollout_agent(int(os.environ.get(VERSION_ENV, "1")))


@dataclass(frozen=True)
class Config:
    dsn: str | None
    json: bool
    only: str
    runs: int
    cutovers: int
    settle_seconds: float
    seed: int
    queue: int
    tasks: int
    rounds: int


async def migrated_database(server: Server, name: str) -> str:
    """A scratch database ``name``, migrated; its DSN."""
    dsn = await create_database(server.dsn, name)
    connection = await connect(settings_for(dsn), application_name="bench-migrate")
    try:
        await migrate(connection)
    finally:
        await connection.close()
    return dsn


# -- cutover to first claim ------------------------------------------------------------------------


def start_worker(dsn: str, version: int, concurrency: int) -> Child:
    """``serve --agents cutover`` of ``version``, importing this file from its own folder."""
    name = f"cutover-v{version}"
    path = os.pathsep.join(
        filter(None, [str(Path(__file__).resolve().parent), os.getenv("PYTHONPATH")])
    )
    env = {**child_env(dsn), "PYTHONPATH": path, VERSION_ENV: str(version)}
    argv = [sys.executable, *SERVE_COMMAND, "--worker-id", name]
    argv += ["--agents", "cutover", "--concurrency", str(concurrency)]
    return Child(argv, env=env, name=name)


async def until(
    check: Callable[[], Awaitable[bool]], worker: Child, what: str, *, within: float
) -> None:
    """Poll ``check`` every 50 ms until it holds; raise if ``worker`` exits or time runs out."""
    deadline = time.monotonic() + within
    while not await check():
        if not worker.alive() or time.monotonic() > deadline:
            raise RuntimeError(
                f"{worker.name}: {what} not within {within:.0f}s (exit code "
                f"{worker.process.poll()}); last lines:\n{worker.tail()}"
            )
        await asyncio.sleep(0.05)


async def start_listening(pool: asyncpg.Pool, dsn: str, version: int, runs: int) -> Child:
    """A worker of ``version``, once it serves and its LISTEN connection is open."""
    worker = start_worker(dsn, version, runs)
    await worker.wait_for_event("serving", within=STARTUP_SECONDS)

    async def listening() -> bool:
        return bool(
            await pool.fetchval(
                "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1",
                f"{worker.name}:listen",
            )
        )

    await until(listening, worker, "a LISTEN connection", within=STARTUP_SECONDS)
    return worker


async def until_held(pool: asyncpg.Pool, worker: Child, runs: int) -> None:
    """Until ``worker`` holds ``runs`` runs at step Hold (their checkpoint written)."""

    async def held() -> bool:
        count = await pool.fetchval(
            "SELECT count(*) FROM runs"
            " WHERE state = 'running' AND lease_owner = $1 AND step = 'Hold'",
            worker.name,
        )
        return bool(count == runs)

    await until(held, worker, f"holding {runs} runs", within=CLAIMS_WITHIN_SECONDS)


@dataclass(frozen=True)
class Cut:
    version: int
    runs_cut: int
    statement_seconds: float
    """The database clock just before the cutover -> its audit row (its last clock reading)."""
    first_claim_seconds: float
    """The cutover's audit row -> the new worker's first ``claimed`` event."""
    all_claimed_seconds: float
    """The cutover's audit row -> the new worker's last ``claimed`` event (every run claimed)."""
    claims: int
    """``claimed`` events of the new worker (must be one per run)."""


CUTOVER_AT_SQL = "SELECT at FROM audit_log WHERE action = 'agent_cutover' ORDER BY seq DESC LIMIT 1"
CLAIMS_SQL = """
SELECT min(at) AS first, max(at) AS last, count(*) AS claims
FROM run_events WHERE kind = 'claimed' AND worker_id = $1
"""


async def cut_over(pool: asyncpg.Pool, version: int, new: Child, runs: int) -> Cut:
    """Cut the agent over to ``version`` (``new``'s); wait until ``new`` holds every run."""
    before: datetime = await pool.fetchval("SELECT clock_timestamp()")
    done = await AgentStore(pool).cutover(AGENT, version)
    if done.runs_cut != runs:
        raise RuntimeError(f"the cutover to {version} took {done.runs_cut} runs, not {runs}")
    await until_held(pool, new, runs)
    committed: datetime = await pool.fetchval(CUTOVER_AT_SQL)
    claims = await pool.fetchrow(CLAIMS_SQL, new.name)
    assert claims is not None  # an aggregate's one row
    return Cut(
        version=version,
        runs_cut=done.runs_cut,
        statement_seconds=(committed - before).total_seconds(),
        first_claim_seconds=(claims["first"] - committed).total_seconds(),
        all_claimed_seconds=(claims["last"] - committed).total_seconds(),
        claims=claims["claims"],
    )


async def cutover_latency(server: Server, config: Config) -> dict[str, Any]:
    name = f"bench_cutover_latency_{os.getpid()}"
    dsn = await migrated_database(server, name)
    rng = random.Random(config.seed)
    workers: list[Child] = []
    cuts: list[Cut] = []
    try:
        pool = await create_pool(settings_for(dsn), application_name="bench-cutover", max_size=2)
        try:
            await pool.execute(queue_runs_sql("r_", AGENT, "'{}'::jsonb"), config.runs)
            old = start_worker(dsn, 1, config.runs)
            workers.append(old)
            await old.wait_for_event("serving", within=STARTUP_SECONDS)
            await until_held(pool, old, config.runs)
            log(f"{config.runs:,} runs held by {old.name}; {config.cutovers} cutovers")
            for version in range(2, config.cutovers + 2):
                new = await start_listening(pool, dsn, version, config.runs)
                workers.append(new)
                await asyncio.sleep(config.settle_seconds + rng.uniform(0.0, 1.0))
                cut = await cut_over(pool, version, new, config.runs)
                cuts.append(cut)
                log(
                    f"  cutover to {version}: first claim {cut.first_claim_seconds:.3f}s, all "
                    f"{cut.runs_cut:,} claimed {cut.all_claimed_seconds:.3f}s after the commit "
                    f"(the cutover statement {cut.statement_seconds:.3f}s)"
                )
                await old.stop(within=30)
                old = new
        finally:
            await pool.close()
    finally:
        for worker in workers:  # the last one still holds every run: no drain
            worker.kill()
        await drop_database(server.dsn, name)
    return summarise_cuts(cuts, config.runs)


def spread(values: Sequence[float]) -> dict[str, float]:
    return {
        "p50": percentile(values, 0.50),
        "p99": percentile(values, 0.99),
        "max": max(values),
    }


def summarise_cuts(cuts: Sequence[Cut], runs: int) -> dict[str, Any]:
    first = spread([cut.first_claim_seconds for cut in cuts])
    return {
        "runs_in_flight": runs,
        "cutovers": len(cuts),
        "commit_to_first_claim": first,
        "commit_to_all_claimed": spread([cut.all_claimed_seconds for cut in cuts]),
        "cutover_statement": spread([cut.statement_seconds for cut in cuts]),
        "every_run_claimed_once": all(cut.claims == runs for cut in cuts),
        "target_met": first["p99"] < TARGET_P99_SECONDS,
        "each": [asdict(cut) for cut in cuts],
    }


# -- the claim's cost with version matching --------------------------------------------------------

QUEUE_SQL = """
INSERT INTO runs (run_id, agent, input, fence, attempt, available_at, step, checkpoint,
                  checkpoint_version, started_version, agent_version)
SELECT 'q_' || lpad(g::text, 7, '0'), $2, '{}'::jsonb, 1, 1,
       clock_timestamp() - interval '1 hour' + g * interval '1 ms', 'Hold', '{"shape": 1}'::jsonb,
       1, '1', '1'
FROM generate_series(1, $1) AS g
"""
"""Runs as a cutover leaves them: a checkpoint version 1 wrote, due at once."""

VERSION_CONDITIONS = re.compile(
    r"\n[ \t]*AND \(r\.agent_version IS NULL OR \$8::jsonb IS NULL [^\n]*"
    r"|\n[ \t]*AND NOT EXISTS \(SELECT 1 FROM agent_cutovers [^\n]*\n[^\n]*\$8::jsonb[^\n]*"
)


def claim_without_versions() -> str | None:
    """The claim statement without its version conditions (as before issue 41), or ``None``
    when they are no longer where this expects them."""
    statement, taken = VERSION_CONDITIONS.subn("", query("claim"))
    return statement if taken == 8 and "$8" not in statement else None


Claim = Callable[[RunStore, TransactionConnection, str], Awaitable[int]]
"""``claim(store, connection, claimer)``: one claim of up to ``BATCH`` runs on ``connection``;
how many it took."""


async def claim_unmatched(store: RunStore, db: TransactionConnection, claimer: str) -> int:
    batch = await store.claim(
        claimer, [AGENT], limit=BATCH, lease_seconds=600, include_expired=False, db=db
    )
    return len(batch.claimed)


async def claim_matching(store: RunStore, db: TransactionConnection, claimer: str) -> int:
    batch = await store.claim(
        claimer,
        [AGENT],
        limit=BATCH,
        lease_seconds=600,
        include_expired=False,
        versions=CLAIMER_VERSIONS,
        db=db,
    )
    return len(batch.claimed)


def claim_by_statement(statement: str) -> Claim:
    """Claims sent as ``statement``, read into ``ClaimedRun``s as ``RunStore.claim`` reads them."""

    async def claim(store: RunStore, db: TransactionConnection, claimer: str) -> int:
        records = await db.fetch(statement, claimer, [AGENT], BATCH, 600.0, False, None, None)
        claimed = [ClaimedRun.from_record(r, claimer) for r in records if r["outcome"] == "claimed"]
        return len(claimed)

    return claim


@dataclass(frozen=True)
class Arm:
    name: str
    label: str
    claim: Claim
    cut_over_to: int | None = None
    """The version the agent is cut over to in this arm's database (``None``: never)."""


@dataclass(frozen=True)
class Measurement:
    runs_per_s: float
    claim_p50_ms: float
    claim_p99_ms: float
    """Percentiles of one claim's time (a statement of ``BATCH`` runs) seen by its task."""
    generic_plans: float
    """The share of claims PostgreSQL ran with the statement's generic plan (the others were
    planned for their parameters: a custom plan, planned anew each time)."""
    postgres: float | None
    """Cores PostgreSQL used meanwhile (embedded server only)."""
    other: float | None
    """Cores other programs used meanwhile: the noise to read the figure against."""


PLANS_SQL = """
SELECT coalesce(sum(generic_plans), 0)::bigint AS generic,
       coalesce(sum(custom_plans), 0)::bigint AS custom
FROM pg_prepared_statements WHERE statement LIKE 'WITH flow AS MATERIALIZED%'
"""
"""How this connection's claim statement was planned (asyncpg prepares each statement)."""


async def claims_per_second(
    dsn: str, arm: Arm, config: Config, postmaster: int | None
) -> Measurement:
    """Fill the arm's queue afresh and claim it all with ``config.tasks`` tasks, each on a
    connection of its own opened for this measurement (as a newly started worker's are)."""
    pool = await create_pool(
        settings_for(dsn), application_name="bench-claims", min_size=1, max_size=config.tasks
    )
    try:
        await pool.execute("TRUNCATE runs, run_events CASCADE")
        await pool.execute(QUEUE_SQL, config.queue, AGENT)
        await pool.execute("VACUUM ANALYZE runs")
        store = RunStore(pool)
        claimed, plans, latencies = 0, {"generic": 0, "custom": 0}, []

        async def claimer(me: str) -> None:
            nonlocal claimed
            async with pool.acquire() as db:
                while True:
                    sent = time.perf_counter()
                    taken = await arm.claim(store, db, me)
                    latencies.append(time.perf_counter() - sent)
                    if not taken:
                        break
                    claimed += taken
                counts = await db.fetchrow(PLANS_SQL)
                assert counts is not None  # an aggregate's one row
                for kind in plans:
                    plans[kind] += counts[kind]

        meter = CpuMeter(None, postmaster)
        first, began = meter.sample(), time.perf_counter()
        with anyio.fail_after(300):
            async with anyio.create_task_group() as group:
                for task in range(config.tasks):
                    group.start_soon(claimer, f"{arm.name}-{task}")
        seconds = time.perf_counter() - began
        shares = cpu_shares(first, meter.sample())  # before the pool's backends exit
    finally:
        await pool.close()
    if claimed != config.queue:
        raise RuntimeError(f"{arm.label}: claimed {claimed} of {config.queue} runs")
    generic = plans["generic"] / max(1, plans["generic"] + plans["custom"])
    return Measurement(
        runs_per_s=claimed / seconds,
        claim_p50_ms=percentile(latencies, 0.50) * 1000,
        claim_p99_ms=percentile(latencies, 0.99) * 1000,
        generic_plans=generic,
        postgres=shares["postgres"],
        other=shares["other"],
    )


def claim_arms() -> list[Arm]:
    arms = [
        Arm("none", "versions=None (no matching)", claim_unmatched),
        Arm("matching", 'versions={"rollout": ["2", "1"]}, cut over to 2', claim_matching, 2),
    ]
    statement = claim_without_versions()
    if statement is None:
        log("the claim statement's version conditions were not found: that arm is left out")
    else:
        arms.append(
            Arm("before", "statement without version conditions", claim_by_statement(statement))
        )
    return arms


async def claim_cost(server: Server, config: Config) -> dict[str, Any]:
    arms = claim_arms()
    names = {arm.name: f"bench_cutover_claims_{arm.name}_{os.getpid()}" for arm in arms}
    dsns: dict[str, str] = {}
    measured: dict[str, list[Measurement]] = {arm.name: [] for arm in arms}
    try:
        for arm in arms:
            dsns[arm.name] = await migrated_database(server, names[arm.name])
            if arm.cut_over_to is not None:
                pool = await create_pool(settings_for(dsns[arm.name]), max_size=1)
                try:
                    await AgentStore(pool).cutover(AGENT, arm.cut_over_to)
                finally:
                    await pool.close()
        for number in range(config.rounds + 1):
            shift = number % len(arms)
            results = {
                arm.name: await claims_per_second(
                    dsns[arm.name], arm, config, server.postmaster_pid
                )
                for arm in [*arms[shift:], *arms[:shift]]
            }
            rates = ", ".join(
                f"{name} {fmt(r.runs_per_s)}/s ({r.generic_plans:.0%} generic plans)"
                for name, r in results.items()
            )
            if number == 0:
                log(f"claims warm-up: {rates}")
                continue
            log(f"claims round {number}: {rates}")
            for name, result in results.items():
                measured[name].append(result)
    finally:
        for name in names.values():
            await drop_database(server.dsn, name)
    return summarise_claims(arms, measured, config)


def summarise_claims(
    arms: Sequence[Arm], measured: dict[str, list[Measurement]], config: Config
) -> dict[str, Any]:
    def rates(name: str) -> list[float]:
        return [measurement.runs_per_s for measurement in measured[name]]

    def matching_cost(name: str) -> float:
        """Matching's cost per run as a multiple of arm ``name``'s: the median over the rounds
        of the arm's runs/s over matching's."""
        pairs = zip(rates(name), rates("matching"), strict=True)
        return statistics.median(theirs / matching for theirs, matching in pairs)

    def median_cores(name: str, part: str) -> float | None:
        cores = [value for m in measured[name] if (value := getattr(m, part)) is not None]
        return statistics.median(cores) if cores else None

    ratio = matching_cost("none")
    return {
        "queue": config.queue,
        "batch": BATCH,
        "tasks": config.tasks,
        "rounds": config.rounds,
        "arms": [
            {
                "arm": arm.name,
                "label": arm.label,
                "runs_per_s": statistics.median(rates(arm.name)),
                "matching_cost_ratio": matching_cost(arm.name),
                "claim_p50_ms": statistics.median(m.claim_p50_ms for m in measured[arm.name]),
                "claim_p99_ms": statistics.median(m.claim_p99_ms for m in measured[arm.name]),
                "generic_plans": statistics.median(m.generic_plans for m in measured[arm.name]),
                "postgres_cores": median_cores(arm.name, "postgres"),
                "other_cores": median_cores(arm.name, "other"),
                "rounds": [asdict(measurement) for measurement in measured[arm.name]],
            }
            for arm in arms
        ],
        "cost_ratio": ratio,
        "target_met": ratio <= TARGET_COST_RATIO,
    }


# -- report ----------------------------------------------------------------------------------------


def render(report: dict[str, Any]) -> str:
    machine = report["machine"]
    out = [
        f"cutover: {report['date']}, {machine['cpus']} CPUs, Python {machine['python']}, "
        f"load average {machine['load_average'][0]:.2f} at the start",
        server_line(report["server"]),
    ]
    cuts = report.get("cutover")
    if cuts:
        out += [
            "",
            f"{cuts['cutovers']} cutovers of {cuts['runs_in_flight']:,} runs in flight to a "
            "new version's idle serve (database clock, seconds)",
            *render_table(
                ["from the cutover's commit", "p50", "p99", "max"],
                [
                    [label, *(fmt(cuts[key][p], ".3f") for p in ("p50", "p99", "max"))]
                    for label, key in (
                        ("to the first claim", "commit_to_first_claim"),
                        (f"to all {cuts['runs_in_flight']:,} claimed", "commit_to_all_claimed"),
                        ("(the cutover statement itself)", "cutover_statement"),
                    )
                ],
            ),
            f"target: commit -> first claim p99 < {TARGET_P99_SECONDS:g}s: "
            f"{verdict(cuts['target_met'])}; every run claimed once by the new worker: "
            f"{'yes' if cuts['every_run_claimed_once'] else 'NO'}",
        ]
    claims = report.get("claims")
    if claims:
        out += [
            "",
            f"claims of {claims['batch']} from a queue of {claims['queue']:,} runs, "
            f"{claims['tasks']} tasks, medians of {claims['rounds']} rounds",
            *render_table(
                [
                    "claim",
                    "runs/s",
                    "matching's cost x",
                    "claim p50 ms",
                    "p99 ms",
                    "generic plans",
                    "postgres cores",
                    "other cores",
                ],
                [
                    [
                        row["label"],
                        fmt(row["runs_per_s"]),
                        fmt(row["matching_cost_ratio"], ".3f"),
                        fmt(row["claim_p50_ms"], ".2f"),
                        fmt(row["claim_p99_ms"], ".2f"),
                        f"{row['generic_plans']:.0%}",
                        fmt(row["postgres_cores"], ".2f"),
                        fmt(row["other_cores"], ".2f"),
                    ]
                    for row in claims["arms"]
                ],
            ),
            f"target: matching's cost <= {TARGET_COST_RATIO:g}x no matching: "
            f"{verdict(claims['target_met'])} ({claims['cost_ratio']:.3f})",
        ]
    return "\n".join(out)


async def benchmark(server: Server, config: Config) -> dict[str, Any]:
    admin = await connect(settings_for(server.dsn), application_name="bench-admin")
    try:
        facts = await server_facts(admin, DURABILITY_SHOWN)
    finally:
        await admin.close()
    report = {
        **report_heading("cutover", load_average=os.getloadavg()),
        "server": {"embedded": server.embedded, **facts},
        "config": workload(config),
    }
    if config.only in ("all", "cutover"):
        report["cutover"] = await cutover_latency(server, config)
    if config.only in ("all", "claims"):
        report["claims"] = await claim_cost(server, config)
    return report


def parse_args(argv: Sequence[str] | None) -> Config:
    parser = benchmark_parser(__doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument("--only", choices=("all", "cutover", "claims"), default="all")
    parser.add_argument("--runs", type=int, default=1000, help="runs in flight at each cutover")
    parser.add_argument("--cutovers", type=int, default=20)
    parser.add_argument(
        "--settle-seconds",
        type=float,
        default=1.0,
        help="wait after the new worker listens before the cutover (plus a random delay)",
    )
    parser.add_argument("--seed", type=int, default=1, help="seed of the random delays")
    parser.add_argument("--queue", type=int, default=20_000, help="runs per claim measurement")
    parser.add_argument("--tasks", type=int, default=4, help="concurrent claimers")
    parser.add_argument("--rounds", type=int, default=5, help="claim rounds after a warm-up")
    config = Config(**vars(parser.parse_args(argv)))
    if min(config.runs, config.cutovers, config.queue, config.tasks, config.rounds) < 1:
        parser.error("--runs, --cutovers, --queue, --tasks and --rounds must be at least 1")
    if config.settle_seconds < 0:
        parser.error("--settle-seconds must not be negative")
    return config


def main(argv: Sequence[str] | None = None) -> int:
    config = parse_args(argv)
    run_and_report(config, "cutover", lambda server: benchmark(server, config), render)
    return 0


if __name__ == "__main__":
    sys.exit(main())
