"""The client's feature handles for synchronous code: each method runs its async twin on the
event loop of ``SyncClient``'s own thread and blocks until it returns."""

from __future__ import annotations

import builtins
import contextlib
import functools
from collections.abc import AsyncGenerator, Awaitable, Callable, Generator
from typing import Any, Concatenate, Generic, ParamSpec, Self, TypeVar, overload

from anyio.from_thread import BlockingPortal

from orchestrator.client.features import (
    ApprovalsHandle,
    BudgetsHandle,
    EffectsHandle,
    LimitsHandle,
    OpsHandle,
    SignalsHandle,
)
from orchestrator.client.runs import RunsHandle
from orchestrator.client.schedules import SchedulesHandle
from orchestrator.db.output import OutputEvent
from orchestrator.effect_model import EffectRecord

H = TypeVar("H")
P = ParamSpec("P")
T = TypeVar("T")


class SyncHandle(Generic[H]):
    """An async handle and the portal to the loop it runs on."""

    def __init__(self, handle: H, portal: BlockingPortal) -> None:
        self._handle = handle
        self._portal = portal


# Lower-case: it stands where a method is defined, as ``property`` does.
class blocking(Generic[H, P, T]):
    """``get = blocking(RunsHandle.get)``: ``sync_runs.get(...)`` blocks on ``runs.get(...)``."""

    def __init__(self, method: Callable[Concatenate[H, P], Awaitable[T]]) -> None:
        self._method = method
        self.__doc__ = method.__doc__

    @overload
    def __get__(self, instance: None, owner: type[Any]) -> Self: ...

    @overload
    def __get__(
        self, instance: SyncHandle[H], owner: type[Any] | None = None
    ) -> Callable[P, T]: ...

    def __get__(
        self, instance: SyncHandle[H] | None, owner: type[Any] | None = None
    ) -> Self | Callable[P, T]:
        if instance is None:
            return self

        def call(*args: P.args, **kwargs: P.kwargs) -> T:
            return self(instance, *args, **kwargs)

        call.__doc__ = self.__doc__
        return call

    def __call__(self, instance: SyncHandle[H], *args: P.args, **kwargs: P.kwargs) -> T:
        """Run the async method on ``instance``'s loop and block until it returns."""
        method, handle = self._method, instance._handle
        return instance._portal.call(functools.partial(method, handle, *args, **kwargs))


class SyncRuns(SyncHandle[RunsHandle]):
    submit = blocking(RunsHandle.submit)
    get = blocking(RunsHandle.get)
    list = blocking(RunsHandle.list)
    wait = blocking(RunsHandle.wait)
    cancel = blocking(RunsHandle.cancel)
    detail = blocking(RunsHandle.detail)

    def stream(
        self, run_id: str, *, after: int = 0, until_end: bool = True
    ) -> Generator[OutputEvent, None, None]:
        """``client.runs.stream`` for synchronous code: the run's live output after position
        ``after``, each event once, in order, as it is published (docs/streaming.md)::

            for event in client.runs.stream(run_id, after=last_seen):
                last_seen = event.seq

        Each ``next`` blocks until the next event (with ``until_end``, the iteration ends once
        the run has ended and all it published has been read). Leaving the loop early, or
        closing the iterator, ends the stream on the client's loop."""
        events = self._handle.stream(run_id, after=after, until_end=until_end)

        async def following() -> OutputEvent | None:
            return await anext(events, None)

        try:
            event = self._portal.call(following)
            while event is not None:  # as long as the stream: it ends, or the caller stops
                yield event
                event = self._portal.call(following)
        finally:
            if isinstance(events, AsyncGenerator):
                with contextlib.suppress(RuntimeError):  # the client was closed meanwhile
                    self._portal.call(events.aclose)


class SyncEffects(SyncHandle[EffectsHandle]):
    list = blocking(EffectsHandle.list)
    get = blocking(EffectsHandle.get)
    resolve = blocking(EffectsHandle.resolve)


class SyncApprovals(SyncHandle[ApprovalsHandle]):
    """Calling the handle lists what awaits approval, as ``SyncClient.approvals(...)`` did."""

    list = blocking(ApprovalsHandle.list)
    approve = blocking(ApprovalsHandle.approve)
    deny = blocking(ApprovalsHandle.deny)

    def __call__(
        self, *, run_id: str | None = None, limit: int = 100
    ) -> builtins.list[EffectRecord]:
        return self.list(run_id=run_id, limit=limit)


class SyncSignals(SyncHandle[SignalsHandle]):
    send = blocking(SignalsHandle.send)
    list = blocking(SignalsHandle.list)


class SyncBudgets(SyncHandle[BudgetsHandle]):
    get = blocking(BudgetsHandle.get)
    ledger = blocking(BudgetsHandle.ledger)
    top_up = blocking(BudgetsHandle.top_up)


class SyncLimits(SyncHandle[LimitsHandle]):
    list = blocking(LimitsHandle.list)
    set = blocking(LimitsHandle.set)
    clear = blocking(LimitsHandle.clear)
    rates = blocking(LimitsHandle.rates)
    set_rate = blocking(LimitsHandle.set_rate)
    clear_rate = blocking(LimitsHandle.clear_rate)


class SyncSchedules(SyncHandle[SchedulesHandle]):
    create = blocking(SchedulesHandle.create)
    list = blocking(SchedulesHandle.list)
    get = blocking(SchedulesHandle.get)
    slots = blocking(SchedulesHandle.slots)
    pause = blocking(SchedulesHandle.pause)
    resume = blocking(SchedulesHandle.resume)
    delete = blocking(SchedulesHandle.delete)
    backfill = blocking(SchedulesHandle.backfill)


class SyncOps(SyncHandle[OpsHandle]):
    queue_stats = blocking(OpsHandle.queue_stats)
    workers = blocking(OpsHandle.workers)
    purgeable = blocking(OpsHandle.purgeable)
    purge = blocking(OpsHandle.purge)
