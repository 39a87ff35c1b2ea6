"""Tool calls PostgreSQL cannot store (issue 37): a NUL, a lone surrogate, an argument of
hundreds of kilobytes, too many calls in one turn. Each goes back to the model as a tool error,
nothing is sent for it, the turn commits, and the run goes on within its first attempt: one
bad call never costs the run its attempts nor bills the model once per attempt.

Real PostgreSQL, the real openai client over real HTTP to the scripted model server, a real
HTTP vendor behind the dispatcher."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pydantic
import pytest
from pydantic_ai import Agent as PydanticAgent

import support.pydantic_ai_agents_for_tests as pai_tools
from orchestrator.agent.llm import ToolCall
from orchestrator.agent.steps import Agent
from orchestrator.agent.stored_replies import stored_json, stored_reply
from orchestrator.agent.tool_loop import ToolAgent
from orchestrator.db.store import RunStore
from orchestrator.effects.store import EffectStore
from orchestrator.integrations.pydantic_ai import PydanticAIAgent, effect
from orchestrator.jsontext import compact
from orchestrator.models import RunState
from orchestrator.settings import Settings
from orchestrator.storable import storable_text
from orchestrator.testing.loopback import (
    Garbled,
    ScriptedCall,
    ScriptedModelServer,
    ScriptedTurn,
    ScriptRequest,
    turns,
)
from support import failed_attempts
from support.tool_agents_for_tests import lookup_order, notify, orders, refund
from test_tool_agent import serve_one

HUGE = "x" * (400 * 1024)

BAD_CALLS = {
    # id: (the call, what ToolAgent tells the model, what a Pydantic AI agent tells it)
    # An effect's argument holding "\u0000": valid JSON, a string jsonb cannot hold.
    "effect, NUL escaped": (
        ScriptedCall("notify", {"order_id": "o-17", "note": "a\x00b"}),
        'arguments["note"] holds a string with a NUL character',
        'arguments["note"] holds a string with a NUL character',
    ),
    # The arguments' text itself holds a NUL (not even JSON).
    "read-only, NUL raw": (
        ScriptedCall("lookup_order", '{"order_id": "o-\x00"}'),
        "they hold a NUL character",
        "they hold a NUL character",
    ),
    # pydantic refuses the escape itself; it used to stop a ToolAgent turn from being keyed.
    "read-only, lone surrogate escaped": (
        ScriptedCall("lookup_order", {"order_id": "o-\ud800"}),
        "invalid arguments for lookup_order",
        "Invalid JSON",
    ),
    "effect, lone surrogate raw": (
        ScriptedCall("notify", '{"order_id": "o-17", "note": "\udfff"}'),
        "they hold a lone surrogate",
        "they hold a lone surrogate",
    ),
    "effect, 400 KB": (
        ScriptedCall("notify", {"order_id": "o-17", "note": HUGE}),
        "its arguments are 409,",
        "its arguments are 409,",
    ),
    "read-only, 400 KB": (
        ScriptedCall("lookup_order", {"order_id": HUGE}),
        "its arguments are 409,",
        "its arguments are 409,",
    ),
    "unknown tool, NUL in its name": (
        ScriptedCall("look\x00up", {}),
        "there is no tool named",
        "Unknown tool name",
    ),
    # Python's JSON (and pydantic's) reads NaN and 1e400 as floats; jsonb holds neither.
    "effect, NaN": (
        ScriptedCall("refund", '{"order_id": "o-17", "amount": NaN}'),
        'arguments["amount"] is nan',
        'arguments["amount"] is nan',
    ),
    "effect, infinity": (
        ScriptedCall("refund", '{"order_id": "o-17", "amount": 1e400}'),
        'arguments["amount"] is inf',
        'arguments["amount"] is inf',
    ),
}

careful = ToolAgent("careful", instructions="", tools=[lookup_order, notify, refund])
pai_agent = PydanticAgent(instructions="You handle orders.")
pai_agent.tool_plain(pai_tools.lookup_order)
pai_agent.tool_plain(pai_tools.notify)
pai_agent.tool_plain(pai_tools.refund)
pai_careful = PydanticAIAgent(
    "pai_careful",
    pai_agent,
    model=pai_tools.local_model,
    read_only=["lookup_order"],
    effects={"notify": effect("crm"), "refund": effect("crm")},
)


def answered_after_errors(first: ScriptedTurn, seen: list[ScriptRequest]) -> Any:
    """A script: ``first`` on turn 0, a plain answer after; every request kept in ``seen``."""

    def script(request: ScriptRequest) -> ScriptedTurn:
        seen.append(request)
        return first if request.turn == 0 else ScriptedTurn(content="Sorry, that failed.")

    return script


async def transcript_is_small(store: RunStore, run_id: str, limit: int = 10_000) -> None:
    """No message kept what the model sent for the bad call beside its note."""
    for message in await store.messages(run_id):
        assert len(json.dumps(message.body)) < limit, str(message.body)[:200]


def error_text(content: str) -> str:
    """A tool message's error: our ``{"error": TEXT}``, or Pydantic AI's own retry prompt."""
    error = json.loads(content).get("error")
    return error if isinstance(error, str) else content


def tool_errors(request: ScriptRequest) -> list[str]:
    return [
        json.loads(m["content"])["error"]
        for m in request.messages
        if m["role"] == "tool" and "error" in json.loads(m["content"])
    ]


async def test_a_call_id_postgresql_cannot_store_is_replaced_and_the_call_runs(
    settings: Settings, store: RunStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[ScriptRequest] = []
    first = ScriptedTurn(calls=(ScriptedCall("lookup_order", {"order_id": "o-17"}, id="c\x00"),))
    async with ScriptedModelServer(answered_after_errors(first, seen)) as model:
        run_id, _ = await serve_one(settings, store, orders, model, monkeypatch, {"p": "id"})
    run = await store.get(run_id)
    assert run.state is RunState.SUCCEEDED, run.error
    assert await failed_attempts(store, run_id) == 0 and len(model.requests) == 2
    [assistant, result] = seen[1].messages[-2:]
    [stored_call] = assistant["tool_calls"]
    assert "\x00" not in stored_call["id"] and result["tool_call_id"] == stored_call["id"]
    assert json.loads(result["content"])["status"] == "shipped"


LIMITED = {
    "ToolAgent": (
        ToolAgent("limited", instructions="", tools=[lookup_order], max_tool_calls_per_turn=3),
        careful,
    ),
    "Pydantic AI": (
        PydanticAIAgent(
            "pai_limited",
            pai_agent,
            model=pai_tools.local_model,
            read_only=["lookup_order"],
            max_tool_calls_per_turn=3,
        ),
        pai_careful,
    ),
}


@pytest.mark.parametrize(("agent", "flooded"), LIMITED.values(), ids=list(LIMITED))
async def test_calls_beyond_the_turns_limit_are_not_run_and_a_flood_fails_at_once(
    settings: Settings,
    store: RunStore,
    monkeypatch: pytest.MonkeyPatch,
    agent: Agent,
    flooded: Agent,
) -> None:
    seen: list[ScriptRequest] = []
    five = tuple(ScriptedCall("lookup_order", {"order_id": f"o-{n}"}) for n in range(5))
    async with ScriptedModelServer(answered_after_errors(ScriptedTurn(calls=five), seen)) as model:
        run_id, _ = await serve_one(settings, store, agent, model, monkeypatch, {"p": "five"})
    run = await store.get(run_id)
    assert run.state is RunState.SUCCEEDED, run.error
    assert await failed_attempts(store, run_id) == 0 and len(model.requests) == 2
    errors = tool_errors(seen[1])
    assert len(errors) == 2 and all("at most 3 tool calls per turn" in e for e in errors)

    # Thousands of calls in one turn: not run, not stored; the run fails at once, its first
    # attempt, after one model call.
    flood = tuple(
        ScriptedCall("lookup_order", {"order_id": f"o-{n}-" + "y" * 200}) for n in range(3000)
    )
    async with ScriptedModelServer(answered_after_errors(ScriptedTurn(calls=flood), [])) as model:
        run_id, _ = await serve_one(settings, store, flooded, model, monkeypatch, {"p": "flood"})
    run = await store.get(run_id)
    assert run.state is RunState.FAILED and run.error is not None
    assert await failed_attempts(store, run_id) == 0 and len(model.requests) == 1
    assert "tool calls" in run.error["message"]


@pytest.mark.parametrize(
    ("integration", "bad", "problem"),
    [
        *(("ToolAgent", call, said) for call, said, _ in BAD_CALLS.values()),
        *(("Pydantic AI", call, said) for call, _, said in BAD_CALLS.values()),
    ],
    ids=[
        f"{integration}: {case}"
        for integration in ("ToolAgent", "Pydantic AI")
        for case in BAD_CALLS
    ],
)
async def test_a_call_postgresql_cannot_store_is_a_tool_error_and_the_run_goes_on(
    settings: Settings,
    store: RunStore,
    monkeypatch: pytest.MonkeyPatch,
    integration: str,
    bad: ScriptedCall,
    problem: str,
) -> None:
    agent = careful if integration == "ToolAgent" else pai_careful
    seen: list[ScriptRequest] = []
    good = ScriptedCall("lookup_order", {"order_id": "o-17"})
    first = ScriptedTurn(calls=(bad, good))
    async with ScriptedModelServer(answered_after_errors(first, seen)) as model:
        run_id, vendor = await serve_one(
            settings, store, agent, model, monkeypatch, {"prompt": "o-17?"}
        )
    run = await store.get(run_id)
    assert run.state is RunState.SUCCEEDED, run.error
    assert await failed_attempts(store, run_id) == 0  # no attempt was spent on it
    assert [r["turn"] for r in model.requests] == [0, 1]  # the model was asked twice, not six
    told = [m["content"] for m in seen[1].messages if m["role"] == "tool"]
    assert len(told) == 2 and problem in error_text(told[0]), told
    assert len(told[0]) < 2000
    assert vendor.requests == 0  # nothing was sent for it
    assert await EffectStore(store.pool).list_effects(run_id=run_id) == []
    # The good call beside it ran, and the model read its result.
    assert json.loads(told[1])["status"] == "shipped"
    await transcript_is_small(store, run_id)


# -- the same calls to tools an MCP server lists ------------------------------------------------
MCP_CASES = {
    # The listed schema is checked with json.loads, which reads these escapes and NaN.
    "read-only, lone surrogate escaped": (
        ScriptedCall("order_status", {"order_id": "o-\ud800"}),
        'arguments["order_id"] holds a string with a lone surrogate',
    ),
    "effect, NUL escaped": (
        ScriptedCall("open_ticket", {"title": "a\x00b"}),
        'arguments["title"] holds a string with a NUL character',
    ),
    "effect, NaN": (
        ScriptedCall("refund", '{"order_id": "o-17", "amount": NaN}'),
        'arguments["amount"] is nan',
    ),
    "effect, 400 KB": (ScriptedCall("open_ticket", {"title": HUGE}), "its arguments are 409,"),
}


@pytest.mark.parametrize(("bad", "problem"), MCP_CASES.values(), ids=list(MCP_CASES))
async def test_mcp_a_call_postgresql_cannot_store_is_a_tool_error_and_nothing_is_called(
    tmp_path: Path,
    settings: Settings,
    store: RunStore,
    monkeypatch: pytest.MonkeyPatch,
    bad: ScriptedCall,
    problem: str,
) -> None:
    pytest.importorskip("mcp")
    from support.mcp_servers_for_tests import ledger, stdio_server
    from test_mcp_tool_agent import mcp_agent, serve_one_run

    seen: list[ScriptRequest] = []
    good = ScriptedCall("order_status", {"order_id": "o-17"})
    first = ScriptedTurn(calls=(bad, good))
    server = stdio_server(tmp_path / "ledger.jsonl")
    async with (
        ScriptedModelServer(answered_after_errors(first, seen)) as model,
        mcp_agent(server) as agent,
    ):
        run_id = await serve_one_run(settings, store, agent, server, model, monkeypatch, "o-17?")
    run = await store.get(run_id)
    assert run.state is RunState.SUCCEEDED, run.error
    assert await failed_attempts(store, run_id) == 0
    assert [r["turn"] for r in model.requests] == [0, 1]
    [error] = tool_errors(seen[1])
    assert problem in error
    # The MCP server was called for the good lookup alone; no effect was recorded.
    assert [(e["tool"], e["arguments"]) for e in ledger(tmp_path / "ledger.jsonl")] == [
        ("order_status", {"order_id": "o-17"})
    ]
    assert await EffectStore(store.pool).list_effects(run_id=run_id) == []
    await transcript_is_small(store, run_id)


# -- answers PostgreSQL cannot store ------------------------------------------------------------
class Verdict(pydantic.BaseModel):
    status: str


ANSWERS = {
    # id: (the agent, the first answer, what the model is told, the answer taken)
    "text with a NUL": (careful, "done\x00", "NUL character", "done"),
    "text of 300 KB": (careful, "y" * (300 * 1024), "answer shorter", "done"),
    "JSON with a NUL escaped": (
        ToolAgent("careful_judge", instructions="", output=Verdict),
        '{"status": "ok\\u0000"}',
        'the answer["status"] holds a string with a NUL',
        {"status": "done"},
    ),
    "Pydantic AI text with a lone surrogate": (pai_careful, "done\ud800", "lone surrogate", "done"),
}


@pytest.mark.parametrize(
    ("agent", "answer", "problem", "taken"), ANSWERS.values(), ids=list(ANSWERS)
)
async def test_an_answer_postgresql_cannot_store_is_asked_again(
    settings: Settings,
    store: RunStore,
    monkeypatch: pytest.MonkeyPatch,
    agent: Agent,
    answer: str,
    problem: str,
    taken: Any,
) -> None:
    seen: list[ScriptRequest] = []
    again = '{"status": "done"}' if isinstance(taken, dict) else "done"

    def script(request: ScriptRequest) -> ScriptedTurn:
        seen.append(request)
        return ScriptedTurn(content=answer if request.turn == 0 else again)

    async with ScriptedModelServer(script) as model:
        run_id, _ = await serve_one(settings, store, agent, model, monkeypatch, {"p": "answer"})
    run = await store.get(run_id)
    assert run.state is RunState.SUCCEEDED, run.error
    assert await failed_attempts(store, run_id) == 0 and len(model.requests) == 2
    assert run.result is not None and run.result["output"] == taken
    asked = seen[1].messages[-1]
    assert asked["role"] == "user" and problem in asked["content"]
    await transcript_is_small(store, run_id, limit=300 * 1024)


@pytest.mark.parametrize(
    "agent",
    [careful, ToolAgent("careful_streaming", instructions="", stream=True), pai_careful],
    ids=lambda agent: agent.name,
)
async def test_an_answer_that_is_not_utf8_is_asked_again_within_the_turn(
    settings: Settings, store: RunStore, monkeypatch: pytest.MonkeyPatch, agent: Agent
) -> None:
    async with ScriptedModelServer(turns(ScriptedTurn(content="done"))) as model:
        model.fail_next(Garbled())
        run_id, _ = await serve_one(settings, store, agent, model, monkeypatch, {"p": "utf8"})
    run = await store.get(run_id)
    assert run.state is RunState.SUCCEEDED, run.error
    assert run.result is not None and run.result["output"] == "done"
    assert await failed_attempts(store, run_id) == 0
    assert [r["answer"] for r in model.requests] == ["garbled", "text"]


# -- what a transcript keeps of such a reply ----------------------------------------------------
def test_the_largest_arguments_are_left_out_until_the_reply_fits() -> None:
    limit = 256 * 1024
    calls = [
        ToolCall("a", "notify", json.dumps({"note": "x" * 100_000})),
        ToolCall("b", "notify", json.dumps({"note": "y" * 120_000})),
        ToolCall("c", "lookup_order", '{"order_id": "o-1"}'),
        ToolCall("d", "notify", json.dumps({"note": "z" * 90_000})),
        ToolCall("e\x00", "lookup_order", '{"order_id": "o-\x00"}'),
    ]
    stored = stored_reply(3, "Let me see.", calls, max_calls=4, max_bytes=limit)
    assert stored.fits and len(compact(stored.body)) <= limit
    # The calls together are over the limit: the largest alone is left out, the rest kept.
    assert sorted(stored.refused) == [1, 4]
    kept = [call["function"]["arguments"] for call in stored.body["tool_calls"]]
    assert json.loads(kept[1]) == {"omitted": "120,012 bytes of arguments, too large to keep"}
    assert kept[0] == calls[0].arguments and kept[3] == calls[3].arguments
    assert "its arguments are 120,012 bytes" in stored.refused[1]
    assert stored.body["tool_calls"][4]["id"] == "call_3_4"  # an id it could not keep
    assert kept[4] == '{"order_id": "o-\ufffd"}'
    assert "at most 4 tool calls per turn" in stored.refused[4]  # the last reason given
    assert stored.content_problem is None


def test_text_postgresql_cannot_hold_is_kept_with_replacement_characters() -> None:
    assert storable_text("a\x00b\ud800c\ud83d\ude00") == "a\ufffdb\ufffdc\U0001f600"
    value = {"k\x00": ["v\udfff", 1, None], "big": "w" * 300_000}
    kept = stored_json(value, 64 * 1024)
    assert kept == {
        "k\ufffd": ["v\ufffd", 1, None],
        "big": "[omitted: 300,000 bytes, too large to keep]",
    }
    assert stored_json({"many": ["s" * 100] * 5000}, 64 * 1024) is None  # no one string is large
