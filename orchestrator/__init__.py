"""orchestrator: long-running AI agent runs on PostgreSQL with run leases and fencing tokens.

What agent authors import::

    from orchestrator import Agent, Step, StepContext, Next, Finish, Fail, Outcome, Effect, chat
    from orchestrator import ToolAgent, ToolContext, tool
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from orchestrator.effects.model import Effect, EffectPolicy
from orchestrator.errors import (
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
    "DatabaseUnavailable",
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
    "Step",
    "StepContext",
    "ToolAgent",
    "ToolContext",
    "UnknownAgent",
    "UnknownStep",
    "__version__",
    "chat",
    "tool",
]
