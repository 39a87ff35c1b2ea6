"""A schema of its own: orchestrator shares an application's database without colliding."""

from __future__ import annotations

from pathlib import Path

import asyncpg
import pytest

from orchestrator.db.bootstrap import SchemaBehind, ensure_schema
from orchestrator.db.connections import connect, create_pool
from orchestrator.db.migrations import latest_version, migrate
from orchestrator.db.schema_snapshot import dump_schema
from orchestrator.db.store import LIVENESS_LOCK_NAMESPACE, RunStore, liveness_namespace
from orchestrator.models import RunState
from orchestrator.settings import Settings
from support import install_an_earlier_release

SNAPSHOT = Path(__file__).parent.parent / "sql" / "schema.sql"


async def objects_by_schema(dsn: str) -> dict[str, set[str]]:
    connection = await asyncpg.connect(dsn)
    try:
        rows = await connection.fetch(
            "SELECT n.nspname, c.relname FROM pg_class AS c "
            "JOIN pg_namespace AS n ON n.oid = c.relnamespace "
            "WHERE n.nspname NOT IN ('pg_catalog', 'information_schema', 'pg_toast')"
        )
        functions = await connection.fetch(
            "SELECT n.nspname, p.proname FROM pg_proc AS p "
            "JOIN pg_namespace AS n ON n.oid = p.pronamespace WHERE p.proname LIKE 'orchestrator%'"
        )
    finally:
        await connection.close()
    found: dict[str, set[str]] = {}
    for row in [*rows, *functions]:
        found.setdefault(row[0], set()).add(row[1])
    return found


async def test_migrations_produce_exactly_the_schema_snapshot(empty_database: str) -> None:
    connection = await connect(Settings(database_url=empty_database))
    try:
        await migrate(connection)
    finally:
        await connection.close()
    dumped = dump_schema(empty_database)
    assert dumped == SNAPSHOT.read_text(), (
        "sql/schema.sql is out of date: python -m orchestrator.db.schema_snapshot > sql/schema.sql"
    )


async def test_everything_lives_in_its_schema_beside_an_applications_own_tables(
    empty_database: str,
) -> None:
    app = await asyncpg.connect(empty_database)
    try:
        await app.execute("CREATE TABLE public.runs (id int PRIMARY KEY, note text)")
        await app.execute("INSERT INTO public.runs VALUES (1, 'the application''s own')")
    finally:
        await app.close()
    settings = Settings(database_url=empty_database)
    connection = await connect(settings)
    try:
        await migrate(connection)
    finally:
        await connection.close()
    found = await objects_by_schema(empty_database)
    assert found["public"] == {"runs", "runs_pkey"}  # the application's, untouched
    assert {"runs", "run_events", "workers", "effects", "effect_fences"} <= found["orchestrator"]
    assert {"orchestrator_schema_migrations", "orchestrator_accept_effect"} <= found["orchestrator"]
    pool = await create_pool(settings)
    try:
        store = RunStore(pool)
        run = (await store.submit("agent", {"n": 1})).run
        assert (await store.claim("w", ["agent"])).claimed[0].run_id == run.run_id
    finally:
        await pool.close()
    app = await asyncpg.connect(empty_database)
    try:
        rows = [tuple(row) for row in await app.fetch("SELECT * FROM public.runs")]
        assert rows == [(1, "the application's own")]
    finally:
        await app.close()


async def test_a_database_of_an_earlier_release_moves_into_the_schema_with_its_history(
    empty_database: str,
) -> None:
    legacy = Settings(database_url=empty_database, schema="public")
    connection = await connect(legacy)
    try:  # what release 0.1 built: migrations 1-6 in public
        await install_an_earlier_release(connection, migrations=6)
        # A run and its timeline as that release wrote them (today's store speaks today's
        # schema, so the rows are written by hand).
        await connection.execute(
            "INSERT INTO runs (run_id, agent, input, idempotency_key, state, finished_at) "
            "VALUES ('r_legacy', 'agent', '{\"kept\": true}', 'k-1', 'cancelled', now())"
        )
        await connection.execute(
            "INSERT INTO run_events (run_id, kind, fence, details) VALUES "
            "('r_legacy', 'submitted', 0, '{}'), ('r_legacy', 'cancelled', 1, '{}')"
        )
    finally:
        await connection.close()

    settings = Settings(database_url=empty_database)
    behind = f"version 6, this orchestrator needs {latest_version()}"
    with pytest.raises(SchemaBehind, match=behind):
        await ensure_schema(settings, empty_database, auto_migrate=False)
    connection = await connect(settings)
    try:
        applied = await migrate(connection)
        assert [m.version for m in applied] == list(range(7, latest_version() + 1))
    finally:
        await connection.close()
    found = await objects_by_schema(empty_database)
    assert "public" not in found  # everything moved, nothing left behind
    pool = await create_pool(settings)
    try:
        store = RunStore(pool)
        moved = await store.get("r_legacy")
        assert (moved.state, moved.input, moved.idempotency_key) == (
            RunState.CANCELLED,
            {"kept": True},
            "k-1",
        )
        assert [e.kind for e in await store.events("r_legacy")] == ["submitted", "cancelled"]
        versions = await pool.fetchval("SELECT count(*) FROM orchestrator_schema_migrations")
        assert versions == latest_version()
    finally:
        await pool.close()


async def test_two_schemas_in_one_database_do_not_see_each_other(empty_database: str) -> None:
    tenants = [Settings(database_url=empty_database, schema=name) for name in ("team_a", "team_b")]
    stores = []
    for settings in tenants:
        connection = await connect(settings)
        try:
            await migrate(connection)
        finally:
            await connection.close()
        stores.append(RunStore(await create_pool(settings)))
    try:
        a, b = stores
        run = (await a.submit("agent", {})).run
        assert [r.run_id for r in await a.list_runs()] == [run.run_id]
        assert await b.list_runs() == []
        assert (await b.claim("w", ["agent"])).claimed == []
    finally:
        for store in stores:
            await store.pool.close()
    assert liveness_namespace("orchestrator") == LIVENESS_LOCK_NAMESPACE
    assert len({liveness_namespace(n) for n in ("orchestrator", "team_a", "team_b")}) == 3
