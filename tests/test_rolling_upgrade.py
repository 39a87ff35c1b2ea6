"""Rolling upgrades of orchestrator itself (docs/upgrades.md, CONTRIBUTING.md): this release keeps
working on a schema a newer release migrated while those migrations only expanded it, refuses it
once one contracted, and (but for `serve`, which migrates) refuses a schema older than it needs;
each refusal is one line naming what to do."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import anyio
import asyncpg
import pytest

from orchestrator.db.bootstrap import SchemaBehind, ensure_schema
from orchestrator.db.connections import connect
from orchestrator.db.migrations import latest_version, migrate
from orchestrator.db.store import RunStore
from orchestrator.models import RunState
from orchestrator.settings import DEFAULT_SCHEMA, Settings
from support import ServeProcess, install_an_earlier_release, serving


def command(database_url: str, *words: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", *words],
        env={"ORCHESTRATOR_DATABASE_URL": database_url, "PATH": ""},
        capture_output=True,
        text=True,
        timeout=120,
    )


async def test_this_release_serves_beside_a_newer_one_until_it_contracts_the_schema(
    database_url: str, store: RunStore, pool: asyncpg.Pool
) -> None:
    # What a newer release's expanding migration does: a new column, a new table, its version.
    await pool.execute("ALTER TABLE runs ADD COLUMN a_newer_release_s text")
    await pool.execute("CREATE TABLE a_newer_release_s_table (id int PRIMARY KEY)")
    await pool.execute(
        "INSERT INTO orchestrator_schema_migrations (version, name) VALUES ($1, 'expanded')",
        latest_version() + 1,
    )
    run_ids = [(await store.submit("noop", {})).run.run_id for _ in range(5)]
    with ServeProcess(database_url, *serving("orchestrator.agents.noop"), name="this-release"):
        with anyio.fail_after(60):
            while await pool.fetchval(  # noqa: ASYNC110 - database state, polled
                "SELECT count(*) FROM runs WHERE state <> 'succeeded'"
            ):
                await anyio.sleep(0.1)
    assert {(await store.get(run_id)).state for run_id in run_ids} == {RunState.SUCCEEDED}
    # The newer release contracts: this one must stop, not misread the schema.
    await pool.execute(
        "INSERT INTO orchestrator_schema_migrations (version, name, contracts)"
        " VALUES ($1, 'dropped_what_it_reads', true)",
        latest_version() + 2,
    )
    done = await asyncio.to_thread(
        command, database_url, "serve", "--agents", "orchestrator.agents.noop"
    )
    assert done.returncode == 1, done.stderr
    assert "dropped_what_it_reads" in done.stderr and "Upgrade orchestrator" in done.stderr


async def test_this_release_refuses_a_schema_older_than_it_needs(empty_database: str) -> None:
    settings = Settings(database_url=empty_database)
    connection = await connect(settings)
    try:
        await connection.execute(f'CREATE SCHEMA "{DEFAULT_SCHEMA}"')
        await install_an_earlier_release(connection, migrations=latest_version() - 1)
    finally:
        await connection.close()
    with pytest.raises(SchemaBehind, match="orchestrator db migrate") as raised:
        await ensure_schema(settings, empty_database, auto_migrate=False)
    assert "\n" not in str(raised.value)
    # `serve` migrates the schema itself (expand-only migrations leave the previous release's
    # workers working); every other command refuses, naming the command that migrates.
    done = await asyncio.to_thread(command, empty_database, "runs", "list")
    assert done.returncode == 1 and "orchestrator db migrate" in done.stderr, done.stderr
    assert done.stderr.strip().count("\n") == 0
    connection = await connect(settings)
    try:
        assert len(await migrate(connection)) == 1  # the one migration it lacked
    finally:
        await connection.close()
