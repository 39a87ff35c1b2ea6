"""The database side: connections, the run store, queries, migrations, the embedded server.

Its public face is below (``from orchestrator.db import RunStore, open_store``); the modules
behind it are internal and may change. Only the stores issue statements (``query``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from orchestrator.lazy import lazy_exports

if TYPE_CHECKING:
    from orchestrator.db.bootstrap import ensure_schema, open_pool, open_store
    from orchestrator.db.connections import connect, create_pool, redact_dsn, resolve_dsn
    from orchestrator.db.deadlines import DATABASE_ERRORS
    from orchestrator.db.embedded import EmbeddedPostgres
    from orchestrator.db.executor import Executor
    from orchestrator.db.migrations import check_schema, latest_version, migrate
    from orchestrator.db.store import RunStore
    from orchestrator.db.workers import WorkerRegistry

_EXPORTS = {
    "DATABASE_ERRORS": "orchestrator.db.deadlines",
    "EmbeddedPostgres": "orchestrator.db.embedded",
    "Executor": "orchestrator.db.executor",
    "RunStore": "orchestrator.db.store",
    "WorkerRegistry": "orchestrator.db.workers",
    "check_schema": "orchestrator.db.migrations",
    "connect": "orchestrator.db.connections",
    "create_pool": "orchestrator.db.connections",
    "ensure_schema": "orchestrator.db.bootstrap",
    "latest_version": "orchestrator.db.migrations",
    "migrate": "orchestrator.db.migrations",
    "open_store": "orchestrator.db.bootstrap",
    "open_pool": "orchestrator.db.bootstrap",
    "redact_dsn": "orchestrator.db.connections",
    "resolve_dsn": "orchestrator.db.connections",
}

if not TYPE_CHECKING:
    __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

__all__ = [
    "DATABASE_ERRORS",
    "EmbeddedPostgres",
    "Executor",
    "RunStore",
    "WorkerRegistry",
    "check_schema",
    "connect",
    "create_pool",
    "ensure_schema",
    "latest_version",
    "migrate",
    "open_pool",
    "open_store",
    "redact_dsn",
    "resolve_dsn",
]
