"""The run store: leases and fencing tokens on PostgreSQL.

This is the only module that knows query names. Every method is one statement, or one
transaction, whose WHERE clause carries the ownership conditions; a method that finds its
conditions no longer hold changes nothing and says so (``None`` or ``False``), and the caller
treats that as lost ownership.
"""

from __future__ import annotations

import zlib
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, NamedTuple, TypeAlias

import asyncpg

from orchestrator.backoff import Backoff
from orchestrator.db.executor import Executor, TransactionConnection
from orchestrator.db.queries import query
from orchestrator.errors import (
    IdempotencyConflict,
    InvalidInput,
    InvalidTransition,
    RunAlreadyExists,
    RunNotFound,
)
from orchestrator.ids import new_run_id, validate_agent_name, validate_run_id
from orchestrator.jsontext import compact, utf8_size
from orchestrator.models import (
    JSON,
    ClaimBatch,
    ClaimedRun,
    CommitResult,
    Lease,
    Message,
    Row,
    Run,
    RunEvent,
    RunState,
    Submission,
    TraceRow,
    WorkerInfo,
)
from orchestrator.settings import DEFAULT_MAX_INPUT_BYTES, DEFAULT_SCHEMA
from orchestrator.storable import check_json, check_text
from orchestrator.telemetry import current_traceparent

MAX_LIST_LIMIT = 10_000
MAX_ATTEMPTS_LIMIT = 1_000

if TYPE_CHECKING:
    from orchestrator.budgets import Spend
    from orchestrator.effects.model import Effect


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


def _checkpoint_events(commit: StepCommit) -> list[dict[str, JSON]]:
    first = StepEvent(
        "checkpoint", {"version": commit.expected_version + 1, "step": commit.next_step}
    )
    return _events_json([first, *commit.events])


@dataclass(frozen=True)
class FailOutcome:
    state: RunState
    """``waiting`` (a retry is scheduled) or ``dead`` (attempts exhausted)."""
    retry_at: datetime | None
    attempt: int


def encode_input(value: JSON, *, max_bytes: int) -> JSON:
    """Validate a run's input: a JSON object no larger than ``max_bytes`` once encoded."""
    if not isinstance(value, dict):
        raise InvalidInput(
            f'input must be a JSON object (for example {{"topic": "..."}}), '
            f"not a {type(value).__name__}"
        )
    check_json(value, "input")
    try:
        size = utf8_size(compact(value))
    except (TypeError, ValueError) as error:
        raise InvalidInput(f"input is not JSON-serialisable: {error}") from None
    if size > max_bytes:
        raise InvalidInput(
            f"input is {size:,} bytes, over the {max_bytes:,}-byte limit; store large documents "
            "elsewhere and pass a reference, or raise ORCHESTRATOR_MAX_INPUT_BYTES"
        )
    return value


_FINISHED_STATES = frozenset((RunState.SUCCEEDED, RunState.FAILED))


def _final_states(finishes: Sequence[RunFinish]) -> list[RunState]:
    """The finishes' states, each succeeded or failed: a step ends a run that way; cancel and
    dead-letter have their own paths (cancel must raise the fence). One set check per batch."""
    states = [finish.state for finish in finishes]
    if not _FINISHED_STATES.issuperset(states):
        wrong = next(state for state in states if state not in _FINISHED_STATES)
        raise ValueError(f"a run is finished as succeeded or failed, not {wrong.value}")
    return states


def _unless_all_null(values: list[str | None]) -> list[str | None]:
    """A batch column of only NULLs travels as an empty array: unnest with several arrays pads
    the shorter ones with NULLs (documented PostgreSQL behaviour), so no element is encoded.
    Most final commits have no error and keep their checkpoint."""
    return [] if values.count(None) == len(values) else values


def _json_text(value: JSON, encoded: str | None = None) -> str | None:
    """JSON for a text[] batch parameter (``encoded`` if given); ``None`` stays SQL NULL."""
    if encoded is not None:
        return encoded
    return None if value is None else compact(value)


def _same_worker(worker_id: str, leases: Sequence[Lease]) -> None:
    if any(lease.worker_id != worker_id for lease in leases):
        raise ValueError("a batched statement acts for one worker at a time")


def _events_json(events: Sequence[StepEvent]) -> list[dict[str, JSON]]:
    return [{"kind": event.kind, "details": dict(event.details)} for event in events]


class RunStore:
    """Typed operations on runs; see ``sql/queries.sql`` for the statements and their rules."""

    def __init__(
        self,
        pool: asyncpg.Pool,
        *,
        max_input_bytes: int = DEFAULT_MAX_INPUT_BYTES,
        backoff: Backoff | None = None,
    ) -> None:
        self.pool = pool
        self.max_input_bytes = max_input_bytes
        self.backoff = backoff or Backoff()

    @asynccontextmanager
    async def _transaction(self, db: Executor | None) -> AsyncIterator[TransactionConnection]:
        if db is None or isinstance(db, asyncpg.Pool):
            async with (db or self.pool).acquire() as connection, connection.transaction():
                yield connection
        else:
            async with db.transaction():
                yield db

    # -- submitting and reading ---------------------------------------------------------------
    async def submit(
        self,
        agent: str,
        input: JSON,
        *,
        run_id: str | None = None,
        idempotency_key: str | None = None,
        max_attempts: int = 5,
        not_before: datetime | None = None,
    ) -> Submission:
        """Queue a run (due at ``not_before``, or now). The same idempotency key returns the run
        it first created."""
        validate_agent_name(agent)
        if not_before is not None and not_before.utcoffset() is None:
            raise InvalidInput("a run's start time must be timezone-aware (e.g. 2026-12-24T09:00Z)")
        encode_input(input, max_bytes=self.max_input_bytes)
        if run_id is not None:
            validate_run_id(run_id)
        if not 1 <= max_attempts <= MAX_ATTEMPTS_LIMIT:
            raise InvalidInput(f"max attempts must be between 1 and {MAX_ATTEMPTS_LIMIT}")
        if idempotency_key is not None:
            check_text(idempotency_key, "the idempotency key")
            if not 1 <= len(idempotency_key) <= 200:
                raise InvalidInput("an idempotency key must be 1-200 characters")
        record = await self.pool.fetchrow(
            query("submit_run"),
            run_id or new_run_id(),
            agent,
            input,
            max_attempts,
            idempotency_key,
            not_before,
            current_traceparent(),
        )
        if record is not None:
            return Submission(Run.from_record(record), created=True)
        if idempotency_key is not None:
            existing = await self.pool.fetchrow(
                query("get_run_by_idempotency_key"), idempotency_key
            )
            if existing is not None:
                run = Run.from_record(existing)
                if run.agent != agent or run.input != input:
                    raise IdempotencyConflict(
                        f"idempotency key {idempotency_key!r} was already used for run "
                        f"{run.run_id} with a different agent or input; use a new key for a new run"
                    )
                return Submission(run, created=False)
        raise RunAlreadyExists(
            f"run id {run_id!r} is already taken; omit --run-id to get a fresh one"
        )

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

    async def list_runs(
        self,
        *,
        state: RunState | Sequence[RunState] | None = None,
        agent: str | None = None,
        limit: int = 100,
        submitted_after: datetime | None = None,
        submitted_before: datetime | None = None,
    ) -> list[Run]:
        """Runs newest first, filtered by state(s), agent and submission time."""
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

    # -- leases -------------------------------------------------------------------------------
    async def claim(
        self,
        worker_id: str,
        agents: Sequence[str],
        *,
        limit: int = 1,
        lease_seconds: float = 45.0,
        include_expired: bool = True,
        db: Executor | None = None,
    ) -> ClaimBatch:
        """Claim up to ``limit`` due or lease-expired runs of ``agents`` in one statement.

        ``include_expired=False`` claims due runs only, without reading the running set to find
        expired leases (see claim in sql/queries.sql).
        """
        # Each agent is probed once; a repeated name would fill the limit with duplicates.
        unique_agents = list(dict.fromkeys(agents))
        records = await (db or self.pool).fetch(
            query("claim"), worker_id, unique_agents, limit, lease_seconds, include_expired, None
        )
        return self._claim_batch(records, worker_id)

    async def claim_run(
        self,
        worker_id: str,
        run_id: str,
        *,
        lease_seconds: float = 45.0,
        db: Executor | None = None,
    ) -> ClaimedRun | None:
        """Claim one specific run if it is due or its lease expired; ``None`` otherwise."""
        validate_run_id(run_id)
        records = await (db or self.pool).fetch(
            query("claim"), worker_id, [], 1, lease_seconds, True, run_id
        )
        batch = self._claim_batch(records, worker_id)
        return batch.claimed[0] if batch.claimed else None

    @staticmethod
    def _claim_batch(records: Sequence[Row], worker_id: str) -> ClaimBatch:
        claimed: list[ClaimedRun] = []
        dead: list[str] = []
        for record in records:
            if record["outcome"] == "claimed":
                claimed.append(ClaimedRun.from_record(record, worker_id))
            else:
                dead.append(record["run_id"])
        return ClaimBatch(claimed=claimed, dead_lettered=dead)

    async def renew(
        self, lease: Lease, *, lease_seconds: float = 45.0, db: Executor | None = None
    ) -> datetime | None:
        """Extend one lease; ``None`` means ownership is lost or cannot be proven."""
        record = await (db or self.pool).fetchrow(
            query("renew_lease"), lease.run_id, lease.worker_id, lease.fence, lease_seconds
        )
        return None if record is None else record["lease_until"]

    async def renew_many(
        self,
        worker_id: str,
        leases: Sequence[Lease],
        *,
        lease_seconds: float | Sequence[float],
        db: Executor | None = None,
    ) -> dict[str, datetime]:
        """Extend many leases of one worker in one statement; returns the ones that held."""
        _same_worker(worker_id, leases)
        seconds = (
            [float(lease_seconds)] * len(leases)
            if isinstance(lease_seconds, int | float)
            else [float(value) for value in lease_seconds]
        )
        records = await (db or self.pool).fetch(
            query("renew_leases"),
            [lease.run_id for lease in leases],
            [lease.fence for lease in leases],
            seconds,
            worker_id,
        )
        return {record["run_id"]: record["lease_until"] for record in records}

    async def release(
        self, lease: Lease, *, reason: str = "shutdown", db: Executor | None = None
    ) -> bool:
        """Hand a run back without raising its fence (graceful shutdown)."""
        record = await (db or self.pool).fetchrow(
            query("release_lease"), lease.run_id, lease.worker_id, lease.fence, reason
        )
        return record is not None

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
        db: Executor | None = None,
    ) -> CommitResult | None:
        """Commit a step's checkpoint and events, fenced; ``None`` means nothing was committed.

        ``in_transaction`` runs inside the same transaction after ownership was proven, for
        writes that must commit with the checkpoint or not at all (effect records).
        """
        events_json = _checkpoint_events(
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
        _same_worker(worker_id, [commit.lease for commit in commits])
        records = await (db or self.pool).fetch(
            query("commit_steps"),
            worker_id,
            [c.lease.run_id for c in commits],
            [c.lease.fence for c in commits],
            [c.expected_version for c in commits],
            [c.next_step for c in commits],
            [_json_text(c.checkpoint, c.checkpoint_text) for c in commits],
            [_json_text(_checkpoint_events(c)) for c in commits],
        )
        return {
            r["run_id"]: CommitResult(
                r["checkpoint_version"], r["lease_until"], r["signals_pending"]
            )
            for r in records
        }

    async def finish_many(
        self, worker_id: str, finishes: Sequence[RunFinish], *, db: Executor | None = None
    ) -> set[str]:
        """Many runs' final commits in one statement; returns the runs that were finished."""
        _same_worker(worker_id, [finish.lease for finish in finishes])
        states = _final_states(finishes)  # sent as they are: a StrEnum member is its text
        records = await (db or self.pool).fetch(
            query("finish_runs"),
            worker_id,
            [f.lease.run_id for f in finishes],
            [f.lease.fence for f in finishes],
            [f.expected_version for f in finishes],
            states,
            _unless_all_null([_json_text(f.result, f.result_text) for f in finishes]),
            _unless_all_null([_json_text(f.error) for f in finishes]),
            _unless_all_null([_json_text(f.checkpoint, f.checkpoint_text) for f in finishes]),
        )
        return {record["run_id"] for record in records}

    async def park_many(
        self, worker_id: str, parks: Sequence[tuple[Lease, Park]], *, db: Executor
    ) -> set[str]:
        """After their step commits, in the same transaction: these runs wait (see park_runs).
        Returns the runs parked."""
        _same_worker(worker_id, [lease for lease, _ in parks])
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

    async def consume_signals(
        self, consumed: Sequence[tuple[Lease, Sequence[int]]], *, db: Executor
    ) -> None:
        """In a commit's transaction: the signals its step was given are consumed."""
        rows = [(lease, seq) for lease, seqs in consumed for seq in seqs]
        await db.execute(
            query("consume_signals"),
            [lease.run_id for lease, _ in rows],
            [seq for _, seq in rows],
            [lease.fence for lease, _ in rows],
        )

    async def settle_budgets(self, spends: Sequence[tuple[str, Spend]], *, db: Executor) -> None:
        """In a commit's transaction: each step's reservation becomes what it spent."""
        await db.execute(
            query("settle_budgets"),
            [run_id for run_id, _ in spends],
            [spend.fence for _, spend in spends],
            [spend.turns for _, spend in spends],
            [spend.tool_calls for _, spend in spends],
            [spend.input_tokens for _, spend in spends],
            [spend.output_tokens for _, spend in spends],
            [spend.cost for _, spend in spends],
        )

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

    # -- operator actions ---------------------------------------------------------------------
    async def cancel(self, run_id: str, *, reason: str | None = None) -> Run:
        """Cancel an unfinished run and raise its fence, so its owner can no longer act."""
        validate_run_id(run_id)
        if reason is not None:
            check_text(reason, "the cancel reason")
        record = await self.pool.fetchrow(query("cancel_run"), run_id, reason)
        if record is None:
            run = await self.get(run_id)
            raise InvalidTransition(
                f"run {run_id} is already {run.state.value}; only queued, waiting or running "
                "runs can be cancelled"
            )
        return await self.get(run_id)

    async def retry(self, run_id: str) -> Run:
        """Requeue a dead-lettered run with a fresh set of attempts."""
        validate_run_id(run_id)
        record = await self.pool.fetchrow(query("requeue_dead"), run_id)
        if record is None:
            run = await self.get(run_id)
            raise InvalidTransition(
                f"run {run_id} is {run.state.value}, not dead; only dead-lettered runs can be "
                "retried (submit a new run to repeat a finished one)"
            )
        return await self.get(run_id)


LIVENESS_LOCK_NAMESPACE = 0x6F72  # "or": the first key of every worker's liveness lock
REREGISTER_GRACE_SECONDS = 10.0
"""After a PostgreSQL restart, how long workers registered before it have to register again
before a reaper judges them dead (every worker checks its liveness session each second)."""


@dataclass(frozen=True)
class ExpiredLease:
    run_id: str
    fence: int
    previous_owner: str


def liveness_namespace(schema: str) -> int:
    """The first key of the liveness locks of one schema's workers. Advisory locks belong to
    the database, not to a schema: two schemas in one database must not share key spaces."""
    if schema == DEFAULT_SCHEMA:
        return LIVENESS_LOCK_NAMESPACE
    return 0x10000 + zlib.crc32(schema.encode()) % 0x7FFE0000


class WorkerRegistry:
    """Worker liveness for dead-session takeover (see sql/migrations/0002_workers.sql)."""

    def __init__(self, schema: str = DEFAULT_SCHEMA) -> None:
        self.namespace = liveness_namespace(schema)

    async def list_workers(self, db: Executor) -> list[WorkerInfo]:
        """Registered workers, alive or dead, with the runs each holds."""
        return [
            WorkerInfo.from_record(r) for r in await db.fetch(query("list_workers"), self.namespace)
        ]

    async def register(
        self,
        connection: asyncpg.Connection,
        *,
        worker_id: str,
        host: str,
        pid: int,
        agents: Sequence[str],
    ) -> int:
        """Take a liveness lock on ``connection`` and record the worker; returns its key.

        The lock is taken before the row is written, so a registered worker is never judged
        dead for want of a lock it has not yet taken. ``connection`` must stay open, and do
        nothing else, for as long as the worker lives.
        """
        key = int(await connection.fetchval(query("next_session_key")))
        locked = await connection.fetchval(query("hold_session_lock"), self.namespace, key)
        if not locked:
            raise RuntimeError(f"liveness lock {key} is held by another session")
        await connection.execute(query("register_worker"), worker_id, key, host, pid, list(agents))
        return key

    async def served_agents(self, db: Executor) -> list[str]:
        return [record["agent"] for record in await db.fetch(query("served_agents"))]

    async def unregister(self, db: Executor, worker_id: str) -> None:
        await db.execute(query("unregister_worker"), worker_id)

    async def expire_dead_owners(
        self, db: Executor, *, reregister_grace_seconds: float = REREGISTER_GRACE_SECONDS
    ) -> list[ExpiredLease]:
        """End the leases of workers whose session is gone, so their runs are claimable now."""
        records = await db.fetch(
            query("expire_dead_owners"), self.namespace, reregister_grace_seconds
        )
        return [ExpiredLease(r["run_id"], r["fence"], r["lease_owner"]) for r in records]

    async def expire_unheld_leases(
        self, db: Executor, worker_id: str, held: Sequence[str]
    ) -> list[ExpiredLease]:
        """End ``worker_id``'s leases on runs it does not hold (``held``: those it does)."""
        records = await db.fetch(query("expire_unheld_leases"), worker_id, list(held))
        return [ExpiredLease(r["run_id"], r["fence"], worker_id) for r in records]
