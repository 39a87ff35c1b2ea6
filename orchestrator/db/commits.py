"""Fenced commits: a step's checkpoint, a run's end, a failed attempt, and what commits with
them (events, transcript messages, trace contexts, parks). Every statement carries the lease's
fence, so a worker that lost its run changes nothing."""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager

import asyncpg

from orchestrator.backoff import Backoff
from orchestrator.db.commit_records import (
    FailOutcome,
    InTransaction,
    Park,
    RunFinish,
    StepCommit,
    StepEvent,
    checkpoint_events,
    fenced_columns,
    final_states,
    json_text,
    same_worker,
    unless_all_null,
)
from orchestrator.db.executor import Executor, TransactionConnection
from orchestrator.db.pool_store import PoolStore
from orchestrator.db.queries import query
from orchestrator.jsontext import compact
from orchestrator.models import JSON, CommitResult, Lease, Message, RunState, TraceRow


class Commits(PoolStore):
    """Fenced writes of a run's progress: checkpoints, final states, attempts, events."""

    def __init__(self, pool: asyncpg.Pool, *, backoff: Backoff | None = None) -> None:
        super().__init__(pool)
        self.backoff = backoff or Backoff()

    @asynccontextmanager
    async def _transaction(self, db: Executor | None) -> AsyncIterator[TransactionConnection]:
        if db is None or isinstance(db, asyncpg.Pool):
            async with (db or self.pool).acquire() as connection, connection.transaction():
                yield connection
        else:
            async with db.transaction():
                yield db

    async def record_attempt_traces(
        self,
        worker_id: str,
        attempts: Sequence[tuple[str, int, str]],
        *,
        db: Executor | None = None,
    ) -> list[TraceRow]:
        """Keep each new attempt's ``(run_id, fence, traceparent)``; return the earlier trace
        rows of those runs (the submitter's, fence 0, and earlier attempts'), in fence order."""
        run_ids, fences, traceparents = zip(*attempts, strict=True) if attempts else ((), (), ())
        records = await (db or self.pool).fetch(
            query("record_attempt_traces"),
            list(run_ids),
            list(fences),
            list(traceparents),
            worker_id,
        )
        return [TraceRow.from_record(record) for record in records]

    async def append_messages(
        self, messages_by_run: Mapping[str, Sequence[Message]], *, db: Executor
    ) -> set[str]:
        """Append committed runs' messages in the caller's transaction; returns the runs whose
        messages could not all be written (a sequence number already taken)."""
        rows = [(run_id, m) for run_id, messages in messages_by_run.items() for m in messages]
        if not rows:
            return set()
        written = await db.fetch(
            query("append_messages"),
            [run_id for run_id, _ in rows],
            [m.seq for _, m in rows],
            [m.turn for _, m in rows],
            [m.role for _, m in rows],
            [compact(m.body) for _, m in rows],
            [None if m.usage is None else compact(m.usage) for _, m in rows],
            [m.fence for _, m in rows],
        )
        counts: dict[str, int] = {}
        for record in written:
            counts[record["run_id"]] = counts.get(record["run_id"], 0) + 1
        return {
            run_id
            for run_id, messages in messages_by_run.items()
            if counts.get(run_id, 0) != len(messages)
        }

    # -- progress -----------------------------------------------------------------------------
    async def commit_step(
        self,
        lease: Lease,
        *,
        expected_version: int,
        next_step: str,
        checkpoint: JSON,
        events: Sequence[StepEvent] = (),
        in_transaction: InTransaction | None = None,
        agent_version: str | None = None,
        db: Executor | None = None,
    ) -> CommitResult | None:
        """Commit a step's checkpoint and events, fenced; ``None`` means nothing was committed.

        ``in_transaction`` runs inside the same transaction after ownership was proven, for
        writes that must commit with the checkpoint or not at all (effect records).
        """
        events_json = checkpoint_events(
            StepCommit(lease, expected_version, next_step, checkpoint, events)
        )
        arguments = (
            lease.run_id,
            lease.worker_id,
            lease.fence,
            expected_version,
            next_step,
            checkpoint,
            events_json,
            agent_version,
        )
        if in_transaction is None:
            # One statement is atomic by itself: no BEGIN/COMMIT round trips.
            record = await (db or self.pool).fetchrow(query("commit_step"), *arguments)
            return None if record is None else CommitResult(*record)
        async with self._transaction(db) as connection:
            record = await connection.fetchrow(query("commit_step"), *arguments)
            if record is None:
                return None
            result = CommitResult(record["checkpoint_version"], record["lease_until"])
            await in_transaction(connection, result)
            return result

    async def finish(
        self,
        lease: Lease,
        *,
        expected_version: int,
        result: JSON = None,
        checkpoint: JSON = None,
        db: Executor | None = None,
    ) -> bool:
        """Mark the run succeeded with ``result``, fenced like a commit."""
        finish = RunFinish(lease, expected_version, RunState.SUCCEEDED, result, None, checkpoint)
        return await self._finish(finish, db)

    async def fail(
        self,
        lease: Lease,
        *,
        expected_version: int,
        error: Mapping[str, JSON],
        checkpoint: JSON = None,
        db: Executor | None = None,
    ) -> bool:
        """Mark the run failed for good (the step decided; no retry), fenced like a commit."""
        finish = RunFinish(lease, expected_version, RunState.FAILED, None, dict(error), checkpoint)
        return await self._finish(finish, db)

    async def _finish(self, finish: RunFinish, db: Executor | None) -> bool:
        finished = await self.finish_many(finish.lease.worker_id, [finish], db=db)
        return finish.lease.run_id in finished

    # -- group commit -------------------------------------------------------------------------
    async def commit_steps(
        self, worker_id: str, commits: Sequence[StepCommit], *, db: Executor | None = None
    ) -> dict[str, CommitResult]:
        """Many runs' step commits in one statement; returns the ones that took effect.

        Each run's conditions are those of ``commit_step``: a refused run changes nothing and
        does not affect the others.
        """
        records = await (db or self.pool).fetch(
            query("commit_steps"),
            worker_id,
            *fenced_columns(worker_id, commits),
            [c.next_step for c in commits],
            [json_text(c.checkpoint, c.checkpoint_text) for c in commits],
            [json_text(checkpoint_events(c)) for c in commits],
            unless_all_null([c.agent_version for c in commits]),
        )
        return {
            r["run_id"]: CommitResult(
                r["checkpoint_version"], r["lease_until"], r["signals_pending"], r["drained"]
            )
            for r in records
        }

    async def finish_many(
        self, worker_id: str, finishes: Sequence[RunFinish], *, db: Executor | None = None
    ) -> set[str]:
        """Many runs' final commits in one statement; returns the runs that were finished."""
        columns = fenced_columns(worker_id, finishes)
        states = final_states(finishes)  # sent as they are: a StrEnum member is its text
        records = await (db or self.pool).fetch(
            query("finish_runs"),
            worker_id,
            *columns,
            states,
            unless_all_null([json_text(f.result, f.result_text) for f in finishes]),
            unless_all_null([json_text(f.error) for f in finishes]),
            unless_all_null([json_text(f.checkpoint, f.checkpoint_text) for f in finishes]),
            unless_all_null([f.agent_version for f in finishes]),
        )
        return {record["run_id"] for record in records}

    async def park_many(
        self, worker_id: str, parks: Sequence[tuple[Lease, Park]], *, db: Executor
    ) -> set[str]:
        """After their step commits, in the same transaction: these runs wait (see park_runs).
        Returns the runs parked."""
        same_worker(worker_id, [lease for lease, _ in parks])
        records = await db.fetch(
            query("park_runs"),
            worker_id,
            [lease.run_id for lease, _ in parks],
            [lease.fence for lease, _ in parks],
            [compact(dict(park.wait)) for _, park in parks],
            [park.until for _, park in parks],
            [park.progressed for _, park in parks],
        )
        return {record["run_id"] for record in records}

    async def spawn_children(
        self,
        lease: Lease,
        children: Sequence[Mapping[str, JSON]],
        *,
        db: Executor,
        budget_limits: Mapping[str, JSON] | None = None,
    ) -> dict[str, str] | None:
        """After the step commits, in the same transaction: start its children under its
        fence (see spawn_children), carving the budgets of those it creates from the run's
        (``budget_limits``: its own; see carve_budgets). Each child's run by key (an existing
        one for a key spawned before); ``None`` when the run is not the lease's any more
        (nothing spawned)."""
        records = await db.fetch(
            query("spawn_children"), lease.run_id, lease.fence, lease.worker_id, list(children)
        )
        if not records:
            return None
        spawned = {record["child_key"]: record["run_id"] for record in records}
        created = {record["child_key"] for record in records if record["created"]}
        carves = [
            {"run_id": spawned[str(child["key"])], "budget": child.get("budget")}
            for child in children
            if child["key"] in created
        ]
        if carves and (budget_limits is not None or any(c["budget"] for c in carves)):
            arguments = (lease.run_id, lease.fence, lease.worker_id, budget_limits, carves)
            if await db.fetchval(query("carve_budgets"), *arguments) is None:
                return None
        return spawned

    async def keep_checkpoints(
        self,
        commits: Sequence[StepCommit],
        committed: Mapping[str, CommitResult],
        *,
        db: Executor,
    ) -> None:
        """Last in the commits' transaction: keep these step commits' checkpoints, from which a
        run can be forked (see keep_checkpoints)."""
        await db.execute(
            query("keep_checkpoints"),
            [c.lease.run_id for c in commits],
            [committed[c.lease.run_id].checkpoint_version for c in commits],
            [c.next_step for c in commits],
            [json_text(c.checkpoint, c.checkpoint_text) for c in commits],
            [c.agent_version for c in commits],
            [c.lease.fence for c in commits],
        )

    async def release_drained(
        self, worker_id: str, run_ids: Sequence[str], *, db: Executor
    ) -> set[str]:
        """After their step commits, in the same transaction: a drained cutover let these runs
        finish that step, so give them back (see release_drained). Returns the runs given back."""
        records = await db.fetch(query("release_drained"), worker_id, list(run_ids))
        return {record["run_id"] for record in records}

    async def fail_attempt(
        self, lease: Lease, *, error: Mapping[str, JSON], db: Executor | None = None
    ) -> FailOutcome | None:
        """Record a failed attempt: retry after backoff, or dead-letter after the last attempt."""
        record = await (db or self.pool).fetchrow(
            query("fail_attempt"),
            lease.run_id,
            lease.worker_id,
            lease.fence,
            dict(error),
            self.backoff.base_seconds,
            self.backoff.max_seconds,
        )
        if record is None:
            return None
        state = RunState(record["state"])
        return FailOutcome(
            state=state,
            retry_at=record["available_at"] if state is RunState.WAITING else None,
            attempt=record["attempt"],
        )

    async def record_event(
        self,
        run_id: str,
        kind: str,
        *,
        fence: int | None = None,
        worker_id: str | None = None,
        details: Mapping[str, JSON] | None = None,
        db: Executor | None = None,
    ) -> int:
        """Append an event; changes no state, so even a worker that lost its lease may."""
        event_id = await (db or self.pool).fetchval(
            query("record_event"), run_id, kind, fence, worker_id, dict(details or {})
        )
        return int(event_id)
