"""Live output (docs/streaming.md): appends under a run's lease, reads from a position.

The rules are in the database (migration 0031): an append is written only while its worker
holds the run under its fence; a reader's read first retracts what an attempt that has lost the
run left unfinished. This module only moves the rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from typing import TYPE_CHECKING, Any

import asyncpg

from orchestrator.db.queries import query
from orchestrator.errors import InvalidInput, RunNotFound
from orchestrator.ids import validate_run_id
from orchestrator.models import JSON, JsonFields, from_row

if TYPE_CHECKING:
    from orchestrator.db.executor import Executor

MAX_READ = 10_000
"""The most events one read returns (the database refuses more)."""


class OutputKind(StrEnum):
    TEXT = "text"
    """A piece of the model's answer (``data["text"]``), to be appended to what came before."""
    PROGRESS = "progress"
    """A step's progress (``data["message"]`` and whatever else it gave)."""
    RETRACTED = "retracted"
    """An attempt lost the run: its events ``data["from_seq"]`` to ``data["to_seq"]`` of fence
    ``data["fence"]`` (its steps that never committed) are no longer current output."""
    TRUNCATED = "truncated"
    """The run's output reached its bound; nothing more of it is kept."""


@dataclass(frozen=True, slots=True)
class OutputEvent(JsonFields):
    """One event of a run's live output, at its position ``seq`` (1, 2, ... with no gaps)."""

    seq: int
    fence: int
    """The fence of the attempt that published it (for a retraction: the attempt retracted)."""
    base_version: int
    """The checkpoint version the publishing step started from."""
    kind: OutputKind
    data: dict[str, Any]
    created_at: datetime

    @property
    def retracts(self) -> range:
        """The positions a retraction takes back (empty for any other event)."""
        if self.kind is not OutputKind.RETRACTED:
            return range(0)
        return range(int(self.data["from_seq"]), int(self.data["to_seq"]) + 1)

    def takes_back(self, event: OutputEvent) -> bool:
        """Whether this retraction takes back ``event``."""
        return event.fence == self.fence and event.seq in self.retracts


@dataclass(frozen=True, slots=True)
class Appended:
    """What an append came to: ``ok``; ``stale`` (nothing written: the worker no longer holds
    the run under that fence, or the step's checkpoint moved on); ``truncated`` (the run's bound
    is reached: what did not fit was dropped)."""

    status: str
    last_seq: int | None


@dataclass(frozen=True)
class OutputStore:
    db: Executor

    async def append(
        self,
        run_id: str,
        worker_id: str,
        fence: int,
        base_version: int,
        events: list[dict[str, JSON]],
        *,
        max_events: int,
        max_bytes: int,
    ) -> Appended:
        """Append ``events`` (each ``{"kind": ..., "data": {...}}``) as worker ``worker_id``
        under ``fence``, from checkpoint version ``base_version``."""
        row = await self.db.fetchrow(
            query("append_output"),
            run_id,
            worker_id,
            fence,
            base_version,
            events,
            max_events,
            max_bytes,
        )
        assert row is not None
        return Appended(row["status"], row["last_seq"])

    async def read(self, run_id: str, *, after: int = 0, limit: int = 1000) -> list[OutputEvent]:
        """The run's output after position ``after``, at most ``limit`` events, in order;
        ``RunNotFound`` for an unknown run."""
        validate_run_id(run_id)
        if isinstance(after, bool) or not isinstance(after, int) or after < 0:
            raise InvalidInput(f"a stream position is 0 or more, not {after!r}")
        if not 1 <= limit <= MAX_READ:
            raise InvalidInput(f"a read returns 1 to {MAX_READ:,} events, not {limit!r}")
        try:
            rows = await self.db.fetch(query("read_output"), run_id, after, limit)
        except asyncpg.NoDataFoundError:
            raise RunNotFound(run_id) from None
        return [from_row(OutputEvent, row, kind=OutputKind(row["kind"])) for row in rows]
