"""Which of the agent's tools are fenced effects (``effect(kind, ...)``), and how their settled
records go back to Pydantic AI: as ``DeferredToolResults`` for the calls it deferred."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic_ai.tools import DeferredToolResults, ToolApproved, ToolDenied
from pydantic_core import to_jsonable_python

from orchestrator.agent.budgets import Budget
from orchestrator.agent.children import Child, ChildOutcome
from orchestrator.agent.tools import AgentTool
from orchestrator.agent.turns import EffectSpec, check_effect_spec, default_result, denial
from orchestrator.effect_model import DEFAULT_APPROVAL_SECONDS, EffectPolicy, EffectRecord
from orchestrator.errors import InvalidInput
from orchestrator.ids import validate_agent_name
from orchestrator.models import JSON

SETTLED = "orchestrator_settled_result"
"""The metadata key carrying an approved call's settled record to its resumed execution."""


@dataclass(frozen=True)
class EffectfulTool(EffectSpec):
    """How one of the agent's tools acts on the world: as a fenced effect of ``kind`` (a vendor
    in the dispatcher's configuration), sent once by the dispatcher after the turn commits. Its
    Python function never runs in the worker. Build with ``effect(...)``."""

    kind: str
    policy: EffectPolicy = EffectPolicy.IRREVERSIBLE
    approve: Callable[..., bool] | bool = False
    approval_seconds: float = DEFAULT_APPROVAL_SECONDS
    payload: Callable[..., JSON] | None = None
    """Builds the effect's payload from the call's validated arguments (default: the arguments)."""
    result: Callable[[EffectRecord], JSON] | None = None
    """What the model is told of the settled record (default: ``turns.default_result``)."""


def effect(
    kind: str,
    *,
    policy: EffectPolicy = EffectPolicy.IRREVERSIBLE,
    approve: Callable[..., bool] | bool = False,
    approval_seconds: float = DEFAULT_APPROVAL_SECONDS,
    payload: Callable[..., JSON] | None = None,
    result: Callable[[EffectRecord], JSON] | None = None,
) -> EffectfulTool:
    """Mark a Pydantic AI tool as an effect of ``kind`` (see ``EffectfulTool``). ``approve``
    (``True``, or a predicate called with the call's arguments) makes a call wait for a person's
    approval of its payload, denied by expiry after ``approval_seconds``."""
    check_effect_spec("effect", kind, approve, approval_seconds)
    if not isinstance(policy, EffectPolicy):
        raise InvalidInput(f"effect policy must be an EffectPolicy, not {policy!r}")
    return EffectfulTool(kind, policy, approve, approval_seconds, payload, result)


@dataclass(frozen=True)
class ChildAgentTool:
    """A tool that runs another agent as a child run (docs/child-runs.md): the call is
    deferred, the turn's commit starts the child, the run waits for it without its lease, and
    the call returns how the child ended. Build with ``child_agent(...)``."""

    agent: str
    input: Callable[..., JSON] | None = None
    """Builds the child's input from the call's validated arguments (default: the arguments)."""
    budget: Budget | None = None
    """Carved from the run's budget (needed when the agent has one)."""

    def child(self, key: str, arguments: Mapping[str, Any]) -> Child:
        made = self.input(**arguments) if self.input is not None else dict(arguments)
        return Child(self.agent, to_jsonable_python(made), key, budget=self.budget)


def child_agent(
    agent: str, *, input: Callable[..., JSON] | None = None, budget: Budget | None = None
) -> ChildAgentTool:
    """Mark a Pydantic AI tool as a run of ``agent`` (see ``ChildAgentTool``)."""
    validate_agent_name(agent)
    if budget is not None and not isinstance(budget, Budget):
        raise InvalidInput(f"child_agent {agent}: a budget is a Budget, not {budget!r}")
    return ChildAgentTool(agent, input, budget)


def deferred_results(
    pending: Sequence[Mapping[str, JSON]],
    records: Mapping[str, EffectRecord],
    children: Mapping[str, ChildOutcome | None],
    effects: Mapping[str, EffectfulTool],
) -> DeferredToolResults:
    """The settled records of the previous turn's deferred calls, as Pydantic AI resumes them:
    an effect's result as the call's return, a person's denial as ``ToolDenied``, a child
    run's end (its result or its error) as the call's return."""
    results = DeferredToolResults()
    for call in pending:
        call_id, tool = str(call["call_id"]), str(call["tool"])
        if "child_key" in call:
            results.calls[call_id] = AgentTool.told(children.get(str(call["child_key"])))
            continue
        record = records[str(call["effect_key"])]
        marked = effects.get(tool)
        told = marked.told(record) if marked is not None else default_result(record)
        denied = denial(record)
        if not call.get("approval"):
            results.calls[call_id] = told
        elif denied is not None:
            results.approvals[call_id] = ToolDenied(str(denied))
        else:  # approved (and sent, or failed): the settled record is the call's return
            results.approvals[call_id] = ToolApproved()
            results.metadata[call_id] = {SETTLED: told}
    return results


__all__ = [
    "SETTLED",
    "ChildAgentTool",
    "EffectfulTool",
    "child_agent",
    "deferred_results",
    "effect",
]
