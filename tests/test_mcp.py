"""MCP tools through the fence: a real MCP server (the ``mcp`` SDK's ``MCPServer``) on loopback,
over streamable HTTP and over stdio, counting its calls per idempotency key."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import anyio
import asyncpg
import pytest

from orchestrator.agent.mcp.client import McpConnection, McpServerSpec
from orchestrator.db.store import RunStore
from orchestrator.effect_model import Effect, EffectStatus, idempotency_key
from orchestrator.effects.dispatcher import Dispatcher
from orchestrator.effects.store import EffectStore
from orchestrator.effects.vendors import adapter_from_config
from support.mcp_servers_for_tests import (
    calls_per_key,
    http_server,
    ledger,
    stdio_server,
    tickets_kind,
    tickets_server,
)
from test_effects_dispatch import dispatch_until, requested

pytest.importorskip("mcp")
SETTLED = {EffectStatus.CONFIRMED, EffectStatus.FAILED, EffectStatus.PARKED}


def ticket(key: str = "ticket-1", tool: str = "open_ticket", **arguments: Any) -> Effect:
    return Effect(
        key,
        "tickets",
        {"server": "tickets", "tool": tool, "arguments": arguments or {"title": "hi"}},
    )


@pytest.mark.parametrize("transport", ["http", "stdio"])
async def test_an_effectful_mcp_tool_is_called_once_with_the_key_in_meta(
    transport: str, tmp_path: Path, store: RunStore, pool: asyncpg.Pool
) -> None:
    with tickets_server(transport, tmp_path / "ledger.jsonl") as server:
        adapter = adapter_from_config("tickets", tickets_kind(server))
        effect = ticket()
        run_id = await requested(store, pool, effect)
        record = await dispatch_until(pool, {"tickets": adapter}, run_id, effect.key, SETTLED)
    assert record.status is EffectStatus.CONFIRMED
    key = idempotency_key(run_id, effect.key)
    assert record.external_id == f"T-{key}"
    assert record.result == {"id": f"T-{key}", "title": "hi"}
    assert calls_per_key(tmp_path / "ledger.jsonl", "open_ticket") == {key: 1}


@pytest.mark.parametrize("transport", ["http", "stdio"])
async def test_a_tool_error_fails_the_effect_and_an_unlisted_tool_is_never_called(
    transport: str, tmp_path: Path, store: RunStore, pool: asyncpg.Pool
) -> None:
    with tickets_server(transport, tmp_path / "ledger.jsonl") as server:
        adapter = adapter_from_config("tickets", tickets_kind(server))
        failing = ticket("reject", "reject_order", order_id="o-1")
        unlisted = ticket("drop", "drop_all_orders")
        for effect in (failing, unlisted):
            run_id = await requested(store, pool, effect)
            record = await dispatch_until(pool, {"tickets": adapter}, run_id, effect.key, SETTLED)
            assert record.status is EffectStatus.FAILED
            assert isinstance(record.error, dict)
    assert "drop_all_orders" in str(record.error["message"])
    assert [entry["tool"] for entry in ledger(tmp_path / "ledger.jsonl")] == ["reject_order"]


async def test_a_server_slow_to_start_is_not_sent_yet_never_an_uncertain_send(
    tmp_path: Path, store: RunStore, pool: asyncpg.Pool
) -> None:
    # The stdio server takes longer to start than a send may take: opening its connection is
    # not sending, so the effect waits (not sent, retried) and goes out once, never uncertain
    # (with no lookup tool an uncertain send would be parked for a person).
    server = stdio_server(tmp_path / "ledger.jsonl")
    server["env"]["MCP_TEST_START_SECONDS"] = "3"
    kind = {key: value for key, value in tickets_kind(server).items() if key != "lookup_tool"}
    adapter = adapter_from_config("tickets", kind)
    effect = ticket()
    run_id = await requested(store, pool, effect)
    try:
        record = await dispatch_until(
            pool, {"tickets": adapter}, run_id, effect.key, SETTLED, lease_seconds=2, within=60
        )
    finally:
        await adapter.aclose()
    assert record.status is EffectStatus.CONFIRMED, record.error
    key = idempotency_key(run_id, effect.key)
    assert calls_per_key(tmp_path / "ledger.jsonl", "open_ticket") == {key: 1}


async def test_a_call_cancelled_while_connecting_leaves_the_connection_usable(
    tmp_path: Path,
) -> None:
    server = stdio_server(tmp_path / "ledger.jsonl")
    server["env"]["MCP_TEST_START_SECONDS"] = "2"
    connection = McpConnection(McpServerSpec.from_config("tickets", server))
    try:
        with anyio.move_on_after(0.3):
            await connection.call_tool(
                "find_ticket", {"idempotency_key": "k"}, meta=None, seconds=30
            )
        result = await connection.call_tool(
            "find_ticket", {"idempotency_key": "k"}, meta=None, seconds=30
        )
    finally:
        await connection.aclose()
    assert not result.is_error


@pytest.mark.parametrize("transport", ["http", "stdio"])
async def test_an_unanswered_call_is_reconciled_through_the_lookup_tool_never_resent(
    transport: str, tmp_path: Path, store: RunStore, pool: asyncpg.Pool
) -> None:
    hang = tmp_path / "hang"
    hang.touch()
    with tickets_server(transport, tmp_path / "ledger.jsonl", hang) as server:
        adapter = adapter_from_config("tickets", tickets_kind(server, timeout_seconds=1))
        effect = ticket()
        run_id = await requested(store, pool, effect)
        record = await dispatch_until(pool, {"tickets": adapter}, run_id, effect.key, SETTLED)
        hang.unlink()
    assert record.status is EffectStatus.CONFIRMED
    key = idempotency_key(run_id, effect.key)
    assert record.external_id == f"T-{key}"
    assert calls_per_key(tmp_path / "ledger.jsonl", "open_ticket") == {key: 1}


async def test_a_stdio_server_that_dies_after_acting_is_reconciled_never_resent(
    tmp_path: Path, store: RunStore, pool: asyncpg.Pool
) -> None:
    die = tmp_path / "die"
    die.touch()  # the first server to open a ticket dies before it answers
    server = stdio_server(tmp_path / "ledger.jsonl", die=die)
    effect = ticket()
    run_id = await requested(store, pool, effect)
    adapter = adapter_from_config("tickets", tickets_kind(server))
    record = await dispatch_until(pool, {"tickets": adapter}, run_id, effect.key, SETTLED)
    assert not die.exists()
    assert record.status is EffectStatus.CONFIRMED
    key = idempotency_key(run_id, effect.key)
    assert record.external_id == f"T-{key}" and record.attempts >= 2
    assert calls_per_key(tmp_path / "ledger.jsonl", "open_ticket") == {key: 1}


@pytest.mark.parametrize("transport", ["http", "stdio"])
async def test_concurrent_effects_share_one_connection_each_called_once(
    transport: str, tmp_path: Path, store: RunStore, pool: asyncpg.Pool
) -> None:
    effects = [ticket(f"ticket-{n}", title=f"t{n}") for n in range(6)]
    runs = [await requested(store, pool, effect) for effect in effects]
    records = EffectStore(pool)
    with tickets_server(transport, tmp_path / "ledger.jsonl") as server:
        adapter = adapter_from_config("tickets", tickets_kind(server))
        dispatcher = Dispatcher(pool, {"tickets": adapter}, lease_seconds=5, poll_seconds=0.05)
        async with anyio.create_task_group() as group:
            group.start_soon(dispatcher.run)
            with anyio.fail_after(60):
                for run_id, effect in zip(runs, effects, strict=True):
                    while (await records.get(run_id, effect.key)).status not in SETTLED:  # noqa: ASYNC110
                        await anyio.sleep(0.05)
            group.cancel_scope.cancel()
    for run_id, effect in zip(runs, effects, strict=True):
        assert (await records.get(run_id, effect.key)).status is EffectStatus.CONFIRMED
    assert calls_per_key(tmp_path / "ledger.jsonl", "open_ticket") == {
        idempotency_key(run_id, effect.key): 1 for run_id, effect in zip(runs, effects, strict=True)
    }


async def test_without_a_lookup_tool_an_unanswered_call_is_parked(
    tmp_path: Path, store: RunStore, pool: asyncpg.Pool
) -> None:
    hang = tmp_path / "hang"
    hang.touch()
    server = stdio_server(tmp_path / "ledger.jsonl", hang)
    kind = tickets_kind(server, timeout_seconds=1)
    del kind["lookup_tool"]
    effect = ticket()
    run_id = await requested(store, pool, effect)
    record = await dispatch_until(
        pool, {"tickets": adapter_from_config("tickets", kind)}, run_id, effect.key, SETTLED
    )
    hang.unlink()
    assert record.status is EffectStatus.PARKED
    assert calls_per_key(tmp_path / "ledger.jsonl", "open_ticket") == {
        idempotency_key(run_id, effect.key): 1
    }


async def test_a_server_that_cannot_be_reached_is_retried_once_it_is_up(
    tmp_path: Path, store: RunStore, pool: asyncpg.Pool
) -> None:
    ledger_file = tmp_path / "ledger.jsonl"
    server = stdio_server(ledger_file)
    broken = {**server, "command": str(tmp_path / "not-yet")}
    effect = ticket()
    run_id = await requested(store, pool, effect)
    records = EffectStore(pool)
    dispatcher = Dispatcher(
        pool,
        {"tickets": adapter_from_config("tickets", tickets_kind(broken))},
        lease_seconds=5,
        poll_seconds=0.05,
    )
    async with anyio.create_task_group() as group:
        group.start_soon(dispatcher.run)
        with anyio.fail_after(30):
            while (record := await records.get(run_id, effect.key)).error is None:  # noqa: ASYNC110
                await anyio.sleep(0.05)
        group.cancel_scope.cancel()
    assert record.status is EffectStatus.ACCEPTED  # Retry: nothing was sent
    assert "cannot connect to MCP server tickets" in str(record.error)
    record = await dispatch_until(
        pool,
        {"tickets": adapter_from_config("tickets", tickets_kind(server))},
        run_id,
        effect.key,
        SETTLED,
    )
    assert record.status is EffectStatus.CONFIRMED
    assert calls_per_key(ledger_file, "open_ticket") == {idempotency_key(run_id, effect.key): 1}


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"tools": ["open_ticket"]}, "exactly one of url or command"),
        ({"url": "ftp://x", "tools": ["a"]}, "http(s) URL"),
        ({"command": "x", "tools": []}, "tools must list"),
        ({"command": "x", "tools": ["a"], "colour": 1}, "unknown option(s) colour"),
        ({"url": "http://x", "token_env": "ORCH_TEST_UNSET", "tools": ["a"]}, "is not set"),
    ],
)
def test_bad_mcp_adapter_config_is_one_clear_line(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)) as raised:
        adapter_from_config("tickets", {"adapter": "mcp", **options})
    assert "\n" not in str(raised.value)


async def test_a_bearer_token_from_the_environment_reaches_an_http_server(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ORCH_TEST_MCP_TOKEN", "s3cret")
    with http_server(tmp_path / "ledger.jsonl") as server:
        spec = McpServerSpec.from_config("tickets", {**server, "token_env": "ORCH_TEST_MCP_TOKEN"})
        assert spec.headers == {"Authorization": "Bearer s3cret"}
        connection = McpConnection(spec)
        try:
            names = {tool.name for tool in await connection.list_tools(seconds=30)}
        finally:
            await connection.aclose()
    assert {"open_ticket", "find_ticket"} <= names
