"""Schema migrations: numbered SQL files applied in order, once, under an advisory lock.

Several processes may start at once (``serve`` on three machines after a deploy); the advisory
lock makes one of them migrate while the others wait and then find nothing to do.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from importlib import resources

import asyncpg

from orchestrator.errors import SchemaTooNew

# An arbitrary constant: "orchestrator migrations" as a 64-bit advisory lock key.
MIGRATION_LOCK_KEY = 0x6F72_6368_6D69_6772
_FILE_NAME = re.compile(r"^(\d{4})_([a-z0-9_]+)\.sql$")


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    sql: str


def available_migrations() -> list[Migration]:
    folder = resources.files("orchestrator.sql.migrations")
    found: list[Migration] = []
    for entry in folder.iterdir():
        match = _FILE_NAME.match(entry.name)
        if match:
            found.append(Migration(int(match[1]), match[2], entry.read_text("utf-8")))
    found.sort(key=lambda migration: migration.version)
    versions = [migration.version for migration in found]
    if versions != list(range(1, len(found) + 1)):
        raise RuntimeError(f"migration files are not numbered 1..n without gaps: {versions}")
    return found


def latest_version() -> int:
    return len(available_migrations())


_CREATE_VERSION_TABLE = """
CREATE TABLE IF NOT EXISTS orchestrator_schema_migrations (
    version    integer     PRIMARY KEY,
    name       text        NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT clock_timestamp()
)
"""


async def current_version(connection: asyncpg.Connection) -> int:
    exists = await connection.fetchval(
        "SELECT to_regclass('orchestrator_schema_migrations') IS NOT NULL"
    )
    if not exists:
        return 0
    version = await connection.fetchval(
        "SELECT coalesce(max(version), 0) FROM orchestrator_schema_migrations"
    )
    return int(version)


def _too_new(found: int, known: int) -> SchemaTooNew:
    return SchemaTooNew(
        f"the database schema is at version {found} but this orchestrator knows only up to "
        f"{known}: it was migrated by a newer release. Upgrade orchestrator on this machine."
    )


async def check_schema(connection: asyncpg.Connection) -> int:
    """Refuse a schema newer than this code; return the current version."""
    version = await current_version(connection)
    known = latest_version()
    if version > known:
        raise _too_new(version, known)
    return version


async def migrate(connection: asyncpg.Connection) -> list[Migration]:
    """Apply pending migrations, each in its own transaction; return those applied."""
    await connection.execute("SELECT pg_advisory_lock($1)", MIGRATION_LOCK_KEY)
    try:
        await connection.execute(_CREATE_VERSION_TABLE)
        version = await check_schema(connection)
        applied: list[Migration] = []
        for migration in available_migrations():
            if migration.version <= version:
                continue
            async with connection.transaction():
                await connection.execute(migration.sql)
                await connection.execute(
                    "INSERT INTO orchestrator_schema_migrations (version, name) VALUES ($1, $2)",
                    migration.version,
                    migration.name,
                )
            applied.append(migration)
        return applied
    finally:
        await connection.execute("SELECT pg_advisory_unlock($1)", MIGRATION_LOCK_KEY)
