"""``sql/schema.sql``: the schema the migrations produce, as one readable file.

The migrations are the source of truth; the snapshot shows their sum (what a table looks like
today needs no reading of seven files), and ``tests/test_migrations.py`` checks that migrating an
empty database produces exactly it. Regenerate after adding a migration, from the repository
root::

    python -m orchestrator.db.schema_snapshot > sql/schema.sql
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from urllib.parse import urlsplit

from orchestrator.db.connections import connect
from orchestrator.db.embedded import EmbeddedPostgres, binaries_dir
from orchestrator.db.migrations import migrate
from orchestrator.settings import DEFAULT_SCHEMA, Settings

HEADER = (
    "-- The orchestrator schema as migrations 0001..N produce it (generated: do not edit).\n"
    "-- Regenerate: python -m orchestrator.db.schema_snapshot > sql/schema.sql\n"
)


def dump_schema(dsn: str, schema: str = DEFAULT_SCHEMA) -> str:
    """``pg_dump --schema-only`` of ``schema``, without what differs between servers and runs
    (version comments, session SETs, psql's random ``\\restrict`` keys)."""
    parts = urlsplit(dsn)
    command = [
        str(binaries_dir() / "pg_dump"),
        "--schema-only",
        "--no-owner",
        "--no-privileges",
        "--no-comments",
        f"--schema={schema}",
        f"--host={parts.hostname or '127.0.0.1'}",
        f"--port={parts.port or 5432}",
        f"--username={parts.username or 'postgres'}",
        parts.path.lstrip("/"),
    ]
    output = subprocess.run(command, check=True, capture_output=True, text=True, timeout=60)
    kept = [
        line
        for line in output.stdout.splitlines()
        if line.strip()
        and not line.startswith(("--", "SET ", "SELECT pg_catalog.set_config", "\\restrict"))
        and not line.startswith("\\unrestrict")
    ]
    return HEADER + "\n".join(kept) + "\n"


async def _snapshot() -> str:
    home = Path(tempfile.mkdtemp(prefix="orchestrator-snapshot-"))
    server = EmbeddedPostgres(home)
    try:
        dsn = server.ensure_running().dsn()
        connection = await connect(Settings(database_url=dsn))
        try:
            await migrate(connection)
        finally:
            await connection.close()
        return dump_schema(dsn)
    finally:
        server.stop(mode="immediate")
        shutil.rmtree(home, ignore_errors=True)


def main() -> int:
    sys.stdout.write(asyncio.run(_snapshot()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
