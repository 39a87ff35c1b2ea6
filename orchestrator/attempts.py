"""A run's attempts, read from its timeline: who held it under which fence, for how long, and how
each attempt ended. What ``runs show`` and the console print first in an incident review."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime

from orchestrator.models import JSON, RunEvent, TraceRow
from orchestrator.telemetry import trace_id_of

ENDINGS = {
    "lease_lost": "lost its lease",
    "released": "released at shutdown",
    "owner_session_gone": "its worker's session ended",
    "retry_scheduled": "failed; a retry is scheduled",
    "dead_lettered": "dead-lettered",
    "waiting": "parked, waiting",
    "succeeded": "succeeded",
    "failed": "failed",
    "cancelled": "cancelled",
}
"""Timeline events that end an attempt, and how they read."""


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
    events: list[int] = field(default_factory=list)
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


def attempts_of(events: Sequence[RunEvent], traces: Sequence[TraceRow] = ()) -> list[Attempt]:
    """One attempt per claim, in order; an attempt still open when the next claim comes lost
    its lease to expiry. ``traces`` (the run's stored trace contexts) give each its trace id."""
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
        attempt.events.append(event.event_id)
        if event.kind == "checkpoint":
            attempt.checkpoints += 1
        elif event.kind == "effect_accepted":
            attempt.effects_requested += 1
        elif event.kind == "stale_fence_rejected":
            attempt.stale_refusals += 1
        elif event.kind in ENDINGS and attempt.ended_at is None:
            attempt.ended_at = event.at
            attempt.ending = ENDINGS[event.kind]
    return attempts
