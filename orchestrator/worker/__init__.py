"""The worker runtime: claiming, run executions, heartbeats, group commit (asyncio).

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
