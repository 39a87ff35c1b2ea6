"""Fixtures: every test gets its own freshly migrated database on a real PostgreSQL.

Set ``ORCHESTRATOR_TEST_DATABASE_URL`` to test against an existing server (its user must be
allowed to create databases); otherwise an embedded server is started for the session.

The suite runs in parallel (pytest-xdist, ``-n auto`` in pyproject.toml): each worker process
starts its own embedded server on a port the kernel hands out, so no two workers share a server,
a database or a port. Tests spend most of their time waiting (leases expiring, processes starting,
servers restarting), so there are twice as many workers as cores.
``ORCHESTRATOR_TEST_WORKERS=N`` sets the number. Against an existing server the workers would
share its cluster-wide roles, so ``-n auto`` runs one worker there unless told otherwise.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import asyncpg
import pytest

from orchestrator.db.connections import connect, create_pool
from orchestrator.db.embedded import EmbeddedPostgres
from orchestrator.db.store import RunStore
from orchestrator.settings import Settings
from orchestrator.testing import TEST_SERVER_SETTINGS, DatabaseFactory, with_database


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto``: twice the cores (at least 2, at most 8), or ``ORCHESTRATOR_TEST_WORKERS``."""
    chosen = os.environ.get("ORCHESTRATOR_TEST_WORKERS")
    if chosen:
        return max(1, int(chosen))
    if os.environ.get("ORCHESTRATOR_TEST_DATABASE_URL"):
        return 1
    return min(8, max(2, 2 * (os.cpu_count() or 1)))


def pytest_configure(config: pytest.Config) -> None:
    if not hasattr(config, "workerinput"):  # once, in the process that starts the workers
        compile_the_package()


def compile_the_package() -> None:
    """Write the package's bytecode once. Where Python writes none itself
    (``PYTHONDONTWRITEBYTECODE``, as on CI machines), every process the suite starts (a few
    hundred workers, dispatchers and commands) would otherwise compile it again."""
    import compileall

    import orchestrator.agents
    import orchestrator.effects

    packages = (orchestrator, orchestrator.effects, orchestrator.agents)
    for folder in {path for package in packages for path in package.__path__}:
        compileall.compile_dir(folder, quiet=2, workers=0)


@pytest.fixture(scope="session")
def database_factory() -> Iterator[DatabaseFactory]:
    factory = DatabaseFactory(os.environ.get("ORCHESTRATOR_TEST_DATABASE_URL") or None)
    yield factory
    factory.close()


@pytest.fixture
async def database_url(database_factory: DatabaseFactory) -> AsyncIterator[str]:
    dsn = await database_factory.create()
    yield dsn
    await database_factory.drop(dsn)


@pytest.fixture
def settings(database_url: str) -> Settings:
    return Settings(database_url=database_url)


@pytest.fixture
async def pool(settings: Settings) -> AsyncIterator[asyncpg.Pool]:
    pool = await create_pool(settings, application_name="test", max_size=20)
    yield pool
    await pool.close()


@pytest.fixture
def store(pool: asyncpg.Pool) -> RunStore:
    return RunStore(pool)


@pytest.fixture
async def empty_database(database_factory: DatabaseFactory) -> AsyncIterator[str]:
    """A database with nothing in it: not even the migrations table."""
    name = f"orchestrator_empty_{uuid.uuid4().hex[:12]}"
    admin = await connect(database_factory.settings)
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')
    finally:
        await admin.close()
    dsn = with_database(database_factory.server_dsn, name)
    yield dsn
    await database_factory.drop(dsn)


@pytest.fixture
def own_server() -> Iterator[EmbeddedPostgres]:
    """An embedded server (not yet started) that the test alone uses, so that it may stop or
    restart PostgreSQL under the session's other tests' feet."""
    # Not under pytest's tmp_path: pytest keeps its base directory private to root (0700),
    # and the server runs as its own user when the tests run as root.
    home = Path(tempfile.mkdtemp(prefix="orchestrator-own-"))
    server = EmbeddedPostgres(home, server_settings=TEST_SERVER_SETTINGS)
    try:
        yield server
    finally:
        server.stop(mode="immediate")
        shutil.rmtree(home, ignore_errors=True)
