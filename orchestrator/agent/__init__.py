"""The author's API and every fenced turn loop: steps, tools, the model call, budgets, MCP.

What an agent author imports (also from ``orchestrator`` itself)::

    from orchestrator.agent import Agent, Step, StepContext, Next, Finish, Fail, Wait, Outcome
    from orchestrator.agent import ToolAgent, ToolContext, tool, Budget, chat

Behind the face: ``steps`` (agents as step classes), ``tools`` (tool definitions and the
``ToolSource`` protocol), ``turns`` (what every fenced turn loop shares: effect keys and specs,
settling, the commit, the turn state and its spending), ``tool_loop`` (the ToolAgent loop),
``transcript``, ``llm`` (the model call), ``stored_replies`` (a reply made storable), ``budgets``
and ``mcp/`` (an MCP server's tools as a ``ToolSource``). Names are imported on first use.
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
    from orchestrator.agent.tools import (
        EffectTool,
        ReadOnlyTool,
        Tool,
        ToolContext,
        ToolSource,
        tool,
    )

_EXPORTS = {
    "Agent": "orchestrator.agent.steps",
    "Budget": "orchestrator.agent.budgets",
    "BudgetExhausted": "orchestrator.agent.budgets",
    "EffectTool": "orchestrator.agent.tools",
    "Fail": "orchestrator.agent.steps",
    "Finish": "orchestrator.agent.steps",
    "ModelNotConfigured": "orchestrator.agent.llm",
    "Next": "orchestrator.agent.steps",
    "Outcome": "orchestrator.agent.steps",
    "ReadOnlyTool": "orchestrator.agent.tools",
    "Step": "orchestrator.agent.steps",
    "StepContext": "orchestrator.agent.steps",
    "Tool": "orchestrator.agent.tools",
    "ToolAgent": "orchestrator.agent.tool_loop",
    "ToolContext": "orchestrator.agent.tools",
    "ToolSource": "orchestrator.agent.tools",
    "UnknownAgent": "orchestrator.agent.steps",
    "UnknownStep": "orchestrator.agent.steps",
    "Wait": "orchestrator.agent.steps",
    "WaitState": "orchestrator.agent.steps",
    "chat": "orchestrator.agent.llm",
    "tool": "orchestrator.agent.tools",
}

if not TYPE_CHECKING:
    __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

__all__ = [
    "Agent",
    "Budget",
    "BudgetExhausted",
    "EffectTool",
    "Fail",
    "Finish",
    "ModelNotConfigured",
    "Next",
    "Outcome",
    "ReadOnlyTool",
    "Step",
    "StepContext",
    "Tool",
    "ToolAgent",
    "ToolContext",
    "ToolSource",
    "UnknownAgent",
    "UnknownStep",
    "Wait",
    "WaitState",
    "chat",
    "tool",
]
