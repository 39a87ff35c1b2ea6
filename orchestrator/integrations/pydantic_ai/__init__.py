"""Existing ``pydantic_ai.Agent``s inside orchestrator steps (``fenced-orchestrator[pydantic-ai]``).

``PydanticAIAgent`` wraps the agent as an orchestrator ``Agent`` whose one step, ``turn``, is one
model turn of the Pydantic AI run, committed like a ``ToolAgent`` turn:

1. The effect calls of the previous turn are settled first (confirmed, failed or rejected; an
   uncertain or parked outcome is waited out, never reported): the step waits for their records,
   holding its lease for a short grace, then without it (``Wait``), and hands the settled outcomes
   to Pydantic AI as ``DeferredToolResults``: an effect's result as the call's return, a person's
   denial as ``ToolDenied`` (the model reads a tool denial).
2. The agent runs (``Agent.iter``) from the committed message history for one model request.
   ``OrchestratorCapability`` (Pydantic AI's public capability hooks) puts the run's id and fence
   on the request's span and reserves and records it against the run's ``Budget``. Tools listed
   in ``read_only`` run inline; tools listed in ``effects`` never run in the worker: their call
   is deferred (``CallDeferred``, or ``ApprovalRequired`` when a person must approve it) and
   becomes a fenced ``Effect`` keyed like a ``ToolAgent`` call (``turns.call_effect_keys``); tools
   listed in ``agents`` (``child_agent(...)``) are deferred too and start a child run, whose end
   the next turn hands back as the call's return. Any other tool is hidden from the model and
   refused if called.
3. One fenced commit holds the turn: its Pydantic AI messages (appended to the run's transcript,
   each message's JSON under ``body["pydantic_ai"]``), the effect records and a small checkpoint.
   A replaced worker resumes from the transcript and never asks the model again for a committed
   turn; a turn replayed before its commit proposes new calls, and nothing was sent for the old.

With ``stream=True`` the turn's model request is streamed and its text published to the run's
live output as it comes (``ctx.output``, docs/streaming.md), from Pydantic AI's own stream events.

Behind this face: ``_agent`` (the agent and its turn), ``_capability`` (the hooks),
``_effects`` (``effect(...)`` and the settled records handed back), ``_history`` (the
messages in the transcript) and ``_streaming`` (the live output), all over
``orchestrator.agent.turns``. Only public Pydantic AI
modules are used (``pydantic_ai``, ``pydantic_ai.capabilities``, ``pydantic_ai.messages``,
``pydantic_ai.tools``); see docs/pydantic-ai.md for the versions tested.
"""

from __future__ import annotations

from orchestrator.lazy import extra_for, install_hint

try:
    from orchestrator.integrations.pydantic_ai._agent import PydanticAIAgent
    from orchestrator.integrations.pydantic_ai._capability import OrchestratorCapability
    from orchestrator.integrations.pydantic_ai._effects import (
        ChildAgentTool,
        EffectfulTool,
        child_agent,
        effect,
    )
except ImportError as error:  # pragma: no cover - the extra is missing
    if extra_for(error.name) != "pydantic-ai":
        raise
    # The missing module's name is kept: ``serve --agents`` names the extra from it.
    raise ModuleNotFoundError(
        f"orchestrator.integrations.pydantic_ai needs Pydantic AI: {install_hint('pydantic-ai')}",
        name=error.name,
    ) from error

__all__ = [
    "ChildAgentTool",
    "EffectfulTool",
    "OrchestratorCapability",
    "PydanticAIAgent",
    "child_agent",
    "effect",
]
