"""Which runs a listing or a bulk action means: states, agent and a submission window, read
against the database's clock, so that the command line, the console and the client select alike."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from orchestrator.db.retention import AGE_PATTERN, parse_age
from orchestrator.errors import InvalidInput
from orchestrator.models import Run, RunState

if TYPE_CHECKING:
    from orchestrator.db.run_reads import RunReads


def parse_time(raw: str, option: str) -> datetime:
    """An ISO 8601 time with a zone (``Z`` or ``+01:00``): a run's start is never ambiguous."""
    try:
        moment = datetime.fromisoformat(raw.strip())
    except ValueError:
        raise InvalidInput(
            f"{option} {raw!r} is not an ISO 8601 time; write e.g. 2026-12-24T09:00:00Z"
        ) from None
    if moment.utcoffset() is None:
        raise InvalidInput(
            f"{option} {raw!r} has no time zone; add Z for UTC or an offset such as +01:00"
        )
    try:  # a time at the calendar's edge can leave it once in UTC, as the database keeps it
        return moment.astimezone(UTC)
    except OverflowError:
        raise InvalidInput(
            f"{option} {raw!r} is out of range; give a time between years 1 and 9999 in UTC"
        ) from None


def parse_when(raw: str, option: str, now: datetime) -> datetime:
    """An ISO 8601 time with a zone, or an age back from the database's ``now`` (``2h``)."""
    if AGE_PATTERN.fullmatch(raw):
        return now - parse_age(raw, option)
    try:
        datetime.fromisoformat(raw.strip())
    except ValueError:  # neither form: say both
        raise InvalidInput(
            f"{option} takes an age such as 2h, 90m or 7d, or an ISO 8601 time such as "
            f"2026-12-24T09:00:00Z, not {raw!r}"
        ) from None
    return parse_time(raw, option)


@dataclass(frozen=True)
class RunSelection:
    """Which runs a listing or a bulk action means: states, agent and submission window (an
    ISO 8601 time or an age back from the database's clock); empty, it selects every run."""

    states: tuple[str, ...] = ()
    agent: str | None = None
    since: str | None = None
    until: str | None = None
    parent: str | None = None
    """Only the children of this run (docs/child-runs.md)."""

    @property
    def active(self) -> bool:
        return bool(self.states or self.agent or self.since or self.until or self.parent)


async def select_runs(runs: RunReads, selection: RunSelection, limit: int) -> list[Run]:
    now = await runs.database_now()
    since, until = selection.since, selection.until
    return await runs.list_runs(
        state=[RunState(state) for state in selection.states] or None,
        agent=selection.agent,
        limit=limit,
        submitted_after=None if since is None else parse_when(since, "--since", now),
        submitted_before=None if until is None else parse_when(until, "--until", now),
        parent=selection.parent,
    )
