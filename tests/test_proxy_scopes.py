"""Services' database tokens at the action proxy: only a working service token is taken, and a
request outside its scope is refused 403 with nothing recorded (the real app served on loopback
by uvicorn, a real HTTP client, a real PostgreSQL)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import subprocess
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
import asyncpg
import httpx
import pytest
import structlog.testing
import uvicorn

from orchestrator.access import PrincipalKind, Role, TokenScope
from orchestrator.db.access import AccessStore
from orchestrator.db.store import RunStore
from orchestrator.effects.proxy import FORBIDDEN, AuthCache, create_app
from orchestrator.testing import capture_metrics
from test_effects_proxy import free_port, running_proxy, start_proxy

FLAT = "flat-token-kept-working"
PAYMENTS = "payments"
NOTES = "notes"


@contextlib.asynccontextmanager
async def serving(
    pool: asyncpg.Pool, *, auth_cache_seconds: float = 0.0
) -> AsyncIterator[httpx.AsyncClient]:
    """The proxy app served by uvicorn on a loopback port, and a client of it. A plain task, not
    a task group: a fixture's setup and teardown may run in different tasks."""
    app = create_app(pool, [FLAT], access=AccessStore(pool), auth_cache_seconds=auth_cache_seconds)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", log_config=None))
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    base = f"http://127.0.0.1:{listener.getsockname()[1]}"
    serve = asyncio.create_task(server.serve([listener]))
    try:
        async with httpx.AsyncClient(base_url=base, timeout=10, trust_env=False) as client:
            with anyio.fail_after(30):
                while not server.started:
                    assert not serve.done(), "the proxy stopped"
                    await anyio.sleep(0.01)
            yield client
    finally:
        server.should_exit = True
        await serve
        listener.close()


@pytest.fixture
async def proxy(pool: asyncpg.Pool) -> AsyncIterator[httpx.AsyncClient]:
    async with serving(pool) as client:
        yield client


@pytest.fixture
def access(pool: asyncpg.Pool) -> AccessStore:
    return AccessStore(pool)


async def token_of(
    access: AccessStore,
    name: str,
    *,
    kind: PrincipalKind = PrincipalKind.SERVICE,
    scope: TokenScope | None = None,
) -> str:
    """A new token of ``name`` (added as ``kind`` if need be)."""
    await access.set_principal(name, kind=kind, role=Role.OPERATOR)
    return (await access.create_token(name, expires_in=None, scope=scope)).secret


async def running(store: RunStore, agent: str) -> tuple[str, int]:
    """A run of ``agent`` claimed by a worker: its id and fence."""
    await store.submit(agent, {})
    claimed = (await store.claim("w", [agent], lease_seconds=600)).claimed[0]
    return claimed.run_id, claimed.fence


def request(run_id: str, fence: int, **fields: Any) -> dict[str, Any]:
    return {
        "run_id": run_id,
        "effect_key": "charge-1",
        "fence": fence,
        "kind": "stripe_charge",
        "payload": {"amount": 40},
        **fields,
    }


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


async def effect_rows(pool: asyncpg.Pool) -> int:
    return int(await pool.fetchval("SELECT count(*) FROM effects"))


PAYMENTS_SCOPE = TokenScope.of(
    agents=[PAYMENTS], kinds=["stripe_charge"], amount_field="amount", max_amount=100
)


async def test_a_scoped_token_is_taken_within_its_scope(
    proxy: httpx.AsyncClient, access: AccessStore, store: RunStore, pool: asyncpg.Pool
) -> None:
    token = await token_of(access, "billing", scope=PAYMENTS_SCOPE)
    run_id, fence = await running(store, PAYMENTS)
    answer = await proxy.post("/v1/effects", json=request(run_id, fence), headers=bearer(token))
    assert answer.status_code == 201, answer.text
    read = await proxy.get(f"/v1/effects/{run_id}/charge-1", headers=bearer(token))
    assert read.status_code == 200 and read.json()["effect"]["kind"] == "stripe_charge"
    assert await effect_rows(pool) == 1


@pytest.mark.parametrize(
    ("agent", "fields", "named"),
    [
        (NOTES, {}, "'notes'"),
        (PAYMENTS, {"kind": "send_email"}, "'send_email'"),
        (PAYMENTS, {"payload": {"amount": 100.01}}, "100.01"),
        (PAYMENTS, {"payload": {"amount": "lots"}}, "'amount'"),
        (PAYMENTS, {"payload": {}}, "'amount'"),
    ],
    ids=["agent", "kind", "amount", "amount-not-a-number", "amount-missing"],
)
async def test_a_request_outside_the_scope_is_refused_and_nothing_is_recorded(
    proxy: httpx.AsyncClient,
    access: AccessStore,
    store: RunStore,
    pool: asyncpg.Pool,
    agent: str,
    fields: dict[str, Any],
    named: str,
) -> None:
    reader = capture_metrics()
    assert reader is not None
    token = await token_of(access, "billing", scope=PAYMENTS_SCOPE)
    run_id, fence = await running(store, agent)
    before = forbidden_count(reader)
    answer = await proxy.post(
        "/v1/effects", json=request(run_id, fence, **fields), headers=bearer(token)
    )
    assert answer.status_code == 403, answer.text
    body = answer.json()
    assert body["error"] == "forbidden" and named in body["reason"]
    assert await effect_rows(pool) == 0
    assert forbidden_count(reader) == before + 1


def forbidden_count(reader: Any) -> float:
    """How many requests the proxy's counter has answered ``forbidden`` so far."""
    data = reader.get_metrics_data()
    return float(
        sum(
            point.value
            for resource in (data.resource_metrics if data else ())
            for scope in resource.scope_metrics
            for metric in scope.metrics
            if metric.name == "orchestrator.proxy.requests"
            for point in metric.data.data_points
            if point.attributes.get("outcome") == FORBIDDEN
        )
    )


async def test_the_amount_limit_is_inclusive_and_the_same_key_is_not_refused_twice(
    proxy: httpx.AsyncClient, access: AccessStore, store: RunStore, pool: asyncpg.Pool
) -> None:
    token = await token_of(access, "billing", scope=PAYMENTS_SCOPE)
    run_id, fence = await running(store, PAYMENTS)
    at_limit = request(run_id, fence, payload={"amount": "100"})
    assert (
        await proxy.post("/v1/effects", json=at_limit, headers=bearer(token))
    ).status_code == 201
    again = await proxy.post("/v1/effects", json=at_limit, headers=bearer(token))
    assert again.status_code == 200 and again.json()["outcome"] == "existing"


async def test_an_agent_scoped_token_gets_404_for_an_unknown_run_and_records_nothing(
    proxy: httpx.AsyncClient, access: AccessStore, pool: asyncpg.Pool
) -> None:
    token = await token_of(access, "billing", scope=PAYMENTS_SCOPE)
    missing = request("r_01jd3k5q8m2x7c9v4b6n0p1r2s", 1)
    answer = await proxy.post("/v1/effects", json=missing, headers=bearer(token))
    assert answer.status_code == 404 and answer.json()["error"] == "unknown_run"
    assert await effect_rows(pool) == 0


async def test_a_persons_token_is_refused_403(
    proxy: httpx.AsyncClient, access: AccessStore, store: RunStore, pool: asyncpg.Pool
) -> None:
    token = await token_of(access, "alice@example.com", kind=PrincipalKind.PERSON)
    run_id, fence = await running(store, PAYMENTS)
    for answer in (
        await proxy.post("/v1/effects", json=request(run_id, fence), headers=bearer(token)),
        await proxy.get(f"/v1/effects/{run_id}/charge-1", headers=bearer(token)),
    ):
        assert answer.status_code == 403, answer.text
        assert answer.json()["error"] == "forbidden"
        assert "person" in answer.json()["reason"] and "service" in answer.json()["reason"]
    assert await effect_rows(pool) == 0


async def test_a_revoked_expired_or_disabled_token_is_refused_401(
    proxy: httpx.AsyncClient, access: AccessStore, store: RunStore, pool: asyncpg.Pool
) -> None:
    run_id, fence = await running(store, PAYMENTS)
    revoked = await access.create_token(
        (
            await access.set_principal("svc-a", kind=PrincipalKind.SERVICE, role=Role.OPERATOR)
        ).principal.name,
        expires_in=None,
    )
    expired = await token_of(access, "svc-b")
    disabled = await token_of(access, "svc-c")
    for token in (revoked.secret, expired, disabled):  # all working before
        known = await proxy.get(f"/v1/effects/{run_id}/none", headers=bearer(token))
        assert known.status_code == 404, known.text
    await access.revoke_token(revoked.entry.token_id)
    await pool.execute(
        "UPDATE access_tokens SET expires_at = now() - interval '1 second'"
        " WHERE principal = 'svc-b'"
    )
    await access.disable("svc-c")
    for token in (revoked.secret, expired, disabled, "orc_unknown0000_" + "x" * 43):
        answer = await proxy.post("/v1/effects", json=request(run_id, fence), headers=bearer(token))
        assert answer.status_code == 401, answer.text
        assert answer.json()["error"] == "unauthorized"
    assert await effect_rows(pool) == 0


async def test_an_unscoped_service_token_may_request_anything(
    proxy: httpx.AsyncClient, access: AccessStore, store: RunStore, pool: asyncpg.Pool
) -> None:
    token = await token_of(access, "ops-bot")
    for agent in (PAYMENTS, NOTES):
        run_id, fence = await running(store, agent)
        big = request(run_id, fence, kind="anything", payload={"amount": 10**9})
        answer = await proxy.post("/v1/effects", json=big, headers=bearer(token))
        assert answer.status_code == 201, answer.text
        read = await proxy.get(f"/v1/effects/{run_id}/charge-1", headers=bearer(token))
        assert read.status_code == 200
    assert await effect_rows(pool) == 2


async def test_reading_another_agents_effect_is_refused_403(
    proxy: httpx.AsyncClient, access: AccessStore, store: RunStore
) -> None:
    notes_token = await token_of(access, "notes-bot", scope=TokenScope.of(agents=[NOTES]))
    payments_token = await token_of(access, "billing", scope=PAYMENTS_SCOPE)
    run_id, fence = await running(store, NOTES)
    created = await proxy.post(
        "/v1/effects", json=request(run_id, fence), headers=bearer(notes_token)
    )
    assert created.status_code == 201, created.text
    path = f"/v1/effects/{run_id}/charge-1"
    refused = await proxy.get(path, headers=bearer(payments_token))
    assert refused.status_code == 403
    assert refused.json()["error"] == "forbidden" and "'notes'" in refused.json()["reason"]
    assert "effect" not in refused.json()
    assert (await proxy.get(path, headers=bearer(notes_token))).status_code == 200


async def test_the_flat_tokens_keep_working_beside_database_tokens(
    proxy: httpx.AsyncClient, store: RunStore, pool: asyncpg.Pool
) -> None:
    run_id, fence = await running(store, NOTES)
    answer = await proxy.post("/v1/effects", json=request(run_id, fence), headers=bearer(FLAT))
    assert answer.status_code == 201, answer.text
    read = await proxy.get(f"/v1/effects/{run_id}/charge-1", headers=bearer(FLAT))
    assert read.status_code == 200
    for wrong in (bearer("not-the-token"), bearer(f"orc_{FLAT}"), {"Authorization": FLAT}, {}):
        refused = await proxy.get(f"/v1/effects/{run_id}/charge-1", headers=wrong)
        assert refused.status_code == 401


async def test_without_an_access_store_a_database_token_is_an_unknown_token(
    pool: asyncpg.Pool, access: AccessStore, store: RunStore
) -> None:
    token = await token_of(access, "ops-bot")
    run_id, fence = await running(store, NOTES)
    app = create_app(pool, [FLAT])
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as client:
        answer = await client.post(
            "/v1/effects", json=request(run_id, fence), headers=bearer(token)
        )
    assert answer.status_code == 401


async def test_the_cache_keeps_answers_by_hash_until_its_time_is_up(
    access: AccessStore, pool: asyncpg.Pool
) -> None:
    now = [0.0]
    clock: Callable[[], float] = lambda: now[0]  # noqa: E731
    cache = AuthCache(access, seconds=5.0, size=2, clock=clock)
    issued = await access.create_token(
        (
            await access.set_principal("svc", kind=PrincipalKind.SERVICE, role=Role.OPERATOR)
        ).principal.name,
        expires_in=None,
    )
    assert (found := await cache.authenticate(issued.secret)) is not None
    assert found.principal.name == "svc"
    assert issued.secret not in repr(cache.__dict__)
    await access.revoke_token(issued.entry.token_id)
    now[0] = 4.9
    assert await cache.authenticate(issued.secret) is not None  # revocation not seen yet
    now[0] = 5.0
    assert await cache.authenticate(issued.secret) is None  # seen once the answer is stale
    for n in range(5):  # bounded: the oldest answers are forgotten
        await cache.authenticate(f"orc_unknown{n:04d}_secret")
    assert len(cache._answers) == 2


async def test_no_token_reaches_the_logs(
    proxy: httpx.AsyncClient,
    access: AccessStore,
    store: RunStore,
    capfd: pytest.CaptureFixture[str],
) -> None:
    person = await token_of(access, "alice@example.com", kind=PrincipalKind.PERSON)
    scoped = await token_of(access, "billing", scope=PAYMENTS_SCOPE)
    run_id, fence = await running(store, NOTES)
    with structlog.testing.capture_logs() as logs:
        await proxy.post("/v1/effects", json=request(run_id, fence), headers=bearer(person))
        await proxy.post("/v1/effects", json=request(run_id, fence), headers=bearer(scoped))
        await proxy.get(f"/v1/effects/{run_id}/charge-1", headers=bearer(scoped))
    assert {entry.get("principal") for entry in logs} == {"alice@example.com", "billing"}
    said = json.dumps(logs, default=str) + "".join(capfd.readouterr())
    for secret in (person, scoped, FLAT):
        assert secret not in said


@pytest.mark.slow
async def test_serve_needs_no_flat_tokens_when_a_service_holds_a_database_token(
    database_url: str, access: AccessStore, store: RunStore
) -> None:
    unusable = start_proxy(database_url, free_port(), tokens="", stderr=subprocess.PIPE)
    _, said = unusable.communicate(timeout=60)
    assert unusable.returncode == 1
    [line] = said.decode().strip().splitlines()
    assert "no bearer tokens" in line and "orchestrator users token create" in line
    token = await token_of(access, "billing", scope=PAYMENTS_SCOPE)
    run_id, fence = await running(store, PAYMENTS)
    async with running_proxy(database_url, tokens="") as client:
        answer = await client.post(
            "/v1/effects", json=request(run_id, fence), headers=bearer(token)
        )
        assert answer.status_code == 201, answer.text
        other = await client.post(
            "/v1/effects", json=request(run_id, fence, kind="wire"), headers=bearer(token)
        )
        assert other.status_code == 403 and "'wire'" in other.json()["reason"]
