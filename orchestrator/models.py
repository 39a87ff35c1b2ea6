"""Domain objects the store returns: runs, leases, events."""

from __future__ import annotations

import enum
from contextlib import suppress
from dataclasses import dataclass, fields
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, Literal, NamedTuple, Protocol, TypeVar, cast

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

JSON = Any
"""A JSON value as the json module reads it."""

D = TypeVar("D", bound="DataclassInstance")


class Row(Protocol):
    """A database row addressable by column name (an asyncpg Record, or a dict in tests)."""

    def __getitem__(self, key: str, /) -> Any: ...


def from_row(cls: type[D], row: Row, **given: Any) -> D:
    """A dataclass whose fields are ``row``'s columns of the same names (``given`` wins)."""
    return cls(**{f.name: given[f.name] if f.name in given else row[f.name] for f in fields(cls)})


def json_fields(value: DataclassInstance, **given: JSON) -> dict[str, JSON]:
    """A dataclass's fields as JSON, in their order: times in ISO 8601, enums as their values
    (``given`` wins, for a field that is not plain)."""
    return {
        f.name: given[f.name] if f.name in given else _plain(getattr(value, f.name))
        for f in fields(value)
    }


class JsonFields:
    """Gives a dataclass ``as_json``: its fields as JSON (``json_fields``), for ``--json``."""

    __slots__ = ()

    def as_json(self) -> dict[str, Any]:
        return json_fields(cast("DataclassInstance", self))


def _plain(value: Any) -> JSON:
    if isinstance(value, datetime):
        return value.isoformat()
    return value.value if isinstance(value, enum.Enum) else value


class RunState(enum.StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    WAITING = "waiting"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    DEAD = "dead"

    @property
    def terminal(self) -> bool:
        return self in TERMINAL_STATES


TERMINAL_STATES = frozenset(
    {RunState.SUCCEEDED, RunState.FAILED, RunState.CANCELLED, RunState.DEAD}
)


@dataclass(frozen=True)
class Run:
    """A run as stored. Nothing in a worker's memory is authoritative; this row is."""

    run_id: str
    agent: str
    state: RunState
    input: JSON
    fence: int
    lease_owner: str | None
    lease_until: datetime | None
    attempt: int
    max_attempts: int
    available_at: datetime
    step: str | None
    checkpoint: JSON
    checkpoint_version: int
    result: JSON
    error: JSON
    idempotency_key: str | None
    created_at: datetime
    updated_at: datetime
    finished_at: datetime | None
    wait: JSON = None
    """While waiting for something (signals, effects, a time, budget): what, as committed."""
    signals_pending: int = 0
    """Signals sent to the run and not yet consumed by a committed step."""
    concurrency_key: str | None = None
    """What its limits count it under (a tenant, a customer): docs/flow-control.md."""
    priority: int = 0
    """Among due runs of its key, higher first."""
    started_version: str | None = None
    """The version of its agent's code that committed its first step (docs/upgrades.md)."""
    agent_version: str | None = None
    """The version of its agent's code that wrote its latest checkpoint."""
    parent_run_id: str | None = None
    """The run whose step commit started this one (docs/child-runs.md)."""
    child_key: str | None = None
    """Its name among its parent's children."""
    root_run_id: str | None = None
    """The run at the top of its tree (``None``: it is a root)."""
    depth: int = 0
    """Levels below its root."""
    forked_from: str | None = None
    """The run it was forked from (docs/child-runs.md)."""
    forked_at_version: int | None = None
    """The checkpoint version of ``forked_from`` it started from (0: the start)."""
    schedule_id: str | None = None
    """The schedule that started it (docs/schedules.md)."""
    schedule_slot: datetime | None = None
    """The slot it was started for: the instant, before any jitter."""
    held_back: str | None = None
    """Read by ``runs list`` alone: the limit holding this due run back now, or the rate limit
    this running run waits for (docs/flow-control.md)."""

    @classmethod
    def from_record(cls, record: Row) -> Run:
        values = {name: record[name] for name in _STORED_RUN_FIELDS}
        with suppress(KeyError):  # read only by the listing
            values["held_back"] = record["held_back"]
        values["state"] = RunState(values["state"])
        if values["available_at"].tzinfo is None:
            # asyncpg reads 'infinity' (a wait with no time limit) as a naive datetime.max; every
            # other time is in UTC, and this one must compare and print like them.
            values["available_at"] = values["available_at"].replace(tzinfo=UTC)
        return cls(**values)


_STORED_RUN_FIELDS = tuple(name for name in Run.__dataclass_fields__ if name != "held_back")


@dataclass(frozen=True)
class TraceRow:
    """A stored trace context: the submitter's (fence 0) or one attempt's root span."""

    run_id: str
    fence: int
    traceparent: str
    worker_id: str | None

    @classmethod
    def from_record(cls, record: Row) -> TraceRow:
        return cls(record["run_id"], record["fence"], record["traceparent"], record["worker_id"])


@dataclass(frozen=True)
class Lease:
    """Proof of ownership a worker carries: run id, owner and the fence it was granted.

    Every renewal, commit and effect request presents all three; the database accepts them only
    while they are still the current owner and fence of an unexpired, running run.
    """

    run_id: str
    worker_id: str
    fence: int


class ClaimedRun(NamedTuple):
    """What a claim hands a worker: the lease plus what it needs to resume the run.

    A NamedTuple rather than a frozen dataclass: a worker builds one per claimed run, and an
    immutable tuple is the cheapest immutable record Python has.
    """

    lease: Lease
    agent: str
    input: JSON
    lease_until: datetime
    attempt: int
    max_attempts: int
    step: str | None
    checkpoint: JSON
    checkpoint_version: int
    claimed_at: datetime
    previous_owner: str | None
    previous_lease_until: datetime | None
    wait: JSON
    """What the run waited for before this claim woke it (``None``: it was not waiting)."""
    signals: JSON
    """The run's first unconsumed signals (a JSON list, oldest first), or ``None``: none."""
    signals_pending: int | None
    """How many signals the run has unconsumed (more than ``signals`` holds: later steps)."""
    agent_version: str | None = None
    """The version of the agent's code that wrote ``checkpoint`` (``None``: no step committed
    yet, or written by a release before versions): docs/upgrades.md."""

    @property
    def run_id(self) -> str:
        return self.lease.run_id

    @property
    def fence(self) -> int:
        return self.lease.fence

    @classmethod
    def from_record(cls, record: Row, worker_id: str) -> ClaimedRun:
        # Positional, in field order (a keyword call goes through NamedTuple's Python-level
        # __new__); tests/test_store.py checks every field against its column.
        return cls(
            Lease(record["run_id"], worker_id, record["fence"]),
            record["agent"],
            record["input"],
            record["lease_until"],
            record["attempt"],
            record["max_attempts"],
            record["step"],
            record["checkpoint"],
            record["checkpoint_version"],
            record["claimed_at"],
            record["previous_owner"],
            record["previous_lease_until"],
            record["wait"],
            record["signals"],
            record["signals_pending"],
            record["agent_version"],
        )


@dataclass(frozen=True)
class ClaimBatch:
    """The outcome of one claim statement."""

    claimed: list[ClaimedRun]
    dead_lettered: list[str]
    """Runs whose lease expired on their last allowed attempt: dead-lettered, not claimed."""
    planned: bool = False
    """The claim went through flow control (limits or keys): ``cursor`` says where it ended."""
    cursor: str | None = None
    """The last concurrency key the claim looked at."""
    held_back: int = 0
    """Runs the claim passed over because a limit they are under was full."""

    def next_key(self, after: str | None) -> str | None:
        """The key a claimer's next claim starts after: where this one's turn over the keys
        ended, or ``after`` again if it had no turn (no key, no limit)."""
        return self.cursor if self.planned else after


@dataclass(frozen=True)
class Renewal:
    run_id: str
    lease_until: datetime


@dataclass(frozen=True)
class CommitResult:
    checkpoint_version: int
    lease_until: datetime
    signals_pending: int = 0
    """Signals stored for the run and not consumed before this commit (its own included)."""
    drained: bool = False
    """A drained cutover let this step finish: it was the worker's last of the run, which is
    given back in the same transaction (docs/upgrades.md)."""


@dataclass(frozen=True)
class Submission:
    run: Run
    created: bool
    """False when an idempotency key matched an existing run, which is returned instead."""


@dataclass(frozen=True)
class RunEvent:
    event_id: int
    run_id: str
    at: datetime
    kind: str
    fence: int | None
    worker_id: str | None
    details: JSON

    @classmethod
    def from_record(cls, record: Row) -> RunEvent:
        return cls(**{name: record[name] for name in cls.__dataclass_fields__})


@dataclass(frozen=True)
class WorkerInfo:
    """A registered worker, as ``orchestrator workers list`` shows it."""

    worker_id: str
    host: str
    pid: int
    agents: list[str]
    started_at: datetime
    alive: bool
    """Its database session still holds its liveness lock."""
    runs_held: int
    last_renewal: datetime | None
    """Its latest lease renewal, or a later commit of a run it holds now (None: it never
    renewed one)."""
    leases_until: datetime | None

    @classmethod
    def from_record(cls, record: Row) -> WorkerInfo:
        values = {name: record[name] for name in cls.__dataclass_fields__}
        values["agents"] = list(values["agents"])
        return cls(**values)


Role = Literal["system", "user", "assistant", "tool"]
ROLES: tuple[Role, ...] = ("system", "user", "assistant", "tool")
DEFAULT_MAX_MESSAGE_BYTES = 256 * 1024


@dataclass(frozen=True, slots=True)
class Message:
    """One message. ``body`` is the chat message as the model API takes it (``role``,
    ``content``, ``tool_calls``, ``tool_call_id``); ``usage``, on an assistant message, is what its
    model call cost. ``seq`` and ``fence`` are set when it is committed."""

    turn: int
    role: Role
    body: dict[str, Any]
    usage: JSON = None
    seq: int = -1
    fence: int = 0
    at: datetime | None = None


@dataclass(frozen=True, slots=True)
class StoredWait:
    """What a waiting run waits for, as ``runs.wait`` holds it: written by the commit that parks
    the run (``Wait``), read back by the claim that wakes it, by ``runs show`` and the console.
    The one place that knows the format in Python; ``sql/queries.sql`` reads ``signals`` and
    ``until`` of it to decide when a run is due."""

    step: str
    signals: tuple[str, ...] = ()
    effects: tuple[str, ...] = ()
    until: datetime | None = None
    reason: str = ""
    """Why, in the timeline; ``budget``: the run waits for a top-up."""
    children: tuple[str, ...] = ()
    """Keys of the children it waits for (docs/child-runs.md)."""
    need: int | None = None
    """How many of ``children`` must end first (``None``: all)."""

    def as_json(self) -> dict[str, JSON]:
        stored: dict[str, JSON] = {
            "step": self.step,
            "signals": list(self.signals),
            "effects": list(self.effects),
            "until": None if self.until is None else self.until.isoformat(),
            "reason": self.reason or None,
        }
        if self.children:  # the database reads these keys (park_runs, runs_child_ended)
            stored["children"] = list(self.children)
            stored["need"] = self.need
        return stored

    @classmethod
    def from_json(cls, stored: JSON) -> StoredWait:
        """Read ``runs.wait`` (a dict as ``as_json`` wrote it; absent keys are empty)."""
        wait = stored if isinstance(stored, dict) else {}
        until = wait.get("until")
        return cls(
            str(wait.get("step") or ""),
            tuple(str(name) for name in wait.get("signals") or ()),
            tuple(str(key) for key in wait.get("effects") or ()),
            datetime.fromisoformat(until) if isinstance(until, str) else None,
            str(wait.get("reason") or ""),
            tuple(str(key) for key in wait.get("children") or ()),
            need if isinstance(need := wait.get("need"), int) else None,
        )
