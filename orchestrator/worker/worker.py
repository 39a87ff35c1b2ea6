"""The worker process: one task group that claims runs and gives each its own task.

``Worker._started`` builds the pools, connections, keeper, committer, dispatcher and liveness in
one place and tears them down together; ``run`` only starts tasks, claims and drains. Tasks in
the worker's group: the liveness check, the lease keeper (batched renewals), the group
committer, the dispatcher, the chores (``chores``: dead-session takeover, approval expiry,
retention, gauges, a status line), the listener (``listening``: LISTEN/NOTIFY wake-ups, signals
and cancels), the claim loop (``claiming``), and the host of the run tasks (``active_runs``):
one task per claimed run, each running that run's ``RunExecution``, all ended before the group
ends. Nothing in this process's memory is authoritative: every decision that matters is a
fenced statement in PostgreSQL.

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

import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from functools import partial

import anyio
import structlog

from orchestrator.agent.budgets import Prices
from orchestrator.agent.output import OutputLimits
from orchestrator.db.bootstrap import ensure_schema
from orchestrator.db.connections import GENERIC_PLANS, create_pool, redact_dsn, resolve_dsn
from orchestrator.db.deadlines import DATABASE_ERRORS, DedicatedConnection, enter_when_reachable
from orchestrator.db.limits import LimitStore
from orchestrator.db.outages import DatabaseOutage
from orchestrator.db.output import OutputStore
from orchestrator.db.rates import RateLimitStore
from orchestrator.db.standby_wait import StandbyGate
from orchestrator.db.store import RunStore
from orchestrator.db.sync_standby import SyncStandbyRequirement
from orchestrator.effects.dispatcher import Dispatcher
from orchestrator.effects.store import EffectStore
from orchestrator.effects.waiting import EffectWaiters
from orchestrator.settings import Settings
from orchestrator.telemetry import WORKER_ID, Metrics, flow_metrics
from orchestrator.worker.active_runs import ActiveRuns
from orchestrator.worker.chores import Chores, summary
from orchestrator.worker.claiming import ClaimLoop
from orchestrator.worker.config import WorkerConfig, default_worker_id
from orchestrator.worker.execution import STEP_OUTCOMES, Disposition, RunnerConfig, RunServices
from orchestrator.worker.group_commit import GroupCommitter
from orchestrator.worker.heartbeat import LeaseKeeper
from orchestrator.worker.listening import worker_listener
from orchestrator.worker.liveness import Liveness
from orchestrator.worker.metrics_endpoint import Probe
from orchestrator.worker.running import Running

__all__ = ["Worker", "WorkerConfig", "default_worker_id"]

log = structlog.get_logger("orchestrator.worker")

READINESS_SECONDS = 2.0
"""How long the readiness probe's ``SELECT 1`` may take."""


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
        self.log = log.bind(**{WORKER_ID: self.worker_id})
        self.runs = ActiveRuns(self.wake, self.log)
        # The runs' state under the names serve, orchestrator.testing and the tests read.
        self.active = self.runs.active
        self.counters = self.runs.counters
        self.run_tasks = self.runs.run_tasks
        self.running: Running | None = None
        """What ``run`` built, while it runs (None before and after)."""
        self.ready = anyio.Event()
        self.sync_standby = SyncStandbyRequirement(settings.require_sync_standby)
        self.standby = StandbyGate(settings.standby)
        """The dispatcher's wait for a standby, whose problem makes the worker not ready
        while it holds effects (``--standby-wait``, ``--without-standby hold``)."""
        self.effect_waiters = EffectWaiters()
        self.outage = DatabaseOutage(self.log)
        """Shared by the worker's loops: one line when the database is out of reach, one when
        it is back."""
        self.claims = ClaimLoop(
            config,
            self.runs,
            self.effect_waiters,
            schema=settings.schema,
            metrics=self.metrics,
            log=self.log,
            outage=self.outage,
        )

    # -- control ------------------------------------------------------------------------------
    def request_stop(self) -> None:
        """Stop claiming, let running steps finish within the grace period, release the rest."""
        self.runs.stop_requested = True
        self.wake()

    @property
    def stop_requested(self) -> bool:
        return self.runs.stop_requested

    def wake(self, *, leases_may_have_ended: bool = False) -> None:
        """Wake the claim loop; ``leases_may_have_ended``: its next claim looks for expired
        leases even if it is busy (a reaper ended some, or another worker released runs)."""
        self.claims.wake(leases_may_have_ended=leases_may_have_ended)

    def _wake_for_expired(self) -> None:
        self.claims.wake(leases_may_have_ended=True)

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
        if running.dispatcher.adapters and (held := self.standby.holding):
            return Probe(False, held)
        if self.claims.failures:
            return Probe(False, "claims are failing: the database refuses or times out")
        beat = self.claims.beat
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
        flow_metrics().held_back.add(0)  # a series before the first run is held back
        async with AsyncExitStack() as stack:
            running = await enter_when_reachable(
                stack, self._started, within=self.config.start_retry_seconds, log=self.log
            )
            self.running = running
            try:
                await self._serve(running)
            finally:
                self.running = None
        self.log.info("stopped", **summary(running, self.runs))

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
                host=self.runs,
                rates=RateLimitStore(pool),
                prices=Prices.from_env(),
                outputs=OutputStore(pool),
                output_limits=OutputLimits.from_env(),
            )
            liveness = Liveness(
                settings,
                dsn,
                worker_id,
                config.agents.names,
                versions=config.agents.claimable,
                check_seconds=min(1.0, config.reap_seconds),
                statement_seconds=statement_seconds,
            )
            await liveness.register()
            stack.push_async_callback(liveness.close)
            limits = LimitStore(pool)
            for name in config.agents.names:  # what the agents' code declares (Agent(limits=))
                await limits.declare(name, config.agents.get(name).limits, f"code of {worker_id}")
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
                    standby=self.standby,
                    outage=self.outage,
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
        claims = self.claims
        async with anyio.create_task_group() as group:
            group.start_soon(running.liveness.run, partial(claims.expire_unheld, running))
            group.start_soon(running.keeper.run)
            group.start_soon(running.committer.run)
            group.start_soon(running.dispatcher.run)
            group.start_soon(self.run_tasks.host)
            Chores(
                running,
                self.config,
                self.runs,
                self.settings.schema,
                self._wake_for_expired,
                self.log,
                self.outage,
            ).start(group)
            listener = worker_listener(
                self.settings,
                self.config,
                running,
                self.active,
                self.effect_waiters,
                self._wake_for_expired,
            )
            # Claim only once listening (or once listening has failed, bounded by the
            # statement deadline): a cancel NOTIFYed for a run this worker claimed before
            # it listened would reach it only at its next heartbeat.
            await group.start(listener.run)
            await claims.expire_unheld(running)  # a restart under the same --worker-id
            self.ready.set()
            await claims.run(running)
            await self.runs.drain(self.config.grace_seconds)
            await running.dispatcher.finish()  # its sends in flight end: none is cut off
            group.cancel_scope.cancel()
