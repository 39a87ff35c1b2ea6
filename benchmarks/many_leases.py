"""Many concurrent leases in one worker: 10,000 long-running runs held by one ``orchestrator
serve`` process, their leases renewed in batches, with no lease lost.

What is measured: ``--runs`` (10,000) ``sleepy`` runs with input ``{"steps": 2, "seconds":
40}`` are queued in one statement, then one worker is started with ``--concurrency`` equal to
the number of runs and the default lease (45 s) and heartbeat (15 s), so it holds every run at
once for about 80 s (two 40 s steps, a checkpoint commit between them). While it does, once a
second (``--sample-seconds``) the benchmark reads:

* from the database, in one snapshot: how many runs are queued, running and finished; every
  running run's ``lease_until``, and from it the renewals since the last sample (runs already
  running then whose ``lease_until`` has moved: only a renewal moves it, a checkpoint commit
  leaves it alone, and the rows of one ``renew_leases`` statement become visible together) and
  the spread of those renewals' ``lease_until`` (each row's renewal time, so the spread of one
  batch is about the duration of its statement); the smallest time left on any running lease (its
  headroom: how close a lease came to expiring); the events of the interval (claims,
  checkpoints, ``lease_lost``);
* from the OS (psutil): the worker's CPU time and resident memory, and PostgreSQL's CPU.

Reported: the ramp (worker start to all runs claimed), and over the hold window (from all runs
claimed to the first run finished) renewals/s, the renewal batches (count, size, spread), the
worker's CPU share (average, the busiest sample interval, and the CPU each renewal batch
costs the worker: from the sample before it to the one after it, less the window's median) and
RSS, and the smallest lease headroom. Then every run must finish ``succeeded`` with a count
of 2 (no step lost or repeated), with exactly one claim each, and there must be no lost lease:
no ``lease_lost`` event, and no "lease lost", "renewal refused" or "renewal failed" line in the
worker's log.

Why: a worker whose runs wait on slow models or tools holds many leases at once, and the lease
protocol must keep them all without spurious expiry; the batched renewal (one statement per
heartbeat for all of a worker's leases) is what makes that affordable.

By default an embedded PostgreSQL (``orchestrator.embedded``) with the project's default,
durable settings is started in a temporary directory and removed at the end, also on error,
SIGTERM or Ctrl-C; the worker is killed if still running. ``--dsn`` uses an existing server (a
scratch database is created and dropped there). Everything is bounded by ``--max-seconds``
(240). About 100 seconds with the defaults. Progress on stderr, the table on stdout (``--json``
for JSON). From the repository root: ``.venv/bin/python benchmarks/many_leases.py``.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import Any

import asyncpg

from bench_main import benchmark_parser, run_and_report
from bench_report import fmt, log, render_table, report_heading, server_line, workload
from orchestrator.db.connections import connect
from orchestrator.db.migrations import migrate
from serve_harness import (
    CpuMeter,
    CpuSample,
    ServeProcess,
    Server,
    cpu_shares,
    create_database,
    drop_database,
    queue_runs_sql,
    server_facts,
    settings_for,
)

LEASE_SECONDS = 45.0
"""``serve --lease-seconds`` default, used unchanged (heartbeat: a third of it)."""
STARTUP_SECONDS = 60.0
LOST_LOG_EVENTS = ("lease lost", "renewal refused", "renewal failed")

LOAD_RUNS_SQL = queue_runs_sql(
    "r_lease", "sleepy", "jsonb_build_object('steps', $2::int, 'seconds', $3::float8)"
)

SAMPLE_SQL = """
SELECT clock_timestamp() AS now,
       count(*) FILTER (WHERE state = 'queued') AS queued,
       count(*) FILTER (WHERE state = 'running') AS running,
       count(*) FILTER (WHERE state = 'succeeded') AS succeeded,
       count(*) FILTER (WHERE state NOT IN ('queued', 'running', 'succeeded')) AS other,
       min(lease_until) FILTER (WHERE state = 'running') - clock_timestamp() AS headroom
FROM runs
"""
LEASES_SQL = "SELECT run_id, lease_until FROM runs WHERE state = 'running'"
EVENTS_SQL = """
SELECT kind, count(*) AS n, max(event_id) AS last FROM run_events
WHERE event_id > $1 GROUP BY kind
"""


@dataclass(frozen=True)
class Config:
    dsn: str | None
    json: bool
    runs: int
    steps: int
    step_seconds: float
    claim_batch: int | None
    sample_seconds: float
    max_seconds: float


@dataclass
class Sample:
    at: datetime
    """Database time of the sample."""
    queued: int
    running: int
    succeeded: int
    other: int
    claims: int
    renewals: int
    renewal_spread: float | None
    """Seconds between the first and the last renewal of the interval (database clock)."""
    checkpoints: int
    lost: int
    headroom: float | None
    """Seconds left on the running lease closest to expiry."""
    cpu: CpuSample


@dataclass
class Observed:
    samples: list[Sample] = field(default_factory=list)
    last_event: int = 0
    leases: dict[str, datetime] = field(default_factory=dict)
    """Each running run's ``lease_until`` at the previous sample."""
    started_at: datetime | None = None


async def take_sample(
    connection: asyncpg.Connection, meter: CpuMeter, observed: Observed
) -> Sample:
    cpu = meter.sample()
    async with connection.transaction(isolation="repeatable_read", readonly=True):
        row = await connection.fetchrow(SAMPLE_SQL)
        leases = {r["run_id"]: r["lease_until"] for r in await connection.fetch(LEASES_SQL)}
    assert row is not None
    # A lease that moved since the last sample was renewed, unless it is new (a claim): one
    # statement's rows become visible together, so each renewal is counted once, whole.
    moved = [
        until
        for run_id, until in leases.items()
        if run_id in observed.leases and until > observed.leases[run_id]
    ]
    observed.leases = leases
    kinds: dict[str, int] = {}
    for event in await connection.fetch(EVENTS_SQL, observed.last_event):
        kinds[event["kind"]] = int(event["n"])
        observed.last_event = max(observed.last_event, int(event["last"]))
    claims = kinds.get("claimed", 0)
    spread = (max(moved) - min(moved)).total_seconds() if moved else None
    sample = Sample(
        at=row["now"],
        queued=row["queued"],
        running=row["running"],
        succeeded=row["succeeded"],
        other=row["other"],
        claims=claims,
        renewals=len(moved),
        renewal_spread=spread,
        checkpoints=kinds.get("checkpoint", 0),
        lost=kinds.get("lease_lost", 0),
        headroom=row["headroom"].total_seconds() if row["headroom"] is not None else None,
        cpu=cpu,
    )
    observed.samples.append(sample)
    return sample


async def observe(
    connection: asyncpg.Connection, worker: ServeProcess, meter: CpuMeter, config: Config
) -> Observed:
    """Sample until every run has finished (or the time bound is reached)."""
    observed = Observed()
    deadline = time.monotonic() + config.max_seconds
    all_running_logged = False
    while time.monotonic() < deadline:
        await asyncio.sleep(config.sample_seconds)
        sample = await take_sample(connection, meter, observed)
        if sample.claims:
            log(f"claimed {sample.claims:,}; running {sample.running:,}")
        elif sample.renewals:
            log(
                f"renewed {sample.renewals:,} leases (spread {fmt(sample.renewal_spread, '.3f')}s);"
                f" running {sample.running:,}, headroom {fmt(sample.headroom, '.1f')}s"
            )
        if sample.checkpoints:
            log(f"{sample.checkpoints:,} checkpoints committed")
        if sample.running == config.runs and not all_running_logged:
            all_running_logged = True
            log(f"all {config.runs:,} runs running")
        if sample.lost:
            log(f"LEASE LOST: {sample.lost} lease_lost events")
        if sample.succeeded + sample.other >= config.runs:
            log(f"all runs finished ({sample.succeeded:,} succeeded)")
            break
        if not worker.alive():
            raise RuntimeError(f"the worker exited:\n{worker.tail()}")
    else:
        log(f"WARNING: stopped sampling after {config.max_seconds:.0f}s")
    return observed


def summarise(
    config: Config, observed: Observed, timeline: dict[str, Any], serve_started: datetime
) -> dict[str, Any]:
    samples = observed.samples
    all_claimed: datetime | None = timeline["last_claim"]
    first_finish: datetime | None = timeline["first_finish"]
    window = [
        s
        for s in samples
        if all_claimed is not None
        and s.at > all_claimed
        and (first_finish is None or s.at <= first_finish)
    ]
    hold: dict[str, Any] = {"samples": len(window)}
    if len(window) >= 2:
        seconds = (window[-1].at - window[0].at).total_seconds()
        renewals = sum(s.renewals for s in window[1:])
        batches = renewal_batches(window[1:])
        busiest = max(range(1, len(window)), key=lambda i: interval_cpu(window, i))
        hold.update(
            seconds=seconds,
            renewals=renewals,
            renewals_per_s=renewals / seconds if seconds > 0 else 0.0,
            batches=batches,
            cpu=cpu_shares(window[0].cpu, window[-1].cpu),
            busiest_interval_cpu=interval_cpu(window, busiest),
            busiest_interval=describe_interval(window, busiest),
            renewal_batch_cpu=renewal_batch_cpu(window),
            rss_max=max(s.cpu.rss or 0 for s in window),
            min_headroom=min((s.headroom for s in window if s.headroom is not None), default=None),
            checkpoints=sum(s.checkpoints for s in window[1:]),
        )
    return {
        "ramp_seconds": (
            (all_claimed - serve_started).total_seconds() if all_claimed is not None else None
        ),
        "claim_seconds": (
            (all_claimed - timeline["first_claim"]).total_seconds()
            if all_claimed is not None and timeline["first_claim"] is not None
            else None
        ),
        "hold": hold,
        "min_headroom_overall": min(
            (s.headroom for s in samples if s.headroom is not None), default=None
        ),
        "rss_max_overall": max((s.cpu.rss or 0 for s in samples), default=0),
    }


def interval_cpu(window: Sequence[Sample], index: int) -> float:
    """The worker's CPU (cores) between sample ``index - 1`` and sample ``index``."""
    return cpu_shares(window[index - 1].cpu, window[index].cpu)["process"] or 0.0


def describe_interval(window: Sequence[Sample], index: int) -> str:
    sample, before = window[index], window[index - 1]
    if sample.renewals:
        return f"{sample.renewals:,} leases renewed in it"
    if before.renewals:
        return f"right after {before.renewals:,} leases were renewed"
    if sample.checkpoints:
        return f"{sample.checkpoints:,} checkpoints committed in it"
    return "no renewal or checkpoint in or just before it"


def renewal_batch_cpu(window: Sequence[Sample]) -> list[dict[str, float]]:
    """Worker CPU seconds spent on each single-sample renewal batch: from the sample before it
    to the sample after it (a batch's confirmations are processed once its statement returns,
    often in the next interval), less the window's median CPU for as many intervals."""
    per_interval = sorted(
        (window[i].cpu.process or 0.0) - (window[i - 1].cpu.process or 0.0)
        for i in range(1, len(window))
    )
    baseline = per_interval[len(per_interval) // 2] if per_interval else 0.0
    costs = []
    for i in range(1, len(window) - 1):
        sample = window[i]
        if not sample.renewals or window[i - 1].renewals or window[i + 1].renewals:
            continue
        used = (window[i + 1].cpu.process or 0.0) - (window[i - 1].cpu.process or 0.0)
        seconds = max(used - 2 * baseline, 0.0)
        costs.append(
            {
                "leases": sample.renewals,
                "cpu_seconds": seconds,
                "us_per_lease": 1e6 * seconds / sample.renewals,
            }
        )
    return costs


def renewal_batches(samples: Sequence[Sample]) -> list[dict[str, Any]]:
    """Renewals grouped into batches: consecutive samples with renewals form one batch."""
    batches: list[dict[str, Any]] = []
    current: list[Sample] = []
    for sample in [*samples, None]:
        if sample is not None and sample.renewals:
            current.append(sample)
            continue
        if current:
            spreads = [s.renewal_spread for s in current if s.renewal_spread is not None]
            batches.append(
                {
                    "at": current[0].at.isoformat(),
                    "leases": sum(s.renewals for s in current),
                    "spread_seconds": max(spreads) if len(current) == 1 and spreads else None,
                    "samples": len(current),
                }
            )
            current = []
    return batches


async def timeline_of(connection: asyncpg.Connection) -> dict[str, Any]:
    row = await connection.fetchrow(
        """
        SELECT (SELECT min(at) FROM run_events WHERE kind = 'claimed') AS first_claim,
               (SELECT max(at) FROM run_events WHERE kind = 'claimed') AS last_claim,
               (SELECT count(*) FROM run_events WHERE kind = 'claimed') AS claims,
               (SELECT count(*) FROM run_events WHERE kind = 'lease_lost') AS lease_lost,
               (SELECT count(*) FROM run_events WHERE kind = 'checkpoint') AS checkpoints,
               (SELECT min(finished_at) FROM runs) AS first_finish,
               (SELECT max(finished_at) FROM runs) AS last_finish
        """
    )
    assert row is not None
    return dict(row)


async def final_checks(
    connection: asyncpg.Connection, config: Config, worker: ServeProcess, timeline: dict[str, Any]
) -> dict[str, Any]:
    states = {
        row["state"]: row["n"]
        for row in await connection.fetch("SELECT state, count(*) AS n FROM runs GROUP BY state")
    }
    wrong_results = await connection.fetchval(
        "SELECT count(*) FROM runs WHERE state = 'succeeded' AND (result->>'count')::int <> $1",
        config.steps,
    )
    lost_lines = [line for line in worker.lines if line.get("event") in LOST_LOG_EVENTS]
    statuses = worker.events("status")
    renewal_failures = max((int(s.get("renewal_failures", 0)) for s in statuses), default=0)
    problems = []
    if states.get("succeeded", 0) != config.runs:
        problems.append(f"run states: {states}")
    if wrong_results:
        problems.append(f"{wrong_results} runs finished with a count other than {config.steps}")
    if timeline["claims"] != config.runs:
        problems.append(f"{timeline['claims']} claims for {config.runs} runs")
    if timeline["lease_lost"]:
        problems.append(f"{timeline['lease_lost']} lease_lost events")
    if lost_lines:
        problems.append(f"{len(lost_lines)} lost-lease log lines, e.g. {lost_lines[0]}")
    if renewal_failures:
        problems.append(f"{renewal_failures} renewal failures in the status lines")
    warnings = worker.warnings()
    return {
        "states": states,
        "wrong_results": wrong_results,
        "lease_lost_events": timeline["lease_lost"],
        "lost_log_lines": len(lost_lines),
        "renewal_failures": renewal_failures,
        "warning_lines": len(warnings),
        "warning_examples": warnings[:3],
        "problems": problems,
    }


async def benchmark(server: Server, config: Config) -> dict[str, Any]:
    name = f"bench_leases_{os.getpid()}"
    dsn = await create_database(server.dsn, name)
    worker: ServeProcess | None = None
    try:
        connection = await connect(settings_for(dsn), application_name="bench-sampler")
        try:
            await migrate(connection)
            facts = await server_facts(connection)
            await connection.execute(LOAD_RUNS_SQL, config.runs, config.steps, config.step_seconds)
            await connection.execute("ANALYZE")
            await connection.execute("CHECKPOINT")
            log(
                f"{config.runs:,} sleepy runs queued ({config.steps} steps of "
                f"{config.step_seconds:g}s); starting one worker with --concurrency {config.runs}"
            )
            args = ["--agents", "orchestrator.agents.sleepy", "--concurrency", str(config.runs)]
            if config.claim_batch is not None:
                args += ["--claim-batch", str(config.claim_batch)]
            serve_started: datetime = await connection.fetchval("SELECT clock_timestamp()")
            worker = ServeProcess(dsn, *args, name="holder")
            meter = CpuMeter(worker.pid, server.postmaster_pid)
            await worker.wait_for_event("serving", within=STARTUP_SECONDS)
            observed = await observe(connection, worker, meter, config)
            await worker.stop(within=60)
            timeline = await timeline_of(connection)
            checks = await final_checks(connection, config, worker, timeline)
            summary = summarise(config, observed, timeline, serve_started)
        finally:
            await connection.close()
    finally:
        if worker is not None and worker.alive():
            worker.kill()
        await drop_database(server.dsn, name)
    for problem in checks["problems"]:
        log(f"PROBLEM: {problem}")
    return {
        **report_heading("many_leases"),
        "server": {"embedded": server.embedded, **facts},
        "config": workload(config),
        "lease_seconds": LEASE_SECONDS,
        "heartbeat_seconds": LEASE_SECONDS / 3,
        "summary": summary,
        "timeline": {k: str(v) for k, v in timeline.items()},
        "checks": checks,
        "spurious_lost_leases": checks["lease_lost_events"] + checks["lost_log_lines"],
        "ok": not checks["problems"],
        "samples": [
            {**asdict(s), "cpu": asdict(s.cpu), "at": s.at.isoformat()} for s in observed.samples
        ],
    }


def format_report(report: dict[str, Any]) -> str:
    machine, server, summary, checks = (
        report["machine"],
        report["server"],
        report["summary"],
        report["checks"],
    )
    config, hold = report["config"], summary["hold"]
    out = [
        f"many_leases: {report['date']}, {machine['cpus']} CPUs, {machine['memory_gib']} GiB, "
        f"Python {machine['python']}",
        server_line(server),
        f"one worker, --concurrency {config['runs']}, lease {report['lease_seconds']:g}s, "
        f"heartbeat {report['heartbeat_seconds']:g}s; {config['runs']:,} sleepy runs of "
        f"{config['steps']} x {config['step_seconds']:g}s; sampled every "
        f"{config['sample_seconds']:g}s",
        "",
    ]
    cpu = hold.get("cpu", {})
    batches = hold.get("batches", [])
    sizes = [b["leases"] for b in batches]
    spreads = [b["spread_seconds"] for b in batches if b["spread_seconds"] is not None]
    rows = [
        ("ramp: worker start -> all runs claimed", f"{fmt(summary['ramp_seconds'], '.1f')} s"),
        ("  of which first claim -> last claim", f"{fmt(summary['claim_seconds'], '.1f')} s"),
        ("hold window: all claimed -> first finish", f"{fmt(hold.get('seconds'), '.1f')} s"),
        ("renewals in the window", fmt(hold.get("renewals"))),
        ("renewals/s", fmt(hold.get("renewals_per_s"))),
        (
            "renewal batches (leases each)",
            f"{len(batches)} ({', '.join(f'{n:,}' for n in sizes) or '-'})",
        ),
        (
            "renewal batch spread (~statement time)",
            f"{fmt(min(spreads), '.2f')}-{fmt(max(spreads), '.2f')} s" if spreads else "-",
        ),
        ("checkpoints committed in the window", fmt(hold.get("checkpoints"))),
        ("worker CPU, window average", f"{fmt(cpu.get('process'), '.1%')} of a core"),
        ("worker CPU, busiest 1 s interval", busiest_text(hold)),
        ("worker CPU per renewal batch", batch_cpu_text(hold)),
        ("PostgreSQL CPU, window average", f"{fmt(cpu.get('postgres'), '.1%')} of a core"),
        ("other programs' CPU, window average", f"{fmt(cpu.get('other'), '.2f')} cores"),
        ("worker RSS, max", f"{(summary['rss_max_overall'] or 0) / 2**20:,.0f} MiB"),
        ("smallest lease headroom", f"{fmt(summary['min_headroom_overall'], '.1f')} s"),
        ("runs succeeded", f"{checks['states'].get('succeeded', 0):,} of {config['runs']:,}"),
        (
            "lease_lost events / lost-lease log lines",
            f"{checks['lease_lost_events']} / {checks['lost_log_lines']}",
        ),
        ("renewal failures (status lines)", str(checks["renewal_failures"])),
    ]
    out += render_table(("measure", "value"), rows)
    out += [
        "",
        "spurious lost leases: "
        + ("none" if report["spurious_lost_leases"] == 0 else str(report["spurious_lost_leases"])),
        "checks: " + ("all passed" if report["ok"] else "FAILED: " + "; ".join(checks["problems"])),
    ]
    return "\n".join(out)


def busiest_text(hold: dict[str, Any]) -> str:
    if "busiest_interval" not in hold:
        return "-"
    return f"{hold['busiest_interval_cpu']:.0%} ({hold['busiest_interval']})"


def batch_cpu_text(hold: dict[str, Any]) -> str:
    costs = hold.get("renewal_batch_cpu") or []
    if not costs:
        return "-"
    seconds = [cost["cpu_seconds"] for cost in costs]
    per_lease = [cost["us_per_lease"] for cost in costs]
    return (
        f"{min(seconds):.2f}-{max(seconds):.2f} s ({min(per_lease):.0f}-{max(per_lease):.0f} "
        "µs per lease)"
    )


def parse_args(argv: Sequence[str] | None) -> Config:
    parser = benchmark_parser(
        "One worker holding many leases: renewals/s, CPU, RSS and lost leases."
    )
    parser.add_argument("--runs", type=int, default=10_000, help="runs held at once")
    parser.add_argument("--steps", type=int, default=2, help="steps per run")
    parser.add_argument("--step-seconds", type=float, default=40.0, help="seconds per step")
    parser.add_argument(
        "--claim-batch", type=int, default=None, help="serve --claim-batch (default: its own)"
    )
    parser.add_argument("--sample-seconds", type=float, default=1.0)
    parser.add_argument("--max-seconds", type=float, default=240.0, help="bound on sampling")
    config = Config(**vars(parser.parse_args(argv)))
    if config.runs < 1 or config.steps < 1 or config.step_seconds <= 0:
        parser.error("--runs, --steps and --step-seconds must be positive")
    if config.sample_seconds <= 0 or config.max_seconds <= 0:
        parser.error("--sample-seconds and --max-seconds must be positive")
    return config


def main(argv: Sequence[str] | None = None) -> int:
    config = parse_args(argv)
    report = run_and_report(
        config, "many_leases", lambda server: benchmark(server, config), format_report
    )
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
