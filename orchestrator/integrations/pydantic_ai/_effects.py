"""Which of the agent's tools are fenced effects (``effect(kind, ...)``), and how their settled
records go back to Pydantic AI: as ``DeferredToolResults`` for the calls it deferred."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from pydantic_ai.tools import DeferredToolResults, ToolApproved, ToolDenied

from orchestrator.agent.turns import EffectSpec, check_effect_spec, default_result, denial
from orchestrator.effect_model import DEFAULT_APPROVAL_SECONDS, EffectPolicy, EffectRecord
from orchestrator.errors import InvalidInput
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


def deferred_results(
    pending: Sequence[Mapping[str, JSON]],
    records: Mapping[str, EffectRecord],
    effects: Mapping[str, EffectfulTool],
) -> DeferredToolResults:
    """The settled records of the previous turn's deferred calls, as Pydantic AI resumes them:
    an effect's result as the call's return, a person's denial as ``ToolDenied``."""
    results = DeferredToolResults()
    for call in pending:
        call_id, tool = str(call["call_id"]), str(call["tool"])
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


__all__ = ["SETTLED", "EffectfulTool", "deferred_results", "effect"]
