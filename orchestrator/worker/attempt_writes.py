"""An attempt's fenced writes besides its step commits (a failed attempt, a release, a recorded
loss), where a write whose outcome is unknown counts as lost ownership."""

from __future__ import annotations

import time
import traceback
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, TypeVar

import anyio

from orchestrator.db.deadlines import DATABASE_ERRORS, pooled
from orchestrator.db.store import RunStore
from orchestrator.errors import error_fields
from orchestrator.models import JSON, ClaimedRun, RunState
from orchestrator.telemetry import Metrics, RunLogger, start_span
from orchestrator.worker.disposition import NOT_THE_OWNER, Disposition
from orchestrator.worker.heartbeat import LeaseHandle
from orchestrator.worker.run_telemetry import run_ids
from orchestrator.worker.runner_config import RunnerConfig

T = TypeVar("T")


def describe_error(error: BaseException) -> dict[str, JSON]:
    """Type, message and a short traceback: enough to debug, small enough for a row."""
    summary = traceback.format_exception(type(error), error, error.__traceback__, limit=8)
    return {
        "type": type(error).__name__,
        "message": str(error)[:2000],
        "traceback": "".join(summary)[-4000:],
    }


@dataclass(frozen=True, slots=True)
class AttemptWrites:
    """Built by the execution when it needs one of these writes (rarely: not on a step's path)."""

    claimed: ClaimedRun
    handle: LeaseHandle
    store: RunStore
    config: RunnerConfig
    metrics: Metrics
    log: RunLogger

    async def db(self, function: Callable[[Any], Awaitable[T]]) -> T:
        async with pooled(self.store.pool, within=self.config.statement_seconds) as connection:
            return await function(connection)

    async def guarded(self, function: Callable[[Any], Awaitable[T]], what: str) -> T | None:
        """A fenced write. A database error means its outcome is unknown: ownership is unproven."""
        try:
            return await self.db(function)
        except DATABASE_ERRORS as error:
            self.lost(f"{what} outcome unknown ({type(error).__name__}: {error})")
            return None

    def lost(self, reason: str) -> Disposition:
        self.handle.lose(reason)
        return Disposition.LOST

    async def release_before_step(self) -> Disposition:
        """The worker is draining: give the lease back instead of starting the next step."""
        self.handle.finishing = True
        store, lease = self.store, self.claimed.lease
        released = await self.guarded(
            lambda db: store.release(lease, reason="worker shutting down", db=db), "release"
        )
        return Disposition.RELEASED if released else Disposition.LOST

    async def fail_attempt(self, error: BaseException) -> Disposition:
        self.handle.finishing = True
        described = describe_error(error)
        self.log.warning("step raised", error=described["message"], error_type=described["type"])
        store = self.store
        outcome = await self.guarded(
            lambda db: store.fail_attempt(self.claimed.lease, error=described, db=db),
            "fail_attempt",
        )
        if outcome is None:
            return self.lost(f"failure record {NOT_THE_OWNER}")
        if outcome.state is RunState.DEAD:
            return Disposition.DEAD
        return Disposition.RETRY_SCHEDULED

    # -- cleanup (shielded, bounded) ----------------------------------------------------------
    async def cleanup(self, action: Callable[[], Awaitable[Disposition]]) -> Disposition:
        with anyio.move_on_after(self.config.cleanup_seconds, shield=True):
            try:
                return await action()
            except DATABASE_ERRORS as error:
                self.log.warning("cleanup write failed", **error_fields(error))
        return Disposition.LOST

    async def release(self) -> Disposition:
        store = self.store
        released = await self.db(
            lambda db: store.release(self.claimed.lease, reason="worker shutting down", db=db)
        )
        self.log.info("lease released at shutdown", released=released)
        return Disposition.RELEASED if released else Disposition.LOST

    async def record_lost(self) -> Disposition:
        handle = self.handle
        # When the steps were cancelled, and the lease the worker last had confirmed: the
        # record is written later (or, cut off from the database, not at all), so its own time
        # says nothing of when the worker stopped.
        details: dict[str, JSON] = {
            "reason": handle.lost_reason or "unknown",
            "lost_at": _iso(handle.lost_at or time.time()),
            "lease_until": handle.lease_until.isoformat(),
        }
        worker_id = self.config.worker_id
        store, claimed = self.store, self.claimed
        self.metrics.lost_leases.add(1)
        attributes = {**run_ids(claimed, worker_id), "reason": details["reason"]}
        with start_span("lease_lost", attributes=attributes):
            self.log.warning("lease lost", **details)
            await self.db(
                lambda db: store.record_event(
                    claimed.run_id,
                    "lease_lost",
                    fence=claimed.fence,
                    worker_id=worker_id,
                    details=details,
                    db=db,
                )
            )
        # A cancel reaches the owner as a lost lease (a notice or a refused renewal): the run's
        # row says which it was, so the worker's counts do not call a cancel a loss.
        run = await self.db(lambda db: store.get(claimed.run_id, db=db))
        return Disposition.CANCELLED if run.state is RunState.CANCELLED else Disposition.LOST


def _iso(wall_clock: float) -> str:
    return datetime.fromtimestamp(wall_clock, UTC).isoformat()
