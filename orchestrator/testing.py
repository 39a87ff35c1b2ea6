"""Test support for orchestrator and for agent authors' own tests: real PostgreSQL, fast.

``DatabaseFactory`` migrates a template database once per test session and gives each test a
fresh copy through ``CREATE DATABASE ... TEMPLATE`` (a file copy: tens of milliseconds), so
tests are isolated without paying for migrations each time. With no server given it starts an
embedded PostgreSQL in a temporary directory, tuned for tests (no fsync).
"""

from __future__ import annotations

import itertools
import os
import shutil
import tempfile
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import asyncpg

from orchestrator.database import connect
from orchestrator.embedded import EmbeddedPostgres
from orchestrator.migrations import migrate
from orchestrator.settings import Settings

TEST_SERVER_SETTINGS = {
    # Durability is not under test and fsync dominates small transactions on CI disks.
    "fsync": "off",
    "synchronous_commit": "off",
    "full_page_writes": "off",
}


def with_database(dsn: str, database: str) -> str:
    parts = urlsplit(dsn)
    return urlunsplit(parts._replace(path="/" + database))


class DatabaseFactory:
    """Hands out freshly migrated databases on one server."""

    def __init__(self, server_dsn: str | None = None) -> None:
        self._home: Path | None = None
        self.embedded: EmbeddedPostgres | None = None
        if server_dsn is None:
            self._home = Path(tempfile.mkdtemp(prefix="orchestrator-test-"))
            self.embedded = EmbeddedPostgres(self._home, server_settings=TEST_SERVER_SETTINGS)
            server_dsn = self.embedded.ensure_running().dsn()
        self.server_dsn = server_dsn
        self.template = f"orchestrator_template_{os.getpid()}"
        self._counter = itertools.count(1)
        self._ready = False

    @property
    def settings(self) -> Settings:
        return Settings(database_url=self.server_dsn)

    async def _admin(self) -> asyncpg.Connection:
        return await connect(self.settings, application_name="orchestrator-tests")

    async def prepare(self) -> None:
        if self._ready:
            return
        admin = await self._admin()
        try:
            await admin.execute(f'DROP DATABASE IF EXISTS "{self.template}" WITH (FORCE)')
            await admin.execute(f'CREATE DATABASE "{self.template}"')
        finally:
            await admin.close()
        migrator = await connect(self.settings, dsn=with_database(self.server_dsn, self.template))
        try:
            await migrate(migrator)
        finally:
            await migrator.close()
        self._ready = True

    async def create(self) -> str:
        """A new, migrated, empty database; returns its DSN."""
        await self.prepare()
        name = f"orchestrator_test_{os.getpid()}_{next(self._counter)}"
        admin = await self._admin()
        try:
            await admin.execute(f'CREATE DATABASE "{name}" TEMPLATE "{self.template}"')
        finally:
            await admin.close()
        return with_database(self.server_dsn, name)

    async def drop(self, dsn: str) -> None:
        name = urlsplit(dsn).path.lstrip("/")
        admin = await self._admin()
        try:
            await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        finally:
            await admin.close()

    def close(self) -> None:
        """Stop the embedded server (if this factory started one) and delete its files."""
        if self.embedded is not None:
            self.embedded.stop(mode="immediate")
        if self._home is not None:
            shutil.rmtree(self._home, ignore_errors=True)
