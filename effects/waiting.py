"""Letting a step await the settled outcome of an effect its run requested earlier.

The dispatcher NOTIFYs ``orchestrator_effects`` with the run id whenever an effect of that run
settles; the worker's listener wakes the run's waiting step, which re-reads the record. Polling
backs NOTIFY up, so a missed notification costs latency, never correctness.
"""

from __future__ import annotations

import anyio

from orchestrator.effect_model import EffectRecord, EffectStatus
from orchestrator.effects.store import EffectStore


class EffectWaiters:
    """Per-run wake-up events, set by the worker's listener."""

    def __init__(self) -> None:
        self._events: dict[str, anyio.Event] = {}

    def event_for(self, run_id: str) -> anyio.Event:
        event = self._events.get(run_id)
        if event is None:
            event = self._events[run_id] = anyio.Event()
        return event

    def notify(self, run_id: str) -> None:
        event = self._events.pop(run_id, None)
        if event is not None:
            event.set()


class RunEffects:
    """``ctx.effects`` for one run."""

    __slots__ = ("poll_seconds", "run_id", "store", "waiters")

    def __init__(
        self, store: EffectStore, run_id: str, waiters: EffectWaiters, *, poll_seconds: float
    ) -> None:
        self.store = store
        self.run_id = run_id
        self.waiters = waiters
        self.poll_seconds = poll_seconds

    async def get(self, effect_key: str) -> EffectRecord:
        return await self.store.get(self.run_id, effect_key)

    async def wait(self, effect_key: str, *, within: float) -> EffectRecord:
        with anyio.fail_after(within):
            while True:
                woken = self.waiters.event_for(self.run_id)
                record = await self.store.get(self.run_id, effect_key)
                if record.status.settled or record.status is EffectStatus.PARKED:
                    return record
                with anyio.move_on_after(self.poll_seconds):
                    await woken.wait()
