"""Fixtures: every test gets its own freshly migrated database on a real PostgreSQL.

Set ``ORCHESTRATOR_TEST_DATABASE_URL`` to test against an existing server (its user must be
allowed to create databases); otherwise an embedded server is started for the session.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator

import asyncpg
import pytest

from orchestrator.db.connections import create_pool
from orchestrator.db.store import RunStore
from orchestrator.settings import Settings
from orchestrator.testing import DatabaseFactory


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
