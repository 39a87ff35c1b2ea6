"""End-to-end throughput of no-op runs through one ``orchestrator serve``, beside PgQueuer and
Procrastinate doing the same no-op jobs on the same PostgreSQL server in the same run.

What is measured: runs (jobs) completed per second by ONE worker process, from the moment it
starts claiming until the last one is durably done, with ``--jobs`` (20,000) no-op runs queued
beforehand. The no-op agent (``orchestrator.agents.noop``) finishes in its first step, so the
figure is the runtime's own cost per run: claim (lease + fence + ``claimed`` event), the run's
task, scope and heartbeat deadline, and the fenced final commit (group commit), all durable.

Why: it bounds how many short runs one worker can push through, and it is the figure to compare
with plain job queues, which do less per job (no fence, no lease renewal, no per-run event
timeline). The project's target is at least 1.5x PgQueuer on the same machine.

Method, identical for the three systems:

1. A fresh database per measurement, copied from a template holding the system's own schema
   (orchestrator: its migrations; PgQueuer: ``Queries.install()``; Procrastinate:
   ``SchemaManager.apply_schema_async()``), each system in databases of its own.
2. ``--jobs`` jobs are queued in one statement with the system's own API (orchestrator: one
   ``INSERT ... SELECT`` of runs and their ``submitted`` events, the rows ``submit`` writes;
   PgQueuer: ``Queries.enqueue`` with lists; Procrastinate: ``Task.batch_defer_async``), then
   ``ANALYZE`` and ``CHECKPOINT`` (every measurement starts from the same clean state).
3. The consumer starts as its own OS process: ``python -m orchestrator.cli serve --agents
   orchestrator.agents.noop --concurrency C --claim-batch B --log-json`` (JSON logs at info
   level: nothing per run); PgQueuer's documented consumer (``PgQueuer(AsyncpgDriver(conn))``,
   ``qm.run(batch_size=B, max_concurrent_tasks=C, mode=drain)``); Procrastinate's worker
   (``PsycopgConnector`` with its default pool, ``run_worker_async(concurrency=C,
   wait=False)``). The peers' consumers are this file run as ``throughput.py consume ...``.
4. The clock starts, on the database clock, at the first poll (every 5 ms) that finds fewer
   than ``--jobs`` jobs in their initial state (the same query shape for all three; start-up
   and imports are not timed). It stops at the database timestamp of the last completion:
   ``max(runs.finished_at)``; PgQueuer: ``max(created)`` of its ``successful`` log rows;
   Procrastinate: ``max(at)`` of its ``succeeded`` events. Completion is polled every 100 ms
   (a count over the job table: the same small cost for all three). runs/s = jobs / (stop -
   start). For orchestrator the exact first-claim time (``run_events``) is also recorded.
5. CPU: the consumer process's, PostgreSQL's (all its processes) and everything else on the
   machine over the measured interval, in cores. This machine has two cores and is shared:
   "other" shows how much other programs took while the figure was measured.

Settings: orchestrator and PgQueuer each run a small grid of concurrency x batch settings
(``--grid``, default 100x50, 100x200, 500x50, 500x200, 1000x200; PgQueuer refuses
``max_concurrent_tasks < 2 * batch_size``, so 100x200 is skipped for it, and it also runs its
default, no ``max_concurrent_tasks``, with each batch size: the cap adds work to its dequeue
query, and a peer is compared at its best). Procrastinate
fetches one job per statement and has no batch setting; it runs once at
``--procrastinate-concurrency`` (100). Then each of orchestrator's and PgQueuer's best
settings is measured ``--rounds`` (7) more times, alternating, and the orchestrator/PgQueuer
ratio is the median of those rounds' ratios (the grid round chose the settings and is not
reused for the ratio). orchestrator/Procrastinate is the median of orchestrator's rounds over
Procrastinate's single figure.

``--baseline-python PATH`` adds a fourth system, ``orchestrator@baseline``: an older release
of orchestrator installed (not editable) in a virtualenv of its own, whose interpreter is PATH.
Its template database is migrated by that interpreter (``PATH -P -c ...``: ``migrate`` from
``orchestrator.db.migrations``, or from ``orchestrator.migrations`` in old releases, on that
release's own ``connect``), and its consumer is ``PATH -P -m orchestrator.cli serve ...`` with
the current orchestrator's best setting (``-P`` and no ``PYTHONPATH``: the working directory is
not put on ``sys.path``, so the release installed there is the one that runs; the migration
step checks where its package was imported from). It is not in the grid. In each round it is
measured right beside the current orchestrator (order: baseline, orchestrator, PgQueuer,
reversed every other round), and orchestrator/baseline is the median of the per-round ratios
(current rate / baseline rate). Worker CPU per run (the consumer's cores / its rate, in µs) is
reported for every measurement and, as the median of the rounds, for both releases with the
median of their per-round ratios: on a shared machine it moves less than the rate does.

Schemas: the current tree keeps its tables in the schema ``orchestrator`` (the default of
``ORCHESTRATOR_SCHEMA``, which the consumers are started without; orchestrator's own connections
set ``search_path`` to it), older releases keep them in ``public``. The benchmark's own
connections (queue loading, polls, checks) set ``search_path = orchestrator, public`` and name
tables unqualified, so the same statements find either layout; each release's migrations run on
that release's own connection.

``--profile`` adds one orchestrator measurement (``--profile-jobs``, 30,000 runs, for enough
samples) at its best setting under a sampling profiler (``py-spy record --nonblocking``, 200
samples/s, attached to the worker once it claims, if py-spy is installed: ``pip install
py-spy``; else the worker runs under cProfile, start-up included) and prints where the worker
spends its time at saturation: own time by package, the share of samples inside a few
libraries, the top frames, and orchestrator's functions by inclusive time. The profiler shares
the two cores, so that measurement's rate is lower and is not used in any ratio.

By default an embedded PostgreSQL (``orchestrator.embedded``) with the project's default,
durable settings (fsync, synchronous_commit and full_page_writes on) is started in a temporary
directory and removed at the end, also on error, SIGTERM or Ctrl-C; every process started is
killed. ``--dsn`` uses an existing server (scratch databases are created and dropped there).
Every wait is bounded (``--max-seconds`` per measurement). About two minutes with the
defaults on an idle machine (Procrastinate's measurement alone takes about 35 s). Progress on
stderr, the table on stdout (``--json`` for JSON). From the repository root:
``.venv/bin/python benchmarks/throughput.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import pstats
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import asyncpg

import server_statements
from bench_main import benchmark_parser, run_and_report
from bench_report import fmt, log, render_table, report_heading, server_line, verdict, workload
from orchestrator.db.connections import connect
from orchestrator.db.migrations import migrate
from serve_harness import (
    Child,
    CpuMeter,
    ServeProcess,
    Server,
    child_env,
    cpu_shares,
    create_database,
    drop_database,
    queue_runs_sql,
    server_facts,
    settings_for,
    spawn,
)

if TYPE_CHECKING:
    from pgqueuer import Queries

TARGET_VS_PGQUEUER = 1.5
START_POLL_SECONDS = 0.005
DONE_POLL_SECONDS = 0.1
STATEMENTS_SHOWN = 8
"""``--statements``: each system's costliest statements in the report."""
STARTUP_SECONDS = 60.0
"""Longest wait for a consumer to claim its first job."""
HERE = Path(__file__).resolve()
REPOSITORY = HERE.parents[1]
SEARCH_PATH = "orchestrator, public"
"""The benchmark's own connections: orchestrator's tables in schema ``orchestrator`` (the
current layout) or in ``public`` (older releases, and the peers), unqualified names find both."""
BASELINE = "orchestrator@baseline"
BASELINE_SETUP_SECONDS = 120.0
"""Longest wait for the baseline interpreter to migrate its template database."""


@dataclass(frozen=True)
class Setting:
    concurrency: int | None
    """Jobs in flight at most; None: PgQueuer's default (no ``max_concurrent_tasks``)."""
    batch: int | None
    """Jobs claimed per statement; None for Procrastinate (one per statement)."""

    def label(self) -> str:
        return setting_label(asdict(self))


def setting_label(setting: dict[str, Any]) -> str:
    concurrency = setting["concurrency"]
    label = "c=unlimited" if concurrency is None else f"c={concurrency}"
    return label if setting["batch"] is None else f"{label} b={setting['batch']}"


@dataclass(frozen=True)
class Config:
    dsn: str | None
    json: bool
    jobs: int
    grid: tuple[Setting, ...]
    procrastinate_concurrency: int
    rounds: int
    max_seconds: float
    profile: bool
    profile_rate: int
    profile_jobs: int
    baseline_python: str | None
    statements: bool = False


@dataclass
class Measurement:
    system: str
    setting: Setting
    phase: str
    """``grid``, ``round N`` or ``profile``."""
    jobs: int
    completed: int
    seconds: float
    rate: float
    exact_rate: float | None
    """Orchestrator only: jobs / (last finish - first ``claimed`` event)."""
    cpu: dict[str, float | None]
    timed_out: bool
    problems: list[str] = field(default_factory=list)
    profile: dict[str, Any] | None = None
    wal_bytes_per_job: float | None = None
    """WAL the server wrote from the consumer's start to its last completion, per job done."""
    worker_us_per_job: float | None = None
    """The consumer's CPU per job, µs: its cores over the measured interval / the rate."""
    statements: list[dict[str, Any]] | None = None
    """``--statements``: the consumer's statements, server time and WAL per job."""


# -- the three systems -------------------------------------------------------------------------


class System(Protocol):
    name: str
    waiting_sql: str
    """Jobs still in their initial state (the start poll)."""
    done_sql: str
    """Jobs completed (the completion poll)."""
    last_done_sql: str
    """Database time of the last completion."""

    async def prepare(self, dsn: str) -> None:
        """Install the schema into the (template) database ``dsn``."""

    async def load(self, dsn: str, jobs: int) -> None:
        """Queue ``jobs`` no-op jobs in one statement."""

    def start(self, dsn: str, setting: Setting, *, profile_to: Path | None = None) -> Child:
        """Start the consumer process."""

    async def check(self, connection: asyncpg.Connection, jobs: int, child: Child) -> list[str]:
        """Anything wrong with the finished measurement."""


async def open_connection(dsn: str, application_name: str) -> asyncpg.Connection:
    """The benchmark's own connection to a measured database, with ``SEARCH_PATH``: plain
    asyncpg, so that it does not depend on either release's connection set-up."""
    return await asyncpg.connect(
        dsn, server_settings={"application_name": application_name, "search_path": SEARCH_PATH}
    )


LOAD_RUNS_SQL = queue_runs_sql("r_bench", "noop", "'{}'::jsonb")


class Orchestrator:
    """The orchestrator this benchmark imports (the current tree)."""

    name = "orchestrator"
    waiting_sql = "SELECT count(*) FROM runs WHERE state = 'queued'"
    done_sql = "SELECT count(*) FROM runs WHERE state = 'succeeded'"
    last_done_sql = "SELECT max(finished_at) FROM runs WHERE state = 'succeeded'"
    first_claim_sql = "SELECT min(at) FROM run_events WHERE kind = 'claimed'"

    def __init__(self) -> None:
        self.counter = 0

    async def prepare(self, dsn: str) -> None:
        connection = await connect(settings_for(dsn), application_name="bench-setup")
        try:
            await migrate(connection)
        finally:
            await connection.close()

    async def load(self, dsn: str, jobs: int) -> None:
        connection = await open_connection(dsn, "bench-setup")
        try:
            await connection.execute(LOAD_RUNS_SQL, jobs)
        finally:
            await connection.close()

    def start(self, dsn: str, setting: Setting, *, profile_to: Path | None = None) -> Child:
        self.counter += 1
        args = serve_args(setting)
        name = f"bench-{self.counter}"
        if profile_to is None:
            return ServeProcess(dsn, *args, name=name)
        # cProfile fallback (no py-spy): the whole process life is profiled.
        argv = [sys.executable, "-m", "cProfile", "-o", str(profile_to), "-m", "orchestrator.cli"]
        argv += ["serve", "--log-json", "--worker-id", name, *args]
        return Child(argv, env=child_env(dsn), name=name)

    async def check(self, connection: asyncpg.Connection, jobs: int, child: Child) -> list[str]:
        problems: list[str] = []
        claims = await connection.fetchval("SELECT count(*) FROM run_events WHERE kind = 'claimed'")
        if claims != jobs:
            problems.append(f"{claims} claims for {jobs} runs")
        states = await connection.fetch("SELECT state, count(*) FROM runs GROUP BY state")
        other = {row["state"]: row["count"] for row in states if row["state"] != "succeeded"}
        if other:
            problems.append(f"runs not succeeded: {other}")
        warnings = child.warnings()
        if warnings:
            problems.append(f"{len(warnings)} warning log lines, e.g. {warnings[0]}")
        return problems


def serve_args(setting: Setting) -> list[str]:
    """``orchestrator serve`` options for a setting (the same for every release)."""
    return [
        "--agents",
        "orchestrator.agents.noop",
        "--concurrency",
        str(setting.concurrency),
        "--claim-batch",
        str(setting.batch),
    ]


BASELINE_MIGRATE = """
import asyncio, json, platform, sys
from importlib.metadata import packages_distributions, version

import orchestrator
from orchestrator.settings import Settings

try:
    from orchestrator.db.migrations import migrate
except ModuleNotFoundError:
    from orchestrator.migrations import migrate
try:
    from orchestrator.db.connections import connect
except ModuleNotFoundError:
    from orchestrator.database import connect


async def main(dsn):
    connection = await connect(Settings(database_url=dsn), application_name="bench-setup")
    try:
        applied = await migrate(connection)
    finally:
        await connection.close()
    return len(applied)


migrations = asyncio.run(main(sys.argv[1]))
distribution = (packages_distributions().get("orchestrator") or ["orchestrator"])[0]
print(json.dumps({
    "distribution": distribution,
    "orchestrator_version": version(distribution),
    "package": orchestrator.__file__,
    "python": platform.python_version(),
    "migrations": migrations,
}))
"""
"""Run by the baseline interpreter: migrate the database ``argv[1]`` with that release's own
code, and say which orchestrator it imported."""


def check_installed(python: str, installed: dict[str, Any]) -> None:
    """Refuse a baseline that imports the current tree (an editable install, or the working
    directory on its path): it would measure the current code twice."""
    package = Path(installed["package"]).resolve()
    if package.is_relative_to(REPOSITORY):
        raise RuntimeError(
            f"{python} imports the current tree ({package}), not an installed release: "
            "install the baseline non-editable in a virtualenv of its own"
        )
    log(
        f"baseline: {installed['distribution']} {installed['orchestrator_version']} at {package} "
        f"(Python {installed['python']}), {installed['migrations']} migrations applied"
    )


class Baseline(Orchestrator):
    """An older orchestrator release, installed in another virtualenv, run by its interpreter.

    The same queue, polls and checks as the current orchestrator (the runs and run_events rows
    of both releases have the same shape); only its migrations and its consumer differ.
    """

    name = BASELINE

    def __init__(self, python: str) -> None:
        super().__init__()
        self.python = [python, "-P"]
        self.installed: dict[str, Any] = {}

    async def prepare(self, dsn: str) -> None:
        process = await asyncio.create_subprocess_exec(
            *self.python,
            "-c",
            BASELINE_MIGRATE,
            dsn,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env={key: value for key, value in child_env(dsn).items() if key != "PYTHONPATH"},
        )
        try:
            out, err = await asyncio.wait_for(process.communicate(), BASELINE_SETUP_SECONDS)
        except TimeoutError:
            raise RuntimeError(
                f"the baseline's migrations took over {BASELINE_SETUP_SECONDS:.0f}s"
            ) from None
        finally:
            if process.returncode is None:
                process.kill()
                await process.wait()
        if process.returncode != 0:
            raise RuntimeError(f"the baseline's migrations failed:\n{err.decode()[-2000:]}")
        self.installed = json.loads(out.decode().strip().splitlines()[-1])
        check_installed(self.python[0], self.installed)

    def start(self, dsn: str, setting: Setting, *, profile_to: Path | None = None) -> Child:
        self.counter += 1
        name = f"bench-baseline-{self.counter}"
        return ServeProcess(dsn, *serve_args(setting), name=name, python=self.python)


@contextlib.asynccontextmanager
async def pgqueuer_queries(dsn: str) -> AsyncIterator[Queries]:
    """PgQueuer's queries on a connection of their own, closed on leaving."""
    from pgqueuer import AsyncpgDriver, Queries

    connection = await asyncpg.connect(dsn)
    try:
        yield Queries(AsyncpgDriver(connection))
    finally:
        await connection.close()


class PgQueuer:
    name = "pgqueuer"
    waiting_sql = "SELECT count(*) FROM pgqueuer WHERE status = 'queued'"
    done_sql = "SELECT count(*) FROM pgqueuer_log WHERE status = 'successful'"
    last_done_sql = "SELECT max(created) FROM pgqueuer_log WHERE status = 'successful'"

    async def prepare(self, dsn: str) -> None:
        async with pgqueuer_queries(dsn) as queries:
            await queries.install()

    async def load(self, dsn: str, jobs: int) -> None:
        async with pgqueuer_queries(dsn) as queries:
            await queries.enqueue(["noop"] * jobs, [None] * jobs, [0] * jobs)

    def start(self, dsn: str, setting: Setting, *, profile_to: Path | None = None) -> Child:
        argv = [sys.executable, str(HERE), "consume", "pgqueuer", dsn]
        argv += [str(setting.concurrency or 0), str(setting.batch)]
        return Child(argv, env=child_env(dsn), name="pgqueuer")

    async def check(self, connection: asyncpg.Connection, jobs: int, child: Child) -> list[str]:
        left = await connection.fetchval("SELECT count(*) FROM pgqueuer")
        return [f"{left} jobs left in the queue"] if left else []


class Procrastinate:
    name = "procrastinate"
    waiting_sql = "SELECT count(*) FROM procrastinate_jobs WHERE status = 'todo'"
    done_sql = "SELECT count(*) FROM procrastinate_jobs WHERE status = 'succeeded'"
    last_done_sql = "SELECT max(at) FROM procrastinate_events WHERE type = 'succeeded'"

    async def prepare(self, dsn: str) -> None:
        app, _ = procrastinate_app(dsn)
        async with app.open_async():
            await app.schema_manager.apply_schema_async()

    async def load(self, dsn: str, jobs: int) -> None:
        app, task = procrastinate_app(dsn)
        async with app.open_async():
            await task.batch_defer_async(*({} for _ in range(jobs)))

    def start(self, dsn: str, setting: Setting, *, profile_to: Path | None = None) -> Child:
        argv = [sys.executable, str(HERE), "consume", "procrastinate", dsn]
        argv += [str(setting.concurrency), "0"]
        return Child(argv, env=child_env(dsn), name="procrastinate")

    async def check(self, connection: asyncpg.Connection, jobs: int, child: Child) -> list[str]:
        states = await connection.fetch(
            "SELECT status::text, count(*) FROM procrastinate_jobs GROUP BY 1"
        )
        other = {row["status"]: row["count"] for row in states if row["status"] != "succeeded"}
        return [f"jobs not succeeded: {other}"] if other else []


def procrastinate_app(dsn: str) -> tuple[Any, Any]:
    import procrastinate

    app = procrastinate.App(connector=procrastinate.PsycopgConnector(conninfo=dsn))

    async def noop() -> None:
        return None

    task = app.task(name="noop")(noop)
    return app, task


# -- consumers (this file run as `throughput.py consume SYSTEM DSN CONCURRENCY BATCH`) ----------


async def consume_pgqueuer(dsn: str, concurrency: int | None, batch: int) -> None:
    from pgqueuer import AsyncpgDriver
    from pgqueuer import PgQueuer as PgQueuerApp
    from pgqueuer.models import Job
    from pgqueuer.types import QueueExecutionMode

    connection = await asyncpg.connect(dsn)
    pgq = PgQueuerApp(AsyncpgDriver(connection))

    @pgq.entrypoint("noop")
    async def noop(job: Job) -> None:
        return None

    try:
        await pgq.qm.run(
            batch_size=batch, max_concurrent_tasks=concurrency, mode=QueueExecutionMode.drain
        )
    finally:
        await connection.close()


async def consume_procrastinate(dsn: str, concurrency: int) -> None:
    app, _ = procrastinate_app(dsn)
    async with app.open_async():
        await app.run_worker_async(concurrency=concurrency, wait=False)


def consume(argv: Sequence[str]) -> int:
    system, dsn, concurrency, batch = argv
    if system == "pgqueuer":
        asyncio.run(consume_pgqueuer(dsn, int(concurrency) or None, int(batch)))
    elif system == "procrastinate":
        asyncio.run(consume_procrastinate(dsn, int(concurrency)))
    else:
        raise SystemExit(f"unknown system {system!r}")
    return 0


# -- one measurement ---------------------------------------------------------------------------


@dataclass
class Bench:
    server: Server
    config: Config
    templates: dict[str, str] = field(default_factory=dict)
    counter: int = 0


async def prepare_templates(bench: Bench, systems: Sequence[System]) -> None:
    for system in systems:
        slug = re.sub(r"\W", "_", system.name)
        name = f"bench_tp_{os.getpid()}_{slug}_template"
        bench.templates[system.name] = name  # dropped at the end even if prepare fails
        dsn = await create_database(bench.server.dsn, name)
        await system.prepare(dsn)


async def drop_templates(bench: Bench) -> None:
    for name in bench.templates.values():
        with contextlib.suppress(Exception):
            await drop_database(bench.server.dsn, name)


async def measure(
    bench: Bench,
    system: System,
    setting: Setting,
    phase: str,
    *,
    profile: bool = False,
    jobs: int | None = None,
) -> Measurement:
    bench.counter += 1
    jobs = jobs or bench.config.jobs
    name = f"bench_tp_{os.getpid()}_{bench.counter}"
    dsn = await create_database(bench.server.dsn, name, template=bench.templates[system.name])
    connection: asyncpg.Connection | None = None
    child: Child | None = None
    spy: subprocess.Popen[str] | None = None
    workdir = Path(tempfile.mkdtemp(prefix="bench-profile-")) if profile else None
    py_spy = find_py_spy() if profile else None
    use_py_spy = py_spy is not None
    try:
        await system.load(dsn, jobs)
        connection = await open_connection(dsn, "bench-poll")
        await connection.execute("ANALYZE")
        await connection.execute("CHECKPOINT")
        profile_to = workdir / "worker.pstats" if workdir and not use_py_spy else None
        counted = await server_statements.snapshot(connection) if bench.config.statements else None
        wal_start = await connection.fetchval("SELECT pg_current_wal_lsn()")
        child = system.start(dsn, setting, profile_to=profile_to)
        meter = CpuMeter(child.pid, bench.server.postmaster_pid)
        started_at = await wait_for_start(connection, system, jobs, child)
        first = meter.sample()
        if py_spy is not None and workdir is not None:
            spy = spawn(
                [
                    *(py_spy, "record", "--pid", str(child.pid), "--nonblocking"),
                    *("--rate", str(bench.config.profile_rate), "--format", "raw"),
                    "--full-filenames",
                    *("--output", str(workdir / "worker.txt")),
                ]
            )
        done, timed_out = await wait_for_done(connection, system, jobs, child, meter, bench.config)
        last = meter.sample()
        wal_bytes = await connection.fetchval("SELECT pg_current_wal_lsn() - $1::pg_lsn", wal_start)
        finished_at = await connection.fetchval(system.last_done_sql)
        if spy is not None:
            spy.send_signal(signal.SIGINT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                spy.wait(30)
        seconds = (finished_at - started_at).total_seconds() if finished_at else 0.0
        exact: float | None = None
        if isinstance(system, Orchestrator) and finished_at is not None:
            first_claim = await connection.fetchval(system.first_claim_sql)
            exact = done / (finished_at - first_claim).total_seconds()
        await child.stop()
        statements = (
            None
            if counted is None
            else server_statements.difference(
                counted,
                await server_statements.snapshot(connection),
                done,
                leave_out=own_statements(system),
            )
        )
        problems = await system.check(connection, jobs, child)
        if timed_out:
            problems.append(f"stopped after {bench.config.max_seconds:.0f}s: {done} of {jobs} done")
        rate = done / seconds if seconds > 0 else 0.0
        cpu = cpu_shares(first, last)
        result = Measurement(
            system=system.name,
            setting=setting,
            phase=phase,
            jobs=jobs,
            completed=done,
            seconds=seconds,
            rate=rate,
            exact_rate=exact,
            cpu=cpu,
            timed_out=timed_out,
            problems=problems,
            wal_bytes_per_job=float(wal_bytes) / done if done else None,
            worker_us_per_job=cpu_per_job(cpu["process"], rate),
            statements=statements,
        )
        if workdir is not None:
            result.profile = read_profile(workdir, use_py_spy, bench.config.profile_rate, seconds)
        log(
            f"{system.name} {setting.label()} ({phase}): {result.rate:,.0f} jobs/s "
            f"({done:,} in {seconds:.2f}s; worker {fmt(result.cpu['process'], '.2f')} cores, "
            f"postgres {fmt(result.cpu['postgres'], '.2f')}, "
            f"other {fmt(result.cpu['other'], '.2f')})"
            + (f"; PROBLEMS: {problems}" if problems else "")
        )
        return result
    finally:
        if spy is not None and spy.poll() is None:
            spy.kill()
        if child is not None and child.alive():
            child.kill()
        if connection is not None:
            await connection.close()
        await drop_database(bench.server.dsn, name)
        if workdir is not None:
            shutil.rmtree(workdir, ignore_errors=True)


def start_poll_sql(system: System) -> str:
    """The poll that waits for the consumer's first claim."""
    return f"SELECT ({system.waiting_sql}) AS waiting, clock_timestamp() AS now"


def own_statements(system: System) -> list[str]:
    """The benchmark's own statements in a measurement's database (not the consumer's)."""
    own = [system.waiting_sql, system.done_sql, system.last_done_sql, start_poll_sql(system)]
    own += ["SELECT pg_current_wal_lsn()", "SELECT pg_current_wal_lsn() - $1::pg_lsn"]
    own += [getattr(system, "first_claim_sql", ""), *server_statements.OWN_STATEMENTS]
    return own


def cpu_per_job(cores: float | None, rate: float) -> float | None:
    """µs of CPU per job of a process that used ``cores`` while ``rate`` jobs/s were done."""
    return cores / rate * 1e6 if cores is not None and rate > 0 else None


def find_py_spy() -> str | None:
    """py-spy from PATH or beside this interpreter (``pip install py-spy``), if installed."""
    beside = Path(sys.executable).parent / "py-spy"
    return shutil.which("py-spy") or (str(beside) if beside.exists() else None)


async def wait_for_start(
    connection: asyncpg.Connection, system: System, jobs: int, child: Child
) -> datetime:
    """The database time of the first poll that finds a job taken."""
    deadline = time.monotonic() + STARTUP_SECONDS
    poll = start_poll_sql(system)
    while time.monotonic() < deadline:
        row = await connection.fetchrow(poll)
        assert row is not None
        if row["waiting"] < jobs:
            now: datetime = row["now"]
            return now
        if not child.alive():
            raise RuntimeError(f"{child.name} exited before claiming:\n{child.tail()}")
        await asyncio.sleep(START_POLL_SECONDS)
    raise RuntimeError(f"{child.name} claimed nothing in {STARTUP_SECONDS:.0f}s:\n{child.tail()}")


async def wait_for_done(
    connection: asyncpg.Connection,
    system: System,
    jobs: int,
    child: Child,
    meter: CpuMeter,
    config: Config,
) -> tuple[int, bool]:
    deadline = time.monotonic() + config.max_seconds
    while True:
        meter.sample()  # keeps each process's last reading, in case it exits
        done = int(await connection.fetchval(system.done_sql))
        if done >= jobs:
            return done, False
        if not child.alive():
            # PgQueuer and Procrastinate exit once the queue is empty: count once more.
            done = int(await connection.fetchval(system.done_sql))
            if done < jobs:
                raise RuntimeError(
                    f"{child.name} exited with {done} of {jobs} done:\n{child.tail()}"
                )
            return done, False
        if time.monotonic() > deadline:
            return done, True
        await asyncio.sleep(DONE_POLL_SECONDS)


# -- profiles ----------------------------------------------------------------------------------

_FRAME = re.compile(r"^(?P<function>.*) \((?P<file>.*?)(?::(?P<line>\d+))?\)$")
EVENT_LOOP_MODULES = ("asyncio", "selectors", "socket", "ssl", "<frozen")
INCLUSIVE_PACKAGES = ("asyncpg", "opentelemetry", "structlog", "json")
"""Libraries whose inclusive share (samples with any frame in them) is reported."""


def frame_key(frame: str) -> tuple[str, str]:
    """``function (short path)`` without the line number, and the package the frame is in:
    the top-level package under site-packages, ``orchestrator``, or the stdlib module
    (``asyncio`` standing for the event loop and its sockets)."""
    match = _FRAME.match(frame)
    if match is None:
        return frame, "other"
    path = match["file"]
    if "/site-packages/" in path:
        relative = path.rsplit("/site-packages/", 1)[1]
    elif "/orchestrator/" in path:
        relative = "orchestrator/" + path.rsplit("/orchestrator/", 1)[1]
    elif "/lib/python3" in path:
        relative = path.rsplit("/lib/python3", 1)[1].split("/", 1)[-1]
    else:
        relative = path
    top = relative.split("/", 1)[0].removesuffix(".py")
    package = "asyncio" if top.startswith(EVENT_LOOP_MODULES) else top
    return f"{match['function']} ({relative})", package


def read_profile(workdir: Path, py_spy: bool, rate: int, seconds: float) -> dict[str, Any]:
    if py_spy:
        return read_py_spy(workdir / "worker.txt", rate, seconds)
    return read_cprofile(workdir / "worker.pstats")


def read_py_spy(path: Path, rate: int, seconds: float) -> dict[str, Any]:
    """Top frames from py-spy's collapsed stacks (samples where the worker was not idle)."""
    own: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    packages: Counter[str] = Counter()
    libraries: Counter[str] = Counter()
    total = 0
    if not path.exists():
        return {"profiler": "py-spy", "error": "py-spy wrote no output (permissions?)"}
    for line in path.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        total += count
        frames = [frame_key(frame) for frame in stack.split(";")]
        leaf, package = frames[-1]
        own[leaf] += count
        packages[package] += count
        for key in {key for key, package in frames if package == "orchestrator"}:
            inclusive[key] += count
        for library in {package for _, package in frames if package in INCLUSIVE_PACKAGES}:
            libraries[library] += count
    if not total:
        return {"profiler": "py-spy", "error": "no samples"}
    return {
        "profiler": "py-spy",
        "samples": total,
        "busy_share": total / (rate * seconds) if seconds > 0 else None,
        "self_by_package": {key: n / total for key, n in packages.most_common(10)},
        "inclusive_by_library": {key: n / total for key, n in libraries.most_common()},
        "self_top": {key: n / total for key, n in own.most_common(20)},
        "orchestrator_inclusive_top": {key: n / total for key, n in inclusive.most_common(25)},
    }


def read_cprofile(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {"profiler": "cProfile", "error": "no profile written"}
    stats = pstats.Stats(str(path))
    entries: dict[Any, Any] = stats.stats  # type: ignore[attr-defined]
    total = sum(entry[2] for entry in entries.values()) or 1.0

    def key(function: tuple[str, int, str]) -> str:
        return f"{function[2]} ({function[0]})"

    own = sorted(entries.items(), key=lambda item: item[1][2], reverse=True)[:20]
    cumulative = [
        item
        for item in sorted(entries.items(), key=lambda item: item[1][3], reverse=True)
        if "orchestrator" in item[0][0]
    ][:20]
    return {
        "profiler": "cProfile (whole process life, start-up included)",
        "self_top": {key(function): entry[2] / total for function, entry in own},
        "orchestrator_inclusive_top": {
            key(function): entry[3] / total for function, entry in cumulative
        },
    }


# -- the benchmark -----------------------------------------------------------------------------


def pgqueuer_accepts(setting: Setting) -> bool:
    """PgQueuer refuses ``max_concurrent_tasks < 2 * batch_size``."""
    if setting.batch is None:
        return False
    return setting.concurrency is None or setting.concurrency >= 2 * setting.batch


def pgqueuer_grid(grid: Sequence[Setting]) -> list[Setting]:
    """The grid's settings PgQueuer accepts, then its default (no concurrency cap) per batch."""
    accepted = [setting for setting in grid if pgqueuer_accepts(setting)]
    batches = sorted({setting.batch for setting in grid if setting.batch is not None})
    return accepted + [Setting(None, batch) for batch in batches]


async def benchmark(server: Server, config: Config) -> dict[str, Any]:
    orchestrator, pgqueuer, procrastinate = Orchestrator(), PgQueuer(), Procrastinate()
    baseline = Baseline(config.baseline_python) if config.baseline_python else None
    bench = Bench(server=server, config=config)
    admin = await connect(settings_for(server.dsn), application_name="bench-admin")
    try:
        facts = await server_facts(admin)
        if config.statements:  # refused at once, not after the grid
            try:
                await server_statements.snapshot(admin)
            except server_statements.StatementsUnavailable as error:
                raise SystemExit(f"throughput.py: {error}") from None
    finally:
        await admin.close()
    log(
        f"PostgreSQL {facts['server_version']}: fsync={facts['fsync']} "
        f"synchronous_commit={facts['synchronous_commit']}; {config.jobs:,} jobs per measurement"
    )
    measurements: list[Measurement] = []
    try:
        systems: list[System] = [orchestrator, pgqueuer, procrastinate]
        await prepare_templates(bench, systems + ([baseline] if baseline else []))
        log("grid: each setting once")
        for setting in config.grid:
            measurements.append(await measure(bench, orchestrator, setting, "grid"))
        for setting in pgqueuer_grid(config.grid):
            measurements.append(await measure(bench, pgqueuer, setting, "grid"))
        if config.procrastinate_concurrency > 0:
            pro_setting = Setting(config.procrastinate_concurrency, None)
            measurements.append(await measure(bench, procrastinate, pro_setting, "grid"))
        best_orchestrator = best_setting(measurements, "orchestrator")
        best_pgqueuer = best_setting(measurements, "pgqueuer")
        log(
            f"best settings: orchestrator {best_orchestrator.label()}, "
            f"PgQueuer {best_pgqueuer.label()}; {config.rounds} rounds of each"
            + (" and of the baseline at orchestrator's" if baseline else "")
        )
        order: list[tuple[System, Setting]] = [
            (orchestrator, best_orchestrator),
            (pgqueuer, best_pgqueuer),
        ]
        if baseline is not None:
            order.insert(0, (baseline, best_orchestrator))
        for index in range(1, config.rounds + 1):
            for system, setting in order if index % 2 else reversed(order):
                measurements.append(await measure(bench, system, setting, f"round {index}"))
        if config.profile:
            log(f"profiling orchestrator at {best_orchestrator.label()}")
            measurements.append(
                await measure(
                    bench,
                    orchestrator,
                    best_orchestrator,
                    "profile",
                    profile=True,
                    jobs=config.profile_jobs,
                )
            )
    finally:
        await drop_templates(bench)
    installed = baseline.installed if baseline else None
    return build_report(
        config, server, facts, measurements, best_orchestrator, best_pgqueuer, installed
    )


def best_setting(measurements: Sequence[Measurement], system: str) -> Setting:
    candidates = [m for m in measurements if m.system == system and m.phase == "grid"]
    return max(candidates, key=lambda m: m.rate).setting


def build_report(
    config: Config,
    server: Server,
    facts: dict[str, str],
    measurements: Sequence[Measurement],
    best_orchestrator: Setting,
    best_pgqueuer: Setting,
    baseline: dict[str, Any] | None,
) -> dict[str, Any]:
    def rounds(system: str) -> list[Measurement]:
        return [m for m in measurements if m.system == system and m.phase.startswith("round")]

    orchestrator_rounds, pgqueuer_rounds = rounds("orchestrator"), rounds("pgqueuer")
    procrastinate = [m for m in measurements if m.system == "procrastinate"]
    paired = rate_ratios(orchestrator_rounds, pgqueuer_rounds)
    orchestrator_median = statistics.median(m.rate for m in orchestrator_rounds)
    pgqueuer_median = statistics.median(m.rate for m in pgqueuer_rounds)
    procrastinate_rate = procrastinate[0].rate if procrastinate else 0.0
    vs_pgqueuer = statistics.median(paired) if paired else 0.0
    profiles = [m.profile for m in measurements if m.profile is not None]
    return {
        **report_heading("throughput"),
        "server": {"embedded": server.embedded, **facts},
        "config": {
            **workload(config, leaving_out=["grid"]),
            "grid": [setting.label() for setting in config.grid],
        },
        "best": {
            "orchestrator": asdict(best_orchestrator),
            "pgqueuer": asdict(best_pgqueuer),
            "procrastinate": {"concurrency": config.procrastinate_concurrency},
            **({BASELINE: asdict(best_orchestrator)} if baseline is not None else {}),
        },
        "summary": {
            "orchestrator_runs_per_s": orchestrator_median,
            "pgqueuer_jobs_per_s": pgqueuer_median,
            "procrastinate_jobs_per_s": procrastinate_rate,
            "orchestrator_vs_pgqueuer": vs_pgqueuer,
            "orchestrator_vs_pgqueuer_rounds": paired,
            "orchestrator_vs_procrastinate": (
                orchestrator_median / procrastinate_rate if procrastinate_rate else None
            ),
            "target_vs_pgqueuer": TARGET_VS_PGQUEUER,
            "target_met": vs_pgqueuer >= TARGET_VS_PGQUEUER,
            "orchestrator_worker_us_per_run": median_cpu_per_job(orchestrator_rounds),
            "pgqueuer_worker_us_per_job": median_cpu_per_job(pgqueuer_rounds),
            "baseline": (
                baseline_summary(orchestrator_rounds, rounds(BASELINE), baseline)
                if baseline is not None
                else None
            ),
        },
        "measurements": [asdict(m) for m in measurements],
        "statements": {
            system: server_statements.combine(
                [m.statements for m in rounds(system) if m.statements is not None]
            )
            for system in dict.fromkeys(m.system for m in measurements)
            if any(m.statements is not None for m in rounds(system))
        },
        "profile": profiles[0] if profiles else None,
        "problems": [f"{m.system} {m.phase}: {p}" for m in measurements for p in m.problems],
        "versions": peer_versions(),
    }


def rate_ratios(current: Sequence[Measurement], other: Sequence[Measurement]) -> list[float]:
    """Per-round ratios of two systems' rates (the lists are in round order)."""
    return [c.rate / o.rate for c, o in zip(current, other, strict=True) if o.rate > 0]


def median_cpu_per_job(measurements: Sequence[Measurement]) -> float | None:
    """The median of the measurements' worker µs per job (None if none was measured)."""
    values = [m.worker_us_per_job for m in measurements if m.worker_us_per_job is not None]
    return statistics.median(values) if values else None


def baseline_summary(
    current: Sequence[Measurement], baseline: Sequence[Measurement], installed: dict[str, Any]
) -> dict[str, Any]:
    """orchestrator against its baseline release: rates, per-round ratios, worker CPU per run."""
    ratios = rate_ratios(current, baseline)
    cpu_ratios = [
        c.worker_us_per_job / b.worker_us_per_job
        for c, b in zip(current, baseline, strict=True)
        if c.worker_us_per_job is not None and b.worker_us_per_job
    ]
    return {
        "installed": installed,
        "runs_per_s": statistics.median(m.rate for m in baseline),
        "orchestrator_vs_baseline": statistics.median(ratios) if ratios else None,
        "orchestrator_vs_baseline_rounds": ratios,
        "worker_us_per_run": median_cpu_per_job(baseline),
        "orchestrator_worker_us_per_run": median_cpu_per_job(current),
        "worker_cpu_vs_baseline": statistics.median(cpu_ratios) if cpu_ratios else None,
        "worker_cpu_vs_baseline_rounds": cpu_ratios,
    }


def peer_versions() -> dict[str, str]:
    from importlib.metadata import version

    return {name: version(name) for name in ("pgqueuer", "procrastinate", "psycopg")}


def format_report(report: dict[str, Any]) -> str:
    machine, server, summary = report["machine"], report["server"], report["summary"]
    versions = report["versions"]
    out = [
        f"throughput: {report['date']}, {machine['cpus']} CPUs, Python {machine['python']}, "
        f"PgQueuer {versions['pgqueuer']}, Procrastinate {versions['procrastinate']}",
        f"{server_line(server)} full_page_writes={server['full_page_writes']}",
        f"{report['config']['jobs']:,} no-op jobs per measurement, queued beforehand; one consumer "
        "process; jobs/s from the first claim to the last completion (database clock)",
        "cores: CPU used during the measurement by the consumer, by PostgreSQL, and by other "
        "programs on the machine; worker µs/job: the consumer's CPU per job; WAL B/job: "
        "write-ahead log the server wrote per job (full-page images after the CHECKPOINT "
        "included)",
        "",
    ]
    rows = []
    for m in report["measurements"]:
        label = setting_label(m["setting"])
        cpu = m["cpu"]
        rows.append(
            (
                m["system"],
                label,
                m["phase"],
                f"{m['rate']:,.0f}",
                f"{m['seconds']:.2f}",
                fmt(cpu["process"], ".2f"),
                fmt(cpu["postgres"], ".2f"),
                fmt(cpu["other"], ".2f"),
                fmt(m.get("worker_us_per_job"), ",.0f"),
                fmt(m.get("wal_bytes_per_job"), ",.0f"),
                "yes" if m["problems"] else "",
            )
        )
    header = [
        *("system", "setting", "phase", "jobs/s", "seconds"),
        *("worker", "postgres", "other", "worker µs/job", "WAL B/job", "problems"),
    ]
    out += render_table(header, rows)
    best = report["best"]
    orchestrator_best = best["orchestrator"]
    pgqueuer_best = best["pgqueuer"]
    vs_pro = summary["orchestrator_vs_procrastinate"]
    out += [
        "",
        f"best settings: orchestrator --concurrency {orchestrator_best['concurrency']} "
        f"--claim-batch {orchestrator_best['batch']}; PgQueuer max_concurrent_tasks="
        f"{pgqueuer_best['concurrency'] or 'None'} batch_size={pgqueuer_best['batch']}; "
        "Procrastinate "
        f"concurrency={best['procrastinate']['concurrency']}",
        f"orchestrator: {summary['orchestrator_runs_per_s']:,.0f} runs/s (median of "
        f"{report['config']['rounds']} rounds)",
        f"PgQueuer: {summary['pgqueuer_jobs_per_s']:,.0f} jobs/s (median of "
        f"{report['config']['rounds']} rounds)",
        (
            f"Procrastinate: {summary['procrastinate_jobs_per_s']:,.0f} jobs/s (one measurement)"
            if best["procrastinate"]["concurrency"]
            else "Procrastinate: left out (--procrastinate-concurrency 0)"
        ),
        f"orchestrator/PgQueuer: {summary['orchestrator_vs_pgqueuer']:.2f} (median of per-round "
        "ratios: "
        + ", ".join(f"{r:.2f}" for r in summary["orchestrator_vs_pgqueuer_rounds"])
        + ")",
        f"orchestrator/Procrastinate: {fmt(vs_pro, '.2f')}",
        f"target: orchestrator >= {summary['target_vs_pgqueuer']}x PgQueuer: "
        + verdict(summary["target_met"]),
        f"worker CPU per run: orchestrator {fmt(summary['orchestrator_worker_us_per_run'])} µs, "
        f"PgQueuer {fmt(summary['pgqueuer_worker_us_per_job'])} µs (medians of the rounds)",
    ]
    if summary["baseline"] is not None:
        out += format_baseline(summary["baseline"], report["config"]["rounds"])
    if report["statements"]:
        out += server_statements.format_statements(report["statements"], STATEMENTS_SHOWN)
    if report["problems"]:
        out += ["", "PROBLEMS:", *(f"  {problem}" for problem in report["problems"])]
    profile = report["profile"]
    if profile:
        jobs = report["config"]["profile_jobs"]
        out += ["", f"(the profile row: {jobs:,} runs with py-spy attached; not in any ratio)"]
        out += format_profile(profile)
    return "\n".join(out)


def format_baseline(baseline: dict[str, Any], rounds: int) -> list[str]:
    installed = baseline["installed"]
    release = f"{installed['distribution']} {installed['orchestrator_version']}"
    return [
        f"orchestrator@baseline ({release}, Python {installed['python']}, same setting): "
        f"{baseline['runs_per_s']:,.0f} runs/s (median of {rounds} rounds)",
        f"orchestrator/baseline: {fmt(baseline['orchestrator_vs_baseline'], '.2f')} (median of "
        "per-round ratios: "
        + ", ".join(f"{r:.2f}" for r in baseline["orchestrator_vs_baseline_rounds"])
        + ")",
        f"worker CPU per run: orchestrator {fmt(baseline['orchestrator_worker_us_per_run'])} µs, "
        f"baseline {fmt(baseline['worker_us_per_run'])} µs; orchestrator/baseline "
        f"{fmt(baseline['worker_cpu_vs_baseline'], '.2f')} (median of per-round ratios: "
        + ", ".join(f"{r:.2f}" for r in baseline["worker_cpu_vs_baseline_rounds"])
        + ")",
    ]


def format_profile(profile: dict[str, Any]) -> list[str]:
    if "error" in profile:
        return [f"profile ({profile['profiler']}): {profile['error']}"]
    lines = [f"profile of the orchestrator worker at saturation ({profile['profiler']}):"]
    if profile.get("busy_share") is not None:
        lines.append(
            f"  samples with the worker not idle (running or runnable): {profile['samples']:,} "
            f"({profile['busy_share']:.0%} of the interval)"
        )
    if "self_by_package" in profile:
        lines.append(
            "  own time by package: "
            + ", ".join(f"{key} {value:.0%}" for key, value in profile["self_by_package"].items())
        )
    if "inclusive_by_library" in profile:
        lines.append(
            "  samples inside: "
            + ", ".join(
                f"{key} {value:.0%}" for key, value in profile["inclusive_by_library"].items()
            )
        )
    lines.append("  top frames by own time:")
    lines += [f"    {value:6.1%}  {key}" for key, value in list(profile["self_top"].items())[:12]]
    lines.append("  orchestrator functions by inclusive time:")
    lines += [
        f"    {value:6.1%}  {key}"
        for key, value in list(profile["orchestrator_inclusive_top"].items())[:20]
    ]
    return lines


# -- entry point -------------------------------------------------------------------------------


def parse_setting(text: str) -> Setting:
    concurrency, _, batch = text.lower().partition("x")
    return Setting(int(concurrency), int(batch))


def parse_args(argv: Sequence[str] | None) -> Config:
    parser = benchmark_parser(
        "Runs/s of no-op runs through one `orchestrator serve`, beside PgQueuer "
        "and Procrastinate on the same server."
    )
    parser.add_argument("--jobs", type=int, default=20_000, help="jobs per measurement")
    parser.add_argument(
        "--grid",
        type=lambda text: tuple(parse_setting(part) for part in text.split(",") if part),
        default=(
            Setting(100, 50),
            Setting(100, 200),
            Setting(500, 50),
            Setting(500, 200),
            Setting(1000, 200),
        ),
        help="comma-separated CONCURRENCYxBATCH settings for orchestrator and PgQueuer",
    )
    parser.add_argument(
        "--procrastinate-concurrency",
        type=int,
        default=100,
        help="Procrastinate's worker concurrency; 0 leaves Procrastinate out (a quicker run)",
    )
    parser.add_argument("--rounds", type=int, default=7, help="rounds of the best settings")
    parser.add_argument(
        "--max-seconds", type=float, default=90.0, help="time bound of one measurement"
    )
    parser.add_argument(
        "--profile", action="store_true", help="profile the orchestrator worker (py-spy)"
    )
    parser.add_argument("--profile-rate", type=int, default=200, help="py-spy samples/s")
    parser.add_argument(
        "--profile-jobs", type=int, default=30_000, help="runs in the profiled measurement"
    )
    parser.add_argument(
        "--statements",
        action="store_true",
        help="count each statement's server time and WAL per job (pg_stat_statements; an "
        "embedded server is started with it, a --dsn server must preload it)",
    )
    parser.add_argument(
        "--baseline-python",
        metavar="PATH",
        help="the Python of a virtualenv with an older orchestrator release installed: "
        "measure it beside the current one (orchestrator@baseline)",
    )
    config = Config(**vars(parser.parse_args(argv)))
    if config.baseline_python and not os.access(config.baseline_python, os.X_OK):
        parser.error(f"--baseline-python {config.baseline_python}: not an executable file")
    if config.procrastinate_concurrency < 0:
        parser.error("--procrastinate-concurrency must be 0 (leave it out) or more")
    if config.jobs < 100 or config.rounds < 1 or config.max_seconds <= 0 or not config.grid:
        parser.error("--jobs must be at least 100, --rounds at least 1, --grid not empty")
    return config


def main(argv: Sequence[str] | None = None) -> int:
    arguments = list(sys.argv[1:] if argv is None else argv)
    if arguments[:1] == ["consume"]:
        return consume(arguments[1:])
    config = parse_args(arguments)
    run_and_report(
        config,
        "throughput",
        lambda server: benchmark(server, config),
        format_report,
        server_settings=server_statements.SERVER_SETTINGS if config.statements else None,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
