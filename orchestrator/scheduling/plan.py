"""Which of a schedule's due slots a scheduler fires, and which it skips as missed.

A slot is on time while it is at most the catch-up window old; older slots were missed (nothing
ran, or the schedule's lease holder stopped) and the catch-up policy says which of them still
fire: none, the latest only (when no slot is on time), or all of them up to a bound, the newest
first. The walk back from now is bounded too, so a schedule asleep for a year is one question.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Literal

from orchestrator.scheduling.calendar import Calendar

CatchUpPolicy = Literal["none", "latest", "all"]
CATCH_UP_POLICIES: tuple[CatchUpPolicy, ...] = ("none", "latest", "all")
DEFAULT_CATCH_UP_WINDOW = timedelta(seconds=60)
MAX_DUE = 1000
"""Due slots one fire looks at; older ones are missed whatever the policy."""


@dataclass(frozen=True)
class Missed:
    """Slots skipped by the catch-up policy: the oldest, the newest and how many (``None``:
    more than a fire looks at)."""

    first: datetime
    last: datetime
    count: int | None

    def as_json(self) -> dict[str, object]:
        return {"first": self.first.isoformat(), "last": self.last.isoformat(), "count": self.count}


@dataclass(frozen=True)
class Plan:
    fire: list[datetime]
    """Oldest first."""
    missed: Missed | None
    next: datetime | None
    """The first slot after now, before the schedule's end (``None``: it has ended)."""


def plan_fires(
    calendar: Calendar,
    *,
    cursor: datetime,
    now: datetime,
    policy: CatchUpPolicy,
    window: timedelta,
    limit: int,
    ends_at: datetime | None,
) -> Plan:
    """What to do with the slots from ``cursor`` (the first one not yet decided) to ``now``."""
    due: list[datetime] = []  # newest first
    seen_all = True
    for slot in calendar.backward(now):
        if slot < cursor:
            break
        if len(due) == MAX_DUE:
            seen_all = False
            break
        if ends_at is None or slot < ends_at:
            due.append(slot)
    on_time = [slot for slot in due if slot >= now - window]
    missed = due[len(on_time) :]
    if policy == "all":
        kept = missed[:limit]
    elif policy == "latest" and not on_time:
        kept = missed[:1]
    else:
        kept = []
    skipped = missed[len(kept) :]
    summary = None
    if skipped:
        summary = Missed(
            first=min(skipped) if seen_all else cursor,
            last=max(skipped),
            count=len(skipped) if seen_all else None,
        )
    elif not seen_all:  # every slot looked at fires; those before them were not looked at
        before = next(calendar.backward(due[-1] - timedelta(microseconds=1)), cursor)
        summary = Missed(first=cursor, last=before, count=None)
    upcoming = calendar.next_after(now)
    if upcoming is not None and ends_at is not None and upcoming >= ends_at:
        upcoming = None
    return Plan(fire=sorted(on_time + kept), missed=summary, next=upcoming)


def slots_between(calendar: Calendar, start: datetime, end: datetime, most: int) -> list[datetime]:
    """The slots from ``start`` (included) to ``end`` (excluded), or ``ValueError`` when there
    are more than ``most``."""
    found: list[datetime] = []
    for slot in calendar.forward(start - timedelta(microseconds=1)):
        if slot >= end:
            return found
        if len(found) == most:
            raise ValueError(most)
        found.append(slot)
    return found
