"""What the run state machine test checks against: a pure-Python model of each run and its
timeline, the constants and strategies its rules draw from, and the event loop it drives the
store on."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine, Mapping
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, TypeVar

import asyncpg
from hypothesis import strategies as st

from orchestrator.db.store import RunStore
from orchestrator.models import JSON, Lease, RunState

T = TypeVar("T")

LEASE_SECONDS = 600.0
"""Far longer than a test: only the ``expire`` rule ever expires a lease."""

AGENTS = ("alpha", "beta")
WORKERS = ("w1", "w2")
IDEMPOTENCY_KEYS = (None, None, None, "k1", "k2")

ACTIVE_STATES = frozenset({RunState.QUEUED, RunState.WAITING, RunState.RUNNING})

VERSION_OFFSETS = st.sampled_from((0, 0, 0, -1, 1))
"""How far a commit's expected checkpoint version is off the stored one (mostly not)."""
STEP_NAMES = st.sampled_from(("plan", "act", "report"))
CHECKPOINTS = st.fixed_dictionaries({"i": st.integers(0, 9)})
FINAL_CHECKPOINTS = st.none() | st.fixed_dictionaries({"final": st.integers(0, 9)})
EXTRA_EVENTS = st.lists(st.integers(0, 9), max_size=2)
"""Events a step commits besides its checkpoint event."""


def refusal(code: int) -> dict[str, JSON]:
    return {"type": "Refused", "code": code}


class LoopThread:
    """An asyncio event loop running in its own thread, for driving async code from sync code."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._serve, name="state-machine-loop", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_forever()
        finally:
            self.loop.run_until_complete(self.loop.shutdown_asyncgens())
            self.loop.close()

    def run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout=60)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=30)

    def __enter__(self) -> LoopThread:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()


@dataclass(frozen=True)
class Environment:
    loop: LoopThread
    pool: asyncpg.Pool
    store: RunStore


@dataclass(frozen=True)
class ExpectedEvent:
    kind: str
    fence: int
    worker_id: str | None
    details: Mapping[str, JSON] = field(default_factory=dict)
    """A subset of the stored details that must match exactly."""


@dataclass
class ModelRun:
    """What the SQL promises about one run."""

    run_id: str
    agent: str
    input: JSON
    max_attempts: int
    idempotency_key: str | None
    state: RunState = RunState.QUEUED
    fence: int = 0
    attempt: int = 0
    owner: str | None = None
    expired: bool = False
    """Running, and the ``expire`` rule moved its lease into the past."""
    due: bool = True
    """Queued runs are always due; waiting runs only after the ``make_due`` rule."""
    version: int = 0
    step: str | None = None
    checkpoint: JSON = None
    result: JSON = None
    error: JSON = None
    granted_fences: list[int] = field(default_factory=list)
    events: list[ExpectedEvent] = field(default_factory=list)

    def claimable(self) -> bool:
        if self.state is RunState.QUEUED:
            return True
        if self.state is RunState.WAITING:
            return self.due
        return self.state is RunState.RUNNING and self.expired

    def exhausted(self) -> bool:
        """Claiming it dead-letters it instead: its lease expired on the last attempt."""
        return self.state is RunState.RUNNING and self.expired and self.attempt >= self.max_attempts

    def accepts(self, lease: Lease) -> bool:
        """Whether the database must honour ``lease`` right now."""
        return (
            self.state is RunState.RUNNING
            and not self.expired
            and self.owner == lease.worker_id
            and self.fence == lease.fence
        )


class Boom(Exception):
    """Raised inside a commit's transaction: the whole step must roll back."""


Snapshot = tuple[dict[str, dict[str, Any]], int]
"""Every run row by id, and the number of events."""
