"""The effect path: dispatcher throughput, and commit-to-outcome latency, on loopback.

What is measured, on one PostgreSQL server with durable commits and a local HTTP vendor
(``orchestrator.testing.LocalVendor`` on 127.0.0.1, which honours ``Idempotency-Key``), sent to
through ``orchestrator.effects.adapters.HttpAdapter`` (kind ``crm``, reconcile ``lookup``):

1. **Dispatch throughput** (effects/s). ``--effects`` accepted effect records (500) are created
   up front the way a step commit creates them: runs are inserted, claimed with
   ``RunStore.claim``, and each run's effect is accepted with ``EffectStore.accept`` inside a
   transaction (500 per transaction). Then one ``orchestrator.effects.dispatcher.Dispatcher`` is
   started with each ``--dispatch`` setting (concurrency x batch: 20x20 and 50x50; its poll
   interval is ``--dispatch-poll-seconds``, 1 s, the default of ``Dispatcher`` and of
   ``orchestrator effects dispatch``) on a pool of its own (concurrency + 2 connections, opened
   beforehand). The time runs from the database clock just before the dispatcher starts to the
   last ``settled_at``. Every setting gets fresh records and a fresh vendor, whose request count
   must equal the number of effects: a duplicate send would show there. The largest number of
   records seen in ``dispatching`` at once (sampled every 0.1 s) is reported beside the
   dispatcher's concurrency.

2. **Commit-to-outcome latency** (ms). A worker runs in this process
   (``orchestrator.testing.running_worker``, its built-in dispatcher sending ``crm`` effects
   through the same adapter) with a small agent defined below: step 1 requests one effect in the
   commit of its checkpoint; step 2 awaits it with ``ctx.effects.wait`` and reads the database
   clock as soon as that returns. A run's latency is that reading minus the ``at`` of the run's
   ``checkpoint`` event. That event is written by step 1's commit statement, on the database
   clock, a little before the COMMIT, so the figure slightly overstates the latency. ``--runs``
   runs (150) go one at a time, after ``--warmup-runs`` (5) that are not counted. The target is
   a p50 under 20 ms. The worker uses serve's default poll interval (``--poll-seconds``, 2 s),
   which is only the fallback for missed NOTIFYs.

   Each run's latency is split into seven consecutive parts, from the run's events, from a
   ``TimedDispatcher`` (the shipped ``Dispatcher`` recording when NOTIFY woke it and when its
   claim returned; the worker is made to build it for this measurement only), from the adapter
   (when ``send`` was called) and from the vendor (when the request arrived). These timestamps
   come from the database clock and from this host's ``time.time()``; the embedded server runs
   on the same host, and the report shows the measured offset between the two clocks.

Why: the effect boundary is a transactional outbox. Its throughput bounds how many side effects
a deployment can send, and its latency is added to every step that waits for an outcome.

Diagnostics (skip them with ``--no-diagnostics``): the cost of one ``HttpAdapter.send`` and of
the ``httpx.AsyncClient`` it builds for every request, timed one at a time against the same
vendor; the throughput and latency measurements repeated with ``SharedClientAdapter``, a variant
defined here (not shipped) that keeps one ``httpx.AsyncClient`` for all its sends; and one more
throughput row with that variant and a 0.05 s dispatcher poll interval. They show how much of
the figures above is the HTTP client's set-up, and how much the dispatcher's claim loop.

The vendor runs in this process and shares its event loop and CPU with the dispatcher and the
worker. "CPU ms/effect" is this process's CPU time per effect (dispatcher, vendor, pool and
polling). Structlog output is limited to warnings, on stderr. The report records the machine's
load average at the start and the end: other work on the machine moves every figure here, and
the latencies most.

The server (embedded and durable, or ``--dsn``), the scratch database, ``--json`` and the
clean-up are those of every benchmark ("Common to all" in benchmarks/README.md). Every
measurement is bounded in time (``--max-seconds``, 45 s, for a dispatch measurement, 30 s per
latency run); with the defaults the whole benchmark takes two to three minutes. Run from the
repository root: ``.venv/bin/python benchmarks/effects.py``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from typing import Any

import anyio
import asyncpg
import httpx

from bench_main import benchmark_parser, run_and_report
from bench_report import log, render_table, report_heading, server_line, verdict
from orchestrator.db.connections import connect, create_pool
from orchestrator.db.migrations import migrate
from orchestrator.db.store import RunStore
from orchestrator.effects.adapters import (
    Confirmed,
    HttpAdapter,
    SendOutcome,
)
from orchestrator.effects.dispatcher import Dispatcher
from orchestrator.effects.model import (
    Effect,
    EffectPolicy,
    EffectRecord,
    EffectStatus,
    idempotency_key,
)
from orchestrator.effects.store import ClaimedEffect, EffectStore
from orchestrator.models import RunEvent, RunState
from orchestrator.settings import Settings
from orchestrator.steps import Agent, Finish, Next, Outcome, Step, StepContext
from orchestrator.telemetry import configure_logging
from orchestrator.testing import LocalVendor, running_worker
from orchestrator.worker import worker as supervisor_module
from serve_harness import DURABILITY_SHOWN, Server, create_database, drop_database, server_facts

KIND = "crm"
EFFECT_KEY = "crm-update"
TARGET_P50_MS = 20.0
ACCEPT_BATCH = 500
"""Effects accepted per set-up transaction (and runs claimed per set-up claim)."""
SETUP_LEASE_SECONDS = 3_600.0
"""The set-up runs' leases: long enough never to expire while the benchmark runs."""
FAST_POLL = 0.05
"""The dispatcher poll interval of the last diagnostic dispatch row."""
RUN_SECONDS = 30.0
"""Bound of one latency run, from its submit to its end."""
ADAPTER_TIMEOUT_SECONDS = 10.0
POLL_INTERVAL = 0.1
"""How often the throughput measurement reads the effects' statuses (completion, in flight)."""

SERVER_SETTINGS_SHOWN = (*DURABILITY_SHOWN, "wal_sync_method", "shared_buffers")

LOAD_AT_START = list(os.getloadavg())
"""1, 5 and 15-minute load averages when the benchmark started: other work on the machine
shows in every figure here, the latencies most."""


# -- adapters -------------------------------------------------------------------------------------


class TimedHttpAdapter(HttpAdapter):
    """The shipped ``HttpAdapter``, recording when the dispatcher calls ``send`` (wall clock)."""

    def __init__(self, vendor: LocalVendor) -> None:
        super().__init__(
            KIND,
            url=vendor.send_url,
            reconcile="lookup",
            lookup_url=vendor.lookup_url,
            timeout_seconds=ADAPTER_TIMEOUT_SECONDS,
        )
        self.sent_at: dict[str, float] = {}

    async def send(self, effect: EffectRecord) -> SendOutcome:
        self.sent_at.setdefault(effect.idempotency_key, time.time())
        return await self.send_untimed(effect)

    async def send_untimed(self, effect: EffectRecord) -> SendOutcome:
        return await super().send(effect)

    async def aclose(self) -> None:
        """Nothing to close: the shipped adapter opens and closes a client per request."""


class SharedClientAdapter(TimedHttpAdapter):
    """Diagnostic only, not shipped: the same requests and outcomes as ``HttpAdapter``, on one
    ``httpx.AsyncClient`` kept for all sends (one SSL context, keep-alive connections)."""

    def __init__(self, vendor: LocalVendor) -> None:
        super().__init__(vendor)
        self._shared: httpx.AsyncClient | None = None

    def _client(self) -> httpx.AsyncClient:
        # HttpAdapter's send and lookup both ask here for their client: this one is kept.
        if self._shared is None:
            self._shared = super()._client()
        return self._shared

    async def aclose(self) -> None:
        if self._shared is not None:
            await self._shared.aclose()
            self._shared = None


ADAPTERS: dict[str, type[TimedHttpAdapter]] = {
    "shipped": TimedHttpAdapter,
    "shared": SharedClientAdapter,
}
ADAPTER_LABELS = {
    "shipped": "HttpAdapter",
    "shared": "shared client (diagnostic)",
}


class TimedVendor(LocalVendor):
    """``LocalVendor`` recording when each idempotency key's first request arrived."""

    def __init__(self) -> None:
        super().__init__()
        self.arrivals: dict[str, float] = {}

    async def respond(
        self, method: str, path: str, headers: dict[str, str], body: bytes
    ) -> tuple[int, Any]:
        if method == "POST" and path == "/send":
            self.arrivals.setdefault(headers.get("idempotency-key", ""), time.time())
        return await super().respond(method, path, headers, body)


@dataclass(frozen=True)
class ClaimTiming:
    woken_at: float | None
    """When NOTIFY woke the dispatcher before this claim (``None``: its poll timer did)."""
    claimed_at: float


class TimedDispatcher(Dispatcher):
    """The shipped ``Dispatcher``, recording (wall clock) when it was woken and when each claim
    returned. Used for the latency breakdown only; it changes no behaviour."""

    def __init__(self, *args: Any, **options: Any) -> None:
        super().__init__(*args, **options)
        self._woken_at: float | None = None
        self.claims: dict[str, ClaimTiming] = {}

    def wake(self) -> None:
        if self._woken_at is None:
            self._woken_at = time.time()
        super().wake()

    async def _claim(self) -> list[ClaimedEffect]:
        woken_at, self._woken_at = self._woken_at, None
        claimed = await super()._claim()
        claimed_at = time.time()
        for effect in claimed:
            self.claims[effect.record.idempotency_key] = ClaimTiming(woken_at, claimed_at)
        return claimed


@contextmanager
def timed_worker_dispatcher() -> Iterator[None]:
    """Workers started inside build a ``TimedDispatcher`` (``Worker.run`` looks the name up
    in its module when it starts)."""
    namespace = vars(supervisor_module)
    original = namespace["Dispatcher"]
    namespace["Dispatcher"] = TimedDispatcher
    try:
        yield
    finally:
        namespace["Dispatcher"] = original


# -- the latency agent ----------------------------------------------------------------------------


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


# -- configuration --------------------------------------------------------------------------------


@dataclass(frozen=True)
class DispatchSetting:
    concurrency: int
    batch: int
    poll_seconds: float | None = None
    """The dispatcher's poll interval; ``None``: ``--dispatch-poll-seconds``."""

    @property
    def label(self) -> str:
        poll = f", poll {self.poll_seconds:g}s" if self.poll_seconds is not None else ""
        return f"{self.concurrency}x{self.batch}{poll}"


@dataclass(frozen=True)
class Config:
    """The workload; every field has a command-line flag of the same name."""

    dsn: str | None
    json: bool
    effects: int
    dispatch: tuple[DispatchSetting, ...]
    max_seconds: float
    runs: int
    warmup_runs: int
    dispatch_poll_seconds: float
    poll_seconds: float
    worker_concurrency: int
    diagnostics: bool

    def describe(self) -> dict[str, Any]:
        described = {key: value for key, value in asdict(self).items() if key not in ("dsn",)}
        described["dispatch"] = [setting.label for setting in self.dispatch]
        described.pop("json")
        return described

    def dispatch_runs(self) -> list[tuple[str, DispatchSetting]]:
        """(adapter, setting) of every dispatch measurement, in order."""
        runs = [("shipped", setting) for setting in self.dispatch]
        if self.diagnostics:
            runs += [("shared", setting) for setting in self.dispatch]
            last = self.dispatch[-1]
            runs.append(("shared", DispatchSetting(last.concurrency, last.batch, FAST_POLL)))
        return runs

    @property
    def adapters(self) -> list[str]:
        return ["shipped", "shared"] if self.diagnostics else ["shipped"]


# -- throughput -----------------------------------------------------------------------------------

INSERT_RUNS_SQL = """
INSERT INTO runs (run_id, agent, input)
SELECT $1 || lpad(g::text, 6, '0'), $2, jsonb_build_object('n', g)
FROM generate_series(1, $3) AS g
"""

PROGRESS_SQL = """
SELECT count(*) FILTER (WHERE status = 'confirmed') AS confirmed,
       count(*) FILTER (WHERE status IN ('failed', 'rejected', 'parked')) AS settled_otherwise,
       count(*) FILTER (WHERE status = 'dispatching') AS dispatching,
       max(settled_at) AS last_settled
FROM effects
WHERE run_id LIKE $1 || '%'
"""

WITHDRAW_SQL = """
DELETE FROM effects
WHERE run_id LIKE $1 || '%' AND status IN ('accepted', 'dispatching', 'uncertain')
"""


async def accepted_effects(
    pool: asyncpg.Pool, admin: asyncpg.Connection, prefix: str, agent: str, count: int
) -> set[str]:
    """``count`` accepted effect records, created the way a step commit creates them: the run is
    claimed (so its fence is current) and the effect accepted at the boundary in a transaction.
    Returns their idempotency keys."""
    await admin.execute(INSERT_RUNS_SQL, prefix, agent, count)
    store, effects = RunStore(pool), EffectStore(pool)
    keys: set[str] = set()
    while len(keys) < count:
        batch = await store.claim(
            "bench-requester",
            [agent],
            limit=min(ACCEPT_BATCH, count - len(keys)),
            lease_seconds=SETUP_LEASE_SECONDS,
        )
        if not batch.claimed:
            raise RuntimeError(f"set-up claimed {len(keys)} of {count} runs, then none")
        async with pool.acquire() as connection, connection.transaction():
            for run in batch.claimed:
                effect = Effect(EFFECT_KEY, KIND, {"customer": "bench", "n": run.input["n"]})
                answer = await effects.accept(
                    connection, run.run_id, run.fence, effect, worker_id="bench-requester"
                )
                if answer.outcome != "accepted":
                    raise RuntimeError(f"set-up effect of {run.run_id}: {answer.outcome}")
        keys.update(idempotency_key(run.run_id, EFFECT_KEY) for run in batch.claimed)
    await admin.execute("ANALYZE runs, effects, run_events")
    return keys


async def measure_dispatch(
    admin: asyncpg.Connection,
    dsn: str,
    args: Config,
    index: int,
    setting: DispatchSetting,
    adapter_name: str,
) -> dict[str, Any]:
    prefix, agent = f"r_tp{index}_", f"bench_tp_{index}"
    settings = Settings(database_url=dsn)
    pool_size = setting.concurrency + 2
    poll = setting.poll_seconds if setting.poll_seconds is not None else args.dispatch_poll_seconds
    label = f"{ADAPTER_LABELS[adapter_name]}, {setting.label}"
    pool = await create_pool(
        settings,
        application_name=f"bench-dispatch-{index}",
        min_size=pool_size,
        max_size=pool_size,
        keep_session_state=True,
    )
    try:
        started = time.perf_counter()
        keys = await accepted_effects(pool, admin, prefix, agent, args.effects)
        log(
            f"dispatch {label}: {len(keys):,} accepted effects created in "
            f"{time.perf_counter() - started:.1f}s; dispatching"
        )
        async with TimedVendor() as vendor:
            adapter = ADAPTERS[adapter_name](vendor)
            dispatcher = Dispatcher(
                pool,
                {KIND: adapter},
                dispatcher_id=f"bench-dispatch-{index}",
                batch=setting.batch,
                concurrency=setting.concurrency,
                poll_seconds=poll,
            )
            max_dispatching = 0
            progress: asyncpg.Record | None = None
            timed_out = False
            try:
                async with anyio.create_task_group() as group:
                    db_start: datetime = await admin.fetchval("SELECT clock_timestamp()")
                    cpu_start, wall_start = time.process_time(), time.perf_counter()
                    group.start_soon(dispatcher.run)
                    deadline = wall_start + args.max_seconds
                    last_logged = wall_start
                    while True:
                        await anyio.sleep(POLL_INTERVAL)
                        progress = await admin.fetchrow(PROGRESS_SQL, prefix)
                        assert progress is not None
                        max_dispatching = max(max_dispatching, progress["dispatching"])
                        done = progress["confirmed"] + progress["settled_otherwise"]
                        now = time.perf_counter()
                        if done >= args.effects:
                            break
                        if now > deadline:
                            timed_out = True
                            break
                        if now - last_logged >= 10:
                            last_logged = now
                            log(
                                f"  {done:,}/{args.effects:,} settled after {now - wall_start:.0f}s"
                            )
                    cpu_seconds = time.process_time() - cpu_start
                    group.cancel_scope.cancel()
            finally:
                await adapter.aclose()
        if timed_out:
            await admin.execute(WITHDRAW_SQL, prefix)
        assert progress is not None
        confirmed = int(progress["confirmed"])
        last_settled: datetime | None = progress["last_settled"]
        seconds = (last_settled - db_start).total_seconds() if last_settled else args.max_seconds
        delivered = set(vendor.deliveries)
        row = {
            "adapter": adapter_name,
            "label": label,
            "concurrency": setting.concurrency,
            "batch": setting.batch,
            "poll_seconds": poll,
            "pool_size": pool_size,
            "effects": args.effects,
            "confirmed": confirmed,
            "settled_otherwise": int(progress["settled_otherwise"]),
            "seconds": seconds,
            "effects_per_s": confirmed / seconds if seconds > 0 else 0.0,
            "timed_out": timed_out,
            "vendor_requests": vendor.requests,
            "vendor_deliveries": len(delivered),
            "duplicates": vendor.requests - len(delivered),
            "unknown_keys_delivered": len(delivered - keys),
            "max_dispatching_seen": max_dispatching,
            "cpu_ms_per_effect": 1000 * cpu_seconds / confirmed if confirmed else None,
            "dispatcher_outcomes": dict(dispatcher.outcomes),
        }
        row["exact"] = (
            not timed_out
            and confirmed == args.effects
            and vendor.requests == args.effects
            and len(delivered) == args.effects
            and not row["unknown_keys_delivered"]
        )
        log(
            f"dispatch {label}: {row['effects_per_s']:,.1f} effects/s, {confirmed:,} confirmed in "
            f"{seconds:.1f}s, vendor requests {vendor.requests:,}, at most "
            f"{max_dispatching} dispatching at once" + (" (TIMED OUT)" if timed_out else "")
        )
        return row
    finally:
        await pool.close()


# -- latency --------------------------------------------------------------------------------------


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


def breakdown(
    run_id: str,
    key: str,
    events: Sequence[RunEvent],
    observation: Observation,
    dispatcher: TimedDispatcher,
    adapter: TimedHttpAdapter,
    vendor: TimedVendor,
) -> dict[str, Any]:
    """One run's latency and its parts, in ms."""

    def at(kind: str) -> float | None:
        found = next((event for event in events if event.kind == kind), None)
        return found.at.timestamp() if found is not None else None

    checkpoint = next(event for event in events if event.kind == "checkpoint")
    total = ms((observation.seen_db - checkpoint.at).total_seconds())
    row: dict[str, Any] = {
        "run_id": run_id,
        "status": observation.status,
        "total_ms": total,
        "total_wall_ms": ms(observation.seen_wall - checkpoint.at.timestamp()),
        "probe_ms": ms(observation.probe_seconds),
    }
    claim = dispatcher.claims.get(key)
    row["dispatcher_woken"] = claim is not None and claim.woken_at is not None
    moments = [
        checkpoint.at.timestamp(),
        at("effect_accepted"),
        claim.woken_at if claim is not None else None,
        claim.claimed_at if claim is not None else None,
        adapter.sent_at.get(key),
        vendor.arrivals.get(key),
        at("effect_confirmed"),
        observation.seen_db.timestamp(),
    ]
    row["parts_ms"] = {
        part: ms(end - start)
        for part, start, end in zip(PARTS, moments, moments[1:], strict=False)
        if start is not None and end is not None
    }
    return row


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


PARTS = {
    "checkpoint_to_accepted": "checkpoint event -> effect_accepted event (same transaction)",
    "accepted_to_woken": "effect_accepted -> dispatcher woken (COMMIT, NOTIFY)",
    "woken_to_claimed": "dispatcher woken -> claim returned (claim statement)",
    "claimed_to_send": "claim returned -> send() called (task start, re-check statement)",
    "send_to_vendor": "send() called -> vendor has the request (HTTP client set-up, connect)",
    "vendor_to_confirmed": "vendor has it -> effect_confirmed event (answer, settle statement)",
    "confirmed_to_seen": "effect_confirmed -> step 2 sees it (COMMIT, NOTIFY, wake, re-read)",
}
"""The parts of one run's latency, in order; they add up to the total."""


async def measure_latency(
    admin: asyncpg.Connection, dsn: str, args: Config, index: int, adapter_name: str
) -> dict[str, Any]:
    agent_name = f"bench_latency_{index}"
    agent = latency_agent(agent_name)
    settings = Settings(database_url=dsn)
    pool = await create_pool(settings, application_name="bench-latency", min_size=2, max_size=2)
    PROBE.pool = pool
    label = ADAPTER_LABELS[adapter_name]
    rows: list[dict[str, Any]] = []
    try:
        store = RunStore(pool)
        async with TimedVendor() as vendor:
            adapter = ADAPTERS[adapter_name](vendor)
            try:
                with timed_worker_dispatcher():
                    async with running_worker(
                        settings,
                        [agent],
                        worker_id=f"bench-worker-{index}",
                        effect_adapters={KIND: adapter},
                        concurrency=args.worker_concurrency,
                        poll_seconds=args.poll_seconds,
                    ) as supervisor:
                        assert supervisor.running is not None
                        dispatcher = supervisor.running.dispatcher
                        assert isinstance(dispatcher, TimedDispatcher)
                        for number in range(args.warmup_runs + args.runs):
                            run_id = await one_run(store, agent_name, number)
                            if number < args.warmup_runs:
                                continue
                            rows.append(
                                breakdown(
                                    run_id,
                                    idempotency_key(run_id, EFFECT_KEY),
                                    await store.events(run_id),
                                    PROBE.observations[run_id],
                                    dispatcher,
                                    adapter,
                                    vendor,
                                )
                            )
                            if len(rows) % 50 == 0:
                                log(f"  {len(rows)}/{args.runs} runs")
            finally:
                await adapter.aclose()
        totals = [row["total_ms"] for row in rows]
        confirmed = sum(1 for row in rows if row["status"] == EffectStatus.CONFIRMED.value)
        parts = {
            part: percentiles([row["parts_ms"][part] for row in rows if part in row["parts_ms"]])
            for part in PARTS
        }
        summary = percentiles(totals)
        result = {
            "adapter": adapter_name,
            "label": label,
            "runs": len(rows),
            "confirmed": confirmed,
            "latency_ms": summary,
            "latency_wall_ms": percentiles([row["total_wall_ms"] for row in rows]),
            "probe_ms": percentiles([row["probe_ms"] for row in rows]),
            "parts_ms": parts,
            "vendor_requests": vendor.requests,
            "duplicates": vendor.requests - len(vendor.deliveries),
            "woken_by_notify": sum(1 for row in rows if row["dispatcher_woken"]),
            "over_poll_interval": sum(1 for value in totals if value >= 1000 * args.poll_seconds),
            "meets_target": bool(summary) and summary["p50"] < TARGET_P50_MS,
            "samples_ms": totals,
        }
        log(
            f"latency {label}: p50 {summary['p50']:.1f} ms, p99 {summary['p99']:.1f} ms, "
            f"max {summary['max']:.1f} ms over {len(rows)} runs"
        )
        return result
    finally:
        PROBE.pool = None
        await pool.close()


# -- diagnostics ----------------------------------------------------------------------------------


async def client_costs(samples: int) -> dict[str, float]:
    """Per-request costs of the HTTP client, one at a time (ms, median of ``samples``)."""
    timeout = httpx.Timeout(ADAPTER_TIMEOUT_SECONDS)

    async def timed(action: Callable[[], Awaitable[None]]) -> float:
        values = []
        for _ in range(samples):
            started = time.perf_counter()
            await action()
            values.append(ms(time.perf_counter() - started))
        return statistics.median(values)

    async def new_client() -> None:
        client = httpx.AsyncClient(timeout=timeout)
        await client.aclose()

    async def new_client_without_tls() -> None:
        client = httpx.AsyncClient(timeout=timeout, verify=False)
        await client.aclose()

    costs: dict[str, float] = {
        "new_async_client": await timed(new_client),
        "new_async_client_verify_false": await timed(new_client_without_tls),
    }
    async with TimedVendor() as vendor:
        counter = iter(range(10 * samples))

        def record() -> EffectRecord:
            now, key = datetime.now(UTC), f"probe-{next(counter)}"
            return EffectRecord(
                run_id="r_probe",
                effect_key=key,
                kind=KIND,
                policy=EffectPolicy.IRREVERSIBLE,
                fence=1,
                status=EffectStatus.DISPATCHING,
                payload={"probe": True},
                idempotency_key=key,
                external_id=None,
                result=None,
                error=None,
                attempts=1,
                available_at=now,
                created_at=now,
                updated_at=now,
                settled_at=None,
            )

        for name in ADAPTERS:
            adapter = ADAPTERS[name](vendor)
            try:
                await adapter.send(record())  # a first request outside the timing

                async def send(adapter: TimedHttpAdapter = adapter) -> None:
                    outcome = await adapter.send(record())
                    if not isinstance(outcome, Confirmed):
                        raise RuntimeError(f"probe send failed: {outcome}")

                costs[f"send_{name}"] = await timed(send)
            finally:
                await adapter.aclose()
    return costs


# -- the benchmark --------------------------------------------------------------------------------


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


async def benchmark(server: Server, args: Config) -> dict[str, Any]:
    database = f"orchestrator_bench_effects_{os.getpid()}"
    dsn = await create_database(server.dsn, database)
    try:
        return await benchmark_in(dsn, args, server.embedded)
    finally:
        await drop_database(server.dsn, database)


async def benchmark_in(dsn: str, args: Config, embedded: bool) -> dict[str, Any]:
    admin = await connect(Settings(database_url=dsn), application_name="bench-admin")
    try:
        await migrate(admin)
        server = await server_facts(admin, SERVER_SETTINGS_SHOWN)
        offset = await clock_offset_ms(admin)
        log(
            f"PostgreSQL {server['server_version']}: fsync={server['fsync']} "
            f"synchronous_commit={server['synchronous_commit']} "
            f"full_page_writes={server['full_page_writes']}; database clock - host clock: "
            f"{offset:+.2f} ms"
        )
        costs: dict[str, float] = {}
        if args.diagnostics:
            costs = await client_costs(samples=10)
            log(
                "HTTP client: new httpx.AsyncClient "
                f"{costs['new_async_client']:.1f} ms (verify=False: "
                f"{costs['new_async_client_verify_false']:.1f} ms); HttpAdapter.send "
                f"{costs['send_shipped']:.1f} ms, on a shared client {costs['send_shared']:.1f} ms"
            )
        dispatch_rows: list[dict[str, Any]] = []
        index = 0
        for adapter_name, setting in args.dispatch_runs():
            index += 1
            dispatch_rows.append(
                await measure_dispatch(admin, dsn, args, index, setting, adapter_name)
            )
        latency_rows: list[dict[str, Any]] = []
        for adapter_name in args.adapters:
            index += 1
            log(f"latency {ADAPTER_LABELS[adapter_name]}: {args.runs} runs, one at a time")
            latency_rows.append(await measure_latency(admin, dsn, args, index, adapter_name))
        return build_report(args, server, offset, embedded, costs, dispatch_rows, latency_rows)
    finally:
        await admin.close()


# -- reporting ------------------------------------------------------------------------------------


def build_report(
    args: Config,
    server: dict[str, str],
    offset_ms: float,
    embedded: bool,
    costs: dict[str, float],
    dispatch_rows: list[dict[str, Any]],
    latency_rows: list[dict[str, Any]],
) -> dict[str, Any]:
    shipped = [row for row in latency_rows if row["adapter"] == "shipped"]
    return {
        **report_heading(
            "effects",
            httpx=httpx.__version__,
            load_average_at_start=LOAD_AT_START,
            load_average_at_end=list(os.getloadavg()),
        ),
        "server": {"embedded": embedded, **server},
        "database_clock_minus_host_clock_ms": offset_ms,
        "config": args.describe(),
        "target_p50_ms": TARGET_P50_MS,
        "target_met": bool(shipped) and all(row["meets_target"] for row in shipped),
        "no_duplicates": all(row["duplicates"] == 0 for row in dispatch_rows + latency_rows),
        "all_dispatched_exactly_once": all(row["exact"] for row in dispatch_rows),
        "http_client_costs_ms": costs,
        "dispatch": dispatch_rows,
        "latency": latency_rows,
    }


def format_table(report: dict[str, Any]) -> str:
    server, machine, config = report["server"], report["machine"], report["config"]
    out = [
        f"effects: {report['date']}, {machine['cpus']} CPUs, Python {machine['python']}, "
        f"asyncpg {machine['asyncpg']}, httpx {machine['httpx']}; load average "
        f"{machine['load_average_at_start'][0]:.1f} at start, "
        f"{machine['load_average_at_end'][0]:.1f} at end",
        f"{server_line(server)} full_page_writes={server['full_page_writes']}; "
        "database clock - host clock "
        f"{report['database_clock_minus_host_clock_ms']:+.2f} ms",
        "",
        f"dispatch throughput: {config['effects']:,} accepted effects, one Dispatcher "
        f"(poll {config['dispatch_poll_seconds']:g}s unless shown), LocalVendor on 127.0.0.1",
    ]
    header = (
        "adapter, concurrency x batch",
        "pool",
        "effects/s",
        "seconds",
        "confirmed",
        "vendor POSTs",
        "duplicates",
        "max dispatching",
        "CPU ms/effect",
    )
    lines: list[tuple[str, ...]] = []
    for row in report["dispatch"]:
        cpu = row["cpu_ms_per_effect"]
        lines.append(
            (
                row["label"],
                str(row["pool_size"]),
                f"{row['effects_per_s']:,.1f}",
                f"{row['seconds']:.1f}" + (" (timed out)" if row["timed_out"] else ""),
                f"{row['confirmed']:,}/{row['effects']:,}",
                f"{row['vendor_requests']:,}",
                str(row["duplicates"]),
                str(row["max_dispatching_seen"]),
                f"{cpu:.2f}" if cpu is not None else "-",
            )
        )
    out += render_table(header, lines)
    out += [
        "",
        f"commit -> awaiting step sees the outcome: {config['runs']} runs one at a time "
        f"(after {config['warmup_runs']} warm-up runs), worker poll {config['poll_seconds']:g}s, "
        "database clock",
    ]
    latency_header = ("adapter", "confirmed", "p50 ms", "p90 ms", "p99 ms", "max ms", "POSTs")
    latency_lines: list[tuple[str, ...]] = []
    for row in report["latency"]:
        summary = row["latency_ms"]
        latency_lines.append(
            (
                row["label"],
                f"{row['confirmed']}/{row['runs']}",
                *(f"{summary[p]:.1f}" for p in ("p50", "p90", "p99", "max")),
                str(row["vendor_requests"]),
            )
        )
    out += render_table(latency_header, latency_lines)
    for row in report["latency"]:
        out.append(
            f"  where the time goes, {row['label']} (p50 / p99 ms; the dispatcher was woken by "
            f"NOTIFY for {row['woken_by_notify']} of {row['runs']} runs; "
            f"{row['over_poll_interval']} took a poll interval or longer):"
        )
        for part, description in PARTS.items():
            values = row["parts_ms"].get(part) or {}
            if values:
                out.append(f"    {description}: {values['p50']:.1f} / {values['p99']:.1f}")
    costs = report["http_client_costs_ms"]
    if costs:
        out += [
            "",
            "HTTP client, one request at a time (median ms): new httpx.AsyncClient + aclose "
            f"{costs['new_async_client']:.1f} (verify=False: "
            f"{costs['new_async_client_verify_false']:.1f}); HttpAdapter.send "
            f"{costs['send_shipped']:.1f}; the same request on a shared client "
            f"{costs['send_shared']:.1f}",
        ]
    shipped = [row for row in report["latency"] if row["adapter"] == "shipped"]
    p50 = ", ".join(f"{row['latency_ms']['p50']:.1f} ms" for row in shipped)
    met = verdict(report["target_met"])
    out += [
        "",
        f"target: p50 commit -> outcome under {TARGET_P50_MS:.0f} ms with HttpAdapter: {met} "
        f"({p50})",
        "every effect sent exactly once (vendor POSTs = effects, no duplicate keys): "
        + ("yes" if report["all_dispatched_exactly_once"] and report["no_duplicates"] else "NO"),
    ]
    return "\n".join(out)


# -- entry point ----------------------------------------------------------------------------------


def parse_dispatch(text: str) -> tuple[DispatchSetting, ...]:
    settings = []
    for part in text.split(","):
        concurrency, sep, batch = part.strip().partition("x")
        if not sep or not concurrency.isdigit() or not batch.isdigit():
            raise argparse.ArgumentTypeError(f"{part!r} is not CONCURRENCYxBATCH (e.g. 20x20)")
        settings.append(DispatchSetting(int(concurrency), int(batch)))
    return tuple(settings)


def parse_args(argv: Sequence[str] | None) -> Config:
    parser = benchmark_parser(
        "Effect dispatch throughput and commit-to-outcome latency on loopback."
    )
    parser.add_argument("--effects", type=int, default=500, help="effects per dispatch run")
    parser.add_argument(
        "--dispatch",
        type=parse_dispatch,
        default=parse_dispatch("20x20,50x50"),
        help="comma-separated dispatcher settings CONCURRENCYxBATCH",
    )
    parser.add_argument(
        "--max-seconds", type=float, default=45.0, help="time bound of one dispatch run"
    )
    parser.add_argument("--runs", type=int, default=150, help="latency runs measured")
    parser.add_argument("--warmup-runs", type=int, default=5, help="latency runs not counted")
    parser.add_argument(
        "--dispatch-poll-seconds",
        type=float,
        default=1.0,
        help="the standalone dispatcher's poll interval (Dispatcher's and `effects dispatch`'s "
        "default: 1)",
    )
    parser.add_argument(
        "--poll-seconds",
        type=float,
        default=2.0,
        help="the latency worker's poll interval, which its built-in dispatcher and the "
        "awaiting step use too (the NOTIFY fallback; serve's default: 2)",
    )
    parser.add_argument("--worker-concurrency", type=int, default=10)
    parser.add_argument(
        "--no-diagnostics",
        dest="diagnostics",
        action="store_false",
        help="skip the HTTP client costs and the shared-client rows",
    )
    config = Config(**vars(parser.parse_args(argv)))
    positive: list[float] = [config.effects, config.runs, config.worker_concurrency]
    positive += [config.max_seconds, config.poll_seconds, config.dispatch_poll_seconds]
    positive += [n for setting in config.dispatch for n in (setting.concurrency, setting.batch)]
    if any(value <= 0 for value in positive) or config.warmup_runs < 0:
        parser.error("every count and duration must be positive (--warmup-runs may be 0)")
    return config


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    configure_logging(json_logs=True, level="warning")
    run_and_report(args, "effects", lambda server: benchmark(server, args), format_table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
