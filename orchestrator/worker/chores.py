"""A worker's periodic chores besides claiming: dead-session takeover, approval expiry,
retention, schedules, gauges and a status line, each a loop its task group cancels."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from functools import partial
from typing import Any

import anyio
from anyio.abc import TaskGroup
from structlog.typing import FilteringBoundLogger

from orchestrator.db.deadlines import DATABASE_ERRORS, pooled
from orchestrator.db.outages import DatabaseOutage
from orchestrator.db.purges import purge_round
from orchestrator.db.retention import PURGE_INTERVAL_SECONDS
from orchestrator.db.store import WorkerRegistry
from orchestrator.effects.approvals import ApprovalStore
from orchestrator.telemetry import RUN_FENCE, RUN_ID
from orchestrator.worker.active_runs import ActiveRuns
from orchestrator.worker.config import WorkerConfig
from orchestrator.worker.metrics_endpoint import sample_gauges
from orchestrator.worker.running import Running
from orchestrator.worker.scheduler import Scheduler

SCHEDULE_LEASE_SECONDS = 10.0
"""A schedule's lease at most: its fire follows its claim at once, and a process that stops in
between delays the schedule's slots by no more than this."""
APPROVAL_EXPIRY_SECONDS = 1.0
"""How often a worker denies expired approvals (an expiry is late by at most this)."""


def summary(running: Running, runs: ActiveRuns) -> dict[str, Any]:
    """The worker's counts, for its status line and its last words."""
    return {
        "active": len(runs.active),
        "claimed": runs.counters.claimed,
        "finished": dict(runs.counters.finished),
        "taken_over": runs.counters.taken_over,
        "renewal_failures": running.keeper.failures,
        "commit_batches": running.committer.batches,
    }


@dataclass(frozen=True, slots=True)
class Chores:
    """One worker's chores, sharing what it built; ``start`` puts them in its task group."""

    running: Running
    config: WorkerConfig
    runs: ActiveRuns
    schema: str
    wake_for_expired: Callable[[], None]
    """Wakes the claim loop to look for the leases a takeover ended."""
    log: FilteringBoundLogger
    outage: DatabaseOutage
    """The worker's: a chore that cannot reach the database adds no line of its own."""

    def start(self, group: TaskGroup) -> None:
        """Start the chores this worker's configuration asks for."""
        config = self.config
        group.start_soon(self.report_status)
        group.start_soon(self.expire_approvals)
        if config.gauges is not None:
            group.start_soon(
                partial(
                    sample_gauges,
                    self.running.store.pool,
                    config.gauges,
                    self.outage,
                    versions=WorkerRegistry(self.schema),
                )
            )
        if config.retention is not None:
            group.start_soon(self.purge, config.retention)
        if config.dead_session_takeover:
            group.start_soon(self.reap)
        if config.schedules:
            group.start_soon(self.scheduler.run)

    @property
    def scheduler(self) -> Scheduler:
        running = self.running
        return Scheduler(
            running.store.pool,
            self.config.worker_id,
            min(self.config.lease_seconds, SCHEDULE_LEASE_SECONDS),
            running.statement_seconds,
            self.log,
            self.outage,
        )

    async def reap(self) -> None:
        """End the leases of owners whose session is gone (see ``liveness``)."""
        registry = WorkerRegistry(self.schema)
        running = self.running
        while True:
            await anyio.sleep(self.config.reap_seconds)
            try:
                async with pooled(running.store.pool, within=running.statement_seconds) as db:
                    expired = await registry.expire_dead_owners(db)
            except DATABASE_ERRORS:
                continue
            for lease in expired:
                self.runs.counters.taken_over += 1
                self.log.info(
                    "owner's session is gone; lease ended for takeover",
                    **{RUN_ID: lease.run_id, RUN_FENCE: lease.fence},
                    previous_owner=lease.previous_owner,
                )
            if expired:
                self.wake_for_expired()

    async def expire_approvals(self) -> None:
        """Deny, by expiry, approvals nobody gave in time (any worker may; each row once)."""
        running = self.running
        while True:
            await anyio.sleep(max(self.config.poll_seconds, APPROVAL_EXPIRY_SECONDS))
            try:
                async with pooled(running.store.pool, within=running.statement_seconds) as db:
                    await ApprovalStore(db).expire(limit=100)
            except DATABASE_ERRORS as error:
                self.outage.failed(error, otherwise="cannot expire approvals")

    async def purge(self, age: timedelta) -> None:
        """Delete finished runs past their retention, a bounded round at a time."""
        while True:
            await anyio.sleep(PURGE_INTERVAL_SECONDS)
            try:
                purged = await purge_round(self.running.store.pool, age)
            except DATABASE_ERRORS as error:
                self.outage.failed(error, otherwise="cannot purge finished runs")
                continue
            if purged is not None and purged.runs:
                self.log.info(
                    "purged finished runs", runs=purged.runs, other_rows=purged.other_rows
                )

    async def report_status(self) -> None:
        while True:
            await anyio.sleep(self.config.status_seconds)
            self.log.info("status", **summary(self.running, self.runs))
