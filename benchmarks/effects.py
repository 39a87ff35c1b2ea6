"""The effect path: dispatcher throughput and CPU against its physical limit and an older release,
its scaling over processes, and commit-to-outcome latency, on loopback (issue 24).

Three kinds of process take part, each in its own: the **vendor** (``effects_vendor.py``: a
lean HTTP/1.1 keep-alive server on 127.0.0.1, standard library only, that honours
``Idempotency-Key``: ``POST /send`` delivers once per key and answers repeats with the first
answer, ``GET /requests/{key}`` answers 200 or 404, ``GET /stats`` reports the POSTs per key);
the **dispatchers** and the **raw client loops** (``effects_dispatch.py``, which imports only the
API that every release shares: ``Dispatcher(pool, adapters, dispatcher_id=, lease_seconds=,
batch=, concurrency=, poll_seconds=)``, ``adapter_from_config`` with an ``http`` adapter,
reconcile ``lookup``, ``RunStore.claim``, ``EffectStore.accept``, the migrations); and this
process, which starts them, polls PostgreSQL and reports. ``LocalVendor`` (the test vendor, on
anyio streams) answered about 6,700 POSTs/s to the aiohttp loop in a check on this machine;
this vendor answers 10,000/s on a fifth of a core, so it stays far from being the limit, and
the table shows the cores it used in every measurement.

What is measured, in ONE run:

1. **Dispatch throughput** (effects/s). A fresh database per measurement, migrated and filled by
   the interpreter that dispatches (``effects_dispatch.py setup``: ``--effects`` runs, 5,000,
   inserted, claimed with ``RunStore.claim`` and each run's effect accepted with
   ``EffectStore.accept`` in transactions of 500, the way a step commit accepts it). Then the
   dispatcher process opens its pool (concurrency + 2 connections) and builds its
   ``Dispatcher`` (``--concurrency`` x ``--batch``, 50 x 50; poll ``--dispatch-poll-seconds``,
   1 s, the default); the clock starts on the database clock just before it is told to go and
   stops at the last ``settled_at``. Effects/s = confirmed / that span. Measured for the current
   tree and, with ``--baseline-python PATH``, for an older release installed (not editable) in
   another virtualenv: its interpreter runs the same script with ``-P`` (this tree is not on its
   path) and the benchmark refuses it if it imports this tree. Beside them, the **raw client
   loops**, the physical limit: the same number of POSTs with the same payloads and the same
   concurrency (that many tasks on one client, keep-alive) to the same vendor, with ``httpx``
   (the client ``HttpAdapter`` uses) and with ``aiohttp`` (optional: its row is skipped with a
   note if it is not installed), timed in their own process from go to the last answer.
   The 1-process dispatcher is measured ``--rounds`` (3) times; with a baseline, each round
   measures both back to back, in an order that alternates (baseline first in odd rounds).
   Reported: dispatcher/baseline (the median of the per-round ratios) and dispatcher/best raw
   loop (the median of the rounds over the faster loop), and for every row the cores used
   from go to stop by the sender(s), the vendor, PostgreSQL (the embedded server only: psutil
   over the postmaster and its children) and everything else on the machine ("other": other
   programs on this shared machine, the noise to read every figure against).

2. **Dispatcher CPU per effect**: the dispatcher process's own CPU time (``getrusage``, user +
   system) from go until it is told to stop (right after the last settle is seen), divided by the
   effects confirmed (the median of the rounds); beside the **worker's CPU per no-op run**,
   measured in the same run: ``--noop-runs`` (3,000) no-op runs queued in one statement and run
   by ``orchestrator serve --agents orchestrator.agents.noop --concurrency 100 --claim-batch 50``
   in its own process (its CPU read with psutil from its first claim to its last completion). The
   ratio dispatcher/worker is the figure issue 24 targets (10x or less): sending an effect should
   not cost much more than a whole run.

3. **Commit-to-outcome latency** (ms). A worker runs in this process
   (``orchestrator.testing.running_worker``, its built-in dispatcher sending ``crm`` effects
   through ``adapter_from_config``'s adapter to the vendor process) with a small agent defined
   below: step 1 requests one effect in the commit of its checkpoint; step 2 awaits it with
   ``ctx.effects.wait`` and reads the database clock as soon as that returns. A run's latency
   is that reading minus the ``at`` of its ``checkpoint`` event (written by step 1's commit
   statement, a little before the COMMIT: the figure slightly overstates the latency).
   ``--runs`` (150) runs one at a time after ``--warmup-runs`` (5). Targets: p50 5 ms or less,
   p99 15 ms or less. The worker polls every ``--poll-seconds`` (2 s, serve's default), the
   fallback for missed NOTIFYs. Each run is split into consecutive parts from its events, the
   adapter (when ``send`` was called), the vendor (when the request arrived) and, while the
   dispatcher still has them, its private claim and wake hooks (a subclass records them; when a
   timestamp is missing the parts around it are merged, so the breakdown degrades instead of
   failing when the internals change). Timestamps come from the database clock and this host's
   ``time.time()`` (the vendor's too); the report shows the offset between the two clocks.

4. **Exactly once**: after every measurement the vendor's POST count per idempotency key must
   be exactly 1 for every key of the measurement (and no other key may have arrived), and every
   effect must be ``confirmed``; the table prints it, and the benchmark exits with status 1
   otherwise.

5. **Scaling**: 1, 2 and 4 dispatcher processes (``--processes``) of the current tree against
   the one vendor and one PostgreSQL, over the same number of effects (each process with the
   same concurrency x batch): effects/s, the POSTs per key, their CPU per effect and the cores
   of each party. The 1-process row is the current tree's last round of measurement 1.

Why: the effect boundary is a transactional outbox. Its throughput bounds how many side effects
a deployment can send, its CPU what sending them costs beside the runs that request them, and
its latency is added to every step that waits for an outcome.

This machine is shared (two cores): figures move with other work, the latencies most; compare the
ratios, whose two sides are measured seconds apart in the same run, and read the load averages at
the start and the end. The server (embedded and durable, or ``--dsn``), the scratch databases,
``--json`` and the clean-up are those of every benchmark ("Common to all" in benchmarks/README.md);
every child process is killed on the way out. Every measurement is bounded in time
(``--max-seconds``, 60 s; 30 s per latency run); the defaults take two to three minutes. Run from
the repository root: ``.venv/bin/python benchmarks/effects.py [--baseline-python
../base-venv/bin/python]``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import IO, Any

import anyio
import asyncpg
import httpx
import psutil  # type: ignore[import-untyped]  # psutil ships no type information

from bench_main import benchmark_parser, run_and_report
from bench_report import fmt, log, render_table, report_heading, server_line, verdict, workload
from orchestrator.agent.steps import Agent, Finish, Next, Outcome, Step, StepContext
from orchestrator.db.connections import connect, create_pool
from orchestrator.db.migrations import migrate
from orchestrator.db.store import RunStore
from orchestrator.effect_model import Effect
from orchestrator.effects.dispatcher import Dispatcher
from orchestrator.effects.vendors import adapter_from_config
from orchestrator.models import RunEvent, RunState
from orchestrator.settings import Settings
from orchestrator.telemetry import configure_logging
from orchestrator.testing import running_worker
from orchestrator.worker import worker as supervisor_module
from serve_harness import (
    DURABILITY_SHOWN,
    CpuMeter,
    ServeProcess,
    Server,
    child_env,
    cpu_shares,
    create_database,
    drop_database,
    queue_runs_sql,
    server_facts,
)

HERE = Path(__file__).resolve().parent
REPOSITORY = HERE.parent
VENDOR_SCRIPT = HERE / "effects_vendor.py"
SENDER_SCRIPT = HERE / "effects_dispatch.py"
MARK = "@@ "
"""How the helper processes prefix their answers on stdout."""
KIND = "crm"
EFFECT_KEY = "crm-update"
TARGET_P50_MS = 5.0
TARGET_P99_MS = 15.0
TARGET_CPU_RATIO = 10.0
"""Dispatcher CPU per effect over the worker's CPU per no-op run, at most."""
NOOP_CONCURRENCY, NOOP_BATCH = 100, 50
RUN_SECONDS = 30.0
"""Bound of one latency run, from its submit to its end."""
HELPER_SECONDS = 120.0
"""Longest wait for a helper process's answer (set-up included)."""
ADAPTER_TIMEOUT_SECONDS = 10.0
POLL_INTERVAL = 0.1
"""How often a dispatch measurement reads the effects' statuses."""
SEARCH_PATH = "orchestrator, public"
"""The benchmark's own polling connections: the current layout keeps the tables in schema
``orchestrator``, older releases in ``public``; unqualified names find both."""

SERVER_SETTINGS_SHOWN = (*DURABILITY_SHOWN, "wal_sync_method", "shared_buffers")

LOAD_AT_START = list(os.getloadavg())
"""1, 5 and 15-minute load averages when the benchmark started."""


# -- helper processes -----------------------------------------------------------------------------


class Helper:
    """A child process answering ``@@ {json}`` lines on stdout and reading cues on stdin; its
    stderr goes to a temporary file, shown when it fails."""

    def __init__(self, name: str, process: asyncio.subprocess.Process, stderr: IO[bytes]) -> None:
        self.name = name
        self.process = process
        self._stderr = stderr

    @classmethod
    async def start(cls, argv: Sequence[str], *, env: dict[str, str], name: str) -> Helper:
        stderr = tempfile.TemporaryFile()  # noqa: SIM115 - closed by close()
        process = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=stderr,
            env=env,
        )
        return cls(name, process, stderr)

    async def answer(self, within: float = HELPER_SECONDS) -> dict[str, Any]:
        assert self.process.stdout is not None
        deadline = time.monotonic() + within
        while True:
            left = deadline - time.monotonic()
            try:
                line = await asyncio.wait_for(self.process.stdout.readline(), max(left, 0.001))
            except TimeoutError:
                raise RuntimeError(f"{self.name} did not answer within {within:.0f}s") from None
            if not line:
                await self.process.wait()
                raise RuntimeError(
                    f"{self.name} exited ({self.process.returncode}) without answering:\n"
                    + self.tail()
                )
            text = line.decode(errors="replace")
            if text.startswith(MARK):
                answer: dict[str, Any] = json.loads(text[len(MARK) :])
                return answer

    async def tell(self, cue: str) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(f"{cue}\n".encode())
        await self.process.stdin.drain()

    def tail(self, count: int = 20) -> str:
        self._stderr.seek(0)
        return "\n".join(self._stderr.read().decode(errors="replace").splitlines()[-count:])

    async def close(self) -> None:
        """End the process (closing its stdin first: the vendor and a finished helper exit)."""
        if self.process.returncode is None:
            if self.process.stdin is not None:
                self.process.stdin.close()
            try:
                await asyncio.wait_for(self.process.wait(), 5)
            except TimeoutError:
                self.process.kill()
                await self.process.wait()
        self._stderr.close()


@contextlib.asynccontextmanager
async def helpers() -> Any:
    """A list to start helpers into; every one still running is ended on leaving."""
    started: list[Helper] = []
    try:
        yield started
    finally:
        for helper in started:
            with anyio.CancelScope(shield=True):
                await helper.close()


class Interpreter:
    """The Python that runs the dispatcher: this one (the current tree) or a baseline."""

    def __init__(self, python: str | None) -> None:
        self.baseline = python is not None
        self.argv = [python, "-P"] if python is not None else [sys.executable]
        self.label = "baseline" if python is not None else "current"
        self.installed: dict[str, Any] | None = None

    def env(self, dsn: str) -> dict[str, str]:
        env = child_env(dsn)
        if self.baseline:
            env.pop("PYTHONPATH", None)
        return env

    def check(self, installed: dict[str, Any]) -> None:
        """A baseline must not import this tree (an editable install would measure it twice);
        the current interpreter must."""
        if self.installed is not None:
            return
        package = Path(installed["package"]).resolve()
        inside = package.is_relative_to(REPOSITORY)
        if self.baseline and inside:
            raise RuntimeError(
                f"{self.argv[0]} imports the current tree ({package}), not an installed release: "
                "install the baseline non-editable in a virtualenv of its own"
            )
        if not self.baseline and not inside:
            raise RuntimeError(f"this interpreter imports {package}, not the tree at {REPOSITORY}")
        self.installed = installed
        log(
            f"{self.label}: {installed['distribution']} {installed['orchestrator_version']} at "
            f"{package} (Python {installed['python']})"
        )


class VendorProcess:
    """The vendor in its own process, and an HTTP client to read its statistics."""

    def __init__(self, helper: Helper, port: int) -> None:
        self.helper = helper
        self.url = f"http://127.0.0.1:{port}"
        self.client = httpx.AsyncClient(base_url=self.url, timeout=30)

    async def reset(self) -> float:
        """Forget every key; return the vendor's CPU seconds so far."""
        await self.client.post("/reset")
        return float((await self.stats())["cpu_seconds"])

    async def stats(self) -> dict[str, Any]:
        response = await self.client.get("/stats")
        response.raise_for_status()
        stats: dict[str, Any] = response.json()
        return stats


def exactly_once(counts: dict[str, int], expected: set[str]) -> dict[str, Any]:
    """The vendor's POSTs per key against the keys of one measurement."""
    per_key = Counter(counts.get(key, 0) for key in expected)
    return {
        "keys": len(expected),
        "posts": sum(counts.values()),
        "posts_per_key": {str(n): per_key[n] for n in sorted(per_key)},
        "unexpected_keys": len(set(counts) - expected),
        "exact": set(per_key) == {1} and not set(counts) - expected,
    }


def once_text(check: dict[str, Any]) -> str:
    if check["exact"]:
        return f"1 for all {check['keys']:,}"
    parts = [f"{n}: {keys:,} keys" for n, keys in check["posts_per_key"].items()]
    if check["unexpected_keys"]:
        parts.append(f"{check['unexpected_keys']} unknown keys")
    return "NO (" + ", ".join(parts) + ")"


# -- dispatch and raw measurements ----------------------------------------------------------------


async def open_connection(dsn: str) -> asyncpg.Connection:
    """The benchmark's own connection: plain asyncpg, either release's table layout."""
    return await asyncpg.connect(
        dsn, server_settings={"application_name": "bench-effects", "search_path": SEARCH_PATH}
    )


PROGRESS_SQL = """
SELECT count(*) FILTER (WHERE status = 'confirmed') AS confirmed,
       count(*) FILTER (WHERE status IN ('failed', 'rejected', 'parked')) AS settled_otherwise,
       max(settled_at) AS last_settled
FROM effects
"""


async def measure_dispatch(
    server: Server,
    vendor: VendorProcess,
    interpreter: Interpreter,
    args: Config,
    index: int,
    processes: int,
    round_number: int | None = None,
) -> dict[str, Any]:
    """``processes`` dispatcher processes of ``interpreter`` over ``args.effects`` effects."""
    label = f"Dispatcher ({interpreter.label}), {processes} process" + (
        "es" if processes > 1 else ""
    )
    if round_number is not None and args.rounds > 1:
        label += f", round {round_number}"
    database = f"orchestrator_bench_effects_{os.getpid()}_{index}"
    dsn = await create_database(server.dsn, database)
    try:
        async with helpers() as started:
            started_at = time.perf_counter()
            setup = await Helper.start(
                [
                    *interpreter.argv,
                    str(SENDER_SCRIPT),
                    "setup",
                    dsn,
                    "r_fx_",
                    "bench_fx",
                    str(args.effects),
                ],
                env=interpreter.env(dsn),
                name=f"{interpreter.label} set-up",
            )
            started.append(setup)
            made = await setup.answer()
            log(
                f"{label}: {made['accepted']:,} accepted effects created in "
                f"{time.perf_counter() - started_at:.1f}s"
            )
            senders = []
            for number in range(processes):
                name = f"bench-dispatch-{index}-{number}"
                argv = [*interpreter.argv, str(SENDER_SCRIPT), "dispatch", dsn, vendor.url]
                argv += [str(args.concurrency), str(args.batch), str(args.dispatch_poll_seconds)]
                sender = await Helper.start([*argv, name], env=interpreter.env(dsn), name=name)
                started.append(sender)
                senders.append(sender)
            for sender in senders:
                await sender.answer()
            connection = await open_connection(dsn)
            try:
                keys = {
                    row["idempotency_key"]
                    for row in await connection.fetch("SELECT idempotency_key FROM effects")
                }
                vendor_cpu = await vendor.reset()
                meter = CpuMeter(None, server.postmaster_pid)
                first = meter.sample()
                db_start: datetime = await connection.fetchval("SELECT clock_timestamp()")
                for sender in senders:
                    await sender.tell("go")
                wall_start = time.perf_counter()
                deadline, last_logged = wall_start + args.max_seconds, wall_start
                timed_out = False
                while True:
                    await anyio.sleep(POLL_INTERVAL)
                    progress = await connection.fetchrow(PROGRESS_SQL)
                    assert progress is not None
                    # Read PostgreSQL's backends now: the dispatchers' close as they stop.
                    meter.sample()
                    done = progress["confirmed"] + progress["settled_otherwise"]
                    now = time.perf_counter()
                    if done >= args.effects:
                        break
                    if now > deadline:
                        timed_out = True
                        break
                    if now - last_logged >= 5:
                        last_logged = now
                        log(f"  {done:,}/{args.effects:,} settled after {now - wall_start:.0f}s")
                for sender in senders:
                    await sender.tell("stop")
                reports = [await sender.answer() for sender in senders]
                stats = await vendor.stats()
                shares = cpu_shares(first, meter.sample())
                statuses: dict[str, int] = {
                    row["status"]: row["count"]
                    for row in await connection.fetch(
                        "SELECT status, count(*) FROM effects GROUP BY 1"
                    )
                }
            finally:
                await connection.close()
    finally:
        await drop_database(server.dsn, database)
    confirmed = int(progress["confirmed"])
    last_settled: datetime | None = progress["last_settled"]
    seconds = (last_settled - db_start).total_seconds() if last_settled else args.max_seconds
    cpu = sum(float(report["cpu_seconds"]) for report in reports)
    outcomes: Counter[str] = Counter()
    for report in reports:
        outcomes.update(report.get("outcomes") or {})
    once = exactly_once(stats["counts"], keys)
    row = {
        "kind": "dispatcher",
        "label": label,
        "interpreter": interpreter.label,
        "processes": processes,
        "round": round_number,
        "effects": args.effects,
        "confirmed": confirmed,
        "statuses": statuses,
        "seconds": seconds,
        "effects_per_s": confirmed / seconds if seconds > 0 else 0.0,
        "timed_out": timed_out,
        "cpu_seconds": cpu,
        "cpu_ms_per_effect": 1000 * cpu / confirmed if confirmed else None,
        "cpu_ms_per_effect_by_process": [
            1000 * float(report["cpu_seconds"]) * processes / confirmed if confirmed else None
            for report in reports
        ],
        **cores(shares, cpu, float(stats["cpu_seconds"]) - vendor_cpu),
        "vendor_lookups": stats["lookups"],
        "dispatcher_outcomes": dict(outcomes),
        "once": once,
        "exact": once["exact"] and confirmed == args.effects and not timed_out,
    }
    log(
        f"{label}: {row['effects_per_s']:,.0f} effects/s, {confirmed:,} confirmed in "
        f"{seconds:.2f}s, {fmt(row['cpu_ms_per_effect'], '.3f')} CPU ms/effect, POSTs per key: "
        + once_text(once)
        + (" (TIMED OUT)" if timed_out else "")
    )
    return row


async def measure_raw(
    server: Server, vendor: VendorProcess, args: Config, client: str
) -> dict[str, Any]:
    """The same POSTs, payloads and concurrency as a dispatcher, from a bare client loop."""
    label = f"raw {client} loop"
    prefix = f"raw-{client}-"
    async with helpers() as started:
        argv = [sys.executable, str(SENDER_SCRIPT), "raw", vendor.url, str(args.effects)]
        argv += [str(args.concurrency), client, prefix, str(args.max_seconds)]
        helper = await Helper.start(argv, env=dict(os.environ), name=label)
        started.append(helper)
        await helper.answer()
        vendor_cpu = await vendor.reset()
        meter = CpuMeter(None, server.postmaster_pid)
        first = meter.sample()
        await helper.tell("go")
        report = await helper.answer(within=args.max_seconds + 30)
        shares = cpu_shares(first, meter.sample())
        stats = await vendor.stats()
    seconds, sent = float(report["seconds"]), int(report["sent"])
    once = exactly_once(stats["counts"], {f"{prefix}{n:06d}" for n in range(1, sent + 1)})
    row = {
        "kind": "raw",
        "label": label,
        "client": client,
        "effects": args.effects,
        "confirmed": sent - int(report["errors"]),
        "seconds": seconds,
        "effects_per_s": sent / seconds if seconds > 0 else 0.0,
        "timed_out": bool(report["timed_out"]),
        "cpu_seconds": float(report["cpu_seconds"]),
        "cpu_ms_per_effect": 1000 * float(report["cpu_seconds"]) / sent if sent else None,
        **cores(shares, float(report["cpu_seconds"]), float(stats["cpu_seconds"]) - vendor_cpu),
        "errors": report["errors"],
        "first_error": report["first_error"],
        "once": once,
        "exact": once["exact"] and not report["errors"],
    }
    log(
        f"{label}: {row['effects_per_s']:,.0f} requests/s, "
        f"{fmt(row['cpu_ms_per_effect'], '.3f')} CPU ms/request, POSTs per key: {once_text(once)}"
    )
    return row


def cores(shares: dict[str, float | None], senders: float, vendor: float) -> dict[str, Any]:
    """Cores used from go to stop: by the dispatchers, the vendor, PostgreSQL (embedded server
    only), this benchmark and every other program on the machine (the noise)."""
    wall = shares["seconds"] or 0.0
    if wall <= 0:
        return dict.fromkeys(("dispatcher_cores", "vendor_cores", "postgres_cores", "other_cores"))
    ours = senders / wall + vendor / wall + (shares["benchmark"] or 0.0)
    return {
        "dispatcher_cores": senders / wall,
        "vendor_cores": vendor / wall,
        "postgres_cores": shares["postgres"],
        "other_cores": max((shares["machine_busy"] or 0.0) - ours - (shares["postgres"] or 0.0), 0),
    }


def aiohttp_missing() -> str | None:
    """Why the aiohttp row is skipped, or ``None`` if aiohttp can be imported."""
    try:
        import aiohttp  # noqa: F401
    except ImportError as error:
        return f"aiohttp is not installed ({error}): its raw loop is skipped"
    return None


# -- the worker's CPU per no-op run ---------------------------------------------------------------

NOOP_QUEUE_SQL = queue_runs_sql("r_noop", "noop", "'{}'::jsonb")


async def measure_noop_runs(server: Server, args: Config) -> dict[str, Any]:
    """CPU per no-op run of one ``orchestrator serve`` process (the current tree)."""
    database = f"orchestrator_bench_effects_{os.getpid()}_noop"
    dsn = await create_database(server.dsn, database)
    try:
        admin = await connect(Settings(database_url=dsn), application_name="bench-setup")
        try:
            await migrate(admin)
        finally:
            await admin.close()
        connection = await open_connection(dsn)
        try:
            await connection.execute(NOOP_QUEUE_SQL, args.noop_runs)
            await connection.execute("ANALYZE")
            worker = ServeProcess(
                dsn,
                "--agents",
                "orchestrator.agents.noop",
                "--concurrency",
                str(NOOP_CONCURRENCY),
                "--claim-batch",
                str(NOOP_BATCH),
                name="bench-noop-worker",
            )
            try:
                process = psutil.Process(worker.pid)

                def cpu() -> float:
                    times = process.cpu_times()
                    return float(times.user + times.system)

                deadline = time.monotonic() + args.max_seconds + 30
                queued = "SELECT count(*) FROM runs WHERE state = 'queued'"
                while await connection.fetchval(queued) >= args.noop_runs:
                    if time.monotonic() > deadline or not worker.alive():
                        raise RuntimeError(f"the no-op worker never claimed:\n{worker.tail()}")
                    await anyio.sleep(0.005)
                cpu_start, wall_start = cpu(), time.perf_counter()
                done = "SELECT count(*) FROM runs WHERE state = 'succeeded'"
                timed_out = False
                while True:
                    finished = await connection.fetchval(done)
                    cpu_end = cpu()
                    if finished >= args.noop_runs:
                        break
                    if time.monotonic() > deadline:
                        timed_out = True
                        break
                    await anyio.sleep(POLL_INTERVAL)
                seconds = time.perf_counter() - wall_start
            finally:
                await worker.stop()
        finally:
            await connection.close()
    finally:
        await drop_database(server.dsn, database)
    row = {
        "runs": args.noop_runs,
        "succeeded": int(finished),
        "seconds": seconds,
        "runs_per_s": finished / seconds if seconds > 0 else 0.0,
        "cpu_seconds": cpu_end - cpu_start,
        "cpu_ms_per_run": 1000 * (cpu_end - cpu_start) / finished if finished else None,
        "timed_out": timed_out,
        "setting": f"{NOOP_CONCURRENCY}x{NOOP_BATCH}",
    }
    cpu_ms = row["cpu_ms_per_run"]
    log(
        f"worker: {finished:,} no-op runs at {row['runs_per_s']:,.0f} runs/s, "
        f"{fmt(cpu_ms if isinstance(cpu_ms, float) else None, '.3f')} CPU ms/run"
    )
    return row


# -- latency --------------------------------------------------------------------------------------

CLAIM_HOOK, WAKE_HOOK = "_claim", "wake"
"""The dispatcher's private claim and wake methods that ``TimedDispatcher`` wraps, while they
exist: the breakdown's dispatcher parts are skipped when they do not."""


class TimedDispatcher(Dispatcher):
    """The shipped ``Dispatcher``, recording (wall clock) when it was woken and when each claim
    returned, through its private hooks if it still has them; it changes no behaviour, and when
    the hooks are gone it records nothing."""

    def __init__(self, *args: Any, **options: Any) -> None:
        super().__init__(*args, **options)
        self.bench_woken_at: float | None = None
        self.claims: dict[str, tuple[float | None, float]] = {}
        """Idempotency key: (when NOTIFY woke the dispatcher before its claim, or ``None``,
        when the claim returned)."""
        for hook, timed in ((CLAIM_HOOK, self._timed_claim), (WAKE_HOOK, self._timed_wake)):
            original = getattr(self, hook, None)
            if callable(original):
                setattr(self, f"_bench_original{hook}", original)
                setattr(self, hook, timed)

    def _timed_wake(self, *args: Any, **options: Any) -> Any:
        if self.bench_woken_at is None:
            self.bench_woken_at = time.time()
        return getattr(self, f"_bench_original{WAKE_HOOK}")(*args, **options)

    async def _timed_claim(self, *args: Any, **options: Any) -> Any:
        woken_at, self.bench_woken_at = self.bench_woken_at, None
        claimed = await getattr(self, f"_bench_original{CLAIM_HOOK}")(*args, **options)
        claimed_at = time.time()
        with contextlib.suppress(TypeError):
            for effect in claimed:
                record = getattr(effect, "record", effect)
                key = getattr(record, "idempotency_key", None)
                if isinstance(key, str):
                    self.claims[key] = (woken_at, claimed_at)
        return claimed


@contextlib.contextmanager
def timed_worker_dispatcher() -> Iterator[None]:
    """Workers started inside build a ``TimedDispatcher`` if their module still looks
    ``Dispatcher`` up when it starts one (else they build theirs, and the parts are skipped)."""
    namespace = vars(supervisor_module)
    original = namespace.get("Dispatcher")
    if original is not Dispatcher:
        yield
        return
    namespace["Dispatcher"] = TimedDispatcher
    try:
        yield
    finally:
        namespace["Dispatcher"] = original


@dataclass(frozen=True)
class Observation:
    """What step 2 saw: the effect's status and when (database clock and this host's clock)."""

    status: str
    seen_db: datetime
    seen_wall: float
    probe_seconds: float
    """Round trip of the database clock reading (the reading lies within it)."""


class Probe:
    """Shared between the benchmark and the agent's step 2, which runs in the worker."""

    def __init__(self) -> None:
        self.pool: asyncpg.Pool | None = None
        self.observations: dict[str, Observation] = {}
        self._seen: dict[str, anyio.Event] = {}

    def seen_event(self, run_id: str) -> anyio.Event:
        event = self._seen.get(run_id)
        if event is None:
            event = self._seen[run_id] = anyio.Event()
        return event

    async def database_clock(self) -> datetime:
        if self.pool is None:
            raise RuntimeError("the probe has no pool outside a latency measurement")
        now: datetime = await self.pool.fetchval("SELECT clock_timestamp()")
        return now

    def observed(self, run_id: str, observation: Observation) -> None:
        self.observations[run_id] = observation
        self.seen_event(run_id).set()


PROBE = Probe()


class RequestEffect(Step):
    """Step 1: request one effect in the same commit as the checkpoint."""

    name = "request_effect"

    async def run(self, ctx: StepContext) -> Outcome:
        return Next(
            AwaitOutcome,
            checkpoint={"requested_by_fence": ctx.fence},
            effects=[Effect(EFFECT_KEY, KIND, {"customer": "bench", "run": ctx.run_id})],
        )


class AwaitOutcome(Step):
    """Step 2: await the settled outcome, then read the clocks at once."""

    name = "await_outcome"

    async def run(self, ctx: StepContext) -> Outcome:
        assert ctx.effects is not None
        record = await ctx.effects.wait(EFFECT_KEY, within=RUN_SECONDS)
        seen_wall = time.time()
        started = time.perf_counter()
        seen_db = await PROBE.database_clock()
        PROBE.observed(
            ctx.run_id,
            Observation(record.status.value, seen_db, seen_wall, time.perf_counter() - started),
        )
        return Finish(result={"status": record.status.value, "external_id": record.external_id})


def latency_agent(name: str) -> Agent:
    return Agent(name, first=RequestEffect, steps=[AwaitOutcome])


def ms(seconds: float) -> float:
    return seconds * 1000.0


async def one_run(store: RunStore, agent: str, number: int) -> str:
    run_id = (await store.submit(agent, {"n": number})).run.run_id
    with anyio.fail_after(RUN_SECONDS):
        await PROBE.seen_event(run_id).wait()
        while (await store.get(run_id)).state not in (  # noqa: ASYNC110 - database state
            RunState.SUCCEEDED,
            RunState.FAILED,
            RunState.DEAD,
        ):
            await anyio.sleep(0.005)
    return run_id


PARTS = {
    "checkpoint_to_accepted": "checkpoint event -> effect_accepted event (same transaction)",
    "accepted_to_woken": "effect_accepted -> dispatcher woken (COMMIT, NOTIFY)",
    "woken_to_claimed": "dispatcher woken -> claim returned (claim statement)",
    "claimed_to_send": "claim returned -> send() called (task start, re-check statement)",
    "send_to_vendor": "send() called -> vendor has the request (HTTP client, loopback)",
    "vendor_to_confirmed": "vendor has it -> effect_confirmed event (answer, settle statement)",
    "confirmed_to_seen": "effect_confirmed -> step 2 sees it (COMMIT, NOTIFY, wake, re-read)",
}
"""The parts of one run's latency, in order; they add up to the total."""
MOMENTS = (
    "checkpoint event",
    "effect_accepted",
    "dispatcher woken",
    "claim returned",
    "send() called",
    "vendor has the request",
    "effect_confirmed",
    "step 2 sees it",
)
"""The ends of the parts. When some are unknown (a hook the dispatcher no longer has), the parts
around them are merged into one, named ``merged:FIRST -> LAST``: the parts still add up."""


def split(moments: Sequence[float | None]) -> dict[str, float]:
    """The parts (ms) between the known moments, in order."""
    known = [(index, value) for index, value in enumerate(moments) if value is not None]
    parts: dict[str, float] = {}
    for (first, start), (last, end) in itertools.pairwise(known):
        name = (
            list(PARTS)[first]
            if last == first + 1
            else f"merged:{MOMENTS[first]} -> {MOMENTS[last]}"
        )
        parts[name] = ms(end - start)
    return parts


def breakdown(
    run_id: str,
    key: str,
    events: Sequence[RunEvent],
    observation: Observation,
    claims: dict[str, tuple[float | None, float]],
    sent_at: dict[str, float],
    arrivals: dict[str, float],
) -> dict[str, Any]:
    """One run's latency and its parts, in ms."""

    def at(kind: str) -> float | None:
        found = next((event for event in events if event.kind == kind), None)
        return found.at.timestamp() if found is not None else None

    checkpoint = next(event for event in events if event.kind == "checkpoint")
    total = ms((observation.seen_db - checkpoint.at).total_seconds())
    claim = claims.get(key)
    moments = [
        checkpoint.at.timestamp(),
        at("effect_accepted"),
        claim[0] if claim is not None else None,
        claim[1] if claim is not None else None,
        sent_at.get(key),
        arrivals.get(key),
        at("effect_confirmed"),
        observation.seen_db.timestamp(),
    ]
    return {
        "run_id": run_id,
        "status": observation.status,
        "total_ms": total,
        "total_wall_ms": ms(observation.seen_wall - checkpoint.at.timestamp()),
        "probe_ms": ms(observation.probe_seconds),
        "dispatcher_woken": claim is not None and claim[0] is not None,
        "parts_ms": split(moments),
    }


def percentiles(values: Sequence[float]) -> dict[str, float]:
    ordered = sorted(values)
    if not ordered:
        return {}
    cuts = statistics.quantiles(ordered, n=100, method="inclusive") if len(ordered) > 1 else []

    def cut(p: int) -> float:
        return cuts[p - 1] if cuts else ordered[0]

    return {
        "p50": statistics.median(ordered),
        "p90": cut(90),
        "p99": cut(99),
        "max": ordered[-1],
        "mean": statistics.fmean(ordered),
        "min": ordered[0],
    }


def timed_adapter(vendor: VendorProcess) -> tuple[Any, dict[str, float]]:
    """The shipped HTTP adapter for kind ``crm`` (``adapter_from_config``), its ``send``
    wrapped on the instance to note when each key was first sent (the class is untouched)."""
    adapter = adapter_from_config(
        KIND,
        {
            "adapter": "http",
            "url": f"{vendor.url}/send",
            "reconcile": "lookup",
            "lookup_url": f"{vendor.url}/requests/{{idempotency_key}}",
            "timeout_seconds": ADAPTER_TIMEOUT_SECONDS,
        },
    )
    sent_at: dict[str, float] = {}
    send = getattr(adapter, "send", None)
    if callable(send):

        async def timed_send(effect: Any, *args: Any, **options: Any) -> Any:
            key = getattr(effect, "idempotency_key", None)
            if isinstance(key, str):
                sent_at.setdefault(key, time.time())
            return await send(effect, *args, **options)

        setattr(adapter, "send", timed_send)  # noqa: B010 - an instance attribute, on purpose
    return adapter, sent_at


async def measure_latency(server: Server, vendor: VendorProcess, args: Config) -> dict[str, Any]:
    agent_name = "bench_latency"
    agent = latency_agent(agent_name)
    database = f"orchestrator_bench_effects_{os.getpid()}_latency"
    dsn = await create_database(server.dsn, database)
    settings = Settings(database_url=dsn)
    rows: list[dict[str, Any]] = []
    keys: dict[str, str] = {}
    try:
        admin = await connect(settings, application_name="bench-setup")
        try:
            await migrate(admin)
        finally:
            await admin.close()
        pool = await create_pool(settings, application_name="bench-latency", min_size=2, max_size=2)
        PROBE.pool = pool
        try:
            store = RunStore(pool)
            await vendor.reset()
            adapter, sent_at = timed_adapter(vendor)
            seen: list[tuple[str, list[RunEvent], Observation]] = []
            with timed_worker_dispatcher():
                async with running_worker(
                    settings,
                    [agent],
                    worker_id="bench-latency-worker",
                    effect_adapters={KIND: adapter},
                    concurrency=args.worker_concurrency,
                    poll_seconds=args.poll_seconds,
                ) as supervisor:
                    running = getattr(supervisor, "running", None)
                    dispatcher = getattr(running, "dispatcher", None)
                    claims = dispatcher.claims if isinstance(dispatcher, TimedDispatcher) else {}
                    for number in range(args.warmup_runs + args.runs):
                        run_id = await one_run(store, agent_name, number)
                        if number < args.warmup_runs:
                            continue
                        events = await store.events(run_id)
                        seen.append((run_id, list(events), PROBE.observations[run_id]))
                        if len(seen) % 50 == 0:
                            log(f"  {len(seen)}/{args.runs} runs")
            keys = {
                row["idempotency_key"]: row["run_id"]
                for row in await pool.fetch(
                    "SELECT idempotency_key, run_id FROM effects WHERE run_id = ANY($1)",
                    [run_id for run_id, _, _ in seen],
                )
            }
            all_keys = {
                row["idempotency_key"]
                for row in await pool.fetch("SELECT idempotency_key FROM effects")
            }
            stats = await vendor.stats()
            key_of = {run_id: key for key, run_id in keys.items()}
            for run_id, events, observation in seen:
                rows.append(
                    breakdown(
                        run_id,
                        key_of.get(run_id, ""),
                        events,
                        observation,
                        claims,
                        sent_at,
                        stats["arrivals"],
                    )
                )
        finally:
            PROBE.pool = None
            await pool.close()
    finally:
        await drop_database(server.dsn, database)
    totals = [row["total_ms"] for row in rows]
    confirmed = sum(1 for row in rows if row["status"] == "confirmed")
    summary = percentiles(totals)
    once = exactly_once(stats["counts"], all_keys)
    result = {
        "runs": len(rows),
        "confirmed": confirmed,
        "latency_ms": summary,
        "latency_wall_ms": percentiles([row["total_wall_ms"] for row in rows]),
        "probe_ms": percentiles([row["probe_ms"] for row in rows]),
        "parts_ms": {
            part: percentiles([row["parts_ms"][part] for row in rows if part in row["parts_ms"]])
            for part in dict.fromkeys(part for row in rows for part in row["parts_ms"])
        },
        "woken_by_notify": sum(1 for row in rows if row["dispatcher_woken"]),
        "dispatcher_hooks": bool(claims),
        "over_poll_interval": sum(1 for value in totals if value >= 1000 * args.poll_seconds),
        "meets_target": bool(summary)
        and summary["p50"] <= TARGET_P50_MS
        and summary["p99"] <= TARGET_P99_MS,
        "once": once,
        "exact": once["exact"] and confirmed == len(rows) == args.runs,
        "samples_ms": totals,
    }
    log(
        f"latency: p50 {summary['p50']:.1f} ms, p99 {summary['p99']:.1f} ms, "
        f"max {summary['max']:.1f} ms over {len(rows)} runs; POSTs per key: {once_text(once)}"
    )
    return result


# -- the benchmark --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Config:
    """The workload; every field has a command-line flag of the same name."""

    dsn: str | None
    json: bool
    effects: int
    concurrency: int
    batch: int
    dispatch_poll_seconds: float
    processes: tuple[int, ...]
    rounds: int
    max_seconds: float
    noop_runs: int
    runs: int
    warmup_runs: int
    poll_seconds: float
    worker_concurrency: int
    baseline_python: str | None


async def clock_offset_ms(admin: asyncpg.Connection) -> float:
    """Database clock minus this host's ``time.time()``, from the closest of a few readings."""
    best: tuple[float, float] | None = None
    for _ in range(20):
        before = time.time()
        now: datetime = await admin.fetchval("SELECT clock_timestamp()")
        after = time.time()
        sample = (after - before, now.timestamp() - (before + after) / 2)
        if best is None or sample[0] < best[0]:
            best = sample
    assert best is not None
    return ms(best[1])


async def start_vendor(started: list[Helper]) -> VendorProcess:
    helper = await Helper.start(
        [sys.executable, str(VENDOR_SCRIPT)], env=dict(os.environ), name="vendor"
    )
    started.append(helper)
    port = int((await helper.answer(within=30))["port"])
    log(f"vendor (effects_vendor.py) listening on 127.0.0.1:{port}, pid {helper.process.pid}")
    return VendorProcess(helper, port)


async def benchmark(server: Server, args: Config) -> dict[str, Any]:
    admin = await connect(Settings(database_url=server.dsn), application_name="bench-admin")
    try:
        facts = await server_facts(admin, SERVER_SETTINGS_SHOWN)
        offset = await clock_offset_ms(admin)
    finally:
        await admin.close()
    log(
        f"PostgreSQL {facts['server_version']}: fsync={facts['fsync']} "
        f"synchronous_commit={facts['synchronous_commit']} "
        f"full_page_writes={facts['full_page_writes']}; database clock - host clock: "
        f"{offset:+.2f} ms"
    )
    current = Interpreter(None)
    baseline = Interpreter(args.baseline_python) if args.baseline_python else None
    notes: list[str] = []
    async with helpers() as started:
        for interpreter in [current, baseline] if baseline else [current]:
            probe = await Helper.start(
                [*interpreter.argv, str(SENDER_SCRIPT), "installed"],
                env=interpreter.env(server.dsn),
                name=f"{interpreter.label} interpreter",
            )
            started.append(probe)
            interpreter.check((await probe.answer(within=60))["installed"])
        vendor = await start_vendor(started)
        try:
            raw_rows = [await measure_raw(server, vendor, args, "httpx")]
            missing = aiohttp_missing()
            if missing is None:
                raw_rows.append(await measure_raw(server, vendor, args, "aiohttp"))
            else:
                notes.append(missing)
                log(missing)
            index = 0
            dispatch_rows: list[dict[str, Any]] = []
            # Each round measures the baseline and the current tree back to back (the two figures
            # of a ratio as close together as they can be), in an order that alternates.
            for round_number in range(1, args.rounds + 1):
                order = [baseline, current] if baseline else [current]
                if round_number % 2 == 0:
                    order.reverse()
                for interpreter in order:
                    index += 1
                    dispatch_rows.append(
                        await measure_dispatch(
                            server, vendor, interpreter, args, index, 1, round_number
                        )
                    )
            # The 1-process row of the scaling table: the current tree's last round.
            scaling_rows = [
                next(row for row in reversed(dispatch_rows) if row["interpreter"] == "current")
            ]
            for processes in args.processes:
                if processes == 1:
                    continue
                index += 1
                scaling_rows.append(
                    await measure_dispatch(server, vendor, current, args, index, processes)
                )
            noop = await measure_noop_runs(server, args)
            log(f"latency: {args.runs} runs one at a time, after {args.warmup_runs} warm-up runs")
            latency = await measure_latency(server, vendor, args)
        finally:
            await vendor.client.aclose()
    return build_report(
        args,
        facts,
        offset,
        server.embedded,
        raw_rows,
        dispatch_rows,
        scaling_rows,
        noop,
        latency,
        current,
        baseline,
        notes,
    )


# -- reporting ------------------------------------------------------------------------------------


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over the rounds of one release's 1-process dispatcher."""
    cpu = [row["cpu_ms_per_effect"] for row in rows if row["cpu_ms_per_effect"] is not None]
    return {
        "rounds": len(rows),
        "effects_per_s": statistics.median(row["effects_per_s"] for row in rows),
        "cpu_ms_per_effect": statistics.median(cpu) if cpu else None,
    }


def build_report(
    args: Config,
    server: dict[str, str],
    offset_ms: float,
    embedded: bool,
    raw_rows: list[dict[str, Any]],
    dispatch_rows: list[dict[str, Any]],
    scaling_rows: list[dict[str, Any]],
    noop: dict[str, Any],
    latency: dict[str, Any],
    current: Interpreter,
    baseline: Interpreter | None,
    notes: list[str],
) -> dict[str, Any]:
    ours = summarize([row for row in dispatch_rows if row["interpreter"] == "current"])
    theirs_rows = [row for row in dispatch_rows if row["interpreter"] == "baseline"]
    theirs = summarize(theirs_rows) if theirs_rows else None
    round_ratios = [
        ratio(a["effects_per_s"], b["effects_per_s"])
        for a in dispatch_rows
        for b in theirs_rows
        if a["interpreter"] == "current" and a["round"] == b["round"]
    ]
    known_ratios = [value for value in round_ratios if value is not None]
    best_raw = max(raw_rows, key=lambda row: row["effects_per_s"])
    cpu_ratio = ratio(ours["cpu_ms_per_effect"], noop["cpu_ms_per_run"])
    exact = all(row["exact"] for row in [*raw_rows, *dispatch_rows, *scaling_rows, latency])
    return {
        **report_heading(
            "effects",
            httpx=httpx.__version__,
            load_average_at_start=LOAD_AT_START,
            load_average_at_end=list(os.getloadavg()),
        ),
        "server": {"embedded": embedded, **server},
        "database_clock_minus_host_clock_ms": offset_ms,
        "config": workload(args),
        "installed": {
            "current": current.installed,
            "baseline": baseline.installed if baseline else None,
        },
        "notes": notes,
        "ratios": {
            "dispatcher_vs_baseline": statistics.median(known_ratios) if known_ratios else None,
            "dispatcher_vs_baseline_rounds": known_ratios,
            "current": ours,
            "baseline": theirs,
            "dispatcher_vs_best_raw": ratio(ours["effects_per_s"], best_raw["effects_per_s"]),
            "best_raw": best_raw["label"],
            "dispatcher_cpu_vs_worker_run": cpu_ratio,
            "baseline_cpu_vs_worker_run": ratio(
                theirs["cpu_ms_per_effect"] if theirs else None, noop["cpu_ms_per_run"]
            ),
        },
        "targets": {
            "cpu_ratio_at_most": TARGET_CPU_RATIO,
            "cpu_ratio_met": cpu_ratio is not None and cpu_ratio <= TARGET_CPU_RATIO,
            "p50_ms_at_most": TARGET_P50_MS,
            "p99_ms_at_most": TARGET_P99_MS,
            "latency_met": latency["meets_target"],
        },
        "exactly_once": exact,
        "raw": raw_rows,
        "dispatch": dispatch_rows,
        "scaling": scaling_rows,
        "noop_worker": noop,
        "latency": latency,
    }


def format_table(report: dict[str, Any]) -> str:
    server, machine, config = report["server"], report["machine"], report["config"]
    ratios, targets = report["ratios"], report["targets"]
    out = [
        f"effects: {report['date']}, {machine['cpus']} CPUs, Python {machine['python']}, "
        f"asyncpg {machine['asyncpg']}, httpx {machine['httpx']}; load average "
        f"{machine['load_average_at_start'][0]:.1f} at start, "
        f"{machine['load_average_at_end'][0]:.1f} at end",
        f"{server_line(server)} full_page_writes={server['full_page_writes']}; "
        "database clock - host clock "
        f"{report['database_clock_minus_host_clock_ms']:+.2f} ms",
    ]
    for which, installed in report["installed"].items():
        if installed:
            out.append(
                f"{which}: {installed['distribution']} {installed['orchestrator_version']} "
                f"({installed['package']})"
            )
    out += [
        "",
        f"1. dispatch: {config['effects']:,} effects (POSTs), concurrency {config['concurrency']}"
        f" x batch {config['batch']} (dispatcher poll {config['dispatch_poll_seconds']:g}s), "
        "vendor in its own process",
    ]
    header = (
        "sender (own process)",
        "effects/s",
        "seconds",
        "confirmed",
        "CPU ms/effect",
        "cores: sender",
        "vendor",
        "PostgreSQL",
        "other",
        "POSTs per key",
    )
    lines = [throughput_line(row) for row in [*report["raw"], *report["dispatch"]]]
    out += render_table(header, lines)
    out += [f"  note: {note}" for note in report["notes"]]
    ours, theirs = ratios["current"], ratios["baseline"]
    rounds = f"median of {ours['rounds']} rounds" if ours["rounds"] > 1 else "1 round"
    medians = f"  dispatcher (current): {ours['effects_per_s']:,.0f} effects/s ({rounds})"
    if theirs is not None:
        medians += f"; baseline: {theirs['effects_per_s']:,.0f} effects/s"
    out += [
        medians,
        f"  dispatcher/baseline: {fmt(ratios['dispatcher_vs_baseline'], '.2f')}"
        + (
            " (median of the per-round ratios: "
            + ", ".join(f"{value:.2f}" for value in ratios["dispatcher_vs_baseline_rounds"])
            + ")"
            if ratios["dispatcher_vs_baseline"] is not None
            else " (no --baseline-python)"
        ),
        f"  dispatcher/best raw loop ({ratios['best_raw']}): "
        f"{fmt(ratios['dispatcher_vs_best_raw'], '.2f')}",
    ]
    noop = report["noop_worker"]
    cpu_line = (
        f"2. CPU: dispatcher {fmt(ours['cpu_ms_per_effect'], '.3f')} ms/effect ({rounds}); worker "
        f"{fmt(noop['cpu_ms_per_run'], '.3f')} ms per no-op run ({noop['succeeded']:,} runs, "
        f"serve {noop['setting']}, {noop['runs_per_s']:,.0f} runs/s); dispatcher/worker "
        f"{fmt(ratios['dispatcher_cpu_vs_worker_run'], '.1f')}x (target <= "
        f"{targets['cpu_ratio_at_most']:g}x: {verdict(targets['cpu_ratio_met'])})"
    )
    if ratios["baseline_cpu_vs_worker_run"] is not None:
        cpu_line += f"; baseline/worker {ratios['baseline_cpu_vs_worker_run']:.1f}x"
    out += ["", cpu_line]
    latency = report["latency"]
    summary = latency["latency_ms"]
    out += [
        "",
        f"3. commit -> awaiting step sees 'confirmed': {latency['runs']} runs one at a time "
        f"(after {config['warmup_runs']} warm-up), in-process worker, poll "
        f"{config['poll_seconds']:g}s, database clock",
    ]
    out += render_table(
        ("", "confirmed", "p50 ms", "p90 ms", "p99 ms", "max ms", "POSTs per key"),
        [
            (
                "latency",
                f"{latency['confirmed']}/{latency['runs']}",
                *(f"{summary[p]:.1f}" for p in ("p50", "p90", "p99", "max")),
                once_text(latency["once"]),
            )
        ],
    )
    out.append(
        f"  target p50 <= {targets['p50_ms_at_most']:g} ms and p99 <= "
        f"{targets['p99_ms_at_most']:g} ms: {verdict(targets['latency_met'])}"
    )
    hooks = (
        f"the dispatcher was woken by NOTIFY for {latency['woken_by_notify']} of "
        f"{latency['runs']} runs"
        if latency["dispatcher_hooks"]
        else "the dispatcher's claim/wake hooks are gone: its parts are merged"
    )
    out.append(
        f"  where the time goes (p50 / p99 ms; {hooks}; {latency['over_poll_interval']} took a "
        "poll interval or longer):"
    )
    for part, values in latency["parts_ms"].items():
        if values:
            description = PARTS.get(part, part.removeprefix("merged:") + " (parts merged)")
            out.append(f"    {description}: {values['p50']:.1f} / {values['p99']:.1f}")
    out += [
        "",
        "5. scaling: dispatcher processes (current tree) against one vendor and one PostgreSQL, "
        f"{config['effects']:,} effects",
    ]
    base = report["scaling"][0]["effects_per_s"]
    out += render_table(
        (
            "processes",
            "effects/s",
            "x 1 process",
            "seconds",
            "CPU ms/effect",
            "cores: dispatchers",
            "vendor",
            "PostgreSQL",
            "other",
            "POSTs per key",
        ),
        [
            (
                str(row["processes"]),
                f"{row['effects_per_s']:,.0f}",
                fmt(ratio(row["effects_per_s"], base), ".2f"),
                seconds_text(row),
                fmt(row["cpu_ms_per_effect"], ".3f"),
                fmt(row["dispatcher_cores"], ".2f"),
                fmt(row["vendor_cores"], ".2f"),
                fmt(row["postgres_cores"], ".2f"),
                fmt(row["other_cores"], ".2f"),
                once_text(row["once"]),
            )
            for row in report["scaling"]
        ],
    )
    out += [
        "",
        "4. exactly once (every key POSTed once, every effect confirmed, in every measurement): "
        + ("yes" if report["exactly_once"] else "NO"),
    ]
    return "\n".join(out)


def seconds_text(row: dict[str, Any]) -> str:
    return f"{row['seconds']:.2f}" + (" (timed out)" if row["timed_out"] else "")


def throughput_line(row: dict[str, Any]) -> tuple[str, ...]:
    return (
        row["label"],
        f"{row['effects_per_s']:,.0f}",
        seconds_text(row),
        f"{row['confirmed']:,}/{row['effects']:,}",
        fmt(row["cpu_ms_per_effect"], ".3f"),
        fmt(row["dispatcher_cores"], ".2f"),
        fmt(row["vendor_cores"], ".2f"),
        fmt(row["postgres_cores"], ".2f"),
        fmt(row["other_cores"], ".2f"),
        once_text(row["once"]),
    )


# -- entry point ----------------------------------------------------------------------------------


def parse_processes(text: str) -> tuple[int, ...]:
    try:
        counts = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a list of counts (1,2,4)") from None
    if not counts or any(count <= 0 for count in counts):
        raise argparse.ArgumentTypeError("process counts must be positive")
    return counts


def parse_args(argv: Sequence[str] | None) -> Config:
    parser = benchmark_parser(
        "Effect dispatch throughput, CPU and scaling against raw clients and a baseline release; "
        "commit-to-outcome latency; exactly-once checks."
    )
    parser.add_argument("--effects", type=int, default=5_000, help="effects per measurement")
    parser.add_argument("--concurrency", type=int, default=50, help="dispatcher concurrency")
    parser.add_argument("--batch", type=int, default=50, help="dispatcher claim batch")
    parser.add_argument(
        "--dispatch-poll-seconds",
        type=float,
        default=1.0,
        help="the dispatcher's poll interval (Dispatcher's and `effects dispatch`'s default: 1)",
    )
    parser.add_argument(
        "--processes",
        type=parse_processes,
        default=(1, 2, 4),
        help="dispatcher process counts of the scaling table (default 1,2,4)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="rounds of the 1-process dispatcher measurement (with --baseline-python: current "
        "and baseline back to back, alternating order); medians are reported",
    )
    parser.add_argument(
        "--max-seconds", type=float, default=60.0, help="time bound of one measurement"
    )
    parser.add_argument(
        "--noop-runs", type=int, default=3_000, help="no-op runs of the worker CPU measurement"
    )
    parser.add_argument("--runs", type=int, default=150, help="latency runs measured")
    parser.add_argument("--warmup-runs", type=int, default=5, help="latency runs not counted")
    parser.add_argument(
        "--poll-seconds",
        type=float,
        default=2.0,
        help="the latency worker's poll interval, which its built-in dispatcher and the "
        "awaiting step use too (the NOTIFY fallback; serve's default: 2)",
    )
    parser.add_argument("--worker-concurrency", type=int, default=10)
    parser.add_argument(
        "--baseline-python",
        metavar="PATH",
        help="the interpreter of a virtualenv with an older orchestrator installed (not "
        "editable): its dispatcher is measured beside the current one",
    )
    config = Config(**vars(parser.parse_args(argv)))
    positive: list[float] = [config.effects, config.runs, config.worker_concurrency]
    positive += [config.concurrency, config.batch, config.noop_runs, config.rounds]
    positive += [config.max_seconds, config.poll_seconds, config.dispatch_poll_seconds]
    if any(value <= 0 for value in positive) or config.warmup_runs < 0:
        parser.error("every count and duration must be positive (--warmup-runs may be 0)")
    if config.baseline_python and not os.access(config.baseline_python, os.X_OK):
        parser.error(f"--baseline-python {config.baseline_python}: not an executable file")
    return config


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    configure_logging(json_logs=True, level="warning")
    report = run_and_report(args, "effects", lambda server: benchmark(server, args), format_table)
    if not report["exactly_once"]:
        log("FAILED: an effect was not sent exactly once, or not confirmed (see the table)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
