"""Heartbeats: keep each claimed run's lease alive, and know when ownership can't be proven.

Two parts make up each run's heartbeat. One ``LeaseKeeper`` per worker renews every tracked
lease in one batched statement per interval (each run's own owner, fence, state and expiry
conditions are still checked). And each run's ``LeaseHandle`` guards the run's execution:
it cancels the steps the moment the handle is lost (a refused renewal, a cancel, a refused commit),
and a timer on the event loop cancels it when the local deadline passes without a confirmed
renewal: monotonic time when the last *confirmed* renewal was *sent*, plus the lease, minus a
safety margin. The database sets ``lease_until`` no earlier than it receives that renewal, so
the local deadline always falls before the database's. A renewal that returns no row, fails,
times out or never answers confirms nothing.

All the deadlines of one event loop share one loop timer (``LeaseDeadlines``), armed for the
earliest of them: asyncio keeps cancelled timers in its heap and compares them in Python, so a
timer per run grows that heap with every run that ends early (docs/performance.md).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
import weakref
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass, field
from datetime import datetime, timedelta
from typing import ClassVar

import anyio
import asyncpg
import structlog

from orchestrator.db.deadlines import DATABASE_ERRORS, DedicatedConnection
from orchestrator.db.store import RunStore
from orchestrator.models import ClaimedRun, Lease
from orchestrator.telemetry import RUN_FENCE, RUN_ID, WORKER_ID, Metrics, start_span

log = structlog.get_logger("orchestrator.heartbeat")

NO_DEADLINE_CONFIRMATION = "no confirmed renewal before the local deadline"
READ_ONLY_DATABASE = "the database refused the renewal as read-only (a standby, or demoted)"


def safety_margin(lease_seconds: float) -> float:
    """Slack for clock-rate differences and scheduling delay: 10% of the lease, at least 0.2 s."""
    return max(0.2, lease_seconds * 0.1)


@dataclass(eq=False, slots=True)
class LeaseHandle:
    """A worker's local view of one lease. The database, not this object, is the authority.

    Times are the event loop's clock (``loop.time()``, the same clock as
    ``anyio.current_time()``).
    """

    lease: Lease
    lease_seconds: float
    lease_until: datetime
    confirmed_sent_at: float
    lost_reason: str | None = None
    lost_at: float | None = None
    """Wall-clock time (``time.time()``) when ownership was lost and the steps were cancelled:
    the record of the loss says when the worker stopped, not when the record could be written."""
    finishing: bool = False
    """A terminal statement (finish, fail, release) is in flight: it settles ownership itself."""
    cancel: Callable[[], object] | None = None
    """Cancels the run's steps; called when ownership is lost or can no longer be proven."""
    scheduled_at: float | None = None
    """The deadline this handle is filed under in its loop's ``LeaseDeadlines`` (None: not
    guarded). An entry filed under another time is an outdated one, and is dropped."""
    deadlines: LeaseDeadlines | None = None
    """Where the deadline is watched: the worker's, or else the running loop's."""

    @property
    def deadline(self) -> float:
        return self.confirmed_sent_at + self.lease_seconds - safety_margin(self.lease_seconds)

    def database_now(self) -> datetime:
        """The database clock now, as estimated from the last confirmed renewal (early by the
        renewal's network delay, never late)."""
        elapsed = asyncio.get_running_loop().time() - self.confirmed_sent_at
        return self.lease_until + timedelta(seconds=elapsed - self.lease_seconds)

    @property
    def lost(self) -> bool:
        return self.lost_reason is not None

    @property
    def guarded(self) -> bool:
        return self.cancel is not None

    def guard(self, cancel: Callable[[], object]) -> None:
        """Call ``cancel`` on loss or at the local deadline, until ``unguard``."""
        self.cancel = cancel
        if self.lost:
            cancel()
        else:
            if self.deadlines is None:
                self.deadlines = LeaseDeadlines.of_running_loop()
            self.deadlines.file(self)

    def unguard(self) -> None:
        """The run's steps are over: stop watching the deadline and let go of them."""
        if self.cancel is not None:
            self.cancel = None
            if self.scheduled_at is not None and self.deadlines is not None:
                self.deadlines.forget(self)

    def confirm(self, sent_at: float, lease_until: datetime, lease_seconds: float) -> None:
        # A renewal at the same lease moves the deadline later, and the entry already filed is
        # re-read when its time comes (re-filing 10,000 handles per heartbeat would be waste).
        # A step's own, shorter lease can move it earlier: then it is filed again at once.
        if self.lost or sent_at <= self.confirmed_sent_at:
            return
        self.confirmed_sent_at = sent_at
        self.lease_seconds = lease_seconds
        self.lease_until = lease_until
        if (
            self.scheduled_at is not None
            and self.deadlines is not None
            and self.deadline < self.scheduled_at
        ):
            self.deadlines.file(self)

    def lose(self, reason: str) -> None:
        if self.lost_reason is None:
            self.lost_reason = reason
            self.lost_at = time.time()
            if self.cancel is not None:
                self.cancel()

    def deadline_reached(self, now: float) -> bool:
        """Called by ``LeaseDeadlines`` at the filed time; whether the handle is done with."""
        if self.lost or self.cancel is None:
            return True
        if now >= self.deadline:
            self.lose(NO_DEADLINE_CONFIRMATION)
            return True
        return False  # renewals confirmed since: file it again for the new deadline


class LeaseDeadlines:
    """The local lease deadlines of one event loop, behind a single loop timer.

    A heap of (deadline, tie-breaker, handle) entries; the timer is armed for the earliest.
    Entries are dropped lazily: when their time comes, or, since a run usually ends long before
    its deadline, in a sweep once outdated entries outnumber the guarded handles. Tuples
    compare in C; asyncio's own timers compare in Python.
    """

    _BY_LOOP: ClassVar[weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, LeaseDeadlines]] = (
        weakref.WeakKeyDictionary()
    )
    SWEEP_MINIMUM = 1024
    """Outdated entries tolerated before a sweep, however few handles are guarded."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._heap: list[tuple[float, int, LeaseHandle]] = []
        self._order = itertools.count()
        self._timer: asyncio.TimerHandle | None = None
        self._guarded = 0

    @classmethod
    def of_running_loop(cls) -> LeaseDeadlines:
        loop = asyncio.get_running_loop()
        deadlines = cls._BY_LOOP.get(loop)
        if deadlines is None:
            deadlines = cls._BY_LOOP[loop] = cls(loop)
        return deadlines

    def file(self, handle: LeaseHandle) -> None:
        """Watch ``handle`` until its deadline (re-filing replaces the earlier entry)."""
        if handle.scheduled_at is None:
            self._guarded += 1
        when = handle.deadline
        handle.scheduled_at = when
        heapq.heappush(self._heap, (when, next(self._order), handle))
        if self._timer is None or when < self._timer.when():
            self._arm(when)
        elif len(self._heap) > 2 * self._guarded + self.SWEEP_MINIMUM:
            self._sweep()

    def forget(self, handle: LeaseHandle) -> None:
        """Stop watching ``handle``; its entry is dropped later."""
        handle.scheduled_at = None
        self._guarded -= 1

    def __len__(self) -> int:
        """Handles watched now."""
        return self._guarded

    def filed(self) -> int:
        """Entries in the heap, outdated ones included (the sweeps bound them)."""
        return len(self._heap)

    def _sweep(self) -> None:
        # In place: ``_fire`` may be walking this very list when a re-filed handle sweeps it.
        self._heap[:] = [entry for entry in self._heap if entry[2].scheduled_at == entry[0]]
        heapq.heapify(self._heap)

    def _arm(self, when: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self._loop.call_at(when, self._fire)

    def _fire(self) -> None:
        self._timer = None
        now = self._loop.time()
        heap = self._heap
        while heap and heap[0][0] <= now:
            when, _, handle = heapq.heappop(heap)
            if handle.scheduled_at != when:
                continue  # outdated: re-filed under another time, or no longer guarded
            handle.scheduled_at = None
            self._guarded -= 1
            try:
                done = handle.deadline_reached(now)
            except Exception as error:  # one run's cancel failing must not stall the others
                log.error(
                    "cancelling a run at its local lease deadline failed",
                    error=repr(error),
                    **{RUN_ID: handle.lease.run_id, RUN_FENCE: handle.lease.fence},
                )
                continue
            if not done:
                self.file(handle)
        if heap:
            self._arm(heap[0][0])


@dataclass(eq=False)
class LeaseKeeper:
    """Renews all tracked leases of one worker, batched, on a dedicated connection."""

    store: RunStore
    worker_id: str
    connection: DedicatedConnection
    _: KW_ONLY
    heartbeat_seconds: float
    metrics: Metrics
    handles: dict[str, LeaseHandle] = field(default_factory=dict, init=False)
    failures: int = field(default=0, init=False)
    """Renewal statements that failed (the worker's status line)."""
    _deadlines: LeaseDeadlines | None = field(default=None, init=False, repr=False)
    """Made by the first ``track``, on the running event loop whose timer it uses."""

    def track(self, claimed: ClaimedRun, *, sent_at: float, lease_seconds: float) -> LeaseHandle:
        if self._deadlines is None:
            self._deadlines = LeaseDeadlines.of_running_loop()
        handle = LeaseHandle(
            lease=claimed.lease,
            lease_seconds=lease_seconds,
            lease_until=claimed.lease_until,
            confirmed_sent_at=sent_at,
            deadlines=self._deadlines,
        )
        self.handles[claimed.run_id] = handle
        return handle

    def untrack(self, handle: LeaseHandle) -> None:
        handle.unguard()
        if self.handles.get(handle.lease.run_id) is handle:
            del self.handles[handle.lease.run_id]

    async def run(self) -> None:
        """Renew every heartbeat interval, forever (cancelled with the worker)."""
        while True:
            await anyio.sleep(self.heartbeat_seconds)
            await self.renew_all()

    async def renew_all(self) -> None:
        handles = [h for h in self.handles.values() if not h.lost and not h.finishing]
        if not handles:
            return
        sent_at = anyio.current_time()
        try:
            held = await self.connection.call(
                lambda db: self.store.renew_many(
                    self.worker_id,
                    [h.lease for h in handles],
                    lease_seconds=[h.lease_seconds for h in handles],
                    db=db,
                ),
                within=self.heartbeat_seconds,
            )
        except DATABASE_ERRORS as error:
            self.failures += 1
            self.metrics.renewal_failures.add(1)
            if isinstance(error, asyncpg.ReadOnlySQLTransactionError):
                # A standby now, or a primary demoted by a failover: no renewal can succeed
                # there, and the run may already be someone else's on the new primary.
                for handle in handles:
                    handle.lose(READ_ONLY_DATABASE)
            with start_span(
                "renew_failed", attributes={WORKER_ID: self.worker_id, "leases": len(handles)}
            ):
                log.warning(
                    "renewal failed",
                    leases=len(handles),
                    error=str(error) or type(error).__name__,
                    **{WORKER_ID: self.worker_id},
                )
            return
        for handle in handles:
            lease_until = held.get(handle.lease.run_id)
            if lease_until is not None:
                handle.confirm(sent_at, lease_until, handle.lease_seconds)
            elif not handle.finishing:
                handle.lose(
                    "renewal refused: the run was reclaimed, cancelled or its lease expired"
                )
                log.warning(
                    "renewal refused",
                    **{
                        RUN_ID: handle.lease.run_id,
                        RUN_FENCE: handle.lease.fence,
                        WORKER_ID: self.worker_id,
                    },
                )

    async def renew_now(self, handle: LeaseHandle, lease_seconds: float) -> bool:
        """Renew one lease at once, e.g. with a step's own, longer lease before it starts."""
        sent_at = anyio.current_time()
        try:
            lease_until = await self.connection.call(
                lambda db: self.store.renew(handle.lease, lease_seconds=lease_seconds, db=db),
                within=max(0.1, min(self.heartbeat_seconds, handle.deadline - sent_at)),
            )
        except DATABASE_ERRORS:
            self.metrics.renewal_failures.add(1)
            return False
        if lease_until is None:
            handle.lose("renewal refused: the run was reclaimed, cancelled or its lease expired")
            return False
        handle.confirm(sent_at, lease_until, lease_seconds)
        return True
