"""The action proxy as a real HTTP server process: auth, limits, validation, fencing."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import IO, Any

import anyio
import asyncpg
import httpx
import pytest

from orchestrator.backoff import Backoff
from orchestrator.db.store import RunStore
from orchestrator.effect_model import AcceptOutcome

pytestmark = pytest.mark.slow

TOKEN = "test-token-7f3a"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def start_proxy(
    database_url: str,
    port: int,
    *extra: str,
    stderr: int | IO[bytes] | None = subprocess.DEVNULL,
    tokens: str = f"other-token,{TOKEN}",
    fence_store: Path | None = None,
) -> subprocess.Popen[bytes]:
    if fence_store is not None:
        extra = ("--fence-store", str(fence_store), *extra)
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "orchestrator.cli",
            "effects",
            "serve",
            "--listen",
            f"127.0.0.1:{port}",
            "--max-body-bytes",
            "2048",
            "--log-json",
            *extra,
        ],
        env={
            **os.environ,
            "ORCHESTRATOR_DATABASE_URL": database_url,
            "ORCHESTRATOR_PROXY_TOKENS": tokens,
        },
        stdout=subprocess.DEVNULL,
        stderr=stderr,
    )


@pytest.fixture
async def proxy(database_url: str) -> AsyncIterator[httpx.AsyncClient]:
    async with running_proxy(database_url) as client:
        yield client


@contextlib.asynccontextmanager
async def running_proxy(
    database_url: str,
    *extra: str,
    tokens: str = f"other-token,{TOKEN}",
    fence_store: Path | None = None,
    stderr: IO[bytes] | None = None,
) -> AsyncIterator[httpx.AsyncClient]:
    port = free_port()
    process = start_proxy(
        database_url,
        port,
        *extra,
        tokens=tokens,
        fence_store=fence_store,
        stderr=subprocess.DEVNULL if stderr is None else stderr,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        async with httpx.AsyncClient(base_url=base, timeout=10) as client:
            with anyio.fail_after(60):
                while True:
                    try:
                        if (await client.get("/healthz")).status_code == 200:
                            break
                    except httpx.TransportError:
                        assert process.poll() is None, "the proxy exited"
                    await asyncio.sleep(0.1)
            yield client
    finally:
        process.terminate()
        process.wait(60)


async def test_tokens_come_from_a_file_kept_off_the_command_line(
    database_url: str, tmp_path: Path
) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text("file-token-1\n\nfile-token-2,file-token-3\n")
    async with running_proxy(database_url, "--tokens-file", str(tokens), tokens="") as client:
        for token in ("file-token-1", "file-token-2", "file-token-3"):
            known = await client.get("/v1/effects/r_missing/key", headers=auth(token))
            assert known.status_code in (404, 422), (token, known.text)
        refused = await client.get("/v1/effects/r_missing/key", headers=auth(TOKEN))
        assert refused.status_code == 401
    unreadable = start_proxy(
        database_url,
        free_port(),
        "--tokens-file",
        str(tmp_path / "absent"),
        tokens="",
        stderr=subprocess.PIPE,
    )
    _, said = unreadable.communicate(timeout=30)
    assert unreadable.returncode == 1
    [line] = said.decode().strip().splitlines()
    assert "cannot read --tokens-file" in line and "absent" in line


def auth(token: str = TOKEN) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


async def effect_count(pool: asyncpg.Pool) -> int:
    return int(await pool.fetchval("SELECT count(*) FROM effects"))


def request(run_id: str, fence: int, **changes: Any) -> dict[str, Any]:
    body = {
        "run_id": run_id,
        "effect_key": "crm-note",
        "fence": fence,
        "kind": "crm",
        "payload": {"note": "hi"},
    }
    body.update(changes)
    return body


async def test_accept_read_and_reject_a_stale_fence(
    proxy: httpx.AsyncClient, store: RunStore
) -> None:
    await store.submit("agent", {})
    a = (await store.claim("A", ["agent"], lease_seconds=0.3)).claimed[0]
    first = await proxy.post("/v1/effects", json=request(a.run_id, a.fence), headers=auth())
    assert first.status_code == 201, first.text
    assert first.json()["effect"]["status"] == "accepted"
    again = await proxy.post("/v1/effects", json=request(a.run_id, a.fence), headers=auth())
    assert (again.status_code, again.json()["outcome"]) == (200, "existing")
    read = await proxy.get(f"/v1/effects/{a.run_id}/crm-note", headers=auth())
    assert read.status_code == 200 and read.json()["effect"]["fence"] == 1

    await anyio.sleep(0.4)
    b = (await store.claim("B", ["agent"], lease_seconds=30)).claimed[0]
    stale = await proxy.post(
        "/v1/effects", json=request(a.run_id, a.fence, effect_key="other"), headers=auth()
    )
    assert stale.status_code == 409
    assert stale.json()["error"] == "stale_fence" and stale.json()["accepted_fence"] == b.fence
    assert "stale_fence_rejected" in [e.kind for e in await store.events(a.run_id)]
    missing = await proxy.get(f"/v1/effects/{a.run_id}/nope", headers=auth())
    assert missing.status_code == 404


@pytest.mark.parametrize(
    ("headers", "content", "status", "error"),
    [
        ({}, b"{}", 401, "unauthorized"),
        ({"Authorization": "Bearer wrong"}, b"{}", 401, "unauthorized"),
        ({"Authorization": "Basic abc"}, b"{}", 401, "unauthorized"),
        (auth(), b"{not json", 400, "invalid_json"),
        (auth(), b"[1, 2]", 422, "invalid_request"),
        (
            auth(),
            b'{"run_id": "r_x", "effect_key": "k", "kind": "crm", "payload": 1}',
            422,
            "invalid_request",
        ),
        (
            auth(),
            b'{"run_id": "bad id", "effect_key": "k", "fence": 1, "kind": "crm", "payload": 1}',
            422,
            "invalid_request",
        ),
        (
            auth(),
            b'{"run_id": "r_x", "effect_key": "k", "fence": 1, "kind": "crm", '
            b'"payload": 1, "extra": true}',
            422,
            "invalid_request",
        ),
        (
            auth(),
            b'{"run_id": "r_x", "effect_key": "has space", "fence": 1, "kind": "crm", '
            b'"payload": 1}',
            422,
            "invalid_request",
        ),
        (auth(), b'{"payload": "' + b"x" * 4096 + b'"}', 413, "too_large"),
    ],
)
async def test_bad_requests_get_clear_errors_and_change_nothing(
    proxy: httpx.AsyncClient,
    pool: asyncpg.Pool,
    headers: dict[str, str],
    content: bytes,
    status: int,
    error: str,
) -> None:
    before = await effect_count(pool)
    response = await proxy.post(
        "/v1/effects", content=content, headers={**headers, "Content-Type": "application/json"}
    )
    assert response.status_code == status, response.text
    assert response.json()["error"] == error
    assert response.json()["detail"]
    assert await effect_count(pool) == before


async def test_reads_need_a_token_too(proxy: httpx.AsyncClient) -> None:
    assert (await proxy.get("/v1/effects/r_x/k")).status_code == 401
    assert (await proxy.get("/v1/effects/r_x/k", headers=auth("other-token"))).status_code == 404


async def test_an_unknown_run_gets_404_and_nothing_is_recorded(
    proxy: httpx.AsyncClient, pool: asyncpg.Pool
) -> None:
    response = await proxy.post("/v1/effects", json=request("r_nobody", 1), headers=auth())
    assert response.status_code == 404, response.text
    assert response.json()["error"] == "unknown_run"
    assert await effect_count(pool) == 0
    assert await pool.fetchval("SELECT count(*) FROM effect_fences") == 0


async def test_a_fence_from_the_future_is_refused_and_the_owner_keeps_working(
    proxy: httpx.AsyncClient, store: RunStore, pool: asyncpg.Pool
) -> None:
    await store.submit("agent", {})
    owner = (await store.claim("A", ["agent"], lease_seconds=30)).claimed[0]
    forged = await proxy.post("/v1/effects", json=request(owner.run_id, 1_000_000), headers=auth())
    assert forged.status_code == 409, forged.text
    body = forged.json()
    assert (body["error"], body["current_fence"], body["run_state"]) == (
        "fence_not_granted",
        1,
        "running",
    )
    assert "never granted" in body["detail"]
    assert await effect_count(pool) == 0
    # The owner is not fenced out: its effect is accepted and its commit goes through.
    own = await proxy.post("/v1/effects", json=request(owner.run_id, owner.fence), headers=auth())
    assert own.status_code == 201, own.text
    assert await store.commit_step(owner.lease, expected_version=0, next_step="s", checkpoint={})


@pytest.mark.parametrize(
    ("end", "error", "says"),
    [
        ("cancel", "run_cancelled", "was cancelled"),
        ("finish", "run_finished", "has already ended (succeeded)"),
        ("wait", "run_not_running", "is waiting, not running"),
    ],
)
async def test_a_run_that_is_not_running_refuses_effects_and_says_why(
    proxy: httpx.AsyncClient,
    store: RunStore,
    pool: asyncpg.Pool,
    end: str,
    error: str,
    says: str,
) -> None:
    await store.submit("agent", {})
    run = (await store.claim("A", ["agent"], lease_seconds=30)).claimed[0]
    if end == "cancel":
        await store.cancel(run.run_id)
    elif end == "finish":
        assert await store.finish(run.lease, expected_version=0, result={})
    else:
        patient = RunStore(pool, backoff=Backoff(base_seconds=600))
        assert await patient.fail_attempt(run.lease, error={"message": "later"})
    current = (await store.get(run.run_id)).fence
    response = await proxy.post("/v1/effects", json=request(run.run_id, run.fence), headers=auth())
    assert response.status_code == 409, response.text
    body = response.json()
    assert (body["error"], body["current_fence"]) == (error, current)
    assert says in body["detail"] and "another worker owns" not in body["detail"]
    assert await effect_count(pool) == 0


async def test_the_proxy_serves_metrics_and_readiness(database_url: str) -> None:
    port, metrics_port = free_port(), free_port()
    process = start_proxy(
        database_url, port, "--metrics-listen", f"127.0.0.1:{metrics_port}", stderr=None
    )
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{metrics_port}") as client:
            ready = None
            with anyio.fail_after(60):
                while ready is None or ready.status_code != 200:
                    try:
                        ready = await client.get("/ready")
                    except httpx.TransportError:
                        await asyncio.sleep(0.1)
            assert ready.json() == {"ready": True, "reason": "ready"}
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as proxy_client:
                answer = await proxy_client.post(
                    "/v1/effects", json=request("r_missing", 1), headers=auth()
                )
            assert answer.status_code == 404
            scraped = await client.get("/metrics")
            assert scraped.status_code == 200
            counted = {
                line.split('outcome="', 1)[1].split('"', 1)[0]: float(line.rpartition(" ")[2])
                for line in scraped.text.splitlines()
                if line.startswith("orchestrator_proxy_requests_total{")
            }
            # Every answer has a series from the start (at 0), so increase() alerts see one.
            assert counted == {
                **{o.value: 1.0 if o.value == "unknown_run" else 0.0 for o in AcceptOutcome},
                "fence_regression": 0.0,
                "forbidden": 0.0,
            }
    finally:
        process.terminate()  # uvicorn ends on SIGTERM by re-raising it: no exit status to check
        process.wait(60)
