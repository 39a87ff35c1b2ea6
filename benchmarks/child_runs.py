"""Child runs (issue 42's numbers): what spawning 1,000 children in one commit costs against
1,000 plain submits, and how soon a parent that waits for its children is woken.

Two measurements, in one run, on one PostgreSQL server:

* **Spawn and claims.** ``--children`` (1,000) runs of the no-op agent
  (``orchestrator.agents.noop``) are queued four ways, each in a fresh database copied from a
  migrated template, while an ``orchestrator serve --agents orchestrator.agents.noop``
  (``--concurrency`` 100, ``--claim-batch`` 50) is started, listening, and then held with
  SIGSTOP: ``RunStore.submit`` one by one; ``RunStore.submit`` from ``--tasks`` (8) concurrent
  tasks on a pool of as many connections (there is no bulk submit: this is the fastest way a
  user submits 1,000 runs); and one commit of a parent spawning them all, as the worker's group
  committer writes a step that returned ``Wait(then=..., children=[...])`` (the parent waits
  for all of them) or ``Next(..., children=[...])`` (the parent goes on): in one transaction
  ``commit_steps``, ``spawn_children`` in a savepoint and, for ``Wait``, ``park_many``. The
  parent is a run the benchmark submitted and claimed itself (agent ``bench_spawner``, served
  by nobody). Timed by this process's clock, from building the ``Child`` objects (or the first
  submit) to the commit's return; before it, every arm's database gets the same warm-up (a
  submit per pool connection and a spawn of 10 children on the connection the spawn uses, of
  an agent nobody serves). Then ``VACUUM (ANALYZE)``, ``CHECKPOINT``, and the ``serve`` is
  let go (SIGCONT): the time from its first ``claimed`` event to the last run's ``finished_at``
  (the database clock) is the claims' time. Reported per arm: wall time and CPU per run (this
  process, PostgreSQL, the worker) and WAL bytes per run, for the queueing and for the claims.
  CPU is read from the scheduler's nanosecond counters (``/proc/PID/task/*/schedstat``): a phase
  lasts 50-500 ms, in which psutil's 10 ms ticks summed over a dozen processes would be much of
  the figure. After a warm-up round, ``--rounds`` (5) rounds in an order that rotates every
  round. The baseline of a round is its faster submit arm (its queueing and its claims); each
  arm's ratios to it (queueing, claims, the two together, and their CPU: this process's, the
  worker's and PostgreSQL's) are medians of the per-round ratios. Target (issue 42): spawn +
  claims at most 1.2x the submits + claims. ``--history N`` puts N finished runs (of an agent
  nobody serves) in every database beforehand, as in a database in use for a while.
* **Parent wake-up.** A parent (agent ``bench_fan_in``, this file) whose first step returns
  ``Wait(then=Merge, children=[...])`` with ``--fan-in`` (10) no-op children, and whose second
  step reads their outcomes and finishes; ``--parents`` (50) parents one after another, 50 ms
  apart once the last one has finished (an idle system), after 3 more as a warm-up. Two
  deployments: two ``serve`` processes, one serving the no-op agent (it runs the children),
  one the parent's agent, so that only the trigger's NOTIFY can wake the parent's worker; and
  one ``serve`` serving both (the worker that ends the last child also claims the parent: its
  freed slot wakes its claim loop, as the NOTIFY does). Workers poll every ``--poll-seconds``
  (5 s): a wake-up by a poll would take seconds. Times on the database clock: the last child's
  ``succeeded`` event (written by its final commit, before the trigger that wakes the parent
  runs and the transaction commits) to the parent's second ``claimed`` event; beside it, the
  parent's ``submitted`` event to its first ``claimed`` event (a submit's NOTIFY and claim, the
  same path for a new run). p50, p90, p99, max, and how many wake-ups took over 100 ms (a
  poll's). Target: p50 under 5 ms with two workers.

Progress goes to stderr, the table to stdout (``--json`` for the report as JSON). Without
``--dsn`` an embedded PostgreSQL with the project's default, durable settings is started and
removed at the end, also on an error, SIGTERM or Ctrl-C; every ``serve`` started is killed and
every scratch database dropped. Every wait is bounded. About a minute with the defaults (more
on a busy machine). From the repository root: ``.venv/bin/python benchmarks/child_runs.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
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
import psutil  # type: ignore[import-untyped]  # psutil ships no type information

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
from orchestrator import Child
from orchestrator.agent.steps import Agent, Finish, Next, Outcome, Step, StepContext, Wait
from orchestrator.db.connections import connect, create_pool
from orchestrator.db.executor import TransactionConnection
from orchestrator.db.migrations import migrate
from orchestrator.db.store import Park, RunStore, StepCommit
from orchestrator.ids import new_run_id
from orchestrator.models import ClaimedRun
from serve_harness import (
    DURABILITY_SHOWN,
    SERVE_COMMAND,
    CpuMeter,
    CpuSample,
    Server,
    child_env,
    cpu_shares,
    create_database,
    drop_database,
    server_facts,
    settings_for,
)
from serve_harness import Child as Process

TARGET_RATIO = 1.2
TARGET_WAKE_P50_MS = 5.0
CHILD_AGENT = "noop"
"""The agent every measured run is of (``orchestrator.agents.noop``: one step that finishes)."""
NOOP_MODULE = "orchestrator.agents.noop"
SPAWNER_AGENT = "bench_spawner"
"""The spawn measurement's parents: claimed by this process, served by no worker."""
PARENT_WORKER = "bench-parent"
WARM_AGENT = "bench_warm"
"""The warm-up's runs: served by no worker."""
WARM_CHILDREN = 10
STARTUP_SECONDS = 60.0
DONE_WITHIN_SECONDS = 120.0
POLL_SECONDS = 0.01
"""How often this process looks whether the runs it waits for are done."""
WARM_PARENTS = 3
IDLE_SECONDS = 0.05

# -- the parent agent the wake-up's ``serve`` runs (``serve --agents child_runs``) -----------------

FAN_IN_AGENT = "bench_fan_in"


class FanOut(Step):
    """Starts ``input["children"]`` no-op children and waits for all of them."""

    async def run(self, ctx: StepContext) -> Outcome:
        count = int(ctx.input["children"])
        children = [Child(CHILD_AGENT, {"n": n}, key=f"c{n:04d}") for n in range(count)]
        return Wait(then=Merge, children=children)


class Merge(Step):
    """Woken once every child has ended: reads how each ended."""

    async def run(self, ctx: StepContext) -> Outcome:
        ended = ctx.wait.children if ctx.wait is not None and ctx.wait.children else {}
        return Finish(result={"succeeded": sum(1 for c in ended.values() if c.succeeded)})


fan_in = Agent(FAN_IN_AGENT, first=FanOut, steps=[Merge])


@dataclass(frozen=True)
class Config:
    dsn: str | None
    json: bool
    only: str
    children: int
    rounds: int
    tasks: int
    concurrency: int
    claim_batch: int
    fan_in: int
    parents: int
    poll_seconds: float
    history: int


# -- databases and workers -------------------------------------------------------------------------


HISTORY_SQL = """
INSERT INTO runs (run_id, agent, input, state, attempt, result, created_at, updated_at,
                  finished_at)
SELECT 'h_' || lpad(g::text, 9, '0'), 'bench_history', '{}'::jsonb, 'succeeded', 1,
       '{"ok": true}'::jsonb, now() - interval '40 days', now() - interval '40 days',
       now() - interval '40 days' + g * interval '1 ms'
FROM generate_series(1, $1) AS g
"""
"""Finished runs of an agent nobody serves: a database that has been in use for a while."""


async def migrated_template(server: Server, history: int) -> str:
    """A migrated database, holding ``history`` finished runs, to copy each measurement's
    database from; its name."""
    name = f"bench_children_template_{os.getpid()}"
    dsn = await create_database(server.dsn, name)
    connection = await connect(settings_for(dsn), application_name="bench-migrate")
    try:
        await migrate(connection)
        if history:
            log(f"template: {history:,} finished runs")
            await connection.execute(HISTORY_SQL, history)
            await connection.execute("VACUUM (ANALYZE) runs")
    finally:
        await connection.close()
    return name


def start_serve(dsn: str, name: str, modules: Sequence[str], config: Config) -> Process:
    """``orchestrator serve`` of ``modules``, importing this file from its own folder."""
    path = os.pathsep.join(
        filter(None, [str(Path(__file__).resolve().parent), os.getenv("PYTHONPATH")])
    )
    argv = [sys.executable, *SERVE_COMMAND, "--worker-id", name]
    for module in modules:
        argv += ["--agents", module]
    argv += ["--concurrency", str(config.concurrency), "--claim-batch", str(config.claim_batch)]
    argv += ["--poll-seconds", str(config.poll_seconds)]
    return Process(argv, env={**child_env(dsn), "PYTHONPATH": path}, name=name)


async def until(check: Callable[[], Awaitable[bool]], what: str, *, within: float) -> None:
    """Poll ``check`` every ``POLL_SECONDS`` until it holds; raise if time runs out."""
    deadline = time.monotonic() + within
    while not await check():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what}: not within {within:.0f}s")
        await asyncio.sleep(POLL_SECONDS)


async def listening(pool: asyncpg.Pool, worker: Process) -> Process:
    """``worker`` once it serves and its LISTEN connection is open."""
    await worker.wait_for_event("serving", within=STARTUP_SECONDS)

    async def listens() -> bool:
        if not worker.alive():
            raise RuntimeError(f"{worker.name} exited; last lines:\n{worker.tail()}")
        return bool(
            await pool.fetchval(
                "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1",
                f"{worker.name}:listen",
            )
        )

    await until(listens, f"{worker.name}'s LISTEN connection", within=STARTUP_SECONDS)
    return worker


# -- spawn and claims: queueing --------------------------------------------------------------------

Timed = Callable[[], Awaitable[None]]
"""The queueing of one arm, ready to be timed."""
Prepare = Callable[[RunStore, TransactionConnection, Config], Awaitable[Timed]]
"""Sets up an arm's queueing (untimed) on a store and a warmed connection; returns it."""


async def claimed_parent(store: RunStore, db: TransactionConnection) -> ClaimedRun:
    """A run of ``SPAWNER_AGENT`` submitted and claimed by ``PARENT_WORKER`` (10 minutes)."""
    await store.submit(SPAWNER_AGENT, {})
    batch = await store.claim(
        PARENT_WORKER, [SPAWNER_AGENT], limit=1, lease_seconds=600, include_expired=False, db=db
    )
    if len(batch.claimed) != 1:
        raise RuntimeError(f"claimed {len(batch.claimed)} parents, not 1")
    return batch.claimed[0]


async def spawn(
    store: RunStore,
    db: TransactionConnection,
    parent: ClaimedRun,
    agent: str,
    count: int,
    *,
    wait: bool,
) -> None:
    """What the group committer writes for ``parent``'s step that returned ``Wait`` (``wait``)
    or ``Next`` with ``count`` children of ``agent``: in one transaction its step commit, its
    children in a savepoint, and its park; from the step's ``Child`` objects on."""
    children = [Child(agent, {"n": n}, key=f"c{n:04d}") for n in range(count)]
    checkpoint = {"spawned": count}
    outcome: Wait | Next = (
        Wait(then="Merge", children=children)
        if wait
        else Next("Merge", checkpoint, children=children)
    )
    park = Park(outcome.stored().as_json(), None) if isinstance(outcome, Wait) else None
    commit = StepCommit(
        parent.lease,
        parent.checkpoint_version,
        "Merge",
        checkpoint,
        park=park,
        children=tuple(child.spawn(new_run_id()) for child in children),
    )
    lease = parent.lease
    async with db.transaction():
        committed = await store.commit_steps(PARENT_WORKER, [commit], db=db)
        if lease.run_id not in committed:
            raise RuntimeError(f"the parent {lease.run_id}'s step commit was refused")
        async with db.transaction():  # a savepoint, as the group committer's
            spawned = await store.spawn_children(lease, commit.children, db=db)
        if spawned is None or len(spawned) != count:
            raise RuntimeError(f"the parent {lease.run_id} spawned {spawned and len(spawned)}")
        if park is not None:
            parked = await store.park_many(PARENT_WORKER, [(lease, park)], db=db)
            if parked != {lease.run_id}:
                raise RuntimeError(f"the parent {lease.run_id} was not parked")


async def warm_up(store: RunStore, db: TransactionConnection, config: Config) -> None:
    """The same in every arm's database: a submit on each pool connection, and a spawn of
    ``WARM_CHILDREN`` on ``db`` (the spawn arms' connection), all of an agent nobody serves."""
    async with anyio.create_task_group() as group:
        for n in range(config.tasks):
            group.start_soon(store.submit, WARM_AGENT, {"n": n})
    parent = await claimed_parent(store, db)
    await spawn(store, db, parent, WARM_AGENT, WARM_CHILDREN, wait=True)


async def submits_one_by_one(store: RunStore, db: TransactionConnection, config: Config) -> Timed:
    async def queue() -> None:
        for n in range(config.children):
            await store.submit(CHILD_AGENT, {"n": n})

    return queue


async def submits_concurrently(store: RunStore, db: TransactionConnection, config: Config) -> Timed:
    async def submitter(first: int) -> None:
        for n in range(first, config.children, config.tasks):
            await store.submit(CHILD_AGENT, {"n": n})

    async def queue() -> None:
        async with anyio.create_task_group() as group:
            for task in range(config.tasks):
                group.start_soon(submitter, task)

    return queue


def spawner(*, wait: bool) -> Prepare:
    async def prepare(store: RunStore, db: TransactionConnection, config: Config) -> Timed:
        parent = await claimed_parent(store, db)

        async def queue() -> None:
            await spawn(store, db, parent, CHILD_AGENT, config.children, wait=wait)

        return queue

    return prepare


@dataclass(frozen=True)
class Arm:
    name: str
    label: str
    prepare: Prepare
    spawns: bool


def arms(config: Config) -> list[Arm]:
    return [
        Arm("one_by_one", "RunStore.submit, one by one", submits_one_by_one, False),
        Arm(
            "concurrent",
            f"RunStore.submit, {config.tasks} tasks",
            submits_concurrently,
            False,
        ),
        Arm("wait", "spawn in one commit, parent waits (Wait)", spawner(wait=True), True),
        Arm("next", "spawn in one commit, parent goes on (Next)", spawner(wait=False), True),
    ]


# -- CPU at the scheduler's resolution -------------------------------------------------------------


def cpu_seconds(pid: int) -> float | None:
    """CPU seconds of process ``pid``'s threads from the scheduler's nanosecond counters
    (``/proc/PID/task/*/schedstat``, Linux); ``None`` if they cannot be read."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    total = 0
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/schedstat") as stat:
                total += int(stat.read().split()[0])
        except FileNotFoundError:
            continue  # a thread that ended meanwhile
        except (OSError, ValueError, IndexError):
            return None
    return total / 1e9


@dataclass(frozen=True)
class Reading:
    coarse: CpuSample
    """``serve_harness.CpuMeter``'s sample: the machine's busy time, for other programs' share."""
    worker: float | None
    postgres: float | None
    this: float


class Meter:
    """CPU seconds of the worker, of PostgreSQL's processes and of this process, read from the
    scheduler's nanosecond counters: a phase here lasts 50-500 ms, in which psutil's 10 ms
    ticks (``CpuMeter``, summed over a dozen backends) would be much of the figure. Where the
    counters cannot be read, ``CpuMeter``'s figures are used. A process counts with its last
    reading once it has exited."""

    def __init__(self, worker_pid: int | None, postmaster_pid: int | None) -> None:
        self._coarse = CpuMeter(worker_pid, postmaster_pid)
        self._precise = cpu_seconds(os.getpid()) is not None
        self._worker_pid = worker_pid
        self._postmaster = psutil.Process(postmaster_pid) if postmaster_pid is not None else None
        self._worker: float | None = None
        self._postgres: dict[int, float] = {}

    def sample(self) -> Reading:
        coarse = self._coarse.sample()
        if not self._precise:
            return Reading(coarse, coarse.process, coarse.postgres, coarse.this_process)
        if self._worker_pid is not None:
            reading = cpu_seconds(self._worker_pid)
            self._worker = self._worker if reading is None else reading
        return Reading(
            coarse, self._worker, self._postgres_seconds(), cpu_seconds(os.getpid()) or 0.0
        )

    def _postgres_seconds(self) -> float | None:
        if self._postmaster is None:
            return None
        with contextlib.suppress(psutil.Error):
            for member in [self._postmaster, *self._postmaster.children()]:
                reading = cpu_seconds(member.pid)
                if reading is not None:
                    self._postgres[member.pid] = reading
        return sum(self._postgres.values())


def used(first: float | None, last: float | None) -> float | None:
    return None if first is None or last is None else last - first


# -- spawn and claims: one measurement -------------------------------------------------------------


@dataclass(frozen=True)
class Phase:
    """One phase of a measurement: its time and what it cost, in total."""

    seconds: float
    postgres_cpu: float | None
    """CPU seconds of PostgreSQL's processes (embedded server only)."""
    process_cpu: float | None
    """CPU seconds of this process (queueing) or of the worker (claims)."""
    wal_bytes: int
    other_cores: float | None
    """Cores other programs used meanwhile: the noise to read the phase against."""


@dataclass(frozen=True)
class ArmRound:
    arm: str
    runs: int
    queue: Phase
    claims: Phase


DONE_SQL = "SELECT count(*) FROM runs WHERE agent = $1 AND state = 'succeeded'"
CLAIMS_SQL = """
SELECT (SELECT min(e.at) FROM run_events AS e JOIN runs AS r USING (run_id)
        WHERE r.agent = $1 AND e.kind = 'claimed') AS first_claim,
       (SELECT count(*) FROM run_events AS e JOIN runs AS r USING (run_id)
        WHERE r.agent = $1 AND e.kind = 'claimed') AS claims,
       (SELECT max(finished_at) FROM runs WHERE agent = $1) AS last_finish
"""


async def queue_phase(
    arm: Arm, store: RunStore, db: TransactionConnection, config: Config, postmaster: int | None
) -> Phase:
    """Warm up, then time ``arm``'s queueing of ``config.children`` runs."""
    await warm_up(store, db, config)
    queue = await arm.prepare(store, db, config)
    meter = Meter(None, postmaster)
    wal_start = await db.fetchval("SELECT pg_current_wal_lsn()")
    first, began = meter.sample(), time.perf_counter()
    await queue()
    seconds = time.perf_counter() - began
    last = meter.sample()
    wal_bytes = await db.fetchval("SELECT pg_current_wal_lsn() - $1::pg_lsn", wal_start)
    return Phase(
        seconds=seconds,
        postgres_cpu=used(first.postgres, last.postgres),
        process_cpu=last.this - first.this,
        wal_bytes=int(wal_bytes),
        other_cores=cpu_shares(first.coarse, last.coarse)["other"],
    )


async def claims_phase(
    db: TransactionConnection, worker: Process, config: Config, postmaster: int | None
) -> Phase:
    """Let the held ``worker`` go and wait until it has finished every queued run."""
    await db.execute("VACUUM (ANALYZE) runs, run_events")
    await db.execute("CHECKPOINT")
    meter = Meter(worker.pid, postmaster)
    wal_start = await db.fetchval("SELECT pg_current_wal_lsn()")
    first = meter.sample()
    worker.process.send_signal(signal.SIGCONT)

    async def done() -> bool:
        meter.sample()  # keeps each process's last reading
        if not worker.alive():
            raise RuntimeError(f"{worker.name} exited; last lines:\n{worker.tail()}")
        return bool(await db.fetchval(DONE_SQL, CHILD_AGENT) >= config.children)

    await until(done, f"{config.children:,} runs finished", within=DONE_WITHIN_SECONDS)
    last = meter.sample()
    wal_bytes = await db.fetchval("SELECT pg_current_wal_lsn() - $1::pg_lsn", wal_start)
    row = await db.fetchrow(CLAIMS_SQL, CHILD_AGENT)
    assert row is not None  # aggregates: one row
    if row["claims"] != config.children:
        raise RuntimeError(f"{row['claims']} claims of {config.children:,} runs (once each)")
    return Phase(
        seconds=(row["last_finish"] - row["first_claim"]).total_seconds(),
        postgres_cpu=used(first.postgres, last.postgres),
        process_cpu=used(first.worker, last.worker),
        wal_bytes=int(wal_bytes),
        other_cores=cpu_shares(first.coarse, last.coarse)["other"],
    )


async def measure_arm(server: Server, template: str, arm: Arm, config: Config) -> ArmRound:
    """``arm`` in a fresh database: queue the runs under a held worker, then let it claim."""
    name = f"bench_children_{arm.name}_{os.getpid()}"
    dsn = await create_database(server.dsn, name, template=template)
    worker: Process | None = None
    try:
        pool = await create_pool(
            settings_for(dsn), application_name="bench-queue", min_size=1, max_size=config.tasks
        )
        try:
            worker = await listening(pool, start_serve(dsn, "children", [NOOP_MODULE], config))
            worker.process.send_signal(signal.SIGSTOP)
            async with pool.acquire() as db:
                queue = await queue_phase(arm, RunStore(pool), db, config, server.postmaster_pid)
                claims = await claims_phase(db, worker, config, server.postmaster_pid)
        finally:
            await pool.close()
        await worker.stop(within=30)
    finally:
        if worker is not None and worker.alive():
            worker.process.send_signal(signal.SIGCONT)
            worker.kill()
        await drop_database(server.dsn, name)
    return ArmRound(arm.name, config.children, queue, claims)


async def spawn_and_claims(server: Server, template: str, config: Config) -> dict[str, Any]:
    measured = arms(config)
    rounds: list[dict[str, ArmRound]] = []
    for number in range(config.rounds + 1):
        shift = number % len(measured)
        results = {}
        for arm in [*measured[shift:], *measured[:shift]]:
            results[arm.name] = await measure_arm(server, template, arm, config)
        line = ", ".join(
            f"{name} {result.queue.seconds * 1000:,.0f} ms + {result.claims.seconds * 1000:,.0f} ms"
            for name, result in results.items()
        )
        log(f"spawn/submit + claims {'warm-up' if number == 0 else f'round {number}'}: {line}")
        if number:
            rounds.append(results)
    return summarise_spawns(measured, rounds, config)


# -- spawn and claims: summary ---------------------------------------------------------------------


def per_run_us(value: float | None, runs: int) -> float | None:
    return None if value is None else value / runs * 1e6


def median_known(values: Sequence[float | None]) -> float | None:
    known = [value for value in values if value is not None]
    return statistics.median(known) if known else None


def total_cpu(result: ArmRound) -> float | None:
    """CPU seconds of an arm's queueing and claims: this process's, the worker's, PostgreSQL's."""
    parts = [
        result.queue.process_cpu,
        result.queue.postgres_cpu,
        result.claims.process_cpu,
        result.claims.postgres_cpu,
    ]
    known = [part for part in parts if part is not None]
    return sum(known) if len(known) == len(parts) else None


def cpu_ratio(result: ArmRound, baseline: ArmRound) -> float | None:
    mine, theirs = total_cpu(result), total_cpu(baseline)
    return None if mine is None or not theirs else mine / theirs


def phase_summary(phases: Sequence[Phase], runs: int) -> dict[str, float | None]:
    """Medians over the rounds, per run (µs, bytes) but the time of the whole phase (ms)."""
    median = median_known
    return {
        "ms": median([phase.seconds * 1000 for phase in phases]),
        "us_per_run": median([per_run_us(phase.seconds, runs) for phase in phases]),
        "postgres_cpu_us_per_run": median([per_run_us(p.postgres_cpu, runs) for p in phases]),
        "process_cpu_us_per_run": median([per_run_us(p.process_cpu, runs) for p in phases]),
        "wal_bytes_per_run": median([phase.wal_bytes / runs for phase in phases]),
        "other_cores": median([phase.other_cores for phase in phases]),
    }


def baseline_of(results: dict[str, ArmRound], measured: Sequence[Arm]) -> ArmRound:
    """A round's baseline: its submit arm that queued fastest."""
    submits = [results[arm.name] for arm in measured if not arm.spawns]
    return min(submits, key=lambda result: result.queue.seconds)


def summarise_spawns(
    measured: Sequence[Arm], rounds: Sequence[dict[str, ArmRound]], config: Config
) -> dict[str, Any]:
    baselines = [baseline_of(results, measured) for results in rounds]

    def ratios(name: str) -> dict[str, float | None]:
        pairs = [(results[name], base) for results, base in zip(rounds, baselines, strict=True)]
        return {
            "queue": statistics.median(a.queue.seconds / b.queue.seconds for a, b in pairs),
            "claims": statistics.median(a.claims.seconds / b.claims.seconds for a, b in pairs),
            "total": statistics.median(
                (a.queue.seconds + a.claims.seconds) / (b.queue.seconds + b.claims.seconds)
                for a, b in pairs
            ),
            "cpu": median_known([cpu_ratio(a, b) for a, b in pairs]),
        }

    rows: list[dict[str, Any]] = []
    for arm in measured:
        mine = [results[arm.name] for results in rounds]
        rows.append(
            {
                "arm": arm.name,
                "label": arm.label,
                "spawns": arm.spawns,
                "queue": phase_summary([r.queue for r in mine], config.children),
                "claims": phase_summary([r.claims for r in mine], config.children),
                "vs_baseline": ratios(arm.name),
                "baseline_in_rounds": sum(1 for base in baselines if base.arm == arm.name),
            }
        )
    spawning = [row["vs_baseline"] for row in rows if row["spawns"]]
    worst = max(ratios["total"] for ratios in spawning)
    cpu = [ratios["cpu"] for ratios in spawning if ratios["cpu"] is not None]
    return {
        "children": config.children,
        "history": config.history,
        "rounds": len(rounds),
        "arms": rows,
        "worst_total_ratio": worst,
        "target_met": worst <= TARGET_RATIO,
        "worst_cpu_ratio": max(cpu) if cpu else None,
        "each": [{name: asdict(result) for name, result in results.items()} for results in rounds],
    }


# -- parent wake-up --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Deployment:
    name: str
    label: str
    workers: dict[str, list[str]]
    """Each worker's name and the agent modules it serves."""
    parent_worker: str


DEPLOYMENTS = (
    Deployment(
        "two_workers",
        "two workers: children on one, the parent on the other (NOTIFY)",
        {"kids": [NOOP_MODULE], "parents": ["child_runs"]},
        "parents",
    ),
    Deployment(
        "one_worker",
        "one worker runs the parent and its children",
        {"both": ["child_runs", NOOP_MODULE]},
        "both",
    ),
)

WAKE_SQL = """
SELECT (SELECT min(at) FROM run_events WHERE run_id = $1 AND kind = 'submitted') AS submitted,
       (SELECT max(e.at) FROM run_events AS e JOIN runs AS c ON c.run_id = e.run_id
        WHERE c.parent_run_id = $1 AND e.kind = 'succeeded') AS last_child_end,
       (SELECT count(*) FROM runs WHERE parent_run_id = $1 AND state = 'succeeded') AS children,
       ARRAY(SELECT at FROM run_events WHERE run_id = $1 AND kind = 'claimed'
             ORDER BY event_id) AS claimed_at,
       ARRAY(SELECT worker_id FROM run_events WHERE run_id = $1 AND kind = 'claimed'
             ORDER BY event_id) AS claimed_by
"""


@dataclass(frozen=True)
class WakeSample:
    wake_ms: float
    """The last child's ``succeeded`` event -> the parent's second ``claimed`` event."""
    submit_ms: float
    """The parent's ``submitted`` event -> its first ``claimed`` event."""


async def one_parent(
    pool: asyncpg.Pool, store: RunStore, deployment: Deployment, count: int
) -> WakeSample:
    run_id = (await store.submit(FAN_IN_AGENT, {"children": count})).run.run_id

    async def finished() -> bool:
        state = await pool.fetchval("SELECT state FROM runs WHERE run_id = $1", run_id)
        if state not in ("queued", "running", "waiting", "succeeded"):
            raise RuntimeError(f"parent {run_id} ended {state}")
        return bool(state == "succeeded")

    await until(finished, f"parent {run_id} finished", within=DONE_WITHIN_SECONDS)
    row = await pool.fetchrow(WAKE_SQL, run_id)
    assert row is not None  # scalar subqueries: one row
    claimed_at: list[datetime] = row["claimed_at"]
    if row["children"] != count or len(claimed_at) != 2:
        raise RuntimeError(
            f"parent {run_id}: {row['children']} of {count} children succeeded, "
            f"{len(claimed_at)} claims (2 expected)"
        )
    if set(row["claimed_by"]) != {deployment.parent_worker}:
        raise RuntimeError(f"parent {run_id} claimed by {row['claimed_by']}")
    if claimed_at[1] <= row["last_child_end"]:
        raise RuntimeError(f"parent {run_id} claimed before its last child ended")
    return WakeSample(
        wake_ms=(claimed_at[1] - row["last_child_end"]).total_seconds() * 1000,
        submit_ms=(claimed_at[0] - row["submitted"]).total_seconds() * 1000,
    )


def spread(values: Sequence[float]) -> dict[str, float]:
    return {
        "p50": percentile(values, 0.50),
        "p90": percentile(values, 0.90),
        "p99": percentile(values, 0.99),
        "max": max(values),
    }


async def wake_deployment(
    server: Server, template: str, deployment: Deployment, config: Config
) -> dict[str, Any]:
    name = f"bench_children_wake_{deployment.name}_{os.getpid()}"
    dsn = await create_database(server.dsn, name, template=template)
    workers: list[Process] = []
    try:
        pool = await create_pool(settings_for(dsn), application_name="bench-wake", max_size=2)
        try:
            for worker_name, modules in deployment.workers.items():
                workers.append(start_serve(dsn, worker_name, modules, config))
            for worker in workers:
                await listening(pool, worker)
            store = RunStore(pool)
            for _ in range(WARM_PARENTS):
                await one_parent(pool, store, deployment, config.fan_in)
            meter = CpuMeter(None, server.postmaster_pid)
            first = meter.sample()
            samples = []
            for _ in range(config.parents):
                await asyncio.sleep(IDLE_SECONDS)
                samples.append(await one_parent(pool, store, deployment, config.fan_in))
            shares = cpu_shares(first, meter.sample())
        finally:
            await pool.close()
        for worker in workers:
            await worker.stop(within=30)
    finally:
        for worker in workers:
            if worker.alive():
                worker.kill()
        await drop_database(server.dsn, name)
    wake = [sample.wake_ms for sample in samples]
    result: dict[str, Any] = {
        "deployment": deployment.name,
        "label": deployment.label,
        "wake_ms": spread(wake),
        "submit_to_claim_ms": spread([sample.submit_ms for sample in samples]),
        "over_100ms": sum(1 for value in wake if value > 100),
        "postgres_cores": shares["postgres"],
        "other_cores": shares["other"],
        "samples": [asdict(sample) for sample in samples],
    }
    log(
        f"wake-up, {deployment.name}: p50 {result['wake_ms']['p50']:.2f} ms, "
        f"p99 {result['wake_ms']['p99']:.2f} ms (submit to claim p50 "
        f"{result['submit_to_claim_ms']['p50']:.2f} ms)"
    )
    return result


async def wake_ups(server: Server, template: str, config: Config) -> dict[str, Any]:
    results = [await wake_deployment(server, template, d, config) for d in DEPLOYMENTS]
    notify = results[0]["wake_ms"]["p50"]
    return {
        "fan_in": config.fan_in,
        "parents": config.parents,
        "poll_seconds": config.poll_seconds,
        "deployments": results,
        "target_met": notify < TARGET_WAKE_P50_MS,
    }


# -- report ----------------------------------------------------------------------------------------


def render_spawns(spawns: dict[str, Any]) -> list[str]:
    def phase_cells(phase: dict[str, Any]) -> list[str]:
        return [
            fmt(phase["ms"], ",.1f"),
            fmt(phase["us_per_run"], ",.1f"),
            fmt(phase["process_cpu_us_per_run"], ",.1f"),
            fmt(phase["postgres_cpu_us_per_run"], ",.1f"),
            fmt(phase["wal_bytes_per_run"], ",.0f"),
            fmt(phase["other_cores"], ".2f"),
        ]

    header = ["ms", "µs/run", "{} CPU µs/run", "postgres CPU µs/run", "WAL B/run", "other cores"]
    history = f", {spawns['history']:,} finished runs in the table" if spawns["history"] else ""
    return [
        "",
        f"queueing {spawns['children']:,} runs of the no-op agent{history}, medians of "
        f"{spawns['rounds']} rounds",
        *render_table(
            ["queued by", *[h.format("client") for h in header]],
            [[row["label"], *phase_cells(row["queue"])] for row in spawns["arms"]],
        ),
        "",
        "their claims by one serve (first claim -> last finish, database clock)",
        *render_table(
            ["queued by", *[h.format("worker") for h in header]],
            [[row["label"], *phase_cells(row["claims"])] for row in spawns["arms"]],
        ),
        "",
        "against the round's faster submit arm (medians of per-round ratios; CPU: this "
        "process's, the worker's and PostgreSQL's, queueing and claims)",
        *render_table(
            ["queued by", "queueing x", "claims x", "both x", "CPU x", "baseline in rounds"],
            [
                [
                    row["label"],
                    fmt(row["vs_baseline"]["queue"], ".3f"),
                    fmt(row["vs_baseline"]["claims"], ".3f"),
                    fmt(row["vs_baseline"]["total"], ".3f"),
                    fmt(row["vs_baseline"]["cpu"], ".3f"),
                    str(row["baseline_in_rounds"]),
                ]
                for row in spawns["arms"]
            ],
        ),
        f"target: spawn + claims <= {TARGET_RATIO:g}x submits + claims in time: "
        f"{verdict(spawns['target_met'])} (worst {spawns['worst_total_ratio']:.3f}; "
        f"in CPU {fmt(spawns['worst_cpu_ratio'], '.3f')})",
    ]


def render_wakes(wakes: dict[str, Any]) -> list[str]:
    rows = []
    for result in wakes["deployments"]:
        for what, key in (
            ("last child ended -> parent claimed", "wake_ms"),
            ("parent submitted -> claimed", "submit_to_claim_ms"),
        ):
            values = result[key]
            rows.append(
                [
                    f"{result['deployment']}: {what}",
                    *(fmt(values[p], ".2f") for p in ("p50", "p90", "p99", "max")),
                    fmt(result["other_cores"], ".2f"),
                ]
            )
    return [
        "",
        f"parent wake-up: {wakes['parents']} parents of {wakes['fan_in']} children each, one "
        f"at a time, workers polling every {wakes['poll_seconds']:g} s (database clock, ms)",
        *render_table(["", "p50", "p90", "p99", "max", "other cores"], rows),
        *(
            f"  {result['deployment']}: {result['label']}; wake-ups over 100 ms: "
            f"{result['over_100ms']} of {len(result['samples'])}"
            for result in wakes["deployments"]
        ),
        f"target: wake-up p50 < {TARGET_WAKE_P50_MS:g} ms with two workers (the NOTIFY path): "
        f"{verdict(wakes['target_met'])}",
    ]


def render(report: dict[str, Any]) -> str:
    machine = report["machine"]
    out = [
        f"child_runs: {report['date']}, {machine['cpus']} CPUs, Python {machine['python']}, "
        f"load average {machine['load_average'][0]:.2f} at the start, "
        f"{report['load_average_at_end'][0]:.2f} at the end",
        server_line(report["server"]),
    ]
    if "spawn" in report:
        out += render_spawns(report["spawn"])
    if "wake" in report:
        out += render_wakes(report["wake"])
    return "\n".join(out)


async def benchmark(server: Server, config: Config) -> dict[str, Any]:
    admin = await connect(settings_for(server.dsn), application_name="bench-admin")
    try:
        facts = await server_facts(admin, DURABILITY_SHOWN)
    finally:
        await admin.close()
    report: dict[str, Any] = {
        **report_heading("child_runs", load_average=os.getloadavg()),
        "server": {"embedded": server.embedded, **facts},
        "config": workload(config),
    }
    template = await migrated_template(server, config.history)
    try:
        if config.only in ("all", "spawn"):
            report["spawn"] = await spawn_and_claims(server, template, config)
        if config.only in ("all", "wake"):
            report["wake"] = await wake_ups(server, template, config)
    finally:
        await drop_database(server.dsn, template)
    report["load_average_at_end"] = os.getloadavg()
    return report


def parse_args(argv: Sequence[str] | None) -> Config:
    parser = benchmark_parser(__doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument("--only", choices=("all", "spawn", "wake"), default="all")
    parser.add_argument("--children", type=int, default=1000, help="runs queued per arm")
    parser.add_argument("--rounds", type=int, default=5, help="rounds after a warm-up")
    parser.add_argument("--tasks", type=int, default=8, help="concurrent submitters")
    parser.add_argument("--concurrency", type=int, default=100, help="serve --concurrency")
    parser.add_argument("--claim-batch", type=int, default=50, help="serve --claim-batch")
    parser.add_argument("--fan-in", type=int, default=10, help="children of each woken parent")
    parser.add_argument("--parents", type=int, default=50, help="parents woken, one at a time")
    parser.add_argument(
        "--poll-seconds", type=float, default=5.0, help="serve --poll-seconds (a poll is slow)"
    )
    parser.add_argument(
        "--history", type=int, default=0, help="finished runs in every database beforehand"
    )
    config = Config(**vars(parser.parse_args(argv)))
    if not 1 <= config.children <= 1000:
        parser.error("--children is 1 to 1,000 (a commit spawns at most 1,000)")
    if min(config.rounds, config.tasks, config.concurrency, config.claim_batch) < 1:
        parser.error("--rounds, --tasks, --concurrency and --claim-batch must be at least 1")
    if not 1 <= config.fan_in <= 1000 or config.parents < 1 or config.history < 0:
        parser.error("--fan-in is 1 to 1,000, --parents at least 1, --history not negative")
    return config


def main(argv: Sequence[str] | None = None) -> int:
    config = parse_args(argv)
    run_and_report(config, "children", lambda server: benchmark(server, config), render)
    return 0


if __name__ == "__main__":
    sys.exit(main())
