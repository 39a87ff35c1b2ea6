"""MCP effects under real process faults: a dispatcher SIGKILLed mid-call, a worker SIGSTOPped
while its dispatcher's call hangs, replaced, then resumed. The MCP server (the ``mcp`` SDK, over
streamable HTTP and stdio) counts its calls per idempotency key; never a second one."""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import anyio
import asyncpg
import pytest

from orchestrator.agent.tool_loop import effect_keys
from orchestrator.db.store import RunStore
from orchestrator.effect_model import Effect, EffectStatus, idempotency_key
from orchestrator.effects.store import EffectStore
from orchestrator.models import RunState
from orchestrator.testing import wait_for_run
from orchestrator.testing.loopback import ScriptedModelServer
from support import ServeProcess, fenced_claims, serve_args, serving, write_vendors_config
from support.mcp_servers_for_tests import (
    TICKET_TURNS,
    calls_per_key,
    classification,
    tickets_kind,
    tickets_server,
)
from test_effects_processes import start_dispatcher, until_confirmed
from test_runtime import eventually

pytest.importorskip("mcp")
pytestmark = pytest.mark.slow
LEDGER = "ledger.jsonl"


@contextmanager
def hanging_server(transport: str, tmp_path: Path) -> Iterator[tuple[dict[str, Any], Path]]:
    """The tickets server, whose ``open_ticket`` hangs after acting while ``hang`` exists."""
    hang = tmp_path / "hang"
    hang.touch()
    try:
        with tickets_server(transport, tmp_path / LEDGER, hang) as server:
            yield server, hang
    finally:
        hang.unlink(missing_ok=True)


async def until_called(tmp_path: Path, tool: str) -> None:
    await eventually(lambda: bool(calls_per_key(tmp_path / LEDGER, tool)), within=60)


@pytest.mark.parametrize("transport", ["http", "stdio"])
async def test_a_dispatcher_killed_mid_call_is_reconciled_through_the_lookup_tool(
    transport: str, database_url: str, store: RunStore, pool: asyncpg.Pool, tmp_path: Path
) -> None:
    await store.submit("agent", {})
    run = (await store.claim("W", ["agent"], limit=1, lease_seconds=60)).claimed[0]
    effect = Effect(
        "ticket",
        "tickets",
        {"server": "tickets", "tool": "open_ticket", "arguments": {"title": "t"}},
    )
    async with pool.acquire() as db, db.transaction():
        await EffectStore(pool).accept(db, run.run_id, run.fence, effect, worker_id="W")
    with hanging_server(transport, tmp_path) as (server, hang):
        config = write_vendors_config(tmp_path, {"tickets": tickets_kind(server)})
        options = ["--lease-seconds", "2", "--poll-seconds", "0.1", "--log-json"]
        first = start_dispatcher(database_url, config, *options)
        try:
            await until_called(tmp_path, "open_ticket")  # the server acted; no answer yet
        finally:
            first.kill()
            first.wait(60)
        record = await EffectStore(pool).get(run.run_id, effect.key)
        assert record.status is EffectStatus.DISPATCHING
        hang.unlink()
        second = start_dispatcher(database_url, config, *options)
        try:
            await until_confirmed(pool, run.run_id, effect.key)
        finally:
            second.send_signal(signal.SIGTERM)
            assert second.wait(60) == 0
    key = idempotency_key(run.run_id, effect.key)
    assert calls_per_key(tmp_path / LEDGER, "open_ticket") == {key: 1}  # looked up, not resent
    record = await EffectStore(pool).get(run.run_id, effect.key)
    assert (record.external_id, record.result) == (f"T-{key}", {"title": "t"})


NOT_RECORDED = "effect outcome not recorded: another dispatcher holds it now"


@pytest.mark.parametrize("transport", ["http", "stdio"])
async def test_a_paused_owner_whose_call_hangs_is_replaced_and_resumed_without_a_second_call(
    transport: str, database_url: str, store: RunStore, tmp_path: Path
) -> None:
    with hanging_server(transport, tmp_path) as (server, hang):
        rules = tmp_path / "mcp.json"
        rules.write_text(json.dumps(classification(server)))
        config = write_vendors_config(tmp_path, {"tickets": tickets_kind(server)})
        args = [
            *serve_args(
                serving("support.mcp_agents_for_tests"),
                config,
                lease_seconds="2",
                heartbeat_seconds="0.5",
            ),
            "--dispatch-lease-seconds",
            "2",
        ]
        async with ScriptedModelServer(TICKET_TURNS) as model:
            env = {
                "OPENAI_BASE_URL": model.base_url,
                "OPENAI_API_KEY": "",
                "MCP_TEST_CLASSIFICATION": str(rules),
            }
            run_id = (await store.submit("mcp_tickets", {"prompt": "o-17 is damaged"})).run.run_id
            with ServeProcess(database_url, *args, name="A", env=env) as a:
                await until_called(tmp_path, "open_ticket")  # A's dispatcher, mid-call
                a.signal(signal.SIGSTOP)
                with ServeProcess(database_url, *args, name="B", env=env):
                    final = await wait_for_run(store, run_id, within=60)
                hang.unlink()  # the server answers A's call, to a process that is stopped
                a.signal(signal.SIGCONT)
                # A woke: its worker finds its lease gone, or (had its run parked to wait for
                # the call before A was stopped) its dispatcher finds the call taken over.
                await eventually(
                    lambda: bool(a.events("lease lost") or a.events(NOT_RECORDED)), within=60
                )
                await anyio.sleep(1)
    assert final.state is RunState.SUCCEEDED, final.error
    claims = fenced_claims(await store.events(run_id))
    assert claims[0].worker_id == "A" and claims[-1].worker_id == "B"
    [assistant] = [m for m in await store.messages(run_id) if m.role == "assistant" and m.turn == 1]
    [key] = effect_keys(1, assistant.body["tool_calls"])
    record = await EffectStore(store.pool).get(run_id, key)
    assert record.status is EffectStatus.CONFIRMED
    assert record.attempts >= 2  # B's dispatcher took the call over from A's (a lookup)
    assert calls_per_key(tmp_path / LEDGER, "open_ticket") == {record.idempotency_key: 1}
    assert calls_per_key(tmp_path / LEDGER, "drop_all_orders") == {}
