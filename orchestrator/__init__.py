"""orchestrator: long-running AI agent runs on PostgreSQL with run leases and fencing tokens.

What agent authors import::

    from orchestrator import Agent, Step, StepContext, Next, Finish, Fail, Wait, Outcome, Effect
    from orchestrator import ToolAgent, ToolContext, tool, Budget, chat

What applications import: ``from orchestrator import Client`` (or ``SyncClient``).
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from orchestrator.budgets import Budget, BudgetExhausted
from orchestrator.client import Client, SyncClient
from orchestrator.effects.approvals import DecisionRefused
from orchestrator.effects.model import Effect, EffectPolicy
from orchestrator.errors import (
    DatabaseError,
    DatabaseUnavailable,
    IdempotencyConflict,
    InvalidInput,
    InvalidTransition,
    OrchestratorError,
    RunAlreadyExists,
    RunNotFound,
    SchemaTooNew,
)
from orchestrator.llm import ModelNotConfigured, chat
from orchestrator.settings import Settings
from orchestrator.signals import Signal
from orchestrator.steps import (
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
from orchestrator.tool_agent import ToolAgent
from orchestrator.tools import ToolContext, tool
from orchestrator.transcript import Message


def _version() -> str:
    try:
        return version("fenced-orchestrator")
    except PackageNotFoundError:  # running from a source tree that was never installed
        return "0+unknown"


__version__ = _version()

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
    "RunAlreadyExists",
    "RunNotFound",
    "SchemaTooNew",
    "Settings",
    "Signal",
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
