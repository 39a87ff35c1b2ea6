"""The supervisor's per-run tasks: a task group's structured end, at a sixth of its cost.

Starting a task with anyio's ``TaskGroup.start_soon`` costs about 40 µs on this project's
machine, ``loop.create_task`` about 6 µs, and a worker starts one task per run, thousands per
second (benchmarks/README.md, throughput.py). ``RunTasks`` keeps the guarantee that matters
from the task group: it lives as a task *in* the supervisor's group, and when that group ends,
for whatever reason, every run task still going is cancelled and awaited before the group
exits, so no run outlives its worker. A run task must not raise: ``Supervisor._execute``
catches and logs everything below ``BaseException``; anything else is logged here.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

import anyio
import structlog

log = structlog.get_logger("orchestrator.supervisor")

STOP_SECONDS = 10.0
"""How long the end of the group waits for cancelled run tasks (their cleanup is bounded)."""


class RunTasks:
    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[None]] = set()
        self._closed = False

    def __len__(self) -> int:
        return len(self._tasks)

    def start(self, coroutine: Coroutine[Any, Any, None]) -> None:
        if self._closed:
            coroutine.close()
            raise RuntimeError("the worker's run tasks are closed: no run can start now")
        self._tasks.add(asyncio.get_running_loop().create_task(self._run(coroutine)))

    async def _run(self, coroutine: Coroutine[Any, Any, None]) -> None:
        # A wrapper rather than a done callback: one event-loop turn less per run.
        try:
            await coroutine
        except Exception as error:
            log.error("run task failed", error=repr(error))
        finally:
            task = asyncio.current_task()
            if task is not None:
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
