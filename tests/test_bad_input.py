"""Bad input, as a careless user or an attacker sends it: a clear one-line refusal, nothing changed.

Real processes for the command line (stderr is a pipe, not a terminal: no wrapping at 80
columns), a real action proxy on loopback, a real database; every refusal is checked to have
left the database as it was and to have printed no traceback.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import anyio
import asyncpg
import httpx
import pytest

from orchestrator.db.store import RunStore
from support import cli_bytes
from test_effects_proxy import free_port

pytestmark = pytest.mark.slow


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
    one_line_refusal(cli_bytes(database_url, *args, stdin=stdin), says)
    assert await database_state(pool) == before


async def test_a_file_of_invalid_utf8_is_refused(
    database_url: str, pool: asyncpg.Pool, tmp_path: Path
) -> None:
    path = tmp_path / "input.json"
    path.write_bytes(INVALID_UTF8)
    before = await database_state(pool)
    one_line_refusal(
        cli_bytes(database_url, "submit", "a", "--input", f"@{path}"), "not valid UTF-8"
    )
    assert await database_state(pool) == before


async def test_large_integers_and_emoji_are_stored_as_given(
    database_url: str, store: RunStore
) -> None:
    """What jsonb holds is accepted: the refusals above are not over-eager."""
    document = {"n": 10**30, "neg": -(2**63), "emoji": "😀", "slash": "\\u0000 is text here"}
    result = cli_bytes(database_url, "submit", "a", "--input", json.dumps(document), "--json")
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
    result = cli_bytes(url, "runs", "list")
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
    one_line_refusal(cli_bytes(database_url, "runs", "list", env={variable: value}), says)


def test_a_long_error_stays_on_one_line_whatever_the_width(database_url: str) -> None:
    long_id = "r_" + "a" * 120
    for columns in ("20", "80", "300"):
        result = cli_bytes(database_url, "runs", "show", long_id, env={"COLUMNS": columns})
        one_line_refusal(result, "no run with id")


def test_serve_with_an_unreachable_database_exits_1_on_one_line() -> None:
    """A failure inside serve's task group reaches the user as its one line, not a traceback."""
    result = cli_bytes(
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
    result = cli_bytes("postgresql://", "runs", "list", "--json", env=env)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == []
    disabled = cli_bytes(database_url + "?sslmode=disable", "runs", "list", "--json")
    assert disabled.returncode == 0, disabled.stderr
    # The embedded test server has no TLS: sslmode=require is refused, and says so on one line.
    one_line_refusal(cli_bytes(database_url + "?sslmode=require", "runs", "list"), "cannot reach")


# -- amounts, durations and times out of range; signals and budgets from the command line ------
OUT_OF_RANGE: list[tuple[list[str], str]] = [
    (
        ["runs", "budget", "RUN", "--add-usd", "0"],
        "--add-usd must be a number of US dollars above 0",
    ),
    (
        ["runs", "budget", "RUN", "--add-usd", "-1"],
        "--add-usd must be a number of US dollars above 0",
    ),
    (["runs", "budget", "RUN", "--add-usd", "nan"], "--add-usd must be a number of US dollars"),
    (["runs", "budget", "RUN", "--add-turns", "0"], "--add-turns must be a whole number from 1"),
    (["runs", "budget", "RUN", "--add-turns", "-5"], "--add-turns must be a whole number from 1"),
    (
        ["runs", "budget", "RUN", "--add-usd", "5", "--add-input-tokens", "-5000"],
        "--add-input-tokens must be a whole number from 1",
    ),
    (["runs", "list", "--since", "99999999999999d"], "--since must be above 0 and at most 100"),
    (["runs", "list", "--since", "9" * 400 + "s"], "--since must be above 0 and at most 100"),
    (["runs", "purge", "--older-than", "99999999999999d"], "--older-than must be above 0"),
    (["runs", "cancel", "--until", "99999999999999w"], "--until must be above 0"),
    (
        ["runs", "list", "--since", "yesterday"],
        "--since takes an age such as 2h, 90m or 7d, or an ISO",
    ),
    (["runs", "signal", "RUN", "go", "--data", "yes"], "--data is not valid JSON"),
    (["submit", "a", "--delay", "nan"], "a delay is 0 or more seconds, at most ten years"),
    (["submit", "a", "--delay", "1e300"], "a delay is 0 or more seconds, at most ten years"),
    (["submit", "a", "--delay", "-1"], "a delay is 0 or more seconds, at most ten years"),
    (["submit", "a", "--at", "0001-01-01T00:00:00+01:00"], "is out of range; give a time"),
    (["submit", "a", "--at", "9999-12-31T23:00:00-05:00"], "is out of range; give a time"),
    (["submit", "a", "--at", "1990-01-01T00:00:00Z"], "at most ten years from now"),
    (["runs", "list", "--since", "0001-01-01T00:00:00+14:00"], "--since '0001-01-01T00:00:00+14"),
    (["runs", "list", "--until", "9999-12-31T23:59:59-12:00"], "is out of range; give a time"),
    (["runs", "purge", "--older-than", "0.0000001s"], "--older-than must be above 0"),
]


async def test_amounts_durations_and_times_out_of_range_are_one_line_errors(
    database_url: str, store: RunStore, pool: asyncpg.Pool
) -> None:
    run_id = (await store.submit("nobody_serves_this", {})).run.run_id
    before = await database_state(pool)
    for args, says in OUT_OF_RANGE:
        one_line_refusal(
            cli_bytes(database_url, *[run_id if a == "RUN" else a for a in args]), says
        )
    assert await database_state(pool) == before
    assert await pool.fetchval("SELECT count(*) FROM run_signals") == 0


async def test_a_bad_signal_data_message_is_one_clear_line(database_url: str) -> None:
    result = cli_bytes(database_url, "runs", "signal", "r_x", "go", "--data", "yes")
    line = result.stderr.decode().strip()
    assert line == (
        "error: --data is not valid JSON (Expecting value at line 1 column 1); give JSON such "
        'as \'{"text": "yes"}\' or null, or @file.json'
    ), line


async def test_a_signal_without_data_and_a_start_time_in_the_past_are_accepted(
    database_url: str, store: RunStore, pool: asyncpg.Pool
) -> None:
    run_id = (await store.submit("nobody_serves_this", {})).run.run_id
    sent = cli_bytes(database_url, "runs", "signal", run_id, "go")
    assert sent.returncode == 0, sent.stderr
    assert await pool.fetchval("SELECT jsonb_typeof(data) FROM run_signals") == "null"
    past = cli_bytes(database_url, "submit", "a", "--at", "2020-01-01T00:00:00Z")
    assert past.returncode == 0, past.stderr
    warned = past.stderr.decode()
    assert "warning: --at 2020-01-01T00:00:00Z is in the past" in warned and "due now" in warned
    late = await store.get(past.stdout.decode().strip())
    assert late.available_at is not None and late.available_at < await store.database_now()


async def test_the_console_answers_an_age_out_of_range_with_a_400(database_url: str) -> None:
    port = free_port()
    console = await anyio.open_process(
        [sys.executable, "-m", "orchestrator.cli", "console", "--listen", f"127.0.0.1:{port}"],
        env={**os.environ, "ORCHESTRATOR_DATABASE_URL": database_url},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=5) as client:
            with anyio.fail_after(30):
                while True:
                    assert console.returncode is None, "the console exited"
                    with contextlib.suppress(httpx.TransportError):
                        if (await client.get("/healthz")).status_code == 200:
                            break
                    await anyio.sleep(0.1)
            for age in ("99999999999999d", "9" * 400 + "s"):
                page = await client.get("/runs", params={"since": age})
                assert page.status_code == 400, page.text
                assert "at most 100 years" in page.text
            assert (await client.get("/runs", params={"since": "yesterday"})).status_code == 400
    finally:
        console.terminate()
        with anyio.fail_after(15):
            await console.wait()


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["submit", "a", "--at", "2030-01-01T00:00:00Z", "--delay", "1"], "give --at or --delay"),
        (["runs", "list", "--limit", "0"], "Invalid value for '--limit'"),
        (["submit"], "Missing argument 'AGENT'"),
        (["runs", "nope"], "No such command 'nope'"),
    ],
)
def test_usage_errors_are_one_error_line_too(database_url: str, args: list[str], says: str) -> None:
    result = cli_bytes(database_url, *args)
    stderr = result.stderr.decode()
    assert result.returncode == 2, stderr
    assert stderr.startswith("error: ") and says in stderr and "--help" in stderr, stderr
    assert len(stderr.strip().splitlines()) == 1 and "Error:" not in stderr
