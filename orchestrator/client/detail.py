"""Everything ``runs show`` and the console's run page show of one run, read in bounded memory
and time: a run woken 9,000 times has a timeline of 100,000 events, and a signal flood leaves as
many signals. Each part is its newest slice plus a count; ``runs events`` pages through the rest.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from orchestrator.effect_model import EffectRecord
from orchestrator.errors import InvalidInput
from orchestrator.models import Message, Run, RunEvent, RunState

if TYPE_CHECKING:  # the command line reads the limits below without loading the stores
    from orchestrator.client.attempts import Attempt
    from orchestrator.client.stores import Stores
    from orchestrator.db.budgets import BudgetState
    from orchestrator.db.signals import Signal

DEFAULT_EVENTS = 100
"""Timeline events shown unless asked for more (the newest)."""

MAX_EVENTS = 10_000
"""The most a page shows at once; ``runs events`` pages through any number."""

SIGNALS_SHOWN = 100
"""The newest signals shown (with when and by which fence each was consumed)."""

STALE_REFUSALS_SHOWN = 100
EFFECTS_SHOWN = 10_000
CHILDREN_SHOWN = 100


@dataclass(frozen=True)
class RunDetail:
    run: Run
    events: list[RunEvent]
    """The newest events, oldest first."""
    events_total: int
    claims: int
    attempts: list[Attempt]
    """The newest attempts (``attempts.RECENT_ATTEMPTS``)."""
    stale_refusals: list[RunEvent]
    messages: list[Message]
    effects: list[EffectRecord]
    signals: list[tuple[Signal, datetime | None, int | None]]
    """The newest ``SIGNALS_SHOWN`` signals: (signal, consumed at, consumed by fence)."""
    budget: BudgetState | None
    now: datetime
    children: list[Run] = field(default_factory=list)
    """The newest ``CHILDREN_SHOWN`` child runs (``runs list --parent`` lists them all)."""

    @property
    def first_event_shown(self) -> int | None:
        return self.events[0].event_id if self.events else None


async def load_run_detail(
    stores: Stores, run_id: str, *, events: int = DEFAULT_EVENTS
) -> RunDetail:
    """One run as its pages show it; ``RunNotFound`` / ``InvalidInput`` for a bad id. The one
    entry point of ``runs show``, the console's run page and ``client.runs.detail``."""
    from orchestrator.client.attempts import recent_attempts

    if not 1 <= events <= MAX_EVENTS:
        raise InvalidInput(f"events shown must be 1 to {MAX_EVENTS:,}, not {events!r}")
    runs = stores.runs
    run = await runs.get(run_id)
    newest, total = await runs.events_tail(run_id, events)
    _, claims = await runs.events_tail(run_id, 1, kinds=["claimed"])
    stale, _ = await runs.events_tail(run_id, STALE_REFUSALS_SHOWN, kinds=["stale_fence_rejected"])
    return RunDetail(
        run=run,
        events=newest,
        events_total=total,
        claims=claims,
        attempts=await recent_attempts(runs, run_id),
        stale_refusals=stale,
        messages=await runs.messages(run_id),
        effects=await stores.effects.list_effects(run_id=run_id, limit=EFFECTS_SHOWN),
        signals=await stores.signals.history(run_id, newest=SIGNALS_SHOWN),
        budget=await stores.budgets.get(run_id),
        now=await runs.database_now(),
        children=await runs.list_runs(parent=run_id, limit=CHILDREN_SHOWN),
    )


def more_events_hint(detail: RunDetail) -> str | None:
    """How to read the events the page left out, or ``None`` when it shows them all."""
    if detail.events_total <= len(detail.events):
        return None
    return (
        f"the newest {len(detail.events):,} of {detail.events_total:,} events; "
        f"orchestrator runs events {detail.run.run_id} --json pages through all of them "
        f"(--after EVENT_ID --limit N), or runs show --events N shows more"
    )


__all__ = [
    "DEFAULT_EVENTS",
    "MAX_EVENTS",
    "RunDetail",
    "load_run_detail",
    "more_events_hint",
]


# -- how a run's detail reads, on a terminal and in the console ------------------------------
def utc(value: datetime) -> datetime:
    """``value`` in UTC; a naive one (PostgreSQL's infinity, as asyncpg reads it) is UTC."""
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


def time_text(value: datetime | None) -> str:
    return "" if value is None else utc(value).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3] + "Z"


def second_text(value: datetime) -> str:
    """A time to the second, in UTC, for a glance (the timeline keeps milliseconds)."""
    return utc(value).strftime("%Y-%m-%d %H:%M:%SZ")


def relative_text(moment: datetime | None, now: datetime) -> str:
    if moment is None:
        return ""
    seconds = (moment - now).total_seconds()
    return f"in {seconds:.1f}s" if seconds >= 0 else f"{-seconds:.1f}s ago"


def due_text(run: Run, now: datetime) -> str:
    """When a queued or waiting run becomes claimable, while that is ahead: a scheduled run, a
    retry's backoff, a wait's time limit ("" otherwise, and for a wait with no time limit)."""
    due = utc(run.available_at)
    if run.state not in (RunState.QUEUED, RunState.WAITING) or due <= now or due.year == 9999:
        return ""
    return f"{time_text(due)} ({relative_text(due, now)})"


ATTEMPT_COLUMNS = (
    "fence",
    "worker",
    "claimed",
    "held",
    "ended",
    "checkpoints",
    "effects",
    "stale refused",
    "trace",
)
"""The attempts table's headers, on a terminal and in the console."""


def attempt_cells(attempt: Attempt, now: datetime) -> list[str]:
    """One attempt as ``ATTEMPT_COLUMNS`` name it: when it was claimed (to the second), how long
    it held the run (so far, if it still does), how it ended, what it did."""
    held = attempt.seconds
    if held is None:
        held_text = f"{(now - attempt.claimed_at).total_seconds():.1f}s so far"
    else:
        held_text = f"{held:.1f}s"
    return [
        str(attempt.fence),
        attempt.worker_id or "",
        second_text(attempt.claimed_at),
        held_text,
        attempt.ending,
        str(attempt.checkpoints),
        str(attempt.effects_requested),
        str(attempt.stale_refusals) if attempt.stale_refusals else "",
        attempt.trace_id or "",
    ]


def conversation_turns(messages: Sequence[Message]) -> list[int]:
    """Each message's turn as people count them (from 1). A tool result belongs to the turn whose
    call it answers: an effect's result is stored with the next turn, which reads it first."""
    asked: dict[str, int] = {}
    turns = []
    for message in messages:
        turn = message.turn
        if message.role == "tool":
            turn = asked.get(str(message.body.get("tool_call_id")), turn)
        for call in message.body.get("tool_calls") or []:
            if isinstance(call, dict):
                asked[str(call.get("id"))] = message.turn
        turns.append(turn + 1)
    return turns
