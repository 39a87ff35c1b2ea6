"""Existing Pydantic AI agents on orchestrator: a ``pydantic_ai.Agent`` with ``OpenAIChatModel``
over real HTTP to the scripted model server, a real worker, real PostgreSQL, and a real HTTP
vendor behind the dispatcher (counting requests per idempotency key). The process tests (a
SIGKILLed worker, a SIGSTOPped one replaced) run `serve` as real OS processes."""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

import anyio
import asyncpg
import pytest
from pydantic_ai import Agent as PydanticAgent

from orchestrator.agent.steps import Agent
from orchestrator.agent.tool_loop import effect_keys
from orchestrator.console.views import message_views
from orchestrator.db.budgets import BudgetStore
from orchestrator.db.rates import RateLimitStore
from orchestrator.db.store import RunStore
from orchestrator.effect_model import EffectStatus
from orchestrator.effects.approvals import ApprovalStore, Decision
from orchestrator.effects.http import HttpAdapter
from orchestrator.effects.store import EffectStore
from orchestrator.errors import InvalidInput
from orchestrator.integrations.pydantic_ai import PydanticAIAgent, child_agent, effect
from orchestrator.models import RunState
from orchestrator.settings import Settings
from orchestrator.testing import capture_spans, running_worker, wait_for_run
from orchestrator.testing.loopback import (
    LocalVendor,
    RateLimited,
    ScriptedCall,
    ScriptedModelServer,
    ScriptedTurn,
    ServerError,
    Slow,
    turns,
)
from support import ServeProcess, crm_kind, fenced_claims, serve_args, serving, write_vendors_config
from support.pydantic_ai_agents_for_tests import (
    ORDERS_TURNS,
    REFUND_TURNS,
    SLOW_TURN_1,
    STRUCTURED_TURNS,
    TWO_LOOKUPS,
    orders_agent,
    pai_budgeted,
    pai_frugal,
    pai_hurried,
    pai_impatient,
    pai_orders,
    pai_refunds,
    pai_structured,
)
from test_runtime import FAST, eventually

AGENTS = serving("support.pydantic_ai_agents_for_tests")


def crm(vendor: LocalVendor) -> dict[str, HttpAdapter]:
    return {
        "crm": HttpAdapter(
            "crm", url=vendor.send_url, lookup_url=vendor.lookup_url, reconcile="lookup"
        )
    }


def use_model(monkeypatch: pytest.MonkeyPatch, model: ScriptedModelServer) -> None:
    monkeypatch.setenv("OPENAI_BASE_URL", model.base_url)
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)


async def serve_one(
    settings: Settings,
    store: RunStore,
    agent: Agent,
    vendor: LocalVendor,
    run_input: dict[str, Any],
) -> str:
    run_id = (await store.submit(agent.name, run_input)).run.run_id
    async with running_worker(settings, [agent], effect_adapters=crm(vendor), **FAST):
        await wait_for_run(store, run_id, within=60)
    return run_id


async def test_a_pydantic_ai_agent_runs_turn_by_turn_and_its_effect_is_sent_once(
    settings: Settings, store: RunStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    exporter = capture_spans()
    assert exporter is not None
    exporter.clear()
    async with ScriptedModelServer(ORDERS_TURNS) as model, LocalVendor() as vendor:
        use_model(monkeypatch, model)
        run_id = await serve_one(settings, store, pai_orders, vendor, {"prompt": "Where is o-17?"})
    run = await store.get(run_id)
    assert run.state is RunState.SUCCEEDED, run.error
    assert run.result is not None
    assert run.result["output"] == "Order o-17 has shipped; the CRM is noted."
    assert run.result["turns"] == 3
    assert [r["turn"] for r in model.requests] == [0, 1, 2]  # each turn asked once
    transcript = await store.messages(run_id)
    assert all("pydantic_ai" in m.body for m in transcript)
    [turn_1] = [m for m in transcript if m.role == "assistant" and m.turn == 1]
    [key] = effect_keys(1, turn_1.body["tool_calls"])
    record = await EffectStore(store.pool).get(run_id, key)
    assert record.status is EffectStatus.CONFIRMED
    assert record.payload == {"order_id": "o-17", "note": "shipped today"}
    assert sorted(vendor.requests_by_key.values()) == [1]
    assert vendor.requests_by_key[record.idempotency_key] == 1
    # runs show and the console map each call to its effect's status.
    shown = message_views(transcript, [record], last=20, reveal=False)
    assert [c["effect_status"] for v in shown for c in v.calls] == [None, "confirmed"]
    # The model read the settled record as the call's return.
    last = model.requests[-1]
    assert last["answer"] == "text"
    # Model requests carry the run and its fence on their spans.
    chats = [
        s
        for s in exporter.get_finished_spans()
        if s.name.startswith("chat ") and s.attributes.get("orchestrator.run.id") == run_id
    ]
    assert len(chats) == 3
    assert all(s.attributes["orchestrator.run.fence"] >= 1 for s in chats)


async def test_an_approved_refund_is_sent_once_after_approval(
    settings: Settings, store: RunStore, pool: asyncpg.Pool, monkeypatch: pytest.MonkeyPatch
) -> None:
    approvals = ApprovalStore(pool)
    async with ScriptedModelServer(REFUND_TURNS) as model, LocalVendor() as vendor:
        use_model(monkeypatch, model)
        run_id = (await store.submit("pai_refunds", {"prompt": "refund o-17"})).run.run_id
        async with running_worker(settings, [pai_refunds], effect_adapters=crm(vendor), **FAST):
            run = await wait_for_run(store, run_id, states={RunState.WAITING}, within=60)
            assert run.lease_owner is None  # waits without a lease
            [pending] = await approvals.pending(run_id=run_id)
            assert pending.payload == {"order_id": "o-17", "amount": 150.0}
            await anyio.sleep(0.5)
            assert vendor.requests == 0  # never sent unapproved
            await approvals.decide(
                run_id,
                pending.effect_key,
                Decision.APPROVED,
                by="ana",
                payload_sha256=pending.payload_sha256,
            )
            final = await wait_for_run(store, run_id, within=60)
    assert final.state is RunState.SUCCEEDED, final.error
    assert sorted(vendor.requests_by_key.values()) == [1]
    record = await EffectStore(store.pool).get(run_id, pending.effect_key)
    assert record.status is EffectStatus.CONFIRMED
    assert model.answered("refund o-17", 0) == 1  # the approved turn was not asked again


async def test_a_denied_refund_reaches_the_model_as_a_tool_denial(
    settings: Settings, store: RunStore, pool: asyncpg.Pool, monkeypatch: pytest.MonkeyPatch
) -> None:
    approvals = ApprovalStore(pool)
    async with ScriptedModelServer(REFUND_TURNS) as model, LocalVendor() as vendor:
        use_model(monkeypatch, model)
        run_id = (await store.submit("pai_refunds", {"prompt": "deny o-17"})).run.run_id
        async with running_worker(settings, [pai_refunds], effect_adapters=crm(vendor), **FAST):
            await wait_for_run(store, run_id, states={RunState.WAITING}, within=60)
            [pending] = await approvals.pending(run_id=run_id)
            await approvals.decide(
                run_id, pending.effect_key, Decision.DENIED, by="ana", note="too much"
            )
            final = await wait_for_run(store, run_id, within=60)
    assert final.state is RunState.SUCCEEDED, final.error
    assert vendor.requests == 0
    # The last request the model got holds the denial as the refund call's tool message.
    transcript = await store.messages(run_id)
    returns = [
        part
        for m in transcript
        if m.role != "assistant"
        for part in m.body["pydantic_ai"]["parts"]
        if part.get("tool_name") == "refund"
    ]
    assert len(returns) == 1 and "too much" in returns[0]["content"]
    assert returns[0]["outcome"] == "denied"


async def test_the_budget_counts_pydantic_ai_model_requests(
    settings: Settings, store: RunStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with ScriptedModelServer(ORDERS_TURNS) as model, LocalVendor() as vendor:
        use_model(monkeypatch, model)
        run_id = (await store.submit("pai_budgeted", {"prompt": "budget o-17"})).run.run_id
        async with running_worker(settings, [pai_budgeted], effect_adapters=crm(vendor), **FAST):
            with anyio.fail_after(60):
                while (run := await store.get(run_id)).wait is None or run.wait.get(
                    "reason"
                ) != "budget":
                    assert run.state in (RunState.QUEUED, RunState.RUNNING, RunState.WAITING)
                    await anyio.sleep(0.05)
            budgets = BudgetStore(store.pool)
            budget = await budgets.get(run_id)
            assert budget is not None and budget.spent["turns"] == 2
            assert budget.spent["input_tokens"] > 0
            # Topped up, the run resumes the turn that was told of the settled effect: the
            # model reads its record, and nothing is recorded or sent again.
            await budgets.top_up(run_id, turns=5)
            final = await wait_for_run(store, run_id, within=60)
    assert final.state is RunState.SUCCEEDED, final.error
    assert len(await EffectStore(store.pool).list_effects(run_id=run_id)) == 1
    assert sorted(vendor.requests_by_key.values()) == [1]
    told = [
        part["content"]
        for m in await store.messages(run_id)
        if m.role != "assistant"
        for part in m.body["pydantic_ai"]["parts"]
        if part.get("tool_name") == "notify"
    ]
    assert [t["status"] for t in told] == ["confirmed"]
    assert model.answered("budget o-17", 2) == 1  # asked once, after the top-up


async def test_tool_calls_past_the_budget_are_not_run_and_the_model_is_told(
    settings: Settings, store: RunStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with ScriptedModelServer(TWO_LOOKUPS) as model, LocalVendor() as vendor:
        use_model(monkeypatch, model)
        run_id = (await store.submit("pai_frugal", {"prompt": "two lookups"})).run.run_id
        async with running_worker(settings, [pai_frugal], effect_adapters=crm(vendor), **FAST):
            run = await wait_for_run(
                store, run_id, states={RunState.WAITING, RunState.SUCCEEDED}, within=60
            )
    assert run.state is RunState.WAITING  # for a top-up of tool calls
    returns = [
        part["content"]
        for m in await store.messages(run_id)
        if m.role != "assistant"
        for part in m.body["pydantic_ai"]["parts"]
        if part.get("tool_name") == "lookup_order"
    ]
    assert returns[0]["status"] == "shipped"
    assert "tool-call budget is exhausted" in returns[1]["error"]
    budget = await BudgetStore(store.pool).get(run_id)
    assert budget is not None and budget.spent["tool_calls"] == 1


async def test_a_rate_limited_or_failing_model_request_is_retried_by_our_layer_alone(
    settings: Settings, store: RunStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with ScriptedModelServer(ORDERS_TURNS) as model, LocalVendor() as vendor:
        use_model(monkeypatch, model)
        model.fail_next(RateLimited(retry_after=0.1), turn=0)
        model.fail_next(ServerError(502), turn=1)
        run_id = await serve_one(settings, store, pai_orders, vendor, {"prompt": "retry o-17"})
    run = await store.get(run_id)
    assert run.state is RunState.SUCCEEDED, run.error
    assert model.faults_taken == {"RateLimited": 1, "ServerError": 1}
    # One retry each: the SDK's own retries are off, so each fault cost one request.
    assert [r["answer"] for r in model.requests] == [
        "429",
        "tool_calls",
        "502",
        "tool_calls",
        "text",
    ]
    assert sorted(vendor.requests_by_key.values()) == [1]


async def test_model_requests_are_charged_to_the_model_s_shared_rate_limit_and_a_429_pauses_it(
    settings: Settings, store: RunStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    rates = RateLimitStore(store.pool)
    await rates.set("model:gpt-4o-mini", requests=50, per_seconds=3600)
    async with ScriptedModelServer(ORDERS_TURNS) as model, LocalVendor() as vendor:
        use_model(monkeypatch, model)
        model.fail_next(RateLimited(retry_after=0.5), turn=0)
        run_id = await serve_one(settings, store, pai_orders, vendor, {"prompt": "pace o-17"})
    run = await store.get(run_id)
    assert run.state is RunState.SUCCEEDED, run.error
    [limit] = await rates.list("model:gpt-4o-mini")
    assert limit.requests_left is not None
    assert 50 - round(limit.requests_left) == len(model.requests) == 4  # the 429 counted too
    paused_by = await store.pool.fetchval(
        "SELECT paused_by FROM rate_limits WHERE name = 'model:gpt-4o-mini'"
    )
    assert paused_by is not None  # the 429's Retry-After paused it for every worker


async def test_a_structured_output_and_an_unclassified_tool_the_model_was_never_offered(
    settings: Settings, store: RunStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with ScriptedModelServer(STRUCTURED_TURNS) as model, LocalVendor() as vendor:
        use_model(monkeypatch, model)
        run_id = await serve_one(settings, store, pai_structured, vendor, {"prompt": "o-17?"})
    run = await store.get(run_id)
    assert run.state is RunState.SUCCEEDED, run.error
    assert run.result is not None
    assert run.result["output"] == {"order_id": "o-17", "status": "shipped"}
    assert "delete_everything" not in model.requests[0]["tools"]
    assert "lookup_order" in model.requests[0]["tools"]
    refused = [
        part
        for m in await store.messages(run_id)
        if m.role != "assistant"
        for part in m.body["pydantic_ai"]["parts"]
        if part.get("tool_name") == "delete_everything"
    ]
    # Refused by Pydantic AI itself (an unknown tool), never run: told back to the model.
    assert len(refused) == 1 and refused[0]["outcome"] != "success"
    assert vendor.requests == 0


async def test_a_read_only_tool_past_its_timeout_is_told_to_the_model_as_an_error(
    settings: Settings, store: RunStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    script = turns(
        ScriptedTurn(calls=(ScriptedCall("lookup_order", {"order_id": "slow"}),)),
        ScriptedTurn(content="It took too long."),
    )
    monkeypatch.setenv("ORDERS_LOOKUP_SECONDS", "30")
    async with ScriptedModelServer(script) as model, LocalVendor() as vendor:
        use_model(monkeypatch, model)
        run_id = await serve_one(settings, store, pai_impatient, vendor, {"prompt": "slow?"})
    run = await store.get(run_id)
    assert run.state is RunState.SUCCEEDED, run.error
    [told] = [
        part["content"]
        for m in await store.messages(run_id)
        if m.role != "assistant"
        for part in m.body["pydantic_ai"]["parts"]
        if part.get("tool_name") == "lookup_order"
    ]
    assert told == {"error": "lookup_order did not answer within 0.5s"}


async def test_the_deadline_ends_a_run_waiting_for_an_approval_that_never_comes(
    settings: Settings, store: RunStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with ScriptedModelServer(REFUND_TURNS) as model, LocalVendor() as vendor:
        use_model(monkeypatch, model)
        run_id = await serve_one(settings, store, pai_hurried, vendor, {"prompt": "hurry"})
    run = await store.get(run_id)
    assert run.state is RunState.FAILED
    assert run.error is not None and "deadline passed" in str(run.error)
    assert vendor.requests == 0
    assert model.answered("hurry", 1) == 0  # the model was never asked past the deadline


def test_bad_configuration_is_refused_with_one_line() -> None:
    with pytest.raises(InvalidInput, match=r"is not a pydantic_ai\.Agent"):
        PydanticAIAgent("x", object())  # type: ignore[arg-type]
    with pytest.raises(InvalidInput, match="notify is declared more than once"):
        PydanticAIAgent("x", orders_agent, read_only=["notify"], effects={"notify": effect("crm")})
    with pytest.raises(InvalidInput, match="notify is declared more than once"):
        PydanticAIAgent(
            "x",
            orders_agent,
            effects={"notify": effect("crm")},
            agents={"notify": child_agent("a")},
        )
    with pytest.raises(InvalidInput, match="must be effect"):
        PydanticAIAgent("x", orders_agent, effects={"notify": "crm"})  # type: ignore[dict-item]
    with pytest.raises(InvalidInput, match="must be child_agent"):
        PydanticAIAgent("x", orders_agent, agents={"notify": effect("crm")})  # type: ignore[dict-item]
    with pytest.raises(InvalidInput, match="agent"):
        child_agent("bad agent!")
    with pytest.raises(InvalidInput, match="read_only is a list"):
        PydanticAIAgent("x", orders_agent, read_only="lookup_order")
    with pytest.raises(InvalidInput, match="deadline_seconds must be above 0"):
        PydanticAIAgent("x", orders_agent, deadline_seconds=0)
    with pytest.raises(InvalidInput, match="tool_timeout_seconds must be above 0"):
        PydanticAIAgent("x", orders_agent, tool_timeout_seconds=0)
    with pytest.raises(InvalidInput):
        effect("not a kind!")
    assert isinstance(orders_agent, PydanticAgent)


# -- real processes ---------------------------------------------------------------------------
def vendor_config(tmp_path: Path, vendor: LocalVendor) -> str:
    return write_vendors_config(tmp_path, {"crm": crm_kind(vendor)})


def model_env(model: ScriptedModelServer, **more: str) -> dict[str, str]:
    return {"OPENAI_BASE_URL": model.base_url, "OPENAI_API_KEY": "", **more}


@pytest.mark.slow
async def test_a_worker_killed_mid_turn_is_replaced_and_the_replayed_turn_alone_acts(
    database_url: str, store: RunStore, tmp_path: Path
) -> None:
    """A is SIGKILLed between turn 1's model answer and its commit (a slow read-only lookup):
    B replays turn 1, the model answers differently, and only B's call is ever sent."""
    async with ScriptedModelServer(SLOW_TURN_1) as model, LocalVendor() as vendor:
        args = serve_args(
            AGENTS, vendor_config(tmp_path, vendor), lease_seconds="10", heartbeat_seconds="2"
        )
        env = model_env(model, ORDERS_LOOKUP_SECONDS="60")
        conversation = "Where is o-17? (killed)"
        run_id = (await store.submit("pai_orders", {"prompt": conversation})).run.run_id
        with ServeProcess(database_url, *args, name="A", env=env) as a:
            await eventually(lambda: model.answered(conversation, 1) == 1, within=30)
            await anyio.sleep(0.3)
            a.kill()
        with ServeProcess(database_url, *args, name="B", env=env):
            final = await wait_for_run(store, run_id, within=40)
            await eventually(lambda: len(vendor.requests_by_key) == 1, within=60)
    assert final.state is RunState.SUCCEEDED, final.error
    records = await EffectStore(store.pool).list_effects(run_id=run_id)
    assert [r.payload for r in records] == [{"order_id": "o-17", "note": "REPLAYED answer"}]
    assert sorted(vendor.requests_by_key.values()) == [1]  # one vendor call per key
    assert model.answered(conversation, 0) == 1  # the committed turn 0 was not asked again
    assistant_turns = [m.turn for m in await store.messages(run_id) if m.role == "assistant"]
    assert assistant_turns == [0, 1, 2]


@pytest.mark.slow
async def test_a_paused_owner_replaced_and_resumed_never_sends_twice(
    database_url: str, store: RunStore, tmp_path: Path
) -> None:
    async with ScriptedModelServer(ORDERS_TURNS) as model, LocalVendor() as vendor:
        args = serve_args(
            AGENTS, vendor_config(tmp_path, vendor), lease_seconds="2", heartbeat_seconds="0.5"
        )
        conversation = "stop and go"
        model.fail_next(Slow(2.5), turn=2, conversation=conversation)
        run_id = (await store.submit("pai_orders", {"prompt": conversation})).run.run_id
        with ServeProcess(database_url, *args, name="A", env=model_env(model)) as a:
            # Turn 1 (the effect call) committed; A is in turn 2's model request.
            await eventually(lambda: any(r["turn"] == 2 for r in model.requests), within=30)
            a.signal(signal.SIGSTOP)
            with ServeProcess(database_url, *args, name="B", env=model_env(model)):
                final = await wait_for_run(store, run_id, within=40)
            a.signal(signal.SIGCONT)
            await eventually(lambda: bool(a.events("lease lost")), within=60)
            await anyio.sleep(1)
    assert final.state is RunState.SUCCEEDED, final.error
    assert sorted(vendor.requests_by_key.values()) == [1]  # one vendor call per key
    assert model.answered(conversation, 1) == 1  # the committed effect turn was not replayed
    claims = fenced_claims(await store.events(run_id))
    assert claims[0].worker_id == "A" and claims[-1].worker_id == "B"
    records = await EffectStore(store.pool).list_effects(run_id=run_id)
    assert [r.status for r in records] == [EffectStatus.CONFIRMED]
    told = [
        part["content"]
        for m in await store.messages(run_id)
        if m.role != "assistant"
        for part in m.body["pydantic_ai"]["parts"]
        if part.get("tool_name") == "notify"
    ]
    assert [t["status"] for t in told] == ["confirmed"]
    assert json.dumps(told)  # plain JSON


async def committed_an_effect(effects: EffectStore, run_id: str, within: float = 30) -> None:
    """Until the run has an effect record (its turn committed), polled; bounded."""
    with anyio.fail_after(within):
        for _ in range(int(within / 0.05) + 1):
            if await effects.list_effects(run_id=run_id):
                return
            await anyio.sleep(0.05)


@pytest.mark.slow
async def test_a_worker_killed_between_the_commit_and_the_dispatch_the_effect_is_sent_once(
    database_url: str, store: RunStore, tmp_path: Path
) -> None:
    """A (no dispatcher) commits the effect turn and is SIGKILLed; B dispatches it once and
    resumes from the transcript without asking the model again for the committed turns."""
    async with ScriptedModelServer(ORDERS_TURNS) as model, LocalVendor() as vendor:
        config = vendor_config(tmp_path, vendor)
        base = [*AGENTS, "--lease-seconds", "10", "--heartbeat-seconds", "2"]
        conversation = "o-17, please"
        run_id = (await store.submit("pai_orders", {"prompt": conversation})).run.run_id
        effects = EffectStore(store.pool)
        with ServeProcess(
            database_url, *base, "--no-dispatch", name="A", env=model_env(model)
        ) as a:
            await eventually(lambda: model.answered(conversation, 1) == 1, within=30)
            await committed_an_effect(effects, run_id)
            a.kill()
        with ServeProcess(
            database_url, *base, "--effects-config", config, name="B", env=model_env(model)
        ):
            final = await wait_for_run(store, run_id, within=40)
    assert final.state is RunState.SUCCEEDED, final.error
    assert sorted(vendor.requests_by_key.values()) == [1]
    assert model.answered(conversation, 0) == 1 and model.answered(conversation, 1) == 1
    [record] = await effects.list_effects(run_id=run_id)
    assert record.status is EffectStatus.CONFIRMED
