"""Group commit: many runs' fenced commits in one transaction.

Run scopes hand their step commits and final commits to one ``GroupCommitter`` per worker and
wait for their own answer. While a batch is being written, the next accumulates; it is
written as soon as a writer is free (no added delay when the worker is quiet; ``WRITERS``
batches may be in flight at once). Each run's ownership conditions are checked row by row in
the batched statements, so batching never lets a stale run's write through, and a refused run
does not affect the others.

A step commit is awaited (the run goes on with the next step). A final commit is not: its
answer is handed to a callback as soon as the batch's transaction has ended, and the run's task
has long ended by then (see ``RunScope.execute``). Waking a task to read the answer, and
resuming it through its frames only to return, cost about 8% of the worker's CPU per run
(benchmarks/README.md, throughput.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import anyio
import structlog

from orchestrator.deadlines import DATABASE_ERRORS, pooled
from orchestrator.effects.store import EffectStore
from orchestrator.models import CommitResult
from orchestrator.store import RunFinish, RunStore, StepCommit

log = structlog.get_logger("orchestrator.group_commit")

MAX_BATCH = 500
WRITERS = 2
"""Batches written at once, each in its own transaction on its own connection. With one, the
worker idled while PostgreSQL wrote a batch and PostgreSQL idled while the worker ran the next
steps; two keep both busy (about +20% runs/s at saturation, benchmarks/README.md). A run has at
most one commit in flight, so two batches never hold the same run."""


class EffectRefused(Exception):
    """The boundary refused an effect of a commit: the whole batch is rolled back."""


_UNKNOWN_OUTCOME: tuple[type[BaseException], ...] = (*DATABASE_ERRORS, EffectRefused)


class CommitOutcomeUnknown(Exception):
    """The batch's transaction failed or timed out: it may or may not have committed."""


FinishAnswer = Callable[[bool | CommitOutcomeUnknown], None]
"""Receives a final commit's answer: whether the run was finished (``False``: not the owner
any more), or the batch's failure (the outcome is unknown)."""


@dataclass(eq=False, slots=True)
class _Pending:
    request: StepCommit | RunFinish
    done: asyncio.Future[Any] | None
    """A step commit's answer: a bare future, not an anyio Event (one per commit, and an Event
    costs 8x as much)."""
    answer: FinishAnswer | None = None
    """A final commit's answer goes to this callback instead."""

    def settle(self, outcome: Any) -> None:
        """Hand over the answer (a result, or a ``CommitOutcomeUnknown``)."""
        if self.answer is not None:
            try:
                self.answer(outcome)
            except Exception as error:  # one run's bookkeeping must not stall the batch
                log.exception(
                    "handling a final commit's answer failed",
                    run_id=self.request.lease.run_id,
                    error=repr(error),
                )
        elif self.done is not None and not self.done.done():  # done: its scope was cancelled
            if isinstance(outcome, CommitOutcomeUnknown):
                self.done.set_exception(outcome)
            else:
                self.done.set_result(outcome)


class GroupCommitter:
    def __init__(self, store: RunStore, worker_id: str, *, statement_seconds: float) -> None:
        self.store = store
        self.worker_id = worker_id
        self.statement_seconds = statement_seconds
        self.effects = EffectStore(store.pool)
        self._queue: list[_Pending] = []
        self._ready = anyio.Event()
        self.batches = 0

    def commit_step(self, commit: StepCommit) -> asyncio.Future[CommitResult | None]:
        """Await it: the commit's result, or ``None`` if the run's conditions no longer held."""
        return self._submit(commit)

    def finish(self, finish: RunFinish, answer: FinishAnswer) -> None:
        """Queue a final commit; ``answer`` is called once, from the writer, with its outcome.

        Called as the batch's transaction ends, so it must be quick and must not raise (an
        exception is logged, and the other runs of the batch get their answers regardless).
        """
        self._queue.append(_Pending(finish, None, answer))
        self._ready.set()

    def _submit(self, request: StepCommit) -> asyncio.Future[Any]:
        # The future itself is what the run awaits (no coroutine around it: one per commit,
        # thousands per second). If the run's scope is cancelled while waiting, the future is
        # cancelled with it; the batch still commits or refuses the request, and the
        # fenced-safe cleanup follows.
        done: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._queue.append(_Pending(request, done))
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

    async def _accept_effects(self, db: Any, request: StepCommit | RunFinish) -> None:
        for effect in request.effects:
            acceptance = await self.effects.accept(
                db, request.lease.run_id, request.lease.fence, effect, worker_id=self.worker_id
            )
            if acceptance.outcome in ("stale", "conflict"):
                # Cannot happen for the current owner inside its own commit, unless the same
                # key is reused with another kind or policy: a bug in the agent, made visible.
                raise EffectRefused(
                    f"effect {effect.key!r} of run {request.lease.run_id}: {acceptance.outcome}"
                )

    async def _write(self, batch: list[_Pending]) -> None:
        commits = [p.request for p in batch if isinstance(p.request, StepCommit)]
        finishes = [p.request for p in batch if isinstance(p.request, RunFinish)]
        committed: dict[str, CommitResult] = {}
        finished: set[str] = set()
        try:
            async with (
                pooled(self.store.pool, within=self.statement_seconds) as db,
                db.transaction(),
            ):
                if commits:
                    committed = await self.store.commit_steps(self.worker_id, commits, db=db)
                if finishes:
                    finished = await self.store.finish_many(self.worker_id, finishes, db=db)
                # Effect records commit with their step or not at all (invariant 3); only
                # runs whose own commit took effect get theirs recorded.
                requests: list[StepCommit | RunFinish] = [*commits, *finishes]
                for request in requests:
                    run_id = request.lease.run_id
                    if not request.effects:
                        continue
                    if run_id in committed or run_id in finished:
                        await self._accept_effects(db, request)
                    else:
                        # A stale owner asked for effects: say so in the timeline, send nothing.
                        await self.store.record_event(
                            run_id,
                            "stale_fence_rejected",
                            fence=request.lease.fence,
                            worker_id=self.worker_id,
                            details={
                                "effect_keys": [effect.key for effect in request.effects],
                                "reason": "the step's commit was refused: not the owner",
                            },
                            db=db,
                        )
        except _UNKNOWN_OUTCOME as error:
            reason = str(error) or type(error).__name__
            for pending in batch:
                pending.settle(CommitOutcomeUnknown(reason))
            return
        self.batches += 1
        for pending in batch:
            run_id = pending.request.lease.run_id
            if isinstance(pending.request, StepCommit):
                pending.settle(committed.get(run_id))
            else:
                pending.settle(run_id in finished)
