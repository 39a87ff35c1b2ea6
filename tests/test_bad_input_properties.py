"""Property-based: arbitrary JSON-ish text and bytes at every entry point a user can reach.

Each example must end in a clean refusal (exit 1 with one line on stderr, or a 4xx from the
action proxy) that left the database as it was, or in a valid acceptance that stored exactly
what was sent. The command line runs in-process (``CliRunner``: the same code as the real
process, without a Python start-up per example); the proxy is a real server process.
"""

from __future__ import annotations

import json
import math
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import asyncpg
import httpx
import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from orchestrator.cli import main
from orchestrator.db.connections import create_pool
from orchestrator.db.store import RunStore
from orchestrator.settings import Settings
from test_effects_proxy import TOKEN, free_port, start_proxy

pytestmark = pytest.mark.slow

EXAMPLES = settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

# Every character, surrogates and control characters included.
any_text = st.text(st.characters(exclude_categories=()), max_size=20)
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(10**30), max_value=10**30),
    st.floats(allow_nan=True, allow_infinity=True),
    any_text,
)
json_ish = st.recursive(
    scalars,
    lambda children: st.one_of(
        st.lists(children, max_size=4), st.dictionaries(any_text, children, max_size=4)
    ),
    max_leaves=12,
)


def as_text(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, allow_nan=True)


def nested(depth: int) -> str:
    return '{"a":' * depth + "1" + "}" * depth


documents = st.one_of(
    json_ish.map(lambda value: as_text({"doc": value})),
    json_ish.map(as_text),
    any_text,
    st.integers(min_value=150, max_value=5000).map(nested),
)


def run_sync(function: Any, *args: Any) -> Any:
    return anyio.run(function, *args)


async def snapshot(dsn: str) -> tuple[Any, ...]:
    connection = await asyncpg.connect(dsn, server_settings={"search_path": "orchestrator"})
    try:
        return (
            [tuple(r) for r in await connection.fetch("SELECT run_id, state, fence FROM runs")],
            await connection.fetchval("SELECT count(*) FROM run_events"),
            await connection.fetchval("SELECT count(*) FROM effects"),
            [tuple(r) for r in await connection.fetch("SELECT * FROM effect_fences")],
        )
    finally:
        await connection.close()


def invoke(dsn: str, args: list[str], stdin: bytes | None = None) -> Any:
    runner = CliRunner()
    return runner.invoke(main, args, input=stdin, env={"ORCHESTRATOR_DATABASE_URL": dsn})


def assert_clean_refusal(result: Any) -> None:
    assert result.exit_code == 1, (result.exit_code, result.output, result.exception)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert result.stdout == ""


def same_json(a: Any, b: Any) -> bool:
    """Equal as JSON values (floats compared as jsonb's numeric gives them back)."""
    if isinstance(a, float) or isinstance(b, float):
        return isinstance(a, int | float) and isinstance(b, int | float) and math.isclose(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_json(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same_json(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


@pytest.mark.parametrize("channel", ["argument", "stdin", "file"])
@EXAMPLES
@given(document=documents, raw=st.binary(max_size=64))
def test_submit_refuses_cleanly_or_stores_exactly_what_was_sent(
    database_url: str, tmp_path: Path, channel: str, document: str, raw: bytes
) -> None:
    before = run_sync(snapshot, database_url)
    data = document.encode("utf-8", "surrogatepass") if channel != "argument" else b""
    if channel == "file" and raw:
        data = raw  # arbitrary bytes, most of them not UTF-8
    path = tmp_path / "input.json"
    path.write_bytes(data)
    source = {"argument": document, "stdin": "@-", "file": f"@{path}"}[channel]
    result = invoke(database_url, ["submit", "agent", "--input", source, "--json"], data)
    if result.exit_code != 0:
        assert_clean_refusal(result)
        assert run_sync(snapshot, database_url) == before
        return
    run = json.loads(result.stdout)["run"]
    sent = json.loads(data if channel != "argument" else document)
    stored = run_sync(stored_input, database_url, run["run_id"])
    assert same_json(stored, sent)


async def stored_input(dsn: str, run_id: str) -> Any:
    pool = await create_pool(Settings(database_url=dsn), min_size=1, max_size=1)
    try:
        return (await RunStore(pool).get(run_id)).input
    finally:
        await pool.close()


@EXAMPLES
@given(run_id=any_text, effect_key=any_text)
def test_show_commands_refuse_cleanly_whatever_the_ids(
    database_url: str, run_id: str, effect_key: str
) -> None:
    before = run_sync(snapshot, database_url)
    for args in (["runs", "show", run_id], ["effects", "show", run_id, effect_key]):
        result = invoke(database_url, args)
        if result.exit_code == 2:  # click's usage error: an id starting with "-" is an option
            assert run_id.startswith("-") or effect_key.startswith("-")
            continue
        assert_clean_refusal(result)
    assert run_sync(snapshot, database_url) == before


@pytest.fixture
def proxy_url(database_url: str) -> Iterator[str]:
    port = free_port()
    process = start_proxy(database_url, port, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        with httpx.Client(base_url=url, timeout=10) as client:
            for _ in range(200):
                try:
                    if client.get("/healthz").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                anyio.run(anyio.sleep, 0.1)
        yield url
    finally:
        process.terminate()
        _, stderr = process.communicate(timeout=10)
        assert b"Traceback" not in stderr, stderr.decode(errors="replace")[-3000:]
        assert b'"level": "error"' not in stderr, stderr.decode(errors="replace")[-3000:]


async def a_running_run(dsn: str) -> tuple[str, int]:
    pool = await create_pool(Settings(database_url=dsn), min_size=1, max_size=1)
    try:
        store = RunStore(pool)
        await store.submit("agent", {})
        claimed = (await store.claim("W", ["agent"], lease_seconds=600)).claimed[0]
        return claimed.run_id, claimed.fence
    finally:
        await pool.close()


def effect_bodies(run_id: str, fence: int) -> st.SearchStrategy[bytes]:
    fields = st.fixed_dictionaries(
        {
            "run_id": st.one_of(st.just(run_id), any_text),
            "effect_key": st.one_of(st.just("note"), any_text),
            "fence": st.one_of(
                st.just(fence),
                st.integers(min_value=-(2**70), max_value=2**70),
                st.just(2**63),
                st.floats(allow_nan=True),
                any_text,
            ),
            "kind": st.one_of(st.just("crm"), any_text),
            "payload": json_ish,
        },
        optional={
            "policy": st.one_of(st.sampled_from(["irreversible", "replaceable"]), any_text),
            "worker_id": st.one_of(st.just("W"), any_text, st.integers()),
        },
    )
    return st.one_of(
        fields.map(lambda body: as_text(body).encode("utf-8", "surrogatepass")),
        st.binary(max_size=64),
        st.integers(min_value=150, max_value=20_000).map(lambda depth: nested(depth).encode()),
    )


def test_the_action_proxy_never_answers_500_and_refusals_change_nothing(
    database_url: str, proxy_url: str
) -> None:
    run_id, fence = run_sync(a_running_run, database_url)
    headers = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
    client = httpx.Client(base_url=proxy_url, timeout=10, headers=headers)

    @EXAMPLES
    @given(body=effect_bodies(run_id, fence))
    def property(body: bytes) -> None:
        before = run_sync(snapshot, database_url)
        response = client.post("/v1/effects", content=body)
        assert response.status_code in (200, 201, 400, 404, 409, 413, 422), response.text
        assert response.json()["error" if response.status_code >= 400 else "outcome"]
        if response.status_code >= 400:
            after = run_sync(snapshot, database_url)
            assert after[2:] == before[2:]  # no effect, no fence moved
            if response.status_code != 409:  # a 409 leaves its refusal in the timeline
                assert after == before

    try:
        property()
    finally:
        client.close()
