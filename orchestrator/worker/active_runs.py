"""The runs a worker is executing: each started as a task of its own, counted as it ends, drained
at shutdown; the one place a run enters or leaves the worker's ``active`` map."""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

import anyio
from opentelemetry.trace import Status, StatusCode
from structlog.typing import FilteringBoundLogger

from orchestrator.telemetry import RUN_ID
from orchestrator.worker.execution import Disposition, RunExecution
from orchestrator.worker.run_tasks import RunTasks

DRAIN_STOP_SECONDS = 10.0
"""How long a drain waits, after the grace period, for runs told to stop at once."""


@dataclass
class Counters:
    claimed: int = 0
    finished: dict[str, int] = field(default_factory=dict)
    """Executions ended, by ``Disposition``."""
    taken_over: int = 0


class ActiveRuns:
    """The worker's ``RunHost``: starts each claimed run's task and settles its accounts."""

    def __init__(self, wake: Callable[[], None], log: FilteringBoundLogger) -> None:
        self.active: dict[str, RunExecution] = {}
        self.counters = Counters()
        self.run_tasks = RunTasks()
        self.stop_requested = False
        self._wake = wake
        """Wakes the claim loop: a run that ends frees a slot."""
        self._idle = anyio.Event()
        self._log = log

    def draining(self) -> bool:
        return self.stop_requested

    def add(self, execution: RunExecution) -> None:
        """A claimed run, active from its claim on (before its task starts)."""
        self.active[execution.claimed.run_id] = execution

    def start(self, executions: list[RunExecution]) -> None:
        for execution in executions:
            if self.run_tasks.closed:
                # The worker is ending: these runs never started. Their leases are dropped
                # from the keeper and expire (or are taken over at once when this process's
                # session ends), so another worker claims them.
                self.never_started(execution)
                continue
            execution.task = self.run_tasks.start(self._execute(execution, execution.execute()))
        if not self.active:
            self._idle.set()

    async def _execute(
        self, execution: RunExecution, body: Coroutine[Any, Any, Disposition | None]
    ) -> None:
        """The body of a run's task (see ``RunTasks``): the execution, then the accounts.

        ``body`` is ``execution.execute()``, or ``execution.clean_up()`` after a final commit
        that did not finish the run. A run whose final commit is with the group committer
        (``execute`` returned ``None``) stays active, with no task, until ``run_ended`` or
        ``run_needs_cleanup`` hears how it ended.
        """
        disposition: Disposition | None = None
        settling = False
        try:
            disposition = await body
            settling = disposition is None
        except Exception as error:  # a bug in the runtime must not take the worker down
            self._log.exception(
                "run execution crashed", **{RUN_ID: execution.claimed.run_id}, error=str(error)
            )
            disposition = Disposition.CRASHED
        finally:
            if execution.task is not None:
                self.run_tasks.done(execution.task)
            if not settling:  # also when the worker itself is being cancelled
                self._forget(execution)
        if disposition is not None:
            self._count(disposition)

    # -- RunHost: how executions whose final commit was with the committer end ---------------
    def run_ended(self, execution: RunExecution, disposition: Disposition) -> None:
        self._forget(execution)
        self._count(disposition)

    def run_needs_cleanup(self, execution: RunExecution) -> None:
        execution.task = None
        if self.run_tasks.closed:  # the worker is ending: no task can start any more
            self._forget(execution)
            self._count(Disposition.LOST)
            return
        task = self.run_tasks.start(self._execute(execution, execution.clean_up()))
        if execution.task is None:  # not set by an eager start that already ran it
            execution.task = task

    def never_started(self, execution: RunExecution) -> None:
        execution.services.keeper.untrack(execution.handle)
        span = execution.span
        if span.is_recording():
            span.set_status(Status(StatusCode.ERROR, "never started: the worker was stopping"))
            span.end()
        self._forget(execution)

    def _forget(self, execution: RunExecution) -> None:
        run_id = execution.claimed.run_id
        if self.active.get(run_id) is execution:
            del self.active[run_id]
        if not self.active:
            self._idle.set()
        self._wake()

    def _count(self, disposition: Disposition) -> None:
        self.counters.finished[disposition] = self.counters.finished.get(disposition, 0) + 1

    # -- shutdown -----------------------------------------------------------------------------
    async def drain(self, grace_seconds: float) -> None:
        """Let running steps finish within the grace period, then stop the rest at once."""
        if not self.active:
            return
        self._log.info("draining", active=len(self.active), grace_seconds=grace_seconds)
        with anyio.move_on_after(grace_seconds):
            await self._until_idle()
        for execution in list(self.active.values()):
            execution.stop_now()
        with anyio.move_on_after(DRAIN_STOP_SECONDS):
            await self._until_idle()

    async def _until_idle(self) -> None:
        while self.active:
            self._idle = anyio.Event()
            await self._idle.wait()
