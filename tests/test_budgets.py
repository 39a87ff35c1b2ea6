"""Budgets and approvals in the tool loop, in-process with a scripted model server and a real
vendor; budget and price configuration errors."""

from __future__ import annotations

import json
import os
import re
import sys
from decimal import Decimal
from pathlib import Path
from typing import Any

import anyio
import pytest

from orchestrator import (
    Agent,
    Budget,
    Client,
    Finish,
    InvalidInput,
    Next,
    Outcome,
    Step,
    StepContext,
)
from orchestrator.agent.budgets import Prices
from orchestrator.agent.tool_loop import ToolAgent
from orchestrator.db.budgets import BudgetStore
from orchestrator.db.store import RunStore
from orchestrator.effects.approvals import ApprovalStore, Decision
from orchestrator.effects.http import HttpAdapter
from orchestrator.models import RunState
from orchestrator.settings import Settings
from orchestrator.testing import run_agent, running_worker, wait_for_run
from orchestrator.testing.loopback import (
    LocalVendor,
    ScriptedCall,
    ScriptedModelServer,
    ScriptedTurn,
    turns,
)
from support.tool_agents_for_tests import lookup_order, refund
from test_waits import FAST


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


def order_lookups(name: str, budget: Budget) -> ToolAgent:
    return ToolAgent(name, instructions="Look orders up.", tools=[lookup_order], budget=budget)


async def test_a_budget_set_to_fail_ends_the_run_when_exhausted(
    settings: Settings, store: RunStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    agent = order_lookups("strict", Budget(turns=2, on_exhausted="fail"))
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
    agent = order_lookups("frugal", Budget(tool_calls=1))
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


# -- amounts that change a budget are positive --------------------------------------------------
BAD_RESERVATIONS: dict[str, dict[str, Any]] = {
    "negative": {"turns": -10, "input_tokens": -5000},
    "negative cost": {"turns": 1, "cost_usd": Decimal("-1")},
    "NaN cost": {"turns": 1, "cost_usd": Decimal("NaN")},
    "infinite cost": {"turns": 1, "cost_usd": float("inf")},
    "nothing": {},
    "past bigint": {"output_tokens": 2**70},
    "fraction": {"turns": 0.5},
}
BAD_SPENDS: dict[str, dict[str, Any]] = {
    "spend negative": {"turns": -3},
    "spend NaN": {"cost_usd": "NaN"},
}


class ReserveBadly(Step):
    """Tries every bad reservation and spend, then reserves and spends honestly."""

    async def run(self, ctx: StepContext) -> Outcome:
        assert ctx.budget is not None
        refused: dict[str, str] = {}
        for case, amounts in BAD_RESERVATIONS.items():
            try:
                await ctx.budget.reserve(**amounts)
            except InvalidInput as error:
                refused[case] = str(error)
        await ctx.budget.reserve(turns=1)
        for case, amounts in BAD_SPENDS.items():
            try:
                ctx.budget.spend(**amounts)
            except InvalidInput as error:
                refused[case] = str(error)
        ctx.budget.spend(turns=1, input_tokens=0)
        return Finish({"refused": refused})


reserver = Agent("reserver", first=ReserveBadly, budget=Budget(turns=5, input_tokens=100))


async def test_a_step_cannot_reserve_or_spend_a_negative_or_empty_amount(
    settings: Settings, store: RunStore
) -> None:
    run, _ = await run_agent(settings, reserver, {})
    assert run.state is RunState.SUCCEEDED, run.error
    refused = run.result["refused"]
    assert set(refused) == {*BAD_RESERVATIONS, *BAD_SPENDS}
    assert "ctx.budget.reserve(turns=...) must be a whole number from 0" in refused["negative"]
    assert "reserves nothing" in refused["nothing"]
    assert "cost_usd" in refused["NaN cost"] and "cost_usd" in refused["infinite cost"]
    assert all("\n" not in message for message in refused.values())
    budget = await BudgetStore(store.pool).get(run.run_id)
    assert budget is not None
    assert budget.spent["turns"] == 1 and budget.spent["input_tokens"] == 0  # only the honest one
    assert budget.limit["turns"] == 5


BAD_TOP_UPS: list[tuple[dict[str, Any], str]] = [
    ({}, "nothing to add"),
    ({"cost_usd": "0"}, "--add-usd must be a number of US dollars above 0"),
    ({"cost_usd": "-1"}, "--add-usd must be a number of US dollars above 0"),
    ({"cost_usd": "NaN"}, "--add-usd must be a number of US dollars above 0"),
    ({"cost_usd": float("inf")}, "--add-usd must be a number of US dollars above 0"),
    ({"turns": 0}, "--add-turns must be a whole number from 1"),
    ({"turns": -10, "cost_usd": 5}, "--add-turns must be a whole number from 1"),
    ({"input_tokens": -5000}, "--add-input-tokens must be a whole number from 1"),
]


async def test_a_top_up_of_nothing_or_less_is_refused_and_changes_nothing(
    settings: Settings, store: RunStore
) -> None:
    run, _ = await run_agent(settings, reserver, {})
    budgets = BudgetStore(store.pool)
    before = await budgets.get(run.run_id)
    async with await Client.connect(settings) as client:
        for amounts, says in BAD_TOP_UPS:
            with pytest.raises(InvalidInput, match=re.escape(says)):
                await client.top_up(run.run_id, **amounts)
        assert await budgets.get(run.run_id) == before
        assert not [e for e in await budgets.ledger(run.run_id) if e.kind == "top_up"]
        raised = await client.top_up(run.run_id, turns=2)  # and a real one still works
    assert raised.limit["turns"] == 7


async def test_the_ledger_without_json_is_a_table_only(settings: Settings) -> None:
    run, _ = await run_agent(settings, reserver, {})
    assert settings.database_url is not None
    with anyio.fail_after(60):
        shown = await anyio.run_process(
            [sys.executable, "-m", "orchestrator.cli", "runs", "budget", run.run_id, "--ledger"],
            env={**os.environ, "ORCHESTRATOR_DATABASE_URL": settings.database_url},
            check=False,
        )
    assert shown.returncode == 0, shown.stderr
    table = shown.stdout.decode()
    assert "ledger" in table and "reserve" in table and "settle" in table
    assert "{" not in table and '"kind"' not in table  # no JSON after the table


HUGE = 2**62  # budgets.MAX_AMOUNT: one amount may be this large, a total never past it


class SpendHugely(Step):
    """Spends the largest amount allowed in each of two steps (a model server's absurd usage)."""

    async def run(self, ctx: StepContext) -> Outcome:
        assert ctx.budget is not None
        await ctx.budget.reserve(turns=1)
        ctx.budget.spend(turns=1, input_tokens=HUGE)
        try:
            ctx.budget.spend(input_tokens=1)
            refused = ""
        except InvalidInput as error:
            refused = str(error)
        if ctx.checkpoint:
            return Finish({"refused": [*ctx.checkpoint["refused"], refused]})
        return Next(SpendHugely, checkpoint={"refused": [refused]})


async def test_huge_totals_saturate_instead_of_failing_the_commit(
    settings: Settings, store: RunStore
) -> None:
    """Two steps' spends, and two top-ups, add past bigint: the commit (and any batched with
    it) and the top-up must not fail on the database's overflow."""
    agent = Agent("spender", first=SpendHugely, budget=Budget(turns=5))
    run, _ = await run_agent(settings, agent, {})
    assert run.state is RunState.SUCCEEDED, run.error
    assert all("over 4,611,686,018,427,387,904" in message for message in run.result["refused"])
    budgets = BudgetStore(store.pool)
    state = await budgets.get(run.run_id)
    assert state is not None and state.spent["input_tokens"] == HUGE  # saturated, not 2**63
    for _ in range(2):
        await budgets.top_up(run.run_id, turns=HUGE)
    state = await budgets.get(run.run_id)
    assert state is not None and state.limit["turns"] == HUGE
