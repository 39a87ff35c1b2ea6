"""The claim loop: the serial part of a worker's pipeline, so it claims in batches, sleeps only
when idle, and looks for expired leases only when they may be there."""

from __future__ import annotations

import asyncio
import time

import anyio
from structlog.typing import FilteringBoundLogger

from orchestrator.db.deadlines import DATABASE_ERRORS, pooled
from orchestrator.db.outages import UNREACHABLE, DatabaseOutage
from orchestrator.db.store import WorkerRegistry
from orchestrator.effects.waiting import EffectWaiters, RunEffects
from orchestrator.errors import error_fields
from orchestrator.telemetry import (
    RUN_FENCE,
    RUN_ID,
    Metrics,
    debug_enabled,
    flow_metrics,
    tracing_enabled,
)
from orchestrator.worker.active_runs import ActiveRuns
from orchestrator.worker.attempt_traces import trace_attempts
from orchestrator.worker.config import WorkerConfig
from orchestrator.worker.execution import RunExecution
from orchestrator.worker.running import Running

COALESCE_SECONDS = 0.005
EXPIRED_LOOK_SECONDS = 1.0
"""Finding expired leases reads every running run of the worker's agents (the claim query). A
claim loop looks when it was idle, when a notification says leases may have ended (a reaper's
takeover, a release: the runs channel), and otherwise at least this often; a loop that claims
batch after batch skips the scan in between, whose cost grows with the running set."""


class ClaimLoop:
    """Claims due runs into ``runs`` while it has free slots, until the worker stops."""

    def __init__(
        self,
        config: WorkerConfig,
        runs: ActiveRuns,
        effect_waiters: EffectWaiters,
        *,
        schema: str,
        metrics: Metrics,
        log: FilteringBoundLogger,
        outage: DatabaseOutage,
    ) -> None:
        self.config = config
        self.outage = outage
        """Shared with the worker's other loops: one line when the database is out of reach."""
        self.worker_id = config.worker_id
        self.runs = runs
        self.effect_waiters = effect_waiters
        self.schema = schema
        self.metrics = metrics
        self.log = log
        self.beat: float | None = None
        """When the loop last went round (the worker's readiness)."""
        self.failures = 0
        """Claims failed in a row (the worker's readiness)."""
        self._wake = anyio.Event()
        self._look_for_expired = True
        self._after_key: str | None = None
        """Where the last claim's turn over the concurrency keys ended: the next goes on."""
        self._claiming = anyio.Lock()
        """Held by a claim and by ``expire_unheld``: a run claimed is in ``active`` before
        that looks."""
        self._agent_attributes = {name: {"agent": name} for name in config.agents.names}
        """Metric attributes per agent, built once."""
        self._claimable = config.agents.claimable
        """Per agent, the versions of its code this worker claims runs of (docs/upgrades.md)."""

    def wake(self, *, leases_may_have_ended: bool = False) -> None:
        """Wake the loop; ``leases_may_have_ended``: its next claim looks for expired leases
        even if it is busy (a reaper ended some, or another worker released runs)."""
        if leases_may_have_ended:
            self._look_for_expired = True
        self._wake.set()

    async def run(self, running: Running) -> None:
        failures = 0
        config, runs = self.config, self.runs
        full_batch = min(config.concurrency, config.claim_batch)
        expired_looked_at = -EXPIRED_LOOK_SECONDS
        while not runs.stop_requested:
            self.beat = time.monotonic()
            self.failures = failures
            self._wake = anyio.Event()
            capacity = config.concurrency - len(runs.active)
            if 0 < capacity < full_batch // 2:
                # Runs finish one by one; claiming for each would cost a statement per run.
                # Let a few more slots free up (a few milliseconds at most) and claim together.
                await anyio.sleep(COALESCE_SECONDS)
                capacity = config.concurrency - len(runs.active)
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
                            min(capacity, config.claim_batch),
                            include_expired=look_for_expired,
                        )
                    self.outage.reached()
                    failures = self.failures = 0
                except DATABASE_ERRORS as error:
                    self._look_for_expired |= look_for_expired
                    failures += 1
                    if failures == 1 or isinstance(error, UNREACHABLE):
                        self.outage.failed(error, otherwise="cannot claim runs")
                    await anyio.sleep(min(config.poll_seconds * failures, 5.0))
                    continue
            if claimed:
                # Started from the next turn of the event loop, once the next claim is on its
                # way: run tasks may start eagerly (see run_tasks), running their first steps
                # at once, and the claim statement is the serial part of the pipeline.
                asyncio.get_running_loop().call_soon(runs.start, claimed)
            if claimed and len(claimed) == min(capacity, config.claim_batch):
                continue  # there may be more due runs: claim again before sleeping
            with anyio.move_on_after(config.poll_seconds):
                await self._wake.wait()
            self._look_for_expired = True  # idle until now: the look costs nothing in a lull

    async def expire_unheld(self, running: Running) -> None:
        """Back on the database after losing its session: end this worker's leases on runs it
        does not run (their claim's answer, or their final commit, was lost on the way)."""
        try:
            async with (
                self._claiming,
                pooled(running.store.pool, within=running.statement_seconds) as db,
            ):
                expired = await WorkerRegistry(self.schema).expire_unheld_leases(
                    db, self.worker_id, list(self.runs.active)
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
                after_key=self._after_key,
                versions=self._claimable,
                db=db,
            )
        self._after_key = batch.next_key(self._after_key)
        if batch.held_back:
            flow_metrics().held_back.add(batch.held_back)
        for run_id in batch.dead_lettered:
            self.log.warning("dead-lettered: lease expired on the last attempt", **{RUN_ID: run_id})
        executions: list[RunExecution] = []
        debug = debug_enabled()
        claims_per_agent: dict[str, int] = {}
        for run in batch.claimed:
            handle = running.keeper.track(
                run, sent_at=sent_at, lease_seconds=self.config.lease_seconds
            )
            claims_per_agent[run.agent] = claims_per_agent.get(run.agent, 0) + 1
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
            self.runs.add(execution)
            executions.append(execution)
        self.runs.counters.claimed += len(executions)
        for agent, claims in claims_per_agent.items():  # counted per batch, not per run
            self.metrics.claims.add(claims, self._agent_attributes[agent])
        if executions and tracing_enabled():
            try:
                await trace_attempts(running, self.worker_id, executions, sent_at_ns, self.log)
            except BaseException:  # the worker is being cancelled: these runs never start
                for execution in executions:
                    self.runs.never_started(execution)
                raise
        return executions
