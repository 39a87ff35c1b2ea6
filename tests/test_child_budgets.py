"""Budgets flow down (docs/child-runs.md): a child's budget is carved from its parent's by the
commit that spawns it, counts against the parent until the child ends, and is then charged with
what the child spent; a tree never spends more than its root allows."""

from __future__ import annotations

import json
from typing import Any

import asyncpg
import pytest

from orchestrator import Budget, BudgetExhausted, Child
from orchestrator.agent.steps import Agent, Finish, Next, Outcome, Step, StepContext, Wait
from orchestrator.db.store import RunStore
from orchestrator.ids import new_run_id
from orchestrator.models import RunState
from orchestrator.settings import Settings
from orchestrator.testing import running_worker
from test_runtime import FAST
from test_upgrades import until_state


class SpendOne(Step):
    """One turn per step, until the budget says no."""

    async def run(self, ctx: StepContext) -> Outcome:
        assert ctx.budget is not None
        turns = int((ctx.checkpoint or {}).get("turns", 0))
        try:
            await ctx.budget.reserve(turns=1)
        except BudgetExhausted:
            return Finish(result={"turns": turns})
        ctx.budget.spend(turns=1)
        return Next(SpendOne, checkpoint={"turns": turns + 1})


class Carve(Step):
    async def run(self, ctx: StepContext) -> Outcome:
        children = [
            Child("spender", {}, key=f"s{n}", budget=Budget(turns=ctx.input["each"]))
            for n in range(ctx.input["children"])
        ]
        return Wait(then=Total, children=children, checkpoint={})


class Total(Step):
    async def run(self, ctx: StepContext) -> Outcome:
        assert ctx.budget is not None and ctx.wait is not None and ctx.wait.children is not None
        spent = sum(o.result["turns"] for o in ctx.wait.children.values() if o.succeeded)
        try:
            await ctx.budget.reserve(turns=1)
            more = True
        except BudgetExhausted:
            more = False
        return Finish(result={"children_spent": spent, "root_could_spend_more": more})


spender = Agent("spender", first=SpendOne, budget=Budget(turns=1000))
root = Agent("root", first=Carve, steps=[Total], budget=Budget(turns=12))


async def test_children_spend_their_carves_concurrently_and_the_root_s_limit_holds(
    settings: Settings, store: RunStore, pool: asyncpg.Pool
) -> None:
    run_id = (await store.submit("root", {"children": 3, "each": 4})).run.run_id
    async with running_worker(settings, [spender, root], concurrency=10, **FAST):
        done = await until_state(store, run_id, RunState.SUCCEEDED, RunState.DEAD)
    assert done.state is RunState.SUCCEEDED, done.error
    assert done.result == {"children_spent": 12, "root_could_spend_more": False}
    budgets = await pool.fetchrow(
        "SELECT turns_limit, turns_spent, turns_reserved, turns_carved FROM run_budgets"
        " WHERE run_id = $1",
        run_id,
    )
    assert budgets is not None
    assert dict(budgets) == {
        "turns_limit": 12,
        "turns_spent": 12,
        "turns_reserved": 0,
        "turns_carved": 0,
    }
    children = await pool.fetch(
        "SELECT b.turns_limit, b.turns_spent FROM run_budgets AS b JOIN runs AS r"
        " ON r.run_id = b.run_id WHERE r.parent_run_id = $1",
        run_id,
    )
    assert sorted((c["turns_limit"], c["turns_spent"]) for c in children) == [(4, 4)] * 3
    carves = await pool.fetch(
        "SELECT settled_at FROM budget_carves WHERE parent_run_id = $1", run_id
    )
    assert len(carves) == 3 and all(c["settled_at"] is not None for c in carves)


async def test_a_carve_past_the_parent_s_limit_fails_the_attempt_and_spawns_nothing(
    settings: Settings, store: RunStore, pool: asyncpg.Pool
) -> None:
    run_id = (await store.submit("root", {"children": 4, "each": 4}, max_attempts=1)).run.run_id
    async with running_worker(settings, [spender, root], **FAST):
        dead = await until_state(store, run_id, RunState.DEAD, RunState.SUCCEEDED)
    assert dead.state is RunState.DEAD
    assert "would pass run" in json.dumps(dead.error) and "limit on turns" in json.dumps(dead.error)
    assert await pool.fetchval("SELECT count(*) FROM runs WHERE parent_run_id = $1", run_id) == 0
    assert await pool.fetchval("SELECT count(*) FROM budget_carves") == 0


async def claimed_root(store: RunStore) -> Any:
    await store.submit("root", {})
    [claimed] = (await store.claim("w1", ["root"], limit=1, lease_seconds=30)).claimed
    return claimed


@pytest.mark.parametrize(
    ("budget", "why"),
    [(None, "must carve its turns"), (Budget(cost_usd=1), "must carve its turns")],
)
async def test_a_child_of_a_budgeted_run_must_carve_every_dimension_it_limits(
    store: RunStore, pool: asyncpg.Pool, budget: Budget | None, why: str
) -> None:
    claimed = await claimed_root(store)
    child = Child("spender", {}, key="k", budget=budget).spawn(new_run_id())
    async with pool.acquire() as db, db.transaction():
        with pytest.raises(asyncpg.InvalidParameterValueError, match=why):
            async with db.transaction():
                await store.spawn_children(
                    claimed.lease, [child], db=db, budget_limits={"turns": 12}
                )
    assert await pool.fetchval("SELECT count(*) FROM run_budgets") == 0


async def test_a_stale_parent_carves_nothing(store: RunStore, pool: asyncpg.Pool) -> None:
    claimed = await claimed_root(store)
    await pool.execute("UPDATE runs SET fence = fence + 1 WHERE run_id = $1", claimed.run_id)
    carved = await pool.fetchval(
        "SELECT orchestrator_carve_budgets($1, $2, 'w1', '{\"turns\": 5}', '[]')",
        claimed.run_id,
        claimed.fence,
    )
    assert carved is None
    assert await pool.fetchval("SELECT count(*) FROM run_budgets") == 0
