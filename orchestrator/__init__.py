"""orchestrator: long-running AI agent runs on PostgreSQL with run leases and fencing tokens.

What agent authors import::

    from orchestrator import Agent, Step, StepContext, Next, Finish, Fail, Wait, Outcome, Effect
    from orchestrator import ToolAgent, ToolContext, tool, Budget, chat

What applications import: ``from orchestrator import Client`` (or ``SyncClient``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from orchestrator.lazy import lazy_exports

if TYPE_CHECKING:
    from orchestrator.agent.budgets import Budget, BudgetExhausted
    from orchestrator.agent.llm import ModelNotConfigured, chat
    from orchestrator.agent.steps import (
        Agent,
        Fail,
        Finish,
        Next,
        Outcome,
        Step,
        StepContext,
        UnknownAgent,
        UnknownStep,
        Wait,
        WaitState,
    )
    from orchestrator.agent.tool_loop import ToolAgent
    from orchestrator.agent.tools import ToolContext, tool
    from orchestrator.client.clients import Client, SyncClient
    from orchestrator.db.signals import Signal
    from orchestrator.db.standby_wait import StandbyNotReached
    from orchestrator.effect_model import Effect, EffectPolicy
    from orchestrator.effects.approvals import DecisionRefused
    from orchestrator.errors import (
        DatabaseError,
        DatabaseUnavailable,
        IdempotencyConflict,
        InvalidInput,
        InvalidTransition,
        OrchestratorError,
        PermanentFailure,
        PermissionDenied,
        RunAlreadyExists,
        RunNotFound,
        SchemaTooNew,
    )
    from orchestrator.models import Message
    from orchestrator.settings import Settings

_EXPORTS = {
    "Agent": "orchestrator.agent.steps",
    "Budget": "orchestrator.agent.budgets",
    "BudgetExhausted": "orchestrator.agent.budgets",
    "Client": "orchestrator.client.clients",
    "DatabaseError": "orchestrator.errors",
    "DatabaseUnavailable": "orchestrator.errors",
    "DecisionRefused": "orchestrator.effects.approvals",
    "Effect": "orchestrator.effect_model",
    "EffectPolicy": "orchestrator.effect_model",
    "Fail": "orchestrator.agent.steps",
    "Finish": "orchestrator.agent.steps",
    "IdempotencyConflict": "orchestrator.errors",
    "InvalidInput": "orchestrator.errors",
    "InvalidTransition": "orchestrator.errors",
    "Message": "orchestrator.models",
    "ModelNotConfigured": "orchestrator.agent.llm",
    "Next": "orchestrator.agent.steps",
    "OrchestratorError": "orchestrator.errors",
    "Outcome": "orchestrator.agent.steps",
    "PermanentFailure": "orchestrator.errors",
    "PermissionDenied": "orchestrator.errors",
    "RunAlreadyExists": "orchestrator.errors",
    "RunNotFound": "orchestrator.errors",
    "SchemaTooNew": "orchestrator.errors",
    "Settings": "orchestrator.settings",
    "Signal": "orchestrator.db.signals",
    "StandbyNotReached": "orchestrator.db.standby_wait",
    "Step": "orchestrator.agent.steps",
    "StepContext": "orchestrator.agent.steps",
    "SyncClient": "orchestrator.client.clients",
    "ToolAgent": "orchestrator.agent.tool_loop",
    "ToolContext": "orchestrator.agent.tools",
    "UnknownAgent": "orchestrator.agent.steps",
    "UnknownStep": "orchestrator.agent.steps",
    "Wait": "orchestrator.agent.steps",
    "WaitState": "orchestrator.agent.steps",
    "chat": "orchestrator.agent.llm",
    "tool": "orchestrator.agent.tools",
}
"""Each public name and the module defining it: imported on first use (``__getattr__``), so that
``import orchestrator.errors`` loads neither the worker, the console nor the client."""


def _version() -> str:
    # Read on first use: the metadata library costs a command's start more than the rest.
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("fenced-orchestrator")
    except PackageNotFoundError:  # running from a source tree that was never installed
        return "0+unknown"


if TYPE_CHECKING:
    __version__: str
else:  # type checkers read the imports above, and flag a name not among them
    _exported, _listed = lazy_exports(__name__, _EXPORTS)

    def __dir__() -> list[str]:
        return sorted({*_listed(), "__version__"})

    def __getattr__(name: str) -> object:
        if name == "__version__":
            globals()[name] = value = _version()
            return value
        return _exported(name)


__all__ = [
    "Agent",
    "Budget",
    "BudgetExhausted",
    "Client",
    "DatabaseError",
    "DatabaseUnavailable",
    "DecisionRefused",
    "Effect",
    "EffectPolicy",
    "Fail",
    "Finish",
    "IdempotencyConflict",
    "InvalidInput",
    "InvalidTransition",
    "Message",
    "ModelNotConfigured",
    "Next",
    "OrchestratorError",
    "Outcome",
    "PermanentFailure",
    "PermissionDenied",
    "RunAlreadyExists",
    "RunNotFound",
    "SchemaTooNew",
    "Settings",
    "Signal",
    "StandbyNotReached",
    "Step",
    "StepContext",
    "SyncClient",
    "ToolAgent",
    "ToolContext",
    "UnknownAgent",
    "UnknownStep",
    "Wait",
    "WaitState",
    "__version__",
    "chat",
    "tool",
]
