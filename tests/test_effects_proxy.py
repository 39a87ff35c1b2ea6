"""The action proxy as a real HTTP server process: auth, limits, validation, fencing."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from typing import Any

import anyio
import asyncpg
import httpx
import pytest

from orchestrator.store import RunStore

TOKEN = "test-token-7f3a"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def start_proxy(database_url: str, port: int) -> subprocess.Popen[bytes]:
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
        ],
        env={
            **os.environ,
            "ORCHESTRATOR_DATABASE_URL": database_url,
            "ORCHESTRATOR_PROXY_TOKENS": f"other-token,{TOKEN}",
        },
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


@pytest.fixture
async def proxy(database_url: str) -> AsyncIterator[httpx.AsyncClient]:
    port = free_port()
    process = start_proxy(database_url, port)
    base = f"http://127.0.0.1:{port}"
    try:
        async with httpx.AsyncClient(base_url=base, timeout=10) as client:
            with anyio.fail_after(20):
                while True:
                    try:
                        if (await client.get("/healthz")).status_code == 200:
                            break
                    except httpx.TransportError:
                        pass
                    await asyncio.sleep(0.1)
            yield client
    finally:
        process.terminate()
        process.wait(10)


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
