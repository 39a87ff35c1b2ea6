"""The worker's per-run tasks: a task group's structured end, without a task group's cost.

A worker starts one task per run, thousands per second, and anyio's ``TaskGroup.start_soon``
costs several times ``loop.create_task`` (docs/performance.md). ``RunTasks`` keeps the
guarantee that matters from the task group: it lives as a task *in* the worker's group, and
when that group ends, for whatever reason, every run task still going is cancelled and awaited
before the group exits, so no run outlives its worker. A run task must not raise:
``ActiveRuns._execute`` catches and logs everything below ``BaseException``, and calls ``done``
as it ends.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Coroutine
from typing import Any

import anyio

if sys.version_info >= (3, 12):
    # Eager start: the run's task runs its first step at once, inside start(), as a task of its
    # own (asyncio.current_task() is the run's task there, so anyio works as usual). A step
    # that does not suspend (a short agent step) reaches its commit without a turn of the event
    # loop.
    _start_task = asyncio.eager_task_factory
else:

    def _start_task(
        loop: asyncio.AbstractEventLoop, coroutine: Coroutine[Any, Any, None]
    ) -> asyncio.Task[None]:
        return loop.create_task(coroutine)


STOP_SECONDS = 10.0
"""How long the end of the group waits for cancelled run tasks (their cleanup is bounded)."""


class RunTasks:
    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[None]] = set()
        self._closed = False

    def __len__(self) -> int:
        return len(self._tasks)

    @property
    def closed(self) -> bool:
        """The group has ended: no run task can start any more."""
        return self._closed

    def start(self, coroutine: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        """Start a run's task; the coroutine calls ``done`` with it when it ends.

        No wrapper coroutine and no done callback: each would cost a frame on every resume or
        an event-loop turn per run. On Python 3.12+ the task has already run up to its first
        suspension when it is returned (the run's execution finds its task itself then), and may
        even have ended; before 3.12 it is returned before it first runs. Either way its owner
        hands it to the run's execution, which cancels it when ownership is lost.
        """
        if self._closed:
            coroutine.close()
            raise RuntimeError("the worker's run tasks are closed: no run can start now")
        task = _start_task(asyncio.get_running_loop(), coroutine)
        if not task.done():  # an eager start may have run it to its end already
            self._tasks.add(task)
        return task

    def done(self, task: asyncio.Task[None]) -> None:
        """The run's task is ending: it no longer needs ending with the group."""
        self._tasks.discard(task)

    async def host(self) -> None:
        """Run in the worker's task group until it ends; then end every run task."""
        try:
            await anyio.sleep_forever()
        finally:
            self._closed = True
            with anyio.CancelScope(shield=True):
                # A run started just before the end (by a claim loop finishing its claims under
                # the same cancellation) may not have taken its first step yet; cancelled then,
                # its body and cleanup would never run. One turn of the loop starts it.
                await asyncio.sleep(0)
                tasks = list(self._tasks)
                for task in tasks:
                    task.cancel()
                if tasks:
                    await asyncio.wait(tasks, timeout=STOP_SECONDS)
