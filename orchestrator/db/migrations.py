"""Schema migrations: numbered SQL files applied in order, once, under an advisory lock.

Everything lives in one PostgreSQL schema (``ORCHESTRATOR_SCHEMA``, default ``orchestrator``),
so orchestrator can share an application's database. Migrations name their objects
unqualified and run on a connection whose ``search_path`` is that schema (every connection made
by ``orchestrator.db.connections`` has it); the schema is created first if need be.

Several processes may start at once (``serve`` on three machines after a deploy); the advisory
lock (one per schema) makes one of them migrate while the others wait and then find nothing to
do.

Databases migrated by releases before 0.2 keep their tables in ``public``. The first migration
run against such a database moves them, with the version table, into the schema (in one
transaction, before migration 0007), so nothing of their history is lost.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from importlib import resources

import asyncpg

from orchestrator.db.grants import quote_ident
from orchestrator.errors import InvalidInput, SchemaTooNew
from orchestrator.settings import check_schema_name

_FILE_NAME = re.compile(r"^(\d{4})_([a-z0-9_]+)\.sql$")
VERSION_TABLE = "orchestrator_schema_migrations"

LEGACY_TABLES = ("runs", "run_events", "workers", "effects", "effect_fences")
LEGACY_SEQUENCES = ("worker_session_keys",)
LEGACY_FUNCTIONS = (
    "orchestrator_accept_effect(text, text, bigint, text, text, jsonb, text, text)",
)
"""What releases before 0.2 created in ``public`` (each moved only if it is there)."""


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    sql: str

    @property
    def contracts(self) -> bool:
        """It removes, renames or retypes what an earlier release uses (CONTRIBUTING.md)."""
        return "-- contracts: " in self.sql


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


_CREATE_VERSION_TABLE = f"""
CREATE TABLE IF NOT EXISTS {VERSION_TABLE} (
    version    integer     PRIMARY KEY,
    name       text        NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT clock_timestamp()
)
"""


async def schema_of(connection: asyncpg.Connection) -> str:
    """The schema the connection works in: the first entry of its ``search_path``."""
    path = str(await connection.fetchval("SELECT current_setting('search_path')"))
    first = path.split(",")[0].strip().strip('"')
    try:
        return check_schema_name(first)
    except InvalidInput:
        raise RuntimeError(
            f"this connection's search_path is {path!r}: open it with "
            "orchestrator.db.connections.connect, which sets it to the orchestrator schema"
        ) from None


async def _version_in(connection: asyncpg.Connection, schema: str) -> int | None:
    table = f'"{schema}".{VERSION_TABLE}'
    if not await connection.fetchval("SELECT to_regclass($1) IS NOT NULL", table):
        return None
    version = await connection.fetchval(f"SELECT coalesce(max(version), 0) FROM {table}")
    return int(version)


async def current_version(connection: asyncpg.Connection) -> int:
    """The schema's version; a database of a release before 0.2 (tables still in ``public``)
    reports its version there, so that it reads as behind and gets migrated."""
    schema = await schema_of(connection)
    version = await _version_in(connection, schema)
    if version is None and schema != "public":
        version = await _version_in(connection, "public")
    return version or 0


def _too_new(found: int, known: int, contracted_by: str) -> SchemaTooNew:
    return SchemaTooNew(
        f"the database schema is at version {found} but this orchestrator knows only up to "
        f"{known}, and a newer release's migration ({contracted_by}) removed what this one "
        "uses. Upgrade orchestrator on this machine."
    )


async def check_schema(connection: asyncpg.Connection) -> int:
    """Refuse a schema newer than this code unless the newer migrations only expanded it (a
    rolling upgrade runs this release beside the newer one); return the current version."""
    version = await current_version(connection)
    known = latest_version()
    if version > known:
        contracting = await connection.fetch(
            f"SELECT version, name FROM {VERSION_TABLE} WHERE version > $1 AND contracts"
            " ORDER BY version",
            known,
        )
        if contracting:
            raise _too_new(version, known, contracting[0]["name"])
    return version


async def migrate(connection: asyncpg.Connection) -> list[Migration]:
    """Apply pending migrations, each in its own transaction; return those applied."""
    schema = await schema_of(connection)
    lock = f"orchestrator migrations of schema {schema}"
    await connection.execute("SELECT pg_advisory_lock(hashtextextended($1, 0))", lock)
    try:
        if not await connection.fetchval("SELECT 1 FROM pg_namespace WHERE nspname = $1", schema):
            await connection.execute(f'CREATE SCHEMA "{schema}"')
        await _adopt_public_objects(connection, schema)
        await connection.execute(_CREATE_VERSION_TABLE)
        version = await check_schema(connection)
        applied: list[Migration] = []
        for migration in available_migrations():
            if migration.version <= version:
                continue
            async with connection.transaction():
                await _act_as_schema_owner(connection, schema)
                await connection.execute(migration.sql)
                await connection.execute(
                    f"INSERT INTO {VERSION_TABLE} (version, name) VALUES ($1, $2)",
                    migration.version,
                    migration.name,
                )
                if migration.contracts:  # said of it from migration 25 on (the column's own)
                    await connection.execute(
                        f"UPDATE {VERSION_TABLE} SET contracts = true WHERE version = $1",
                        migration.version,
                    )
            applied.append(migration)
        return applied
    finally:
        await connection.execute("SELECT pg_advisory_unlock(hashtextextended($1, 0))", lock)


async def _act_as_schema_owner(connection: asyncpg.Connection, schema: str) -> None:
    """Within a migration's transaction, act as the schema's owner when the connected role is
    only a member of it (a login granted ``orchestrator_migrator``, docs/database-roles.md), so
    that what the migration creates belongs to the owner and ``db grant`` keeps its matrix."""
    owner = await connection.fetchval(
        "SELECT r.rolname FROM pg_namespace AS n JOIN pg_roles AS r ON r.oid = n.nspowner "
        "WHERE n.nspname = $1 AND r.rolname <> current_user "
        "AND pg_has_role(current_user, r.oid, 'MEMBER') AND NOT r.rolsuper",
        schema,
    )
    if owner is not None:
        await connection.execute(f"SET LOCAL ROLE {quote_ident(owner)}")


async def _adopt_public_objects(connection: asyncpg.Connection, schema: str) -> None:
    """Move a pre-0.2 database's objects from ``public`` into ``schema``, all or nothing.

    Only when ``public`` holds orchestrator's version table and ``schema`` does not: an
    application's own tables that happen to share a name are never touched otherwise.
    """
    if schema == "public" or await _version_in(connection, schema) is not None:
        return
    if await _version_in(connection, "public") is None:
        return
    async with connection.transaction():
        for table in (VERSION_TABLE, *LEGACY_TABLES):
            if await connection.fetchval("SELECT to_regclass($1)", f"public.{table}"):
                await connection.execute(f'ALTER TABLE public.{table} SET SCHEMA "{schema}"')
        for sequence in LEGACY_SEQUENCES:
            if await connection.fetchval("SELECT to_regclass($1)", f"public.{sequence}"):
                await connection.execute(f'ALTER SEQUENCE public.{sequence} SET SCHEMA "{schema}"')
        for function in LEGACY_FUNCTIONS:
            if await connection.fetchval("SELECT to_regprocedure($1)", f"public.{function}"):
                await connection.execute(f'ALTER FUNCTION public.{function} SET SCHEMA "{schema}"')
