"""Group settling: the dispatcher records many vendor outcomes in one statement.

Each send hands its outcome over and waits for its own answer. While one batch is written the
next gathers, and it is written as soon as the first is done: a quiet dispatcher adds no delay,
a busy one writes one statement per batch instead of one per effect. Every effect's own
conditions (still dispatching, still held by this dispatcher) are checked row by row in the
batched statement, so batching never lets a lost claim's outcome through.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import asyncpg

from orchestrator.db.deadlines import DATABASE_ERRORS, pooled
from orchestrator.effects.store import EffectStore, SettleRequest

MAX_BATCH = 200


@dataclass(eq=False, slots=True)
class _Pending:
    request: SettleRequest
    answer: asyncio.Future[bool | None]
    """Whether the batch recorded the outcome (None: not by the batch, see ``_alone``): a bare
    future, one per send (an anyio Event is dearer)."""

    def tell(self, recorded: bool | None) -> None:
        if not self.answer.done():
            self.answer.set_result(recorded)

    def fail(self, error: BaseException) -> None:
        if not self.answer.done():
            self.answer.set_exception(error)


class GroupSettler:
    """Writes the outcomes of one dispatcher's sends, many per statement.

    No task of its own: the first caller to find nobody writing writes every batch waiting
    (its own included), so it also works for a dispatcher driven without its run loop.
    """

    def __init__(
        self, pool: asyncpg.Pool, store: EffectStore, dispatcher_id: str, statement_seconds: float
    ) -> None:
        self.pool = pool
        self.store = store
        self.dispatcher_id = dispatcher_id
        self.statement_seconds = statement_seconds
        self._waiting: list[_Pending] = []
        self._writing = False

    async def settle(self, request: SettleRequest) -> bool:
        """Record ``request``; False if this dispatcher no longer held the effect (nothing was
        recorded). Database errors are raised: the outcome may or may not be recorded."""
        pending = _Pending(request, asyncio.get_running_loop().create_future())
        self._waiting.append(pending)
        if not self._writing:
            self._writing = True
            try:
                while self._waiting:
                    batch = self._waiting[:MAX_BATCH]
                    del self._waiting[:MAX_BATCH]
                    await self._write(batch)
            except BaseException as error:  # cancelled while writing: nobody writes the rest
                for left in self._waiting:
                    left.fail(error if isinstance(error, Exception) else _Abandoned())
                self._waiting.clear()
                raise
            finally:
                self._writing = False
        recorded = await pending.answer
        return await self._alone(request) if recorded is None else recorded

    async def _write(self, batch: list[_Pending]) -> None:
        try:
            async with pooled(self.pool, within=self.statement_seconds) as db:
                settled = await self.store.settle_many(
                    db, self.dispatcher_id, [p.request for p in batch]
                )
        except DATABASE_ERRORS as error:
            for pending in batch:
                pending.fail(error)
            return
        except BaseException as error:
            for pending in batch:
                pending.fail(error if isinstance(error, Exception) else _Abandoned())
            raise
        for pending in batch:
            effect = pending.request.effect
            pending.tell(True if (effect.run_id, effect.effect_key) in settled else None)

    async def _alone(self, request: SettleRequest) -> bool:
        """Not settled by its batch: its run's row was held elsewhere (or is gone), or this
        dispatcher lost the effect. Alone, in its sender's task, the statement may wait for the
        row without holding up anyone else's batch."""
        async with pooled(self.pool, within=self.statement_seconds) as db:
            return await self.store.settle(
                db,
                request.effect,
                self.dispatcher_id,
                request.status,
                external_id=request.external_id,
                result=request.result,
                error=request.error,
                retry_after=request.retry_after,
            )


class _Abandoned(ConnectionError):
    """The writer was cancelled before this outcome was written: it may not be recorded."""
