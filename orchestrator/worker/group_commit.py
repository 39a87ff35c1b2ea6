"""Group commit: many runs' fenced commits in one transaction.

Run executions hand their step commits and final commits to one ``GroupCommitter`` per worker
and wait for their own answer. While a batch is being written, the next accumulates; it is
written as soon as a writer is free (no added delay when the worker is quiet; ``WRITERS``
batches may be in flight at once). Each run's ownership conditions are checked row by row in
the batched statements, so batching never lets a stale run's write through, and a refused run
does not affect the others. A run whose effect the boundary refuses inside the batch's
transaction (its step commit took effect but its effect cannot: a key reused with another kind)
is left out: the transaction is rolled back and written again without it, and that run alone
is told why.

A step commit is awaited (the run goes on with the next step). A final commit is not: its
answer is handed to a callback as soon as the batch's transaction has ended, and the run's task
has long ended by then (see ``RunExecution.execute``): waking a task only to read the answer
and return would cost a resumption through its frames per run.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import anyio
import asyncpg
import structlog
from opentelemetry import context
from opentelemetry.context import Context

from orchestrator.db.budgets import BudgetStore, Spend
from orchestrator.db.deadlines import DATABASE_ERRORS, pooled
from orchestrator.db.signals import SignalStore
from orchestrator.db.store import Park, RunFinish, RunStore, StepCommit
from orchestrator.effect_model import AcceptOutcome
from orchestrator.effects.store import EffectStore
from orchestrator.models import CommitResult, Lease
from orchestrator.telemetry import (
    RUN_FENCE,
    RUN_ID,
    WORKER_ID,
    Metrics,
    start_span,
    tracing_enabled,
)

log = structlog.get_logger("orchestrator.group_commit")

MAX_BATCH = 500
WRITERS = 2
"""Batches written at once, each in its own transaction on its own connection. With one, the
worker idled while PostgreSQL wrote a batch and PostgreSQL idled while the worker ran the next
steps; two keep both busy. A run has at most one commit in flight, so two batches never hold
the same run."""


class CommitRefused(Exception):
    """Part of a commit of a run that still held its lease could not be written: a bug in the
    step, raised to it as the step's error. Nothing of that commit was written; the other runs
    of its batch are not affected."""


class EffectRefused(CommitRefused):
    """The boundary refused an effect of the commit (its key is already used with another kind
    or policy)."""


class TranscriptConflict(CommitRefused):
    """A message of the commit would take a transcript position already taken."""


class CommitOutcomeUnknown(Exception):
    """The batch's transaction failed or timed out: it may or may not have committed."""


_UNKNOWN_OUTCOME: tuple[type[BaseException], ...] = DATABASE_ERRORS


@dataclass(frozen=True, slots=True)
class Committed:
    """The commit took effect."""

    result: CommitResult | None = None
    """A step commit's new checkpoint version and pending signals (``None``: a final commit)."""


@dataclass(frozen=True, slots=True)
class NotOwner:
    """The run's conditions no longer held (its fence, owner or lease moved on): nothing was
    written."""


@dataclass(frozen=True, slots=True)
class Refused:
    """Part of the commit could not be written (see ``CommitRefused``): nothing was written."""

    error: CommitRefused


@dataclass(frozen=True, slots=True)
class Unknown:
    """The batch's transaction failed or timed out: it may or may not have committed."""

    error: CommitOutcomeUnknown


CommitAnswer = Committed | NotOwner | Refused | Unknown
"""What the committer answers every commit, step or final."""
FINISHED = Committed()
NOT_OWNER = NotOwner()


class _LeaveOut(Exception):
    """Rolls the batch's transaction back: these runs must be written without (their answers)."""

    def __init__(self, answers: dict[str, CommitAnswer]) -> None:
        super().__init__(f"{len(answers)} runs left out")
        self.answers = answers


FinishAnswer = Callable[[CommitAnswer], object]
"""Receives a final commit's answer."""


@dataclass(eq=False, slots=True)
class _Pending:
    request: StepCommit | RunFinish
    done: asyncio.Future[CommitAnswer] | None
    """A step commit's answer: a bare future (one per commit; an anyio Event is much dearer)."""
    answer: FinishAnswer | None = None
    """A final commit's answer goes to this callback instead."""
    context: Context | None = None
    """While tracing, the requesting step's trace context, for a refusal of its effects."""

    def settle(self, outcome: CommitAnswer) -> None:
        """Hand over the answer."""
        if self.answer is not None:
            try:
                self.answer(outcome)
            except Exception as error:  # one run's bookkeeping must not stall the batch
                log.exception(
                    "handling a final commit's answer failed",
                    run_id=self.request.lease.run_id,
                    error=repr(error),
                )
        elif self.done is not None and not self.done.done():  # done: its run was cancelled
            self.done.set_result(outcome)


class GroupCommitter:
    def __init__(
        self,
        store: RunStore,
        worker_id: str,
        *,
        statement_seconds: float,
        metrics: Metrics | None = None,
    ) -> None:
        self.metrics = metrics or Metrics()
        self.store = store
        self.worker_id = worker_id
        self.statement_seconds = statement_seconds
        self.effects = EffectStore(store.pool)
        self._queue: list[_Pending] = []
        self._ready = anyio.Event()
        self.batches = 0

    def commit_step(self, commit: StepCommit) -> asyncio.Future[CommitAnswer]:
        """Await it: the commit's answer."""
        return self._submit(commit)

    def finish(self, finish: RunFinish, answer: FinishAnswer) -> None:
        """Queue a final commit; ``answer`` is called once, from the writer, with its outcome.

        Called as the batch's transaction ends, so it must be quick and must not raise (an
        exception is logged, and the other runs of the batch get their answers regardless).
        """
        self._queue.append(_Pending(finish, None, answer, _step_context(finish)))
        self._ready.set()

    def _submit(self, request: StepCommit) -> asyncio.Future[CommitAnswer]:
        # The future itself is what the run awaits (no coroutine around it: one per commit,
        # thousands per second). If the run's steps are cancelled while waiting, the future is
        # cancelled with it; the batch still commits or refuses the request, and the
        # fenced-safe cleanup follows.
        done: asyncio.Future[CommitAnswer] = asyncio.get_running_loop().create_future()
        self._queue.append(_Pending(request, done, context=_step_context(request)))
        self._ready.set()
        return done

    async def run(self) -> None:
        """Write batches for as long as the worker runs."""
        async with anyio.create_task_group() as group:
            for _ in range(WRITERS):
                group.start_soon(self._writer)

    async def _writer(self) -> None:
        while True:
            if not self._queue:
                if self._ready.is_set():
                    self._ready = anyio.Event()
                await self._ready.wait()
                continue
            batch, self._queue = self._queue[:MAX_BATCH], self._queue[MAX_BATCH:]
            await self._write(batch)

    async def _write(self, batch: list[_Pending]) -> None:
        left_out: dict[str, CommitAnswer] = {}
        """Runs written without, and their answers: each rewrite leaves at least one more out."""
        committed: dict[str, CommitResult] = {}
        finished: set[str] = set()
        for _ in range(len(batch) + 1):
            try:
                committed, finished = await self._transaction(batch, left_out)
            except _LeaveOut as leave:
                left_out.update(leave.answers)
                continue
            except _UNKNOWN_OUTCOME as error:
                unknown = Unknown(CommitOutcomeUnknown(str(error) or type(error).__name__))
                for pending in batch:
                    pending.settle(left_out.get(pending.request.lease.run_id, unknown))
                return
            break
        self.batches += 1
        for pending in batch:
            run_id = pending.request.lease.run_id
            if run_id in left_out:
                pending.settle(left_out[run_id])
            elif isinstance(pending.request, StepCommit):
                result = committed.get(run_id)
                pending.settle(NOT_OWNER if result is None else Committed(result))
            else:
                pending.settle(FINISHED if run_id in finished else NOT_OWNER)

    async def _transaction(
        self, batch: list[_Pending], left_out: dict[str, CommitAnswer]
    ) -> tuple[dict[str, CommitResult], set[str]]:
        """One transaction for the batch without ``left_out``; raises ``_LeaveOut`` (and is
        rolled back) if a run's effects cannot commit with it."""
        requests = [p.request for p in batch]
        members = [r for r in requests if r.lease.run_id not in left_out]
        commits = [r for r in members if isinstance(r, StepCommit)]
        finishes = [r for r in members if isinstance(r, RunFinish)]
        if finishes and not commits and not any(map(_writes_more, finishes)):
            # One statement is its own transaction: no BEGIN and COMMIT round trips, each of
            # which waits for a busy worker's loop to send the next command.
            async with pooled(self.store.pool, within=self.statement_seconds) as db:
                return {}, await self.store.finish_many(self.worker_id, finishes, db=db)
        committed: dict[str, CommitResult] = {}
        finished: set[str] = set()
        leave_out: dict[str, CommitAnswer] = {}
        async with pooled(self.store.pool, within=self.statement_seconds) as db, db.transaction():
            if commits:
                committed = await self.store.commit_steps(self.worker_id, commits, db=db)
            # Effect records commit with their step or not at all (invariant 3). A final
            # commit's effects are accepted first: the boundary takes effects only from a
            # running run, and the finish ends it.
            for finish in finishes:
                if finish.effects:
                    refusal = await self._accept_effects(db, finish)
                    if refusal is not None:
                        leave_out[finish.lease.run_id] = refusal
            if finishes:
                finished = await self.store.finish_many(self.worker_id, finishes, db=db)
            for finish in finishes:
                run_id = finish.lease.run_id
                if finish.effects and run_id not in finished and run_id not in leave_out:
                    leave_out[run_id] = NOT_OWNER  # its effects were accepted, its finish not
            for commit in commits:
                if commit.effects and commit.lease.run_id in committed:
                    refusal = await self._accept_effects(db, commit)
                    if refusal is not None:
                        leave_out[commit.lease.run_id] = refusal
            # Children start with their parent's step or not at all, under its fence.
            for commit in commits:
                run_id = commit.lease.run_id
                if commit.children and run_id in committed and run_id not in leave_out:
                    refusal = await self._spawn(db, commit)
                    if refusal is not None:
                        leave_out[run_id] = refusal
            transcripts = {
                r.lease.run_id: r.messages
                for r in members
                if r.messages
                and (r.lease.run_id in committed or r.lease.run_id in finished)
                and r.lease.run_id not in leave_out
            }
            for run_id in await self.store.append_messages(transcripts, db=db):
                leave_out[run_id] = Refused(
                    TranscriptConflict(
                        f"run {run_id}: a message would take a transcript position already taken"
                    )
                )
            if leave_out:
                raise _LeaveOut(leave_out)
            await self._after_commit(db, members, committed, finished)
            committed = await self._release_drained(db, committed)
            kept = [c for c in commits if c.keep_checkpoint and c.lease.run_id in committed]
            if kept:  # last: a fork from one of them carries the effects requested up to it
                await self.store.keep_checkpoints(kept, committed, db=db)
            # A stale owner asked for effects: say so in the timeline, send nothing.
            for pending in batch:
                request = pending.request
                if not request.effects:
                    continue
                run_id = request.lease.run_id
                not_owner = (
                    isinstance(left_out[run_id], NotOwner)
                    if run_id in left_out
                    else run_id not in committed and run_id not in finished
                )
                if not_owner:
                    await self._refuse_effects(db, pending)
        return committed, finished

    async def _refuse_effects(self, db: Any, pending: _Pending) -> None:
        """A stale owner's step asked for effects: the timeline and, while tracing, a span in
        the step's trace say so with both fences; nothing is sent."""
        request = pending.request
        run_id = request.lease.run_id
        keys = [effect.key for effect in request.effects]
        accepted_fence = await self.store.fence_of(run_id, db=db)
        self.metrics.stale_rejections.add(len(keys))
        await self.store.record_event(
            run_id,
            "stale_fence_rejected",
            fence=request.lease.fence,
            worker_id=self.worker_id,
            details={
                "effect_keys": keys,
                "reason": "the step's commit was refused: not the owner",
                "accepted_fence": accepted_fence,
            },
            db=db,
        )
        if pending.context is not None:
            attributes = {
                RUN_ID: run_id,
                RUN_FENCE: request.lease.fence,
                WORKER_ID: self.worker_id,
                "orchestrator.effect.keys": keys,
                "orchestrator.effect.accepted_fence": -1
                if accepted_fence is None
                else accepted_fence,
            }
            with start_span("stale_fence_rejected", attributes=attributes, context=pending.context):
                pass

    async def _after_commit(
        self,
        db: Any,
        members: list[StepCommit | RunFinish],
        committed: dict[str, CommitResult],
        finished: set[str],
    ) -> None:
        """What else the committed runs' steps asked for, in the same transaction: consume the
        signals they were given, settle their budgets, park the runs that wait."""
        consumed: list[tuple[Lease, Sequence[int]]] = []
        spends: list[tuple[str, Spend]] = []
        parks: list[tuple[Lease, Park]] = []
        for request in members:
            seqs, spend = request.signal_seqs, request.spend
            park = request.park if isinstance(request, StepCommit) else None
            if not seqs and spend is None and park is None:
                continue  # most commits: one check each
            run_id = request.lease.run_id
            if run_id not in committed and run_id not in finished:
                continue
            if seqs:
                consumed.append((request.lease, seqs))
            if spend is not None:
                spends.append((run_id, spend))
            if park is not None:
                parks.append((request.lease, park))
        if consumed:
            await SignalStore(db).consume(consumed)
        if spends:
            await BudgetStore(db).settle(spends)
        if parks:
            parked = await self.store.park_many(self.worker_id, parks, db=db)
            if len(parked) != len(parks):  # the commit just took effect: only a bug gets here
                raise _LeaveOut(
                    {
                        lease.run_id: Refused(
                            CommitRefused(f"run {lease.run_id} could not be parked")
                        )
                        for lease, _ in parks
                        if lease.run_id not in parked
                    }
                )

    async def _spawn(self, db: Any, commit: StepCommit) -> CommitAnswer | None:
        """Start ``commit``'s children: ``None``, or the answer its run gets instead."""
        try:
            async with db.transaction():  # a savepoint: a refused spawn leaves the batch whole
                spawned = await self.store.spawn_children(
                    commit.lease, commit.children, db=db, budget_limits=commit.budget_limits
                )
        except asyncpg.InvalidParameterValueError as error:
            return Refused(CommitRefused(f"run {commit.lease.run_id}: {error}"))
        return NOT_OWNER if spawned is None else None

    async def _release_drained(
        self, db: Any, committed: dict[str, CommitResult]
    ) -> dict[str, CommitResult]:
        """A drained cutover let these steps finish: give their runs back (those a park has
        not already let go); their results say which were given back."""
        drained = [run_id for run_id, result in committed.items() if result.drained]
        if not drained:
            return committed
        released = await self.store.release_drained(self.worker_id, drained, db=db)
        return {
            run_id: dataclasses.replace(result, drained=run_id in released)
            if result.drained
            else result
            for run_id, result in committed.items()
        }

    async def _accept_effects(
        self, db: Any, request: StepCommit | RunFinish
    ) -> CommitAnswer | None:
        """Record ``request``'s effects: ``None``, or the answer its run gets instead."""
        for effect in request.effects:
            acceptance = await self.effects.accept(
                db, request.lease.run_id, request.lease.fence, effect, worker_id=self.worker_id
            )
            if acceptance.outcome is AcceptOutcome.CONFLICT:
                return Refused(EffectRefused(acceptance.explain(request.lease.run_id, effect.key)))
            if acceptance.outcome.refused:  # not the running run's owner any more
                return NOT_OWNER
        return None


def _step_context(request: StepCommit | RunFinish) -> Context | None:
    """The requesting step's trace context, kept only while tracing and for commits with
    effects (the only ones a refusal span is about)."""
    if not request.effects or not tracing_enabled():
        return None
    return context.get_current()


def _writes_more(finish: RunFinish) -> bool:
    """Whether the final commit writes more than its run's row and event (effects, messages,
    signals consumed, a budget settled), which must share its transaction."""
    return bool(finish.effects or finish.messages or finish.signal_seqs) or finish.spend is not None
