"""Reading runs: one run, lists of them, their timelines, transcripts and trace contexts, and
the database clock that judges every lease. Nothing here changes a run."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any, TypedDict

from orchestrator.db.executor import Executor
from orchestrator.db.pool_store import PoolStore
from orchestrator.db.queries import query
from orchestrator.errors import InvalidInput, RunNotFound
from orchestrator.ids import validate_run_id
from orchestrator.models import Message, Run, RunEvent, RunState, TraceRow

MAX_LIST_LIMIT = 10_000


class RunFilters(TypedDict, total=False):
    """Which runs ``list_runs`` returns, for callers that pass them on."""

    state: RunState | Sequence[RunState] | None
    agent: str | None
    limit: int
    submitted_after: datetime | None
    submitted_before: datetime | None
    parent: str | None


class RunReads(PoolStore):
    """Reads of the ``runs``, ``run_events``, ``run_messages`` and ``run_traces`` tables."""

    async def children_of(
        self, run_id: str, keys: Sequence[str], *, db: Executor | None = None
    ) -> list[dict[str, Any]]:
        """The children of ``run_id`` with these keys: key, run id, state, result, error."""
        records = await (db or self.pool).fetch(query("children_of"), run_id, list(keys))
        return [dict(record) for record in records]

    async def get(self, run_id: str, *, db: Executor | None = None) -> Run:
        validate_run_id(run_id)
        record = await (db or self.pool).fetchrow(query("get_run"), run_id)
        if record is None:
            raise RunNotFound(run_id)
        return Run.from_record(record)

    async def fence_of(self, run_id: str, *, db: Executor | None = None) -> int | None:
        """The run's current fence (``None``: no such run); what a refusal tells a stale owner."""
        fence = await (db or self.pool).fetchval(query("run_fence"), run_id)
        return None if fence is None else int(fence)

    async def agent_of(self, run_id: str) -> str | None:
        """The run's agent (``None``: no such run), so a scoped token is held to its agents."""
        validate_run_id(run_id)
        agent = await self.pool.fetchval(query("run_agent"), run_id)
        return None if agent is None else str(agent)

    async def list_runs(
        self,
        *,
        state: RunState | Sequence[RunState] | None = None,
        agent: str | None = None,
        limit: int = 100,
        submitted_after: datetime | None = None,
        submitted_before: datetime | None = None,
        parent: str | None = None,
    ) -> list[Run]:
        """Runs newest first, filtered by state(s), agent, submission time and parent run."""
        if parent is not None:
            validate_run_id(parent)
        if not 1 <= limit <= MAX_LIST_LIMIT:
            raise InvalidInput(f"limit must be between 1 and {MAX_LIST_LIMIT}")
        for bound in (submitted_after, submitted_before):
            if bound is not None and bound.utcoffset() is None:
                raise InvalidInput("a time filter must be timezone-aware (e.g. 2026-12-24T09:00Z)")
        states = [state] if isinstance(state, RunState) else state
        records = await self.pool.fetch(
            query("list_runs"),
            None if states is None else [s.value for s in states],
            agent,
            limit,
            submitted_after,
            submitted_before,
            parent,
        )
        return [Run.from_record(record) for record in records]

    async def database_now(self, *, db: Executor | None = None) -> datetime:
        """The database clock, which judges every lease (worker clocks may be hours off)."""
        now: datetime = await (db or self.pool).fetchval(query("database_now"))
        return now

    async def events(
        self, run_id: str, *, after: int = 0, limit: int | None = None
    ) -> list[RunEvent]:
        """The run's timeline after event ``after``, oldest first: ``limit`` events, or all."""
        validate_run_id(run_id)
        records = await self.pool.fetch(query("run_events"), run_id, after, limit)
        return [RunEvent.from_record(record) for record in records]

    async def events_tail(
        self, run_id: str, limit: int, *, kinds: Sequence[str] | None = None
    ) -> tuple[list[RunEvent], int]:
        """The run's newest ``limit`` events (of ``kinds``), oldest first, and how many it has
        in all: bounded whatever the length of the timeline."""
        validate_run_id(run_id)
        kinds_list = None if kinds is None else list(kinds)
        records = await self.pool.fetch(query("run_events_tail"), run_id, limit, kinds_list)
        total = records[0]["total"] if records else 0
        return [RunEvent.from_record(record) for record in records], total

    async def attempt_events(
        self, run_id: str, attempts: int, *, endings: Sequence[str], tallied: Sequence[str]
    ) -> tuple[list[RunEvent], dict[tuple[int, str], int]]:
        """What the run's newest ``attempts`` attempts are built from: their claims and the
        events of the kinds ``endings`` (oldest first), and per fence a count of each kind in
        ``tallied``."""
        validate_run_id(run_id)
        records = await self.pool.fetch(
            query("run_attempt_events"), run_id, attempts, list(endings), list(tallied)
        )
        events = sorted(
            (RunEvent.from_record(r) for r in records if r["event_id"] is not None),
            key=lambda event: event.event_id,
        )
        tallies = {
            (r["fence"], r["kind"]): int(r["details"]["count"])
            for r in records
            if r["event_id"] is None
        }
        return events, tallies

    async def traces(self, run_id: str) -> list[TraceRow]:
        """A run's trace contexts: the submitter's (fence 0, if it submitted inside a trace) and
        each traced attempt's."""
        validate_run_id(run_id)
        records = await self.pool.fetch(query("run_traces"), run_id)
        return [TraceRow.from_record(record) for record in records]

    async def messages(
        self, run_id: str, *, after_seq: int = -1, db: Executor | None = None
    ) -> list[Message]:
        """A run's committed transcript after message ``after_seq``, oldest first."""
        validate_run_id(run_id)
        records = await (db or self.pool).fetch(query("run_messages"), run_id, after_seq)
        return [
            Message(r["turn"], r["role"], r["body"], r["usage"], r["seq"], r["fence"], r["at"])
            for r in records
        ]

    async def queue_stats(self) -> list[dict[str, Any]]:
        """Per agent: runs queued, due, running and waiting, and the oldest due run's age in
        seconds (reads only the partial indexes of live runs)."""
        return [dict(row) for row in await self.pool.fetch(query("queue_stats"))]
