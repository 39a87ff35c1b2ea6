"""What a fenced commit carries: the step commits, finishes and parks the worker hands the run
store in batches, and the helpers that turn a batch into one statement's array parameters."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, NamedTuple, TypeAlias

from orchestrator.db.executor import TransactionConnection
from orchestrator.jsontext import compact
from orchestrator.models import JSON, CommitResult, Lease, Message, RunState

if TYPE_CHECKING:
    from orchestrator.db.budgets import Spend
    from orchestrator.effect_model import Effect


InTransaction: TypeAlias = "Callable[[TransactionConnection, CommitResult], Awaitable[None]]"
"""Extra writes a commit performs inside its transaction, after ownership was proven."""


@dataclass(frozen=True)
class StepEvent:
    """An event a step commit appends to the run's timeline, in the same transaction."""

    kind: str
    details: Mapping[str, JSON]


class StepCommit(NamedTuple):
    """One run's step commit inside a group commit (see ``RunStore.commit_steps``).

    A NamedTuple, as ``ClaimedRun``: built once per step on the hot path.
    """

    lease: Lease
    expected_version: int
    next_step: str
    checkpoint: JSON
    events: Sequence[StepEvent] = ()
    effects: Sequence[Effect] = ()
    """Recorded at the effect boundary in the same transaction (by the group committer)."""
    checkpoint_text: str | None = None
    """``checkpoint`` already encoded as compact JSON (the runtime validates by encoding)."""
    messages: Sequence[Message] = ()
    """Transcript messages (numbered) appended in the same transaction."""
    park: Park | None = None
    """The run waits after this commit (no lease, no worker) for what ``park`` says."""
    signal_seqs: Sequence[int] = ()
    """The seqs of the signals the step was given: the commit consumes them."""
    spend: Spend | None = None
    """What the step spent of the run's budget: settles its reservation."""
    agent_version: str | None = None
    """The version of the agent's code that wrote ``checkpoint`` (docs/upgrades.md)."""
    children: Sequence[Mapping[str, JSON]] = ()
    """Child runs spawned in the same transaction (orchestrator_spawn_children's input)."""
    budget_limits: Mapping[str, JSON] | None = None
    """The run's own budget limits (its agent's ``Budget``): its children's budgets are carved
    from them."""
    keep_checkpoint: bool = False
    """Keep this checkpoint in the run's history (``Agent(keep_checkpoints=True)``)."""


class Park(NamedTuple):
    """What a run waits for once its step commit parks it (see ``park_runs``)."""

    wait: Mapping[str, JSON]
    until: datetime | None
    progressed: bool = False
    """The run progressed since its claim (its steps were given signals, or a step committed
    before this wait): a park due at once is then no spin (see park_runs)."""


class RunFinish(NamedTuple):
    """One run's final commit inside a group commit (see ``RunStore.finish_many``)."""

    lease: Lease
    expected_version: int
    state: RunState
    result: JSON = None
    error: JSON = None
    checkpoint: JSON = None
    effects: Sequence[Effect] = ()
    result_text: str | None = None
    """``result`` already encoded as compact JSON, if the caller has it (see StepCommit)."""
    checkpoint_text: str | None = None
    messages: Sequence[Message] = ()
    signal_seqs: Sequence[int] = ()
    spend: Spend | None = None
    agent_version: str | None = None
    """The version of the agent's code that finished the run (docs/upgrades.md)."""


def checkpoint_events(commit: StepCommit) -> list[dict[str, JSON]]:
    first = StepEvent(
        "checkpoint", {"version": commit.expected_version + 1, "step": commit.next_step}
    )
    return events_json([first, *commit.events])


@dataclass(frozen=True)
class FailOutcome:
    state: RunState
    """``waiting`` (a retry is scheduled) or ``dead`` (attempts exhausted)."""
    retry_at: datetime | None
    attempt: int


_FINISHED_STATES = frozenset((RunState.SUCCEEDED, RunState.FAILED))


def final_states(finishes: Sequence[RunFinish]) -> list[RunState]:
    """The finishes' states, each succeeded or failed: a step ends a run that way; cancel and
    dead-letter have their own paths (cancel must raise the fence). One set check per batch."""
    states = [finish.state for finish in finishes]
    if not _FINISHED_STATES.issuperset(states):
        wrong = next(state for state in states if state not in _FINISHED_STATES)
        raise ValueError(f"a run is finished as succeeded or failed, not {wrong.value}")
    return states


def unless_all_null(values: list[str | None]) -> list[str | None]:
    """A batch column of only NULLs travels as an empty array: unnest with several arrays pads
    the shorter ones with NULLs (documented PostgreSQL behaviour), so no element is encoded.
    Most final commits have no error and keep their checkpoint."""
    return [] if values.count(None) == len(values) else values


def json_text(value: JSON, encoded: str | None = None) -> str | None:
    """JSON for a text[] batch parameter (``encoded`` if given); ``None`` stays SQL NULL."""
    if encoded is not None:
        return encoded
    return None if value is None else compact(value)


def same_worker(worker_id: str, leases: Sequence[Lease]) -> None:
    if any(lease.worker_id != worker_id for lease in leases):
        raise ValueError("a batched statement acts for one worker at a time")


def fenced_columns(
    worker_id: str, batch: Sequence[StepCommit] | Sequence[RunFinish]
) -> tuple[list[str], list[int], list[int]]:
    """A batch's run ids, fences and expected checkpoint versions (the columns every fenced
    batch statement checks), once it is known to act for ``worker_id`` alone."""
    same_worker(worker_id, [item.lease for item in batch])
    return (
        [item.lease.run_id for item in batch],
        [item.lease.fence for item in batch],
        [item.expected_version for item in batch],
    )


def events_json(events: Sequence[StepEvent]) -> list[dict[str, JSON]]:
    return [{"kind": event.kind, "details": dict(event.details)} for event in events]
