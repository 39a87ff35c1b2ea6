"""The worker process: one task group that claims runs and gives each its own task.

``Worker._started`` builds the pools, connections, keeper, committer, dispatcher and liveness in
one place and tears them down together; ``run`` only starts tasks, claims and drains. Tasks in
the worker's group: the liveness check, the lease keeper (batched renewals), the group
committer, the dispatcher, the reaper (dead-session takeover), the listener (LISTEN/NOTIFY
wake-ups, signals and cancels), approval expiry, a status line, the claim loop, and the host of
the run tasks (``RunTasks``): one task per claimed run, each running that run's
``RunExecution``, all ended before the group ends. Nothing in this process's memory is
authoritative: every decision that matters is a fenced statement in PostgreSQL.

Dead-session takeover, and why it is safe: each worker holds a session-level advisory lock on a
dedicated connection for its whole life. When the process dies its socket closes and PostgreSQL
frees the lock at once; the reaper (any worker) then ends that owner's leases, and the run is
claimed again in about a second instead of after the full lease. The judgement "the owner is
dead" could only be wrong if the owner were alive without its session, and then it cannot act:
its renewals fail (its lease has ended), and each of its commits and effect requests carries a
fence that the new claim has raised past. A paused or partitioned owner keeps its session and
its lock, so its lease is honoured until it expires.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from functools import partial
from typing import Any

import anyio
import asyncpg
import structlog
from anyio.abc import TaskStatus
from opentelemetry.trace import Status, StatusCode

from orchestrator.budgets import Prices
from orchestrator.db.bootstrap import ensure_schema
from orchestrator.db.connections import GENERIC_PLANS, connect, create_pool, redact_dsn, resolve_dsn
from orchestrator.db.deadlines import (
    DATABASE_ERRORS,
    DedicatedConnection,
    enter_when_reachable,
    pooled,
)
from orchestrator.db.notifications import (
    CANCEL_CHANNEL,
    RUNS_CHANNEL,
    SETTLED_CHANNEL,
    SIGNALS_CHANNEL,
    Listener,
)
from orchestrator.db.store import RunStore, WorkerRegistry
from orchestrator.db.sync_standby import SyncStandbyRequirement
from orchestrator.effects.adapters import Adapter
from orchestrator.effects.approvals import ApprovalStore
from orchestrator.effects.dispatcher import Dispatcher
from orchestrator.effects.store import EffectStore
from orchestrator.effects.waiting import EffectWaiters, RunEffects
from orchestrator.errors import error_fields
from orchestrator.metrics_endpoint import Probe, sample_gauges
from orchestrator.retention import PURGE_INTERVAL_SECONDS, purge_round
from orchestrator.settings import Settings
from orchestrator.steps import AgentRegistry
from orchestrator.telemetry import (
    LINK_KIND,
    RUN_FENCE,
    RUN_ID,
    WORKER_ID,
    Metrics,
    QueueGauges,
    debug_enabled,
    open_span,
    span_context_from,
    traceparent_of,
    tracing_enabled,
)
from orchestrator.worker.execution import (
    STEP_OUTCOMES,
    Disposition,
    RunExecution,
    RunnerConfig,
    RunServices,
)
from orchestrator.worker.group_commit import GroupCommitter
from orchestrator.worker.heartbeat import LeaseKeeper
from orchestrator.worker.liveness import Liveness
from orchestrator.worker.run_tasks import RunTasks

log = structlog.get_logger("orchestrator.worker")

COALESCE_SECONDS = 0.005
EXPIRED_LOOK_SECONDS = 1.0
"""Finding expired leases reads every running run of the worker's agents (the claim query). A
claim loop looks when it was idle, when a notification says leases may have ended (a reaper's
takeover, a release: the runs channel), and otherwise at least this often; a loop that claims
batch after batch skips the scan in between, whose cost grows with the running set."""
APPROVAL_EXPIRY_SECONDS = 1.0
"""How often a worker denies expired approvals (an expiry is late by at most this)."""


READINESS_SECONDS = 2.0
"""How long the readiness probe's ``SELECT 1`` may take."""


def default_worker_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"


@dataclass
class WorkerConfig:
    agents: AgentRegistry
    worker_id: str = field(default_factory=default_worker_id)
    concurrency: int = 10
    lease_seconds: float = 45.0
    heartbeat_seconds: float = 15.0
    poll_seconds: float = 2.0
    claim_batch: int = 50
    grace_seconds: float = 30.0
    reap_seconds: float = 1.0
    status_seconds: float = 10.0
    dead_session_takeover: bool = True
    effect_adapters: dict[str, Adapter] = field(default_factory=dict)
    """Vendors this worker's built-in dispatcher sends effects to (none: no dispatching)."""
    dispatch_lease_seconds: float = 60.0
    """The built-in dispatcher's lease on an effect it sends (see ``serve --help``)."""
    start_retry_seconds: float = 0.0
    """How long ``run`` keeps trying to reach PostgreSQL at start (``serve`` sets 30 s)."""
    gauges: QueueGauges | None = None
    """Sampled from the database every ``QueueGauges.SAMPLE_SECONDS`` when set (``serve
    --metrics-listen``)."""
    retention: timedelta | None = None
    """Finished runs older than this are deleted in the background (``orchestrator.retention``);
    ``None`` keeps them."""

    def validate(self) -> None:
        if self.concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        if self.reap_seconds <= 0:
            raise ValueError("the reaper interval must be positive (it is a sleep between looks)")
        if self.heartbeat_seconds * 2 > self.lease_seconds:
            raise ValueError(
                f"heartbeat every {self.heartbeat_seconds}s is too slow for a "
                f"{self.lease_seconds}s lease: renew at least twice per lease (lease/3 is usual)"
            )
        for agent in (self.agents.get(name) for name in self.agents.names):
            for step in agent.steps.values():
                if (
                    step.lease_seconds is not None
                    and step.lease_seconds < 2 * self.heartbeat_seconds
                ):
                    raise ValueError(
                        f"step {agent.name}.{step.step_name()} asks for a {step.lease_seconds}s "
                        f"lease, shorter than two heartbeats ({self.heartbeat_seconds}s each)"
                    )


@dataclass
class Counters:
    claimed: int = 0
    finished: dict[str, int] = field(default_factory=dict)
    """Executions ended, by ``Disposition``."""
    taken_over: int = 0


@dataclass(frozen=True, slots=True)
class Running:
    """What a running worker built, in one place (``Worker._started``), torn down with it."""

    dsn: str
    store: RunStore
    claim_pool: asyncpg.Pool
    keeper: LeaseKeeper
    committer: GroupCommitter
    dispatcher: Dispatcher
    liveness: Liveness
    effect_store: EffectStore
    services: RunServices
    statement_seconds: float


async def _bounded(close: Callable[[], Awaitable[None]]) -> None:
    # Shielded and bounded: teardown must finish even when the worker is being cancelled.
    with anyio.move_on_after(5, shield=True):
        await close()


class Worker:
    """Run with ``await worker.run()``; stop with ``request_stop()`` (graceful)."""

    def __init__(self, settings: Settings, config: WorkerConfig, *, metrics: Metrics | None = None):
        config.validate()
        self.settings = settings
        self.config = config
        self.metrics = metrics or Metrics()
        self.worker_id = config.worker_id
        self.counters = Counters()
        self.active: dict[str, RunExecution] = {}
        self.run_tasks = RunTasks()
        self.stop_requested = False
        self.running: Running | None = None
        """What ``run`` built, while it runs (None before and after)."""
        self._wake = anyio.Event()
        self._look_for_expired = True
        self._idle = anyio.Event()
        self.ready = anyio.Event()
        self._claim_loop_beat: float | None = None
        """When the claim loop last went round (``readiness``)."""
        self._claim_failures = 0
        self._claiming = anyio.Lock()
        """Held by a claim and by ``_expire_unheld``: a run claimed is in ``active`` before
        that looks."""
        self.sync_standby = SyncStandbyRequirement(settings.require_sync_standby)
        self.effect_waiters = EffectWaiters()
        self.log = log.bind(**{WORKER_ID: self.worker_id})
        self._agent_attributes = {name: {"agent": name} for name in config.agents.names}
        """Metric attributes per agent, built once."""

    # -- control ------------------------------------------------------------------------------
    def request_stop(self) -> None:
        """Stop claiming, let running steps finish within the grace period, release the rest."""
        self.stop_requested = True
        self.wake()

    def draining(self) -> bool:
        return self.stop_requested

    def wake(self, *, leases_may_have_ended: bool = False) -> None:
        """Wake the claim loop; ``leases_may_have_ended``: its next claim looks for expired
        leases even if it is busy (a reaper ended some, or another worker released runs)."""
        if leases_may_have_ended:
            self._look_for_expired = True
        self._wake.set()

    async def readiness(self) -> Probe:
        """Whether this worker can do work now: it reaches the database (a ``SELECT 1`` within
        ``READINESS_SECONDS``) and its claim loop went round within a few poll intervals."""
        running = self.running
        if running is None or not self.ready.is_set():
            return Probe(False, "starting")
        if self.stop_requested:
            return Probe(False, "draining")
        try:
            with anyio.fail_after(READINESS_SECONDS):
                await running.store.pool.fetchval("SELECT 1")
            with anyio.fail_after(READINESS_SECONDS):
                problem = await self.sync_standby.check(running.store.pool)
        except DATABASE_ERRORS as error:
            return Probe(False, f"database unreachable: {str(error) or type(error).__name__}")
        if problem is not None:
            return Probe(False, f"--require-sync-standby: {problem}")
        if self._claim_failures:
            return Probe(False, "claims are failing: the database refuses or times out")
        beat = self._claim_loop_beat
        stale = max(3 * self.config.poll_seconds, 10.0)
        if beat is None or time.monotonic() - beat > stale:
            return Probe(False, f"the claim loop has not gone round for over {stale:g}s")
        return Probe(True, "ready")

    # -- main ---------------------------------------------------------------------------------
    async def run(self) -> None:
        self.metrics.start_at_zero(
            agents=self.config.agents.names,
            dispositions=[disposition.value for disposition in Disposition],
            step_outcomes=STEP_OUTCOMES,
        )
        async with AsyncExitStack() as stack:
            running = await enter_when_reachable(
                stack, self._started, within=self.config.start_retry_seconds, log=self.log
            )
            self.running = running
            try:
                await self._serve(running)
            finally:
                self.running = None
        self.log.info("stopped", **self._summary(running))

    @asynccontextmanager
    async def _started(self) -> AsyncIterator[Running]:
        """Connect, register and build the worker's parts; close them all on the way out."""
        settings, config, worker_id = self.settings, self.config, self.worker_id
        statement_seconds = max(1.0, config.heartbeat_seconds)
        async with AsyncExitStack() as stack:
            dsn = resolve_dsn(settings)
            await ensure_schema(settings, dsn, auto_migrate=True)
            pool = await create_pool(
                settings,
                dsn=dsn,
                application_name=worker_id,
                min_size=2,
                max_size=max(4, min(config.concurrency, 20)),
                keep_session_state=True,
            )
            stack.push_async_callback(_bounded, pool.close)
            await self.sync_standby.require_at_start(pool)
            # Claims are serial (one claim loop) and on the path of every run: one connection
            # of their own, on which the claim statement is planned once, not on every claim.
            claim_pool = await create_pool(
                settings,
                dsn=dsn,
                application_name=worker_id,
                min_size=1,
                max_size=1,
                keep_session_state=True,
                session_settings=GENERIC_PLANS,
            )
            stack.push_async_callback(_bounded, claim_pool.close)
            heartbeat_connection = DedicatedConnection(settings, dsn, worker_id)
            stack.push_async_callback(_bounded, heartbeat_connection.close)
            store = RunStore(pool, max_input_bytes=settings.max_input_bytes)
            keeper = LeaseKeeper(
                store,
                worker_id,
                heartbeat_connection,
                heartbeat_seconds=config.heartbeat_seconds,
                metrics=self.metrics,
            )
            committer = GroupCommitter(
                store, worker_id, statement_seconds=statement_seconds, metrics=self.metrics
            )
            services = RunServices(
                store=store,
                committer=committer,
                keeper=keeper,
                registry=config.agents,
                config=RunnerConfig(
                    worker_id=worker_id,
                    lease_seconds=config.lease_seconds,
                    statement_seconds=statement_seconds,
                ),
                metrics=self.metrics,
                host=self,
                prices=Prices.from_env(),
            )
            liveness = Liveness(
                settings,
                dsn,
                worker_id,
                config.agents.names,
                check_seconds=min(1.0, config.reap_seconds),
                statement_seconds=statement_seconds,
            )
            await liveness.register()
            stack.push_async_callback(liveness.close)
            yield Running(
                dsn=dsn,
                store=store,
                claim_pool=claim_pool,
                keeper=keeper,
                committer=committer,
                dispatcher=Dispatcher(
                    pool,
                    config.effect_adapters,
                    dispatcher_id=worker_id + ":dispatch",
                    lease_seconds=config.dispatch_lease_seconds,
                    poll_seconds=config.poll_seconds,
                    statement_seconds=statement_seconds,
                    sync_standby=self.sync_standby,
                ),
                liveness=liveness,
                effect_store=EffectStore(pool),
                services=services,
                statement_seconds=statement_seconds,
            )

    async def _serve(self, running: Running) -> None:
        """Start the background tasks, claim until asked to stop, drain."""
        self.log.info(
            "serving",
            agents=self.config.agents.names,
            database=redact_dsn(running.dsn),
            concurrency=self.config.concurrency,
            lease_seconds=self.config.lease_seconds,
            heartbeat_seconds=self.config.heartbeat_seconds,
        )
        async with anyio.create_task_group() as group:
            group.start_soon(running.liveness.run, partial(self._expire_unheld, running))
            group.start_soon(running.keeper.run)
            group.start_soon(running.committer.run)
            group.start_soon(running.dispatcher.run)
            group.start_soon(self._status, running)
            group.start_soon(self.run_tasks.host)
            group.start_soon(self._expire_approvals, running)
            if self.config.gauges is not None:
                group.start_soon(sample_gauges, running.store.pool, self.config.gauges, self.log)
            if self.config.retention is not None:
                group.start_soon(self._purge, running, self.config.retention)
            if self.config.dead_session_takeover:
                group.start_soon(self._reap, running)
            # Claim only once listening (or once listening has failed, bounded by the
            # statement deadline): a cancel NOTIFYed for a run this worker claimed before
            # it listened would reach it only at its next heartbeat.
            await group.start(self._listen, running)
            await self._expire_unheld(running)  # a restart under the same --worker-id
            self.ready.set()
            await self._claim_loop(running)
            await self._drain()
            group.cancel_scope.cancel()

    # -- claiming -----------------------------------------------------------------------------
    async def _claim_loop(self, running: Running) -> None:
        failures = 0
        full_batch = min(self.config.concurrency, self.config.claim_batch)
        expired_looked_at = -EXPIRED_LOOK_SECONDS
        while not self.stop_requested:
            self._claim_loop_beat = time.monotonic()
            self._claim_failures = failures
            self._wake = anyio.Event()
            capacity = self.config.concurrency - len(self.active)
            if 0 < capacity < full_batch // 2:
                # Runs finish one by one; claiming for each would cost a statement per run.
                # Let a few more slots free up (a few milliseconds at most) and claim together.
                await anyio.sleep(COALESCE_SECONDS)
                capacity = self.config.concurrency - len(self.active)
            claimed: list[RunExecution] = []
            if capacity > 0:
                now = anyio.current_time()
                look_for_expired = (
                    self._look_for_expired or now - expired_looked_at >= EXPIRED_LOOK_SECONDS
                )
                if look_for_expired:
                    # Cleared before the claim is sent: a hint arriving while it is in flight
                    # (its statement may not see what the hint is about) holds for the next.
                    expired_looked_at, self._look_for_expired = now, False
                try:
                    async with self._claiming:
                        claimed = await self._claim(
                            running,
                            min(capacity, self.config.claim_batch),
                            include_expired=look_for_expired,
                        )
                    if failures:
                        self.log.info("database reachable again; claiming resumed")
                    failures = self._claim_failures = 0
                except DATABASE_ERRORS as error:
                    self._look_for_expired |= look_for_expired
                    failures += 1
                    if failures == 1:
                        self.log.warning(
                            "database unavailable; claiming paused", **error_fields(error)
                        )
                    await anyio.sleep(min(self.config.poll_seconds * failures, 5.0))
                    continue
            if claimed:
                # Started from the next turn of the event loop, once the next claim is on its
                # way: run tasks may start eagerly (see run_tasks), running their first steps
                # at once, and the claim statement is the serial part of the pipeline.
                asyncio.get_running_loop().call_soon(self._start_runs, running, claimed)
            if claimed and len(claimed) == min(capacity, self.config.claim_batch):
                continue  # there may be more due runs: claim again before sleeping
            with anyio.move_on_after(self.config.poll_seconds):
                await self._wake.wait()
            self._look_for_expired = True  # idle until now: the look costs nothing in a lull

    async def _expire_unheld(self, running: Running) -> None:
        """Back on the database after losing its session: end this worker's leases on runs it
        does not run (their claim's answer, or their final commit, was lost on the way)."""
        try:
            async with (
                self._claiming,
                pooled(running.store.pool, within=running.statement_seconds) as db,
            ):
                expired = await WorkerRegistry(self.settings.schema).expire_unheld_leases(
                    db, self.worker_id, list(self.active)
                )
        except DATABASE_ERRORS as error:
            self.log.warning("cannot end leases of runs not running here", **error_fields(error))
            return
        if expired:
            self.log.warning(
                "ended leases of runs this worker no longer runs",
                runs=[lease.run_id for lease in expired],
            )
            self.wake(leases_may_have_ended=True)

    async def _claim(
        self, running: Running, limit: int, *, include_expired: bool = True
    ) -> list[RunExecution]:
        sent_at = anyio.current_time()
        sent_at_ns = time.time_ns()
        async with pooled(running.claim_pool, within=running.statement_seconds) as db:
            batch = await running.store.claim(
                self.worker_id,
                self.config.agents.names,
                limit=limit,
                lease_seconds=self.config.lease_seconds,
                include_expired=include_expired,
                db=db,
            )
        for run_id in batch.dead_lettered:
            self.log.warning("dead-lettered: lease expired on the last attempt", **{RUN_ID: run_id})
        executions: list[RunExecution] = []
        debug = debug_enabled()
        for run in batch.claimed:
            handle = running.keeper.track(
                run, sent_at=sent_at, lease_seconds=self.config.lease_seconds
            )
            self.counters.claimed += 1
            self.metrics.claims.add(1, self._agent_attributes[run.agent])
            if run.previous_lease_until is not None:
                recovery = (run.claimed_at - run.previous_lease_until).total_seconds()
                self.metrics.recovery_seconds.record(max(recovery, 0.0))
            if debug:
                self.log.debug(
                    "claimed",
                    **{RUN_ID: run.run_id, RUN_FENCE: run.fence},
                    attempt=run.attempt,
                    step=run.step,
                    previous_owner=run.previous_owner,
                )
            effects = RunEffects(
                running.effect_store,
                run.run_id,
                self.effect_waiters,
                poll_seconds=self.config.poll_seconds,
            )
            execution = RunExecution(run, handle, running.services, effects)
            self.active[run.run_id] = execution
            executions.append(execution)
        if executions and tracing_enabled():
            try:
                await self._trace_attempts(running, executions, sent_at_ns)
            except BaseException:  # the worker is being cancelled: these runs never start
                for execution in executions:
                    self._never_started(running, execution)
                raise
        return executions

    async def _trace_attempts(
        self, running: Running, executions: list[RunExecution], claim_sent_at_ns: int
    ) -> None:
        """A claim span for a batch that claimed runs (an idle poll leaves no span), each
        attempt's root span, and its links to the run's submitter and earlier attempts.

        The attempts' trace contexts are kept in the database before any of their steps start
        (a worker that freezes in its first step is still linked from the attempt that takes
        over): one statement per claimed batch, only while tracing. Its failure costs only the
        links, never the runs.
        """
        claim = open_span(
            "claim",
            attributes=lambda: {WORKER_ID: self.worker_id, "orchestrator.claimed": len(executions)},
            root=True,
            start_time=claim_sent_at_ns,
        )
        claim.end()
        by_run: dict[str, RunExecution] = {}
        attempts: list[tuple[str, int, str]] = []
        for execution in executions:
            traceparent = traceparent_of(execution.open_span(claim_sent_at_ns))
            if traceparent is not None:
                by_run[execution.claimed.run_id] = execution
                attempts.append((execution.claimed.run_id, execution.claimed.fence, traceparent))
        if not attempts:
            return
        try:
            async with pooled(running.claim_pool, within=running.statement_seconds) as db:
                earlier = await running.store.record_attempt_traces(self.worker_id, attempts, db=db)
        except Exception as error:  # a database error or a bug: the runs go on, unlinked
            self.log.warning("could not keep the attempts' trace contexts", error=repr(error))
            return
        for row in earlier:
            execution = by_run[row.run_id]
            linked = span_context_from(row.traceparent)
            if linked is not None and row.fence < execution.claimed.fence:
                execution.span.add_link(
                    linked,
                    {
                        LINK_KIND: "submitted" if row.fence == 0 else "earlier_attempt",
                        RUN_FENCE: row.fence,
                        WORKER_ID: row.worker_id or "",
                    },
                )

    def _start_runs(self, running: Running, executions: list[RunExecution]) -> None:
        for execution in executions:
            if self.run_tasks.closed:
                # The worker is ending: these runs never started. Their leases are dropped
                # from the keeper and expire (or are taken over at once when this process's
                # session ends), so another worker claims them.
                self._never_started(running, execution)
                continue
            execution.task = self.run_tasks.start(self._execute(execution, execution.execute()))
        if not self.active:
            self._idle.set()

    async def _execute(
        self, execution: RunExecution, body: Coroutine[Any, Any, Disposition | None]
    ) -> None:
        """The body of a run's task (see ``RunTasks``): the execution, then the accounts.

        ``body`` is ``execution.execute()``, or ``execution.clean_up()`` after a final commit
        that did not finish the run. A run whose final commit is with the group committer
        (``execute`` returned ``None``) stays active, with no task, until ``run_ended`` or
        ``run_needs_cleanup`` hears how it ended.
        """
        disposition: Disposition | None = None
        settling = False
        try:
            disposition = await body
            settling = disposition is None
        except Exception as error:  # a bug in the runtime must not take the worker down
            self.log.exception(
                "run execution crashed", **{RUN_ID: execution.claimed.run_id}, error=str(error)
            )
            disposition = Disposition.CRASHED
        finally:
            if execution.task is not None:
                self.run_tasks.done(execution.task)
            if not settling:  # also when the worker itself is being cancelled
                self._forget(execution)
        if disposition is not None:
            self._count(disposition)

    # -- RunHost: how executions whose final commit was with the committer end ---------------
    def run_ended(self, execution: RunExecution, disposition: Disposition) -> None:
        self._forget(execution)
        self._count(disposition)

    def run_needs_cleanup(self, execution: RunExecution) -> None:
        execution.task = None
        if self.run_tasks.closed:  # the worker is ending: no task can start any more
            self._forget(execution)
            self._count(Disposition.LOST)
            return
        task = self.run_tasks.start(self._execute(execution, execution.clean_up()))
        if execution.task is None:  # not set by an eager start that already ran it
            execution.task = task

    def _never_started(self, running: Running, execution: RunExecution) -> None:
        running.keeper.untrack(execution.handle)
        span = execution.span
        if span.is_recording():
            span.set_status(Status(StatusCode.ERROR, "never started: the worker was stopping"))
            span.end()
        self._forget(execution)

    def _forget(self, execution: RunExecution) -> None:
        run_id = execution.claimed.run_id
        if self.active.get(run_id) is execution:
            del self.active[run_id]
        if not self.active:
            self._idle.set()
        self.wake()

    def _count(self, disposition: Disposition) -> None:
        self.counters.finished[disposition] = self.counters.finished.get(disposition, 0) + 1

    # -- shutdown -----------------------------------------------------------------------------
    async def _drain(self) -> None:
        if not self.active:
            return
        self.log.info("draining", active=len(self.active), grace_seconds=self.config.grace_seconds)
        with anyio.move_on_after(self.config.grace_seconds):
            while self.active:
                self._idle = anyio.Event()
                await self._idle.wait()
        for execution in list(self.active.values()):
            execution.stop_now()
        with anyio.move_on_after(10):
            while self.active:
                self._idle = anyio.Event()
                await self._idle.wait()

    # -- background tasks ---------------------------------------------------------------------
    async def _reap(self, running: Running) -> None:
        registry = WorkerRegistry(self.settings.schema)
        while True:
            await anyio.sleep(self.config.reap_seconds)
            try:
                async with pooled(running.store.pool, within=running.statement_seconds) as db:
                    expired = await registry.expire_dead_owners(db)
            except DATABASE_ERRORS:
                continue
            for lease in expired:
                self.counters.taken_over += 1
                self.log.info(
                    "owner's session is gone; lease ended for takeover",
                    **{RUN_ID: lease.run_id, RUN_FENCE: lease.fence},
                    previous_owner=lease.previous_owner,
                )
            if expired:
                self.wake(leases_may_have_ended=True)

    async def _expire_approvals(self, running: Running) -> None:
        """Deny, by expiry, approvals nobody gave in time (any worker may; each row once)."""
        while True:
            await anyio.sleep(max(self.config.poll_seconds, APPROVAL_EXPIRY_SECONDS))
            try:
                async with pooled(running.store.pool, within=running.statement_seconds) as db:
                    await ApprovalStore(db).expire(limit=100)
            except DATABASE_ERRORS as error:
                self.log.warning("cannot expire approvals", **error_fields(error))

    async def _purge(self, running: Running, age: timedelta) -> None:
        """Delete finished runs past their retention, a bounded round at a time."""
        while True:
            await anyio.sleep(PURGE_INTERVAL_SECONDS)
            try:
                purged = await purge_round(running.store.pool, age)
            except DATABASE_ERRORS as error:
                self.log.warning("cannot purge finished runs", **error_fields(error))
                continue
            if purged is not None and purged.runs:
                self.log.info(
                    "purged finished runs", runs=purged.runs, other_rows=purged.other_rows
                )

    async def _listen(
        self, running: Running, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Wake on submits and due runs; cut a run's execution short when it is cancelled.

        Reports started after its first attempt to listen, whether that succeeded or not (a
        worker that cannot listen still claims, by polling). While not listening, a cancel
        reaches the owner at its next heartbeat instead: the renewal is refused.
        """
        agents = set(self.config.agents.names)

        def on_notify(channel: str, payload: str) -> None:
            if channel == RUNS_CHANNEL and payload in agents:
                # A submit, a release, or another worker's reaper ending leases: the channel
                # does not say which, so the next claim also looks for expired leases.
                self.wake(leases_may_have_ended=True)
            elif channel == SETTLED_CHANNEL:
                self.effect_waiters.notify(payload)
            elif channel == SIGNALS_CHANNEL:
                signalled = self.active.get(payload)
                if signalled is not None:
                    signalled.signalled = True
            elif channel == CANCEL_CHANNEL:
                execution = self.active.get(payload)
                if execution is not None:
                    execution.handle.lose("the run was cancelled")

        listener = Listener(
            (RUNS_CHANNEL, CANCEL_CHANNEL, SETTLED_CHANNEL, SIGNALS_CHANNEL),
            on_notify,
            connect=partial(
                connect, self.settings, dsn=running.dsn, application_name=self.worker_id + ":listen"
            ),
            connect_seconds=running.statement_seconds,
            check_seconds=self.config.poll_seconds,
            statement_seconds=running.statement_seconds,
            retry_seconds=self.config.poll_seconds,
            # Whatever happened while not listening: look for it now.
            on_listening=lambda: self.wake(leases_may_have_ended=True),
        )
        await listener.run(task_status=task_status)

    async def _status(self, running: Running) -> None:
        while True:
            await anyio.sleep(self.config.status_seconds)
            self.log.info("status", **self._summary(running))

    def _summary(self, running: Running) -> dict[str, Any]:
        return {
            "active": len(self.active),
            "claimed": self.counters.claimed,
            "finished": dict(self.counters.finished),
            "taken_over": self.counters.taken_over,
            "renewal_failures": running.keeper.failures,
            "commit_batches": running.committer.batches,
        }
