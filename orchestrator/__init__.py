"""orchestrator: long-running AI agent runs on PostgreSQL with run leases and fencing tokens.

What agent authors import::

    from orchestrator import Agent, Step, StepContext, Next, Finish, Fail, Wait, Outcome, Effect
    from orchestrator import ToolAgent, ToolContext, tool, Budget, chat

What applications import: ``from orchestrator import Client`` (or ``SyncClient``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from orchestrator.lazy import DISTRIBUTION, install_moved_modules, lazy_exports

if TYPE_CHECKING:
    from orchestrator.agent import (
        Agent,
        Budget,
        BudgetExhausted,
        Fail,
        Finish,
        ModelNotConfigured,
        Next,
        Outcome,
        Step,
        StepContext,
        ToolAgent,
        ToolContext,
        UnknownAgent,
        UnknownStep,
        Wait,
        WaitState,
        chat,
        tool,
    )
    from orchestrator.agent.children import Child, ChildOutcome
    from orchestrator.agent.rates import RateLimitWait, take_rate
    from orchestrator.client import Client, SyncClient
    from orchestrator.db.limits import RunningLimit
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

_AUTHOR_API = (
    *("Agent", "Step", "StepContext", "Next", "Finish", "Fail", "Wait", "Outcome", "WaitState"),
    *("ToolAgent", "ToolContext", "tool", "Budget", "BudgetExhausted", "chat"),
    *("ModelNotConfigured", "UnknownAgent", "UnknownStep"),
)
_ERRORS = (
    *("OrchestratorError", "DatabaseError", "DatabaseUnavailable", "IdempotencyConflict"),
    *("InvalidInput", "InvalidTransition", "PermanentFailure", "PermissionDenied"),
    *("RunAlreadyExists", "RunNotFound", "SchemaTooNew"),
)
_EXPORTS = {
    **dict.fromkeys(_AUTHOR_API, "orchestrator.agent"),
    **dict.fromkeys(("Client", "SyncClient"), "orchestrator.client"),
    **dict.fromkeys(_ERRORS, "orchestrator.errors"),
    "DecisionRefused": "orchestrator.effects.approvals",
    "Effect": "orchestrator.effect_model",
    "EffectPolicy": "orchestrator.effect_model",
    "Message": "orchestrator.models",
    "Settings": "orchestrator.settings",
    "Signal": "orchestrator.db.signals",
    "StandbyNotReached": "orchestrator.db.standby_wait",
    "RunningLimit": "orchestrator.db.limits",
    "take_rate": "orchestrator.agent.rates",
    "RateLimitWait": "orchestrator.agent.rates",
    "Child": "orchestrator.agent.children",
    "ChildOutcome": "orchestrator.agent.children",
}
"""Each public name and the module defining it: imported on first use (``__getattr__``), so that
``import orchestrator.errors`` loads neither the worker, the console nor the client."""


MOVED = {
    "orchestrator.attempts": "orchestrator.client.attempts",
    "orchestrator.budgets": "orchestrator.agent.budgets",
    "orchestrator.client_features": "orchestrator.client.features",
    "orchestrator.client_runs": "orchestrator.client.runs",
    "orchestrator.client_sync": "orchestrator.client.sync",
    "orchestrator.db.pair_node": "orchestrator.testing.pair_node",
    "orchestrator.db.replicated": "orchestrator.testing.replicated",
    "orchestrator.db.stores": "orchestrator.client.stores",
    "orchestrator.delegation": "orchestrator.client.delegation",
    "orchestrator.demo": "orchestrator.cli.demo_story",
    "orchestrator.effects.model": "orchestrator.effect_model",
    "orchestrator.extras": "orchestrator.lazy",
    "orchestrator.llm": "orchestrator.agent.llm",
    "orchestrator.local_scripts": "orchestrator.testing.local_scripts",
    "orchestrator.loopback": "orchestrator.testing.loopback",
    "orchestrator.mcp_client": "orchestrator.agent.mcp.client",
    "orchestrator.mcp_tools": "orchestrator.agent.mcp.tools",
    "orchestrator.metrics_endpoint": "orchestrator.worker.metrics_endpoint",
    "orchestrator.presentation": "orchestrator.cli.presentation",
    "orchestrator.retention": "orchestrator.db.retention",
    "orchestrator.run_detail": "orchestrator.client.detail",
    "orchestrator.run_waiter": "orchestrator.client.waiter",
    "orchestrator.signals": "orchestrator.db.signals",
    "orchestrator.steps": "orchestrator.agent.steps",
    "orchestrator.stored_replies": "orchestrator.agent.stored_replies",
    "orchestrator.tool_agent": "orchestrator.agent.tool_loop",
    "orchestrator.tools": "orchestrator.agent.tools",
    "orchestrator.transcript": "orchestrator.agent.transcript",
}
"""Modules of release 0.1 that moved into a room of their own, and where they live now: the old
path still imports, with a DeprecationWarning (``lazy.MovedModules``)."""

install_moved_modules(MOVED)


def _version() -> str:
    # Read on first use: the metadata library costs a command's start more than the rest.
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(DISTRIBUTION)
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
    "Child",
    "ChildOutcome",
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
    "RateLimitWait",
    "RunAlreadyExists",
    "RunNotFound",
    "RunningLimit",
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
    "take_rate",
    "tool",
]
