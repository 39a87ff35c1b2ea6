"""The supervisor's per-run tasks: a task group's structured end, at a sixth of its cost.

Starting a task with anyio's ``TaskGroup.start_soon`` costs about 40 µs on this project's
machine, ``loop.create_task`` about 6 µs, and a worker starts one task per run, thousands per
second (benchmarks/README.md, throughput.py). ``RunTasks`` keeps the guarantee that matters
from the task group: it lives as a task *in* the supervisor's group, and when that group ends,
for whatever reason, every run task still going is cancelled and awaited before the group
exits, so no run outlives its worker. A run task must not raise: ``Supervisor._execute``
catches and logs everything below ``BaseException``, and calls ``done`` as it ends.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

import anyio

STOP_SECONDS = 10.0
"""How long the end of the group waits for cancelled run tasks (their cleanup is bounded)."""


class RunTasks:
    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[None]] = set()
        self._closed = False

    def __len__(self) -> int:
        return len(self._tasks)

    def start(self, coroutine: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        """Start a run's task; the coroutine calls ``done`` with it when it ends.

        No wrapper coroutine and no done callback: each would cost a frame on every resume or
        an event-loop turn per run. The task is returned before it first runs, so its owner
        can hand it to the run's scope (which cancels it when ownership is lost).
        """
        if self._closed:
            coroutine.close()
            raise RuntimeError("the worker's run tasks are closed: no run can start now")
        task = asyncio.get_running_loop().create_task(coroutine)
        self._tasks.add(task)
        return task

    def done(self, task: asyncio.Task[None]) -> None:
        """The run's task is ending: it no longer needs ending with the group."""
        self._tasks.discard(task)

    async def host(self) -> None:
        """Run in the supervisor's task group until it ends; then end every run task."""
        try:
            await anyio.sleep_forever()
        finally:
            self._closed = True
            with anyio.CancelScope(shield=True):
                tasks = list(self._tasks)
                for task in tasks:
                    task.cancel()
                if tasks:
                    await asyncio.wait(tasks, timeout=STOP_SECONDS)
