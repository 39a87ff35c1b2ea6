"""A run's attempts, read from its timeline: who held it under which fence, for how long, and how
each attempt ended. What ``runs show`` and the console print first in an incident review."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING

from orchestrator.models import JSON, RunEvent, TraceRow
from orchestrator.telemetry import trace_id_of

if TYPE_CHECKING:
    from orchestrator.db.store import RunStore

ENDINGS = {
    "lease_lost": "lost its lease",
    "released": "released at shutdown",
    "owner_session_gone": "its worker's session ended",
    "lease_abandoned": "its worker came back without it",
    "retry_scheduled": "failed; a retry is scheduled",
    "dead_lettered": "dead-lettered",
    "waiting": "parked, waiting",
    "succeeded": "succeeded",
    "failed": "failed",
    "cancelled": "cancelled",
}
"""Timeline events that end an attempt, and how they read."""

TALLIED = {
    "checkpoint": "checkpoints",
    "effect_accepted": "effects_requested",
    "stale_fence_rejected": "stale_refusals",
}
"""Timeline events counted per attempt, and the attempt's field that counts them."""

RECENT_ATTEMPTS = 100
"""How many attempts ``runs show`` and the console's run page show: the newest."""


@dataclass
class Attempt:
    fence: int
    worker_id: str | None
    claimed_at: datetime
    lease_until: str | None
    """The lease the claim granted (as the claim recorded it; renewals extend it)."""
    ended_at: datetime | None = None
    ending: str = "running"
    checkpoints: int = 0
    effects_requested: int = 0
    stale_refusals: int = 0
    """Effect requests this attempt's fence made after a newer one existed, refused."""
    trace_id: str | None = None
    """The trace of this attempt's spans (when the worker was tracing), to open in a tracing UI."""

    @property
    def seconds(self) -> float | None:
        if self.ended_at is None:
            return None
        return (self.ended_at - self.claimed_at).total_seconds()

    def as_json(self) -> dict[str, JSON]:
        return {
            "fence": self.fence,
            "worker_id": self.worker_id,
            "claimed_at": self.claimed_at.isoformat(),
            "lease_until": self.lease_until,
            "ended_at": None if self.ended_at is None else self.ended_at.isoformat(),
            "ending": self.ending,
            "seconds": self.seconds,
            "checkpoints": self.checkpoints,
            "effects_requested": self.effects_requested,
            "stale_refusals": self.stale_refusals,
            "trace_id": self.trace_id,
        }


async def recent_attempts(store: RunStore, run_id: str) -> list[Attempt]:
    """The run's newest attempts (at most ``RECENT_ATTEMPTS``), read in bounded memory however
    long its timeline is: the counted events arrive as counts."""
    events, tallies = await store.attempt_events(
        run_id, RECENT_ATTEMPTS, endings=list(ENDINGS), tallied=list(TALLIED)
    )
    return attempts_of(events, await store.traces(run_id), tallies=tallies)


def attempts_of(
    events: Sequence[RunEvent],
    traces: Sequence[TraceRow] = (),
    *,
    tallies: Mapping[tuple[int, str], int] | None = None,
) -> list[Attempt]:
    """One attempt per claim, in order; an attempt still open when the next claim comes lost
    its lease to expiry. ``traces`` (the run's stored trace contexts) give each its trace id;
    ``tallies`` (per fence and kind) count the events of ``TALLIED`` kinds not among ``events``."""
    trace_ids = {row.fence: trace_id_of(row.traceparent) for row in traces}
    attempts: list[Attempt] = []
    by_fence: dict[int, Attempt] = {}
    for event in events:
        details = event.details if isinstance(event.details, dict) else {}
        if event.kind == "claimed" and event.fence is not None:
            if attempts and attempts[-1].ended_at is None:
                attempts[-1].ended_at = event.at
                attempts[-1].ending = "lease expired; claimed again"
            lease = details.get("lease_until")
            attempt = Attempt(
                event.fence,
                event.worker_id,
                event.at,
                str(lease) if lease is not None else None,
                trace_id=trace_ids.get(event.fence),
            )
            attempts.append(attempt)
            by_fence[event.fence] = attempt
            continue
        owner = by_fence.get(event.fence) if event.fence is not None else None
        if event.kind == "cancelled" and attempts:
            owner = attempts[-1]  # a cancel raises the fence: it ends the attempt before it
        if owner is None:
            continue
        attempt = owner
        if event.kind in TALLIED:
            _count(attempt, event.kind, 1)
        elif event.kind in ENDINGS and attempt.ended_at is None:
            attempt.ended_at = event.at
            attempt.ending = ENDINGS[event.kind]
    for (fence, kind), count in (tallies or {}).items():
        if fence in by_fence and kind in TALLIED:
            _count(by_fence[fence], kind, count)
    return attempts


def _count(attempt: Attempt, kind: str, count: int) -> None:
    name = TALLIED[kind]
    setattr(attempt, name, getattr(attempt, name) + count)
