"""Before a step's commit starts child runs: each child's agent must be one some worker serves
(docs/child-runs.md), or the attempt fails in one line and nothing is committed."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import asyncpg

from orchestrator.agent.steps import Agent, Next, Wait
from orchestrator.db.deadlines import pooled
from orchestrator.db.workers import WorkerRegistry
from orchestrator.telemetry import current_traceparent
from orchestrator.worker.outcomes import started_children


async def check_child_agents(
    outcome: Next | Wait, served_here: Iterable[str], pool: asyncpg.Pool, *, within: float
) -> None:
    """Raise ``LookupError`` naming a child whose agent no registered worker serves (the read
    bounded by ``within`` seconds, as every read on a step's path is)."""
    children = started_children(outcome)
    wanted = {child.agent for child in children} - set(served_here)
    if not wanted:
        return
    async with pooled(pool, within=within) as db:
        served = await WorkerRegistry().served_agents(db)
    missing = wanted - set(served)
    if missing:
        child = next(child for child in children if child.agent in missing)
        raise LookupError(
            f"child {child.key} is a run of agent {child.agent}, which no worker serves: "
            f"deploy a worker that serves it, or fix the name"
        )


def spawn_context(agent: Agent, outcome: Next | Wait) -> dict[str, Any]:
    """What a commit that starts children carries besides them: the spawning step's trace
    context (the children's traces link to it) and the run's budget limits (their budgets are
    carved from them); nothing for the usual commit, which starts none."""
    if not outcome.children:
        return {}
    return {
        "traceparent": current_traceparent(),
        "budget_limits": None if agent.budget is None else agent.budget.limits(),
    }
