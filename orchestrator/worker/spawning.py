"""Before a step's commit starts child runs: each child's agent must be one some worker serves
(docs/child-runs.md), or the attempt fails in one line and nothing is committed."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from orchestrator.agent.children import new_children
from orchestrator.agent.steps import Agent, Next, Outcome, Wait
from orchestrator.db.executor import Executor
from orchestrator.db.workers import WorkerRegistry
from orchestrator.telemetry import current_traceparent


async def check_child_agents(outcome: Outcome, served_here: Iterable[str], db: Executor) -> None:
    """Raise ``LookupError`` naming a child whose agent no registered worker serves."""
    if isinstance(outcome, Next):
        children = list(outcome.children)
    elif isinstance(outcome, Wait):
        children = list(new_children(outcome.children))
    else:
        return
    wanted = {child.agent for child in children} - set(served_here)
    if not wanted:
        return
    missing = wanted - set(await WorkerRegistry().served_agents(db))
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
