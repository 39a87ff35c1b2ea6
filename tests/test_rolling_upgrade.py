"""Rolling upgrades of orchestrator itself (docs/upgrades.md, CONTRIBUTING.md): the previous
release's workers, installed from its tree into a virtualenv of their own, keep working beside
this release's on the schema this release migrated; this release keeps working on a schema a
newer release migrated while those migrations only expanded it, refuses it once one contracted,
and (but for `serve`, which migrates) refuses a schema older than it needs; each refusal is one
line naming what to do."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import anyio
import asyncpg
import pytest

from orchestrator.db.bootstrap import SchemaBehind, ensure_schema
from orchestrator.db.connections import connect
from orchestrator.db.migrations import latest_version, migrate
from orchestrator.db.store import RunStore
from orchestrator.models import RunState
from orchestrator.settings import DEFAULT_SCHEMA, Settings
from orchestrator.testing import LocalVendor, SmtpSink
from support import (
    ServeProcess,
    crm_kind,
    install_an_earlier_release,
    serve_args,
    serving,
    write_vendors_config,
)

PREVIOUS_RELEASE = "7b4af00"
"""The tree before migration 0026 (a drained cutover): the latest migration it knows is 0025."""
REPOSITORY = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def previous_release(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The interpreter of a virtualenv holding the previous release's tree (from git) and, for
    its dependencies, this environment's: the interpreter a rolling upgrade leaves running. Run
    it outside this repository (``-m`` puts the working directory first on the import path)."""
    if not (REPOSITORY / ".git").exists():
        pytest.skip("not a git checkout: the previous release's tree comes from git history")
    home = tmp_path_factory.mktemp("previous-release")
    tree = home / "tree"
    tree.mkdir()
    archive = subprocess.run(
        ["git", "-C", str(REPOSITORY), "archive", PREVIOUS_RELEASE],
        capture_output=True,
        check=False,
        timeout=120,
    )
    assert archive.returncode == 0, (
        f"git cannot read commit {PREVIOUS_RELEASE} (a shallow clone? `git fetch --unshallow`): "
        f"{archive.stderr.decode(errors='replace').strip()}"
    )
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive.stdout, check=True, timeout=120)
    venv.create(home / "venv", with_pip=False)
    python = home / "venv" / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout.strip()
    # Installed as a user installs it (agents/, effects/ and sql/ map into the package), by
    # this environment's pip; its dependencies are this environment's (a .pth line is not
    # itself a site directory, so this tree's editable install there is not picked up).
    installed = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--target",
            purelib,
            str(tree),
        ],
        capture_output=True,
        text=True,
        check=False,
        timeout=600,
    )
    assert installed.returncode == 0, installed.stderr
    (Path(purelib) / "previous_release.pth").write_text(f"{sysconfig.get_paths()['purelib']}\n")
    found = subprocess.run(
        [str(python), "-c", "import orchestrator; print(orchestrator.__file__)"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
        cwd=home,
    ).stdout.strip()
    assert found.startswith(purelib), found
    return python


def command(database_url: str, *words: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", *words],
        env={"ORCHESTRATOR_DATABASE_URL": database_url, "PATH": ""},
        capture_output=True,
        text=True,
        timeout=120,
    )


async def test_the_previous_release_s_workers_serve_beside_this_one_s_with_effects_in_flight(
    database_url: str, store: RunStore, pool: asyncpg.Pool, tmp_path: Path, previous_release: Path
) -> None:
    """The rolling upgrade: the previous release's worker runs on the schema this release
    migrated; this release's worker starts beside it; the old one is stopped mid-flight (its runs
    given back); every run finishes, every effect reaches its vendor once."""
    assert await pool.fetchval("SELECT max(version) FROM orchestrator_schema_migrations") == (
        latest_version()
    )
    runs = 12
    async with LocalVendor() as vendor:
        with SmtpSink() as sink:
            email = {"adapter": "smtp", "host": "127.0.0.1", "port": sink.port}
            config = write_vendors_config(
                tmp_path, {"crm": crm_kind(vendor), "email": {**email, "sender": "a@orch.test"}}
            )
            agents = ["--agents", "orchestrator.agents.contract_notice", "--poll-seconds", "0.2"]
            args = serve_args(agents, config, lease_seconds="20", heartbeat_seconds="1")
            run_ids = [
                (
                    await store.submit(
                        "contract_notice", {"customer": f"c{n}", "think_seconds": 1.5}
                    )
                ).run.run_id
                for n in range(runs)
            ]
            # The previous release's dispatcher cut off the sends in flight when it stopped
            # (an email then waited for a person): this release's sends the old one's effects.
            with ServeProcess(
                database_url,
                *args,
                "--no-dispatch",
                name="previous",
                python=str(previous_release),
                cwd=previous_release.parents[2],
            ) as old:
                with anyio.fail_after(60):
                    while not await pool.fetchval(  # noqa: ASYNC110 - database state, polled
                        "SELECT count(*) FROM run_events WHERE worker_id = 'previous'"
                        " AND kind = 'claimed'"
                    ):
                        await anyio.sleep(0.05)
                with ServeProcess(database_url, *args, name="this") as new:
                    await new.wait_for_log("serving", within=60)
                    old.signal(signal.SIGTERM)  # the rolling upgrade stops the old worker
                    assert old.process.wait(60) == 0, old.tail()
                    for run_id in run_ids:
                        with anyio.fail_after(90):
                            while (run := await store.get(run_id)).state not in (  # noqa: ASYNC110
                                RunState.SUCCEEDED,
                                RunState.DEAD,
                                RunState.FAILED,
                            ):
                                await anyio.sleep(0.1)
                        assert run.state is RunState.SUCCEEDED, run.error
            claimers = {
                row["worker_id"]
                for row in await pool.fetch(
                    "SELECT DISTINCT worker_id FROM run_events WHERE kind = 'claimed'"
                )
            }
            assert claimers == {"previous", "this"}, claimers
            assert len(vendor.deliveries) == runs and set(vendor.requests_by_key.values()) == {1}
            assert len(sink.messages) == runs  # one email per run
            recipients = sorted(str(m["Subject"]) for m in sink.messages)
            assert recipients == ["Renewal"] * runs


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
