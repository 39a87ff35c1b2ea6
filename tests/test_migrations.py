"""Migrations: an empty database reaches the latest schema; concurrent migrators do not race."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest

from orchestrator.db.bootstrap import SchemaBehind, ensure_schema
from orchestrator.db.connections import connect
from orchestrator.db.migrations import available_migrations, check_schema, latest_version, migrate
from orchestrator.errors import DatabaseUnavailable, SchemaTooNew
from orchestrator.settings import Settings


async def test_migrating_an_empty_database_reaches_the_latest_schema(empty_database: str) -> None:
    connection = await connect(Settings(database_url=empty_database))
    try:
        applied = await migrate(connection)
        assert [m.version for m in applied] == list(range(1, latest_version() + 1))
        assert await migrate(connection) == []
        assert await check_schema(connection) == latest_version()
        tables = {
            r["tablename"]
            for r in await connection.fetch(
                "SELECT tablename FROM pg_tables WHERE schemaname='orchestrator'"
            )
        }
        assert {"runs", "run_events", "orchestrator_schema_migrations"} <= tables
        indexes = {
            r["indexname"]: r["indexdef"]
            for r in await connection.fetch(
                "SELECT indexname, indexdef FROM pg_indexes WHERE tablename='runs'"
            )
        }
        # Renewals must stay HOT: no index may cover lease_until or updated_at.
        for name, definition in indexes.items():
            assert "lease_until" not in definition, name
            assert "updated_at" not in definition, name
        assert "WHERE (state = 'running'::text)" in indexes["runs_running"]
        options = await connection.fetchval("SELECT reloptions FROM pg_class WHERE relname='runs'")
        assert "fillfactor=70" in options
    finally:
        await connection.close()


async def test_concurrent_migrators_apply_each_migration_once(empty_database: str) -> None:
    settings = Settings(database_url=empty_database)
    connections = [await connect(settings) for _ in range(4)]
    try:
        results = await asyncio.gather(*(migrate(c) for c in connections))
        assert sorted(len(applied) for applied in results) == [0, 0, 0, latest_version()]
        count = await connections[0].fetchval("SELECT count(*) FROM orchestrator_schema_migrations")
        assert count == latest_version()
    finally:
        for connection in connections:
            await connection.close()


async def test_a_newer_schema_is_used_while_it_only_expanded_and_refused_once_it_contracted(
    database_url: str,
) -> None:
    # A rolling upgrade: a newer release migrated the database beside this one's workers.
    settings = Settings(database_url=database_url)
    connection = await connect(settings)
    try:
        await connection.execute(
            "INSERT INTO orchestrator_schema_migrations (version, name) VALUES ($1, 'added')",
            latest_version() + 1,
        )
        assert await check_schema(connection) == latest_version() + 1
        assert await migrate(connection) == []  # nothing to apply, nothing refused
        await connection.execute(
            "INSERT INTO orchestrator_schema_migrations (version, name, contracts)"
            " VALUES ($1, 'dropped_a_column', true)",
            latest_version() + 2,
        )
        with pytest.raises(SchemaTooNew, match="dropped_a_column") as raised:
            await check_schema(connection)
        assert "Upgrade orchestrator" in str(raised.value) and "\n" not in str(raised.value)
        with pytest.raises(SchemaTooNew):
            await migrate(connection)
    finally:
        await connection.close()


async def test_a_contracting_migration_is_recorded_as_one(empty_database: str) -> None:
    connection = await connect(Settings(database_url=empty_database))
    try:
        await migrate(connection)
        rows = await connection.fetch(
            "SELECT version, contracts FROM orchestrator_schema_migrations ORDER BY version"
        )
    finally:
        await connection.close()
    assert [row["version"] for row in rows] == list(range(1, latest_version() + 1))
    assert not any(row["contracts"] for row in rows)  # no released migration contracts yet
    assert not any(m.contracts for m in available_migrations())


async def test_an_external_database_is_not_migrated_implicitly(empty_database: str) -> None:
    settings = Settings(database_url=empty_database)
    with pytest.raises(SchemaBehind, match="orchestrator db migrate"):
        await ensure_schema(settings, empty_database, auto_migrate=False)
    assert await ensure_schema(settings, empty_database, auto_migrate=True) == latest_version()


def test_migration_files_are_numbered_without_gaps() -> None:
    versions = [m.version for m in available_migrations()]
    assert versions == list(range(1, len(versions) + 1))


async def test_failed_connection_names_the_dsn_without_password() -> None:
    settings = Settings(connect_timeout_seconds=2)
    dsn = "postgresql://app:s3cret@127.0.0.1:1/orchestrator"
    with pytest.raises(DatabaseUnavailable) as caught:
        await connect(settings, dsn=dsn)
    message = str(caught.value)
    assert "s3cret" not in message
    assert "postgresql://app:***@127.0.0.1:1/orchestrator" in message


EXPAND_ONLY_FROM = 23
"""Migrations from this number on follow the expand-then-contract rule (CONTRIBUTING.md)."""
CONTRACTING = re.compile(
    r"\b(DROP\s+(TABLE|COLUMN|INDEX|VIEW|TYPE|SCHEMA|TRIGGER|CONSTRAINT)|"
    r"RENAME\s+(TO|COLUMN)|ALTER\s+COLUMN\s+\S+\s+(SET\s+DATA\s+)?TYPE|"
    r"ALTER\s+COLUMN\s+\S+\s+SET\s+NOT\s+NULL)\b",
    re.IGNORECASE,
)


def _without_comments(text: str) -> str:
    return "\n".join(line.split("--", 1)[0] for line in text.splitlines())


def test_migrations_expand_and_contract_only_where_they_say_so() -> None:
    """A rolling upgrade runs the previous release beside this one on the migrated schema: a
    migration may not remove, rename or retype what it reads unless it declares a contraction."""
    offenders = []
    for path in sorted((Path(__file__).parent.parent / "sql" / "migrations").glob("*.sql")):
        if int(path.name[:4]) < EXPAND_ONLY_FROM:
            continue
        text = path.read_text("utf-8")
        code = _without_comments(text)
        dropped_functions = re.findall(r"DROP\s+FUNCTION\s+(\w+)", code, re.IGNORECASE)
        recreated = set(re.findall(r"CREATE\s+FUNCTION\s+(\w+)", code, re.IGNORECASE))
        found = [m.group(0) for m in CONTRACTING.finditer(code)]
        found += [f"DROP FUNCTION {name}" for name in dropped_functions if name not in recreated]
        if found and "-- contracts: " not in text:
            offenders.append(f"{path.name}: {', '.join(found)}")
    assert not offenders, (
        "these migrations contract the schema without a '-- contracts: WHAT, unused since "
        f"RELEASE' line (CONTRIBUTING.md, expand then contract): {offenders}"
    )


def test_the_expand_rule_sees_a_contraction() -> None:
    code = _without_comments("ALTER TABLE runs DROP COLUMN priority; -- DROP TABLE x")
    assert [m.group(0) for m in CONTRACTING.finditer(code)] == ["DROP COLUMN"]
    renamed = "ALTER TABLE runs RENAME COLUMN step TO next_step"
    assert CONTRACTING.search(renamed) is not None
    assert CONTRACTING.search("ALTER TABLE runs ALTER COLUMN fence TYPE numeric") is not None
    assert CONTRACTING.search("ALTER TABLE runs ADD COLUMN agent_version text") is None
