"""The server's side of a measurement, statement by statement (``throughput.py --statements``).

PostgreSQL's own ``pg_stat_statements`` counts each statement's execution time, calls and WAL.
Each measurement runs in a database of its own, so its statements are those of its database:
read once before the consumer starts and once after it stops, the difference is what the
consumer's statements cost, per job done. The benchmark's own polls are left out by their text.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import asyncpg

from orchestrator.db.queries import queries

SERVER_SETTINGS = {
    "shared_preload_libraries": "pg_stat_statements",
    "pg_stat_statements.track": "top",
}
"""What an embedded server needs to count statements (loaded at start, so set when it starts)."""

_SNAPSHOT_SQL = """
SELECT queryid, query, calls, total_exec_time, wal_bytes
FROM public.pg_stat_statements
WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())
"""

_CREATE_SQL = "CREATE EXTENSION IF NOT EXISTS pg_stat_statements WITH SCHEMA public"

OWN_STATEMENTS = (_CREATE_SQL, _SNAPSHOT_SQL)
"""The snapshot's statements, left out with the benchmark's own."""

_SPACES = re.compile(r"\s+")


class StatementsUnavailable(RuntimeError):
    """The server does not count statements (pg_stat_statements is not preloaded)."""


async def snapshot(connection: asyncpg.Connection) -> dict[int, dict[str, Any]]:
    """This database's statement counters now, by query id."""
    try:
        await connection.execute(_CREATE_SQL)
        rows = await connection.fetch(_SNAPSHOT_SQL)
    except asyncpg.PostgresError as error:
        raise StatementsUnavailable(
            "--statements needs pg_stat_statements in shared_preload_libraries "
            f"(the embedded server sets it; with --dsn the server must): {error}"
        ) from error
    return {row["queryid"]: dict(row) for row in rows}


_COMMENTS = re.compile(r"--[^\n]*|/\*.*?\*/", re.DOTALL)
_CONSTANTS = re.compile(
    r"\$\d+|'(?:[^']|'')*'|\b\d+(?:\.\d+)?\b|\b(?:true|false)\b|(?<!IS )(?<!NOT )\bNULL\b",
    re.IGNORECASE,
)
"""Parameters and constants: the server shows a statement's constants as parameters."""
_LISTS = re.compile(r"\?(?:\s*,\s*\?)+")
"""A list of constants, which the server shows as one (``IN ($1 /*, ... */)``)."""


def _key(text: str) -> str:
    """A statement's text as it compares with the server's: without comments or spaces, its
    constants and lists of them alike (the server keeps comments, and a quote in one must not
    pair with a constant's; it shows constants as parameters, a list of them as one)."""
    text = _CONSTANTS.sub("?", _COMMENTS.sub("", text))
    return _SPACES.sub("", _LISTS.sub("?", _SPACES.sub("", text)))


def _names() -> dict[str, str]:
    """The orchestrator's named queries by their text, as the server shows it."""
    return {_key(text): name for name, text in queries().items()}


def difference(
    before: Mapping[int, Mapping[str, Any]],
    after: Mapping[int, Mapping[str, Any]],
    jobs: int,
    *,
    leave_out: Iterable[str],
) -> list[dict[str, Any]]:
    """Each statement's calls, server µs and WAL bytes per job between two snapshots, costliest
    first; statements whose text is in ``leave_out`` (the benchmark's own) are not counted."""
    names, skipped = _names(), {_key(text) for text in leave_out}
    rows: list[dict[str, Any]] = []
    for queryid, now in after.items():
        key = _key(now["query"])
        if key in skipped:
            continue
        then = before.get(queryid, {})
        calls = now["calls"] - then.get("calls", 0)
        if calls <= 0 or jobs <= 0:
            continue
        rows.append(
            {
                "statement": names.get(key) or _SPACES.sub(" ", now["query"]).strip()[:60],
                "calls_per_1000_jobs": calls * 1000 / jobs,
                "server_us_per_job": (now["total_exec_time"] - then.get("total_exec_time", 0.0))
                * 1000
                / jobs,
                "wal_bytes_per_job": float(now["wal_bytes"] - then.get("wal_bytes", 0)) / jobs,
            }
        )
    return sorted(rows, key=lambda row: -row["server_us_per_job"])


def combine(measured: Sequence[Sequence[Mapping[str, Any]]]) -> list[dict[str, Any]]:
    """One system's statements over several measurements: the mean of each per-job figure."""
    sums: dict[str, dict[str, float]] = {}
    for statements in measured:
        for row in statements:
            total = sums.setdefault(row["statement"], {})
            for key, value in row.items():
                if key != "statement":
                    total[key] = total.get(key, 0.0) + value
    count = len(measured) or 1
    rows = [
        {"statement": name, **{key: value / count for key, value in total.items()}}
        for name, total in sums.items()
    ]
    return sorted(rows, key=lambda row: -row["server_us_per_job"])


def format_statements(by_system: Mapping[str, Sequence[Mapping[str, Any]]], top: int) -> list[str]:
    """The report's lines: each system's costliest statements."""
    out = [
        "",
        "server side per statement (pg_stat_statements; means of the rounds, per job):",
        f"{'system':<22} {'statement':<42} {'calls/1k':>8} {'µs/job':>7} {'WAL B/job':>9}",
    ]
    for system, statements in by_system.items():
        for row in statements[:top]:
            out.append(
                f"{system:<22} {row['statement'][:42]:<42} {row['calls_per_1000_jobs']:>8.1f} "
                f"{row['server_us_per_job']:>7.1f} {row['wal_bytes_per_job']:>9.0f}"
            )
        total_us = sum(row["server_us_per_job"] for row in statements)
        total_wal = sum(row["wal_bytes_per_job"] for row in statements)
        everything = "(all statements)"
        out.append(f"{system:<22} {everything:<42} {'':>8} {total_us:>7.1f} {total_wal:>9.0f}")
    return out
