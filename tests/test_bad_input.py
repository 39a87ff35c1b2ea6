"""Bad input, as a careless user or an attacker sends it: a clear one-line refusal, nothing changed.

Real processes for the command line (stderr is a pipe, not a terminal: no wrapping at 80
columns), a real action proxy on loopback, a real database; every refusal is checked to have
left the database as it was and to have printed no traceback.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import asyncpg
import pytest

from orchestrator.db.store import RunStore

pytestmark = pytest.mark.slow


def cli(
    database_url: str | None,
    *args: str | bytes,
    stdin: bytes | None = None,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[bytes]:
    base = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    if database_url is not None:
        base["ORCHESTRATOR_DATABASE_URL"] = database_url
    return subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", *args],
        input=stdin,
        capture_output=True,
        env={**base, **(env or {})},
        timeout=60,
        check=False,
    )


async def database_state(pool: asyncpg.Pool) -> tuple[Any, ...]:
    """Everything a refused command could have changed."""
    return (
        [tuple(r) for r in await pool.fetch("SELECT run_id, state, fence FROM runs ORDER BY 1")],
        await pool.fetchval("SELECT count(*) FROM run_events"),
        await pool.fetchval("SELECT count(*) FROM effects"),
        [tuple(r) for r in await pool.fetch("SELECT * FROM effect_fences ORDER BY 1")],
    )


def one_line_refusal(result: subprocess.CompletedProcess[bytes], says: str) -> None:
    stderr = result.stderr.decode("utf-8", "replace")
    assert result.returncode == 1, (result.returncode, stderr)
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    assert lines[0].startswith("error: ") and says in lines[0], lines[0]
    assert "Traceback" not in stderr
    assert result.stdout == b""


NUL_ESCAPE = '{"note": "a\\u0000b"}'
LONE_SURROGATE = '{"note": "\\ud800"}'
DEEP = "[" * 50_000 + "]" * 50_000
INVALID_UTF8 = b'{"note": "caf\xe9"}'


@pytest.mark.parametrize(
    ("args", "stdin", "says"),
    [
        (["submit", "a", "--input", NUL_ESCAPE], None, "NUL character"),
        (["submit", "a", "--input", LONE_SURROGATE], None, "lone surrogate"),
        (["submit", "a", "--input", '{"x": NaN}'], None, "NaN is not a JSON number"),
        (["submit", "a", "--input", '{"x": -Infinity}'], None, "is not a JSON number"),
        (["submit", "a", "--input", '{"x": 1e400}'], None, "not a JSON number"),
        (["submit", "a", "--input", '{"x": ' + "9" * 5000 + "}"], None, "not valid JSON"),
        (["submit", "a", "--input", "@-"], DEEP.encode(), "nested more than 200 levels"),
        (["submit", "a", "--input", "[" * 300 + "]" * 300], None, "nested more than 200"),
        (["submit", "a", "--input", "@-"], INVALID_UTF8, "standard input is not valid UTF-8"),
        (["submit", "a", "--input", "@-"], NUL_ESCAPE.encode(), "NUL character"),
        (["submit", "a", "--idempotency-key", b"key-\xff"], None, "idempotency key is not valid"),
        (["submit", "a", "--idempotency-key", "k\x01\x02" * 100], None, "1-200 characters"),
        (["submit", b"agent\xff"], None, "malformed agent name"),
        (["runs", "show", b"r_\xff"], None, "malformed run id"),
        (["runs", "show", "r_" + "x" * 300], None, "malformed run id"),
        (["runs", "cancel", "r_nobody", "--reason", b"why\xff"], None, "cancel reason"),
        (["effects", "show", "r_x", b"key\xff"], None, "malformed effect key"),
        (["effects", "show", "r_x", "a b"], None, "malformed effect key"),
        (["effects", "list", "--run", b"r_\xff"], None, "malformed run id"),
    ],
)
async def test_bad_values_are_refused_on_one_line_and_change_nothing(
    database_url: str, pool: asyncpg.Pool, args: list[str | bytes], stdin: bytes | None, says: str
) -> None:
    before = await database_state(pool)
    one_line_refusal(cli(database_url, *args, stdin=stdin), says)
    assert await database_state(pool) == before


async def test_a_file_of_invalid_utf8_is_refused(
    database_url: str, pool: asyncpg.Pool, tmp_path: Path
) -> None:
    path = tmp_path / "input.json"
    path.write_bytes(INVALID_UTF8)
    before = await database_state(pool)
    one_line_refusal(cli(database_url, "submit", "a", "--input", f"@{path}"), "not valid UTF-8")
    assert await database_state(pool) == before


async def test_large_integers_and_emoji_are_stored_as_given(
    database_url: str, store: RunStore
) -> None:
    """What jsonb holds is accepted: the refusals above are not over-eager."""
    document = {"n": 10**30, "neg": -(2**63), "emoji": "😀", "slash": "\\u0000 is text here"}
    result = cli(database_url, "submit", "a", "--input", json.dumps(document), "--json")
    assert result.returncode == 0, result.stderr
    run_id = json.loads(result.stdout)["run"]["run_id"]
    assert (await store.get(run_id)).input == document


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("not a url", "must start with postgresql://"),
        ("http://127.0.0.1:5432/db", "must start with postgresql://"),
        ("postgresql://127.0.0.1:70000/db", "port '70000'"),
        ("postgresql://127.0.0.1:-1/db", "port '-1'"),
        ("postgresql://[::1/db", "is not a URL"),
        ("postgresql://127.0.0.1:5432/db?sslmode=sometimes", "sslmode"),
    ],
)
def test_a_bad_database_url_is_refused_on_one_line(url: str, says: str) -> None:
    result = cli(url, "runs", "list")
    one_line_refusal(result, says)


@pytest.mark.parametrize(
    ("variable", "value", "says"),
    [
        ("ORCHESTRATOR_STATEMENT_TIMEOUT_SECONDS", "soon", "is not a number"),
        ("ORCHESTRATOR_CONNECT_TIMEOUT_SECONDS", "-1", "must be greater than zero"),
        ("ORCHESTRATOR_MAX_INPUT_BYTES", "lots", "is not a number"),
        ("ORCHESTRATOR_SCHEMA", "Robert'); DROP TABLE runs;--", "not a usable schema name"),
        ("ORCHESTRATOR_SCHEMA", "pg_temp", "not a usable schema name"),
    ],
)
def test_a_bad_setting_is_refused_on_one_line(
    database_url: str, variable: str, value: str, says: str
) -> None:
    one_line_refusal(cli(database_url, "runs", "list", env={variable: value}), says)


def test_a_long_error_stays_on_one_line_whatever_the_width(database_url: str) -> None:
    long_id = "r_" + "a" * 120
    for columns in ("20", "80", "300"):
        result = cli(database_url, "runs", "show", long_id, env={"COLUMNS": columns})
        one_line_refusal(result, "no run with id")


def test_serve_with_an_unreachable_database_exits_1_on_one_line() -> None:
    """A failure inside serve's task group reaches the user as its one line, not a traceback."""
    result = cli(
        "postgresql://app:hunter2@127.0.0.1:1/orchestrator",
        "serve",
        "--agents",
        "orchestrator.agents.noop",
        "--log-json",
        "--start-retry-seconds",
        "0",
        env={"ORCHESTRATOR_CONNECT_TIMEOUT_SECONDS": "2"},
    )
    one_line_refusal(result, "cannot reach PostgreSQL at postgresql://app:***@127.0.0.1:1/")
    assert b"hunter2" not in result.stderr


def test_libpq_environment_fills_in_what_the_url_leaves_out(database_url: str) -> None:
    """PGHOST, PGPORT, PGUSER and PGDATABASE complete `postgresql://`, as libpq tools do."""
    parts = urlsplit(database_url)
    env = {
        "PGHOST": parts.hostname or "",
        "PGPORT": str(parts.port),
        "PGUSER": parts.username or "",
        "PGDATABASE": parts.path.lstrip("/"),
    }
    result = cli("postgresql://", "runs", "list", "--json", env=env)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == []
    disabled = cli(database_url + "?sslmode=disable", "runs", "list", "--json")
    assert disabled.returncode == 0, disabled.stderr
    # The embedded test server has no TLS: sslmode=require is refused, and says so on one line.
    one_line_refusal(cli(database_url + "?sslmode=require", "runs", "list"), "cannot reach")
