"""MCP servers as tool sources of a ``ToolAgent``: classified read-only tools called in the turn,
effect tools sent once by the dispatcher, unclassified tools denied, approvals bound to the
exact arguments. A real MCP server over streamable HTTP and stdio, the scripted model server,
PostgreSQL; a worker and a dispatcher in this process."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest

from orchestrator.agent.mcp.tools import McpEffectTool, McpToolSource, load_classification
from orchestrator.agent.tool_loop import ToolAgent, effect_keys
from orchestrator.client import Client
from orchestrator.db.store import RunStore
from orchestrator.effect_model import EffectStatus
from orchestrator.effects.store import EffectStore
from orchestrator.effects.vendors import adapter_from_config
from orchestrator.errors import InvalidInput
from orchestrator.models import RunState
from orchestrator.settings import Settings
from orchestrator.testing import running_worker, wait_for_run
from orchestrator.testing.loopback import ScriptedCall, ScriptedModelServer, ScriptedTurn, turns
from support import cli
from support.mcp_servers_for_tests import (
    TICKET_TURNS,
    calls_per_key,
    classification,
    http_server,
    ledger,
    stdio_server,
    tickets_kind,
    tickets_server,
)
from test_runtime import FAST

pytest.importorskip("mcp")

REFUND_TURNS = turns(
    ScriptedTurn(calls=(ScriptedCall("refund", {"order_id": "o-17", "amount": 120.0}),)),
    ScriptedTurn(content="Refunded."),
)


@asynccontextmanager
async def mcp_agent(server: dict[str, Any]) -> AsyncIterator[ToolAgent]:
    sources = load_classification(classification(server))
    agent = ToolAgent(
        "mcp_tickets",
        instructions="You help with orders through the tickets server.",
        tools=sources,
        max_turns=6,
    )
    try:
        yield agent
    finally:
        for source in sources:
            await source.aclose()


async def serve_one_run(
    settings: Settings,
    store: RunStore,
    agent: ToolAgent,
    server: dict[str, Any],
    model: ScriptedModelServer,
    monkeypatch: pytest.MonkeyPatch,
    prompt: str,
) -> str:
    """One run of ``agent`` against ``model`` in a worker whose dispatcher sends the tickets
    server's effects; its id, once it has ended."""
    monkeypatch.setenv("OPENAI_BASE_URL", model.base_url)
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    adapter = adapter_from_config("tickets", tickets_kind(server))
    run_id = (await store.submit(agent.name, {"prompt": prompt})).run.run_id
    async with running_worker(settings, [agent], effect_adapters={"tickets": adapter}, **FAST):
        await wait_for_run(store, run_id, within=60)
    return run_id


@pytest.mark.parametrize("transport", ["http", "stdio"])
async def test_classified_mcp_tools_are_offered_and_an_unlisted_one_is_denied(
    transport: str,
    tmp_path: Path,
    settings: Settings,
    store: RunStore,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("OPENAI_BASE_URL", "")
    with tickets_server(transport, tmp_path / "ledger.jsonl") as server:
        async with ScriptedModelServer(TICKET_TURNS) as model, mcp_agent(server) as agent:
            run_id = await serve_one_run(
                settings, store, agent, server, model, monkeypatch, "o-17 is damaged"
            )
    run = await store.get(run_id)
    assert run.state is RunState.SUCCEEDED, run.error
    # Only classified tools reached the model; the unlisted one was refused as denied.
    offered = set(model.requests[0]["tools"])
    assert offered == {"order_status", "open_ticket", "refund", "find_ticket"}
    transcript = await store.messages(run_id)
    told = [json.loads(m.body["content"]) for m in transcript if m.role == "tool"]
    assert told[0]["status"] == "shipped"  # the read-only call, made in the turn
    assert told[1]["error"].startswith("denied: drop_all_orders")
    assert told[2]["status"] == "confirmed"
    calls = [entry["tool"] for entry in ledger(tmp_path / "ledger.jsonl")]
    assert "drop_all_orders" not in calls
    # The effect: recorded as (server, tool, arguments), sent once by the dispatcher.
    assistant = [m for m in transcript if m.role == "assistant"][1]
    [key] = effect_keys(1, assistant.body["tool_calls"])
    record = await EffectStore(store.pool).get(run_id, key)
    assert record.payload == {
        "server": "tickets",
        "tool": "open_ticket",
        "arguments": {"title": "o-17 arrived damaged"},
    }
    assert record.status is EffectStatus.CONFIRMED
    assert calls_per_key(tmp_path / "ledger.jsonl", "open_ticket") == {record.idempotency_key: 1}


async def test_an_approval_gated_mcp_tool_is_called_once_after_approval_of_its_arguments(
    tmp_path: Path, settings: Settings, store: RunStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    ledger_file = tmp_path / "ledger.jsonl"
    with http_server(ledger_file) as server:
        async with ScriptedModelServer(REFUND_TURNS) as model, mcp_agent(server) as agent:
            monkeypatch.setenv("OPENAI_BASE_URL", model.base_url)
            monkeypatch.delenv("OPENAI_API_KEY", raising=False)
            adapter = adapter_from_config("tickets", tickets_kind(server))
            run_id = (await store.submit(agent.name, {"prompt": "refund o-17"})).run.run_id
            async with (
                running_worker(settings, [agent], effect_adapters={"tickets": adapter}, **FAST),
                await Client.connect(settings) as client,
            ):
                with anyio.fail_after(60):
                    while not (pending := await client.approvals.list(run_id=run_id)):  # noqa: ASYNC110
                        await anyio.sleep(0.05)
                [waiting] = pending
                assert waiting.payload == {
                    "server": "tickets",
                    "tool": "refund",
                    "arguments": {"order_id": "o-17", "amount": 120.0},
                }
                await anyio.sleep(0.5)  # a dispatcher that ignored approval would have sent it
                assert calls_per_key(ledger_file, "refund") == {}
                assert waiting.payload_sha256 is not None
                await client.approvals.approve(
                    run_id, waiting.effect_key, by="ana", payload_sha256=waiting.payload_sha256
                )
                await wait_for_run(store, run_id, within=60)
    run = await store.get(run_id)
    assert run.state is RunState.SUCCEEDED, run.error
    record = await EffectStore(store.pool).get(run_id, waiting.effect_key)
    assert record.status is EffectStatus.CONFIRMED and record.decided_by is not None
    assert calls_per_key(ledger_file, "refund") == {record.idempotency_key: 1}
    [call] = [e for e in ledger(ledger_file) if e["tool"] == "refund"]
    assert call["arguments"] == {"order_id": "o-17", "amount": 120.0}


async def test_arguments_are_checked_against_the_listed_schema_before_any_call(
    tmp_path: Path, settings: Settings, store: RunStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    script = turns(
        ScriptedTurn(
            calls=(
                ScriptedCall("order_status", {"order": "o-17"}),  # not the schema's field
                ScriptedCall("open_ticket", {"title": 17}),  # not a string
            )
        ),
        ScriptedTurn(content="Sorry."),
    )
    server = stdio_server(tmp_path / "ledger.jsonl")
    async with ScriptedModelServer(script) as model, mcp_agent(server) as agent:
        run_id = await serve_one_run(
            settings, store, agent, server, model, monkeypatch, "bad arguments"
        )
    run = await store.get(run_id)
    assert run.state is RunState.SUCCEEDED and run.result is not None
    assert run.result["invalid_calls"] == 2
    told = [json.loads(m.body["content"]) for m in await store.messages(run_id) if m.role == "tool"]
    assert told[0]["error"].startswith("invalid arguments for order_status:")
    assert "'order_id' is a required property" in told[0]["error"]
    assert told[1]["error"].startswith("invalid arguments for open_ticket: title:")
    assert ledger(tmp_path / "ledger.jsonl") == []
    assert await EffectStore(store.pool).list_effects(run_id=run_id) == []


async def test_a_classified_tool_the_server_does_not_list_is_a_clear_error(
    tmp_path: Path,
) -> None:
    document = classification(stdio_server(tmp_path / "ledger.jsonl"))
    document["servers"]["tickets"]["tools"]["close_ticket"] = {"class": "effect"}
    [source] = load_classification(document)
    try:
        with pytest.raises(
            InvalidInput, match=r"does not list the classified tool\(s\) close_ticket"
        ):
            await source.load()
    finally:
        await source.aclose()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"tools": {}}, "lists no tools"),
        ({"tools": {"a": {"class": "maybe"}}}, 'class must be "read_only" or "effect"'),
        ({"tools": {"a": {"class": "read_only", "approve": True}}}, "unknown option(s) approve"),
        ({"tools": {"a": {"class": "effect", "policy": "twice"}}}, "policy must be"),
        ({"tools": {"a": {"class": "effect", "approve": {"argument": "x"}}}}, "approve must be"),
        ({"tools": {"a b": {"class": "effect"}}}, "1-64 letters"),
        ({"url": None, "command": None}, "exactly one of url or command"),
        ({"transport": "carrier pigeon"}, "unknown option(s) transport"),
    ],
)
def test_bad_classifications_are_one_clear_line(change: dict[str, Any], message: str) -> None:
    server: dict[str, Any] = {"url": "http://127.0.0.1:9/mcp", "tools": {"a": {"class": "effect"}}}
    server.update(change)
    server = {k: v for k, v in server.items() if v is not None}
    with pytest.raises(InvalidInput) as raised:
        load_classification({"servers": {"tickets": server}})
    assert message in str(raised.value) and "\n" not in str(raised.value)


def test_an_approval_threshold_asks_a_person_above_it_or_when_unsure() -> None:
    rule = {"class": "effect", "approve": {"argument": "amount", "above": 100}}
    [source] = load_classification(
        {"servers": {"tickets": {"url": "http://127.0.0.1:9/mcp", "tools": {"refund": rule}}}}
    )
    schema = {"type": "object", "properties": {"amount": {"type": "number"}}}
    refund = McpEffectTool(source, "refund", "Refund.", schema, source.rules["refund"])
    assert not refund.needs_approval({"amount": 50})
    assert refund.needs_approval({"amount": 150})
    assert refund.needs_approval({"amount": "a lot"}) and refund.needs_approval({})


def test_a_classification_file_is_json_or_toml(tmp_path: Path) -> None:
    toml = tmp_path / "mcp.toml"
    toml.write_text(
        '[servers.tickets]\nurl = "http://127.0.0.1:9/mcp"\n'
        '[servers.tickets.tools.open_ticket]\nclass = "effect"\napprove = true\n'
    )
    [source] = load_classification(toml)
    assert isinstance(source, McpToolSource)
    assert source.effect_kind == "tickets" and source.rules["open_ticket"].approve
    with pytest.raises(InvalidInput, match="cannot read MCP classification"):
        load_classification(tmp_path / "missing.json")
    broken = tmp_path / "broken.json"
    broken.write_text("{")
    with pytest.raises(InvalidInput, match="is not valid json"):
        load_classification(broken)


def test_mcp_import_prints_a_draft_from_the_hints_that_an_operator_then_owns(
    tmp_path: Path,
) -> None:
    server = stdio_server(tmp_path / "ledger.jsonl")
    arguments = [f"--arg={a}" for a in server["args"]]
    shown = cli(None, "mcp", "import", "tickets", "--command", server["command"], *arguments)
    assert shown.returncode == 0, shown.stderr
    assert "DRAFT" in shown.stdout and "drop_all_orders" in shown.stdout
    printed = cli(
        None, "mcp", "import", "tickets", "--command", server["command"], *arguments, "--json"
    )
    draft = json.loads(printed.stdout)
    tools = draft["servers"]["tickets"]["tools"]
    # Hints pre-fill, never decide: the server's false readOnlyHint shows up in the draft,
    # for the operator to catch; nothing is offered until a classification is given.
    assert tools["order_status"] == {"class": "read_only"}
    assert tools["drop_all_orders"] == {"class": "read_only"}
    assert tools["open_ticket"] == {"class": "effect", "policy": "irreversible", "approve": False}
    assert tools["refund"]["approve"] is True
    [source] = load_classification(draft)
    assert set(source.rules) == set(tools)
    assert calls_per_key(tmp_path / "ledger.jsonl", "drop_all_orders") == {}
    unreachable = cli(None, "mcp", "import", "tickets", "--url", "http://127.0.0.1:9/mcp")
    assert unreachable.returncode == 1
    assert unreachable.stderr.startswith("error: cannot connect to MCP server tickets")
    assert unreachable.stderr.count("\n") == 1
