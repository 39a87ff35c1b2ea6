"""The worker runtime (asyncio), the design card's shape:

- the supervisor task group is ``Worker.run``'s (``worker.py``), hosting every run's task;
- one scope per run is that run's task, ``RunExecution.execute`` (``execution.py``);
- its heartbeat is the run's ``LeaseHandle``, renewed in batches and cancelling the scope when
  the lease is lost (``heartbeat.py``);
- each step's checkpoint and effect records commit in one transaction (``group_commit.py``);
- every span, log and metric carries the run, fence and worker ids (``run_telemetry.py``).

Its public face is ``Worker``, ``WorkerConfig`` and ``default_worker_id`` (what ``serve`` and
``orchestrator.testing`` run); the modules behind it are internal and may change.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from orchestrator.lazy import lazy_exports

if TYPE_CHECKING:
    from orchestrator.worker.worker import Worker, WorkerConfig, default_worker_id

_EXPORTS = dict.fromkeys(
    ("Worker", "WorkerConfig", "default_worker_id"), "orchestrator.worker.worker"
)

if not TYPE_CHECKING:
    __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

__all__ = ["Worker", "WorkerConfig", "default_worker_id"]
