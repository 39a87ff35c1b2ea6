"""Open ready-to-use stores: connect, check the schema version, migrate where that is safe."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TypedDict, Unpack

import asyncpg

from orchestrator.db.connections import connect, create_pool, resolve_dsn
from orchestrator.db.migrations import check_schema, latest_version, migrate
from orchestrator.db.store import RunStore
from orchestrator.errors import OrchestratorError
from orchestrator.settings import Settings


class SchemaBehind(OrchestratorError):
    """The database has not been migrated to this release's schema."""


async def ensure_schema(settings: Settings, dsn: str, *, auto_migrate: bool) -> int:
    """Check (and, if allowed, bring up to date) the schema; return its version.

    The embedded default is migrated automatically so that the very first command works on a
    fresh machine. A database named by ORCHESTRATOR_DATABASE_URL is migrated only by
    ``orchestrator db migrate`` or ``serve``: changing a shared production schema should be a
    deliberate act, not a side effect of ``runs list``.
    """
    connection = await connect(settings, dsn=dsn, application_name="orchestrator-schema")
    try:
        version = await check_schema(connection)
        if version < latest_version():
            if not auto_migrate:
                raise SchemaBehind(
                    f"the database schema is at version {version}, this orchestrator needs "
                    f"{latest_version()}: run `orchestrator db migrate`"
                )
            await migrate(connection)
            version = latest_version()
        return version
    finally:
        await connection.close()


class PoolOptions(TypedDict, total=False):
    """How ``open_pool`` sizes and names its pool (``open_store`` and ``open_stores`` pass them
    on)."""

    application_name: str
    max_size: int
    keep_session_state: bool


@asynccontextmanager
async def open_pool(
    settings: Settings,
    *,
    application_name: str = "orchestrator-cli",
    max_size: int = 4,
    keep_session_state: bool = False,
) -> AsyncIterator[asyncpg.Pool]:
    """One new pool (the schema checked, or migrated where that is safe), closed after.
    ``keep_session_state``: see ``create_pool``."""
    dsn = resolve_dsn(settings)
    await ensure_schema(settings, dsn, auto_migrate=settings.database_url is None)
    pool = await create_pool(
        settings,
        dsn=dsn,
        application_name=application_name,
        min_size=1,
        max_size=max_size,
        keep_session_state=keep_session_state,
    )
    try:
        yield pool
    finally:
        await pool.close()


@asynccontextmanager
async def open_store(settings: Settings, **options: Unpack[PoolOptions]) -> AsyncIterator[RunStore]:
    """The run store alone, for callers that need no other store."""
    async with open_pool(settings, **options) as pool:
        yield RunStore(pool)
