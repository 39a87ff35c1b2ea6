"""Before a step's commit starts child runs: each child's agent must be one some worker serves
(docs/child-runs.md), or the attempt fails in one line and nothing is committed."""

from __future__ import annotations

from collections.abc import Iterable

from orchestrator.agent.children import new_children
from orchestrator.agent.steps import Next, Outcome, Wait
from orchestrator.db.executor import Executor
from orchestrator.db.workers import WorkerRegistry


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
