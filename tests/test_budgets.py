"""Budgets and approvals in the tool loop, in-process with a scripted model server and a real
vendor; budget and price configuration errors."""

from __future__ import annotations

import json
from decimal import Decimal
from pathlib import Path
from typing import Any

import anyio
import pytest

from orchestrator import Budget, InvalidInput
from orchestrator.budgets import BudgetStore, Prices
from orchestrator.db.store import RunStore
from orchestrator.effects.adapters import HttpAdapter
from orchestrator.effects.approvals import ApprovalStore, Decision
from orchestrator.loopback import (
    LocalVendor,
    ScriptedCall,
    ScriptedModelServer,
    ScriptedTurn,
    turns,
)
from orchestrator.models import RunState
from orchestrator.settings import Settings
from orchestrator.testing import running_worker, wait_for_run
from orchestrator.tool_agent import ToolAgent
from test_waits import FAST
from tool_agents_for_tests import lookup_order, refund


def test_a_budget_names_its_limits_clearly() -> None:
    with pytest.raises(InvalidInput, match="at least one limit"):
        Budget()
    with pytest.raises(InvalidInput, match="turns must be between 0 and"):
        Budget(turns=-1)
    with pytest.raises(InvalidInput, match="whole number"):
        Budget(turns=2.5)  # type: ignore[arg-type]
    with pytest.raises(InvalidInput, match="US dollars"):
        Budget(cost_usd="lots")
    with pytest.raises(InvalidInput, match="'wait' or 'fail'"):
        Budget(turns=1, on_exhausted="retry")  # type: ignore[arg-type]
    assert Budget(cost_usd=1.5).limits() == {"cost_usd": "1.5"}


def test_prices_come_from_the_operator(tmp_path: Path) -> None:
    table = {"m": {"input_per_million": 1, "output_per_million": "2.5"}}
    prices = Prices.from_env({"ORCHESTRATOR_PRICES": json.dumps(table)})
    assert prices.cost("m", 1_000_000, 2_000_000) == Decimal("6.0")
    path = tmp_path / "prices.json"
    path.write_text(json.dumps(table))
    assert Prices.from_env({"ORCHESTRATOR_PRICES": str(path)}).models.keys() == {"m"}
    assert Prices.from_env({}).models == {}
    with pytest.raises(InvalidInput, match="no price for model 'other'"):
        prices.cost("other", 1, 1)
    with pytest.raises(InvalidInput, match="neither a JSON object nor a readable file"):
        Prices.from_env({"ORCHESTRATOR_PRICES": "/nonexistent/prices.json"})
    with pytest.raises(InvalidInput, match=r"m\.input_per_million"):
        Prices.from_env({"ORCHESTRATOR_PRICES": '{"m": {"input_per_million": -1, '
                                                  '"output_per_million": 1}}'})  # fmt: skip
    with pytest.raises(InvalidInput, match="output_per_million"):
        Prices.from_env({"ORCHESTRATOR_PRICES": '{"m": {"input_per_million": 1}}'})


LOOKUPS = turns(
    *(
        ScriptedTurn(calls=(ScriptedCall("lookup_order", {"order_id": f"o-{n}"}),))
        for n in range(5)
    ),
    ScriptedTurn(content="done"),
)


async def serve(
    settings: Settings,
    store: RunStore,
    agent: ToolAgent,
    model: ScriptedModelServer,
    monkeypatch: pytest.MonkeyPatch,
    states: set[RunState],
    **adapters: Any,
) -> str:
    monkeypatch.setenv("OPENAI_BASE_URL", model.base_url)
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    run_id = (await store.submit(agent.name, {"prompt": f"{agent.name} please"})).run.run_id
    async with running_worker(settings, [agent], effect_adapters=adapters, **FAST):
        await wait_for_run(store, run_id, states=states, within=60)
    return run_id


async def test_a_budget_set_to_fail_ends_the_run_when_exhausted(
    settings: Settings, store: RunStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    agent = ToolAgent(
        "strict",
        instructions="Look orders up.",
        tools=[lookup_order],
        budget=Budget(turns=2, on_exhausted="fail"),
    )
    async with ScriptedModelServer(LOOKUPS) as model:
        run_id = await serve(settings, store, agent, model, monkeypatch, {RunState.FAILED})
    run = await store.get(run_id)
    assert "exhausted its turns budget" in run.error["message"]
    assert len(model.requests) == 2  # the third call was never made
    budget = await BudgetStore(store.pool).get(run_id)
    assert budget is not None and budget.spent["turns"] == 2


async def test_tool_calls_past_the_budget_are_refused_to_the_model_and_the_run_waits(
    settings: Settings, store: RunStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    agent = ToolAgent(
        "frugal",
        instructions="Look orders up.",
        tools=[lookup_order],
        budget=Budget(tool_calls=1),
    )
    two_calls = turns(
        ScriptedTurn(
            calls=(
                ScriptedCall("lookup_order", {"order_id": "o-1"}),
                ScriptedCall("lookup_order", {"order_id": "o-2"}),
            )
        ),
        ScriptedTurn(content="done"),
    )
    async with ScriptedModelServer(two_calls) as model:
        run_id = await serve(settings, store, agent, model, monkeypatch, {RunState.WAITING})
    run = await store.get(run_id)
    assert run.wait is not None and run.wait["reason"] == "budget"
    tools = [m.body["content"] for m in await store.messages(run_id) if m.role == "tool"]
    assert "shipped" in tools[0]
    assert "tool-call budget is exhausted" in tools[1]
    budget = await BudgetStore(store.pool).get(run_id)
    assert budget is not None and budget.spent["tool_calls"] == 1  # the refused call is free


async def test_a_refund_under_the_threshold_needs_no_approval_and_a_denied_one_is_told(
    settings: Settings, store: RunStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    agent = ToolAgent("refunder", instructions="Refund orders.", tools=[refund])
    script = turns(
        ScriptedTurn(
            calls=(
                ScriptedCall("refund", {"order_id": "o-1", "amount": 20}),
                ScriptedCall("refund", {"order_id": "o-2", "amount": 500}),
            )
        ),
        ScriptedTurn(content="One refunded, one refused."),
    )
    async with ScriptedModelServer(script) as model, LocalVendor() as vendor:
        monkeypatch.setenv("OPENAI_BASE_URL", model.base_url)
        monkeypatch.delenv("OPENAI_API_KEY", raising=False)
        adapters = {"crm": HttpAdapter("crm", url=vendor.send_url, reconcile="replay")}
        run_id = (await store.submit("refunder", {"prompt": "two refunds"})).run.run_id
        async with running_worker(settings, [agent], effect_adapters=adapters, **FAST):
            await wait_for_run(store, run_id, states={RunState.WAITING}, within=60)
            with anyio.fail_after(60):
                while vendor.requests < 1:  # noqa: ASYNC110
                    await anyio.sleep(0.05)
            [pending] = await ApprovalStore(store.pool).pending(run_id=run_id)
            assert pending.payload == {"order_id": "o-2", "amount": 500}
            await ApprovalStore(store.pool).decide(
                run_id, pending.effect_key, Decision.DENIED, by="ana", note="over the limit"
            )
            run = await wait_for_run(store, run_id, within=60)
    assert run.state is RunState.SUCCEEDED, run.error
    assert [d["payload"]["amount"] for d in vendor.deliveries.values()] == [20]
    told = [json.loads(m.body["content"]) for m in await store.messages(run_id) if m.role == "tool"]
    assert told[0]["status"] == "confirmed"
    assert told[1] == {"status": "denied", "error": "denied by reviewer: over the limit"}
