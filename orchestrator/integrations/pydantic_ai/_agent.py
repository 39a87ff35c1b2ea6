"""``PydanticAIAgent``: an existing ``pydantic_ai.Agent`` as an orchestrator agent whose one
step, ``turn``, is one model turn of the Pydantic AI run, committed like a ``ToolAgent`` turn
(the turn state, settling, spending and commit of ``orchestrator.agent.turns``)."""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Mapping
from typing import Any

import anyio
from opentelemetry.trace import Status, StatusCode
from pydantic_ai import Agent as PydanticAgent
from pydantic_ai import AgentRun, ModelRequestNode
from pydantic_ai.messages import ModelMessage, ModelRequest, UserPromptPart
from pydantic_ai.tools import DeferredToolRequests, DeferredToolResults
from pydantic_core import to_jsonable_python
from pydantic_graph import End

from orchestrator.agent.budgets import BudgetExhausted
from orchestrator.agent.children import Child
from orchestrator.agent.steps import Agent, Finish, Outcome, Step, StepContext, Wait
from orchestrator.agent.stored_replies import unstorable_json
from orchestrator.agent.tools import DEFAULT_TOOL_TIMEOUT_SECONDS
from orchestrator.agent.turns import (
    DEADLINE_PASSED,
    DEFAULT_MAX_TOOL_CALLS_PER_TURN,
    DEFAULT_SETTLE_GRACE_SECONDS,
    TurnState,
    default_prompt,
    turn_step,
)
from orchestrator.effect_model import Effect
from orchestrator.errors import InvalidInput
from orchestrator.integrations.pydantic_ai._capability import OrchestratorCapability
from orchestrator.integrations.pydantic_ai._effects import (
    ChildAgentTool,
    EffectfulTool,
    deferred_results,
)
from orchestrator.integrations.pydantic_ai._history import (
    STATE_KEY,
    from_transcript,
    to_transcript,
)
from orchestrator.integrations.pydantic_ai._streaming import LiveOutput
from orchestrator.models import JSON, Message


class PydanticAIAgent(Agent):
    """An existing ``pydantic_ai.Agent`` as an orchestrator agent (see the package docstring).

    ``read_only``: names of tools that run inline in the worker (they may run again after a
    crash). ``effects``: tool name → ``effect(kind, ...)``. Every tool the agent offers must be
    in one of them; an unlisted tool is hidden from the model and refused if called. ``model``:
    the model to run with instead of the agent's own (a ``Model``, a name, or a function
    returning one, called on each turn: e.g. to read the worker's environment). A read-only
    tool that does not answer within ``tool_timeout_seconds`` is told to the model as an error.
    ``max_turns`` and ``deadline_seconds`` (from the first turn, on the database clock; waits
    included) bound the loop: past either, the run fails. ``stream``: each turn's model request
    is streamed and its text published to the run's live output as it comes (docs/streaming.md),
    as ``ToolAgent(stream=True)`` does; the committed turn is the same either way.
    """

    def __init__(
        self,
        name: str,
        agent: PydanticAgent[Any, Any],
        *,
        read_only: Collection[str] = (),
        effects: Mapping[str, EffectfulTool] | None = None,
        agents: Mapping[str, ChildAgentTool] | None = None,
        max_turns: int = 20,
        max_output_tokens: int | None = None,
        prompt: Callable[[JSON], str] = default_prompt,
        deps: Callable[[StepContext], Any] | None = None,
        model: Any = None,
        deadline_seconds: float | None = None,
        description: str = "",
        budget: Any = None,
        lease_seconds: float | None = None,
        settle_grace_seconds: float = DEFAULT_SETTLE_GRACE_SECONDS,
        tool_timeout_seconds: float = DEFAULT_TOOL_TIMEOUT_SECONDS,
        max_tool_calls_per_turn: int = DEFAULT_MAX_TOOL_CALLS_PER_TURN,
        stream: bool = False,
    ) -> None:
        if not isinstance(agent, PydanticAgent):
            raise InvalidInput(
                f"agent {name}: {agent!r} is not a pydantic_ai.Agent; pass the Agent itself"
            )
        self.read_only, self.effects, self.agents = _classified(name, read_only, effects, agents)
        if max_turns < 1 or max_tool_calls_per_turn < 1:
            raise InvalidInput(
                f"agent {name}: max_turns and max_tool_calls_per_turn must be at least 1"
            )
        if max_output_tokens is not None and max_output_tokens < 1:
            raise InvalidInput(f"agent {name}: max_output_tokens must be at least 1")
        if not settle_grace_seconds >= 0:
            raise InvalidInput(f"agent {name}: settle_grace_seconds must be 0 or more")
        if deadline_seconds is not None and not deadline_seconds > 0:
            raise InvalidInput(f"agent {name}: deadline_seconds must be above 0")
        if not tool_timeout_seconds > 0:
            raise InvalidInput(f"agent {name}: tool_timeout_seconds must be above 0")
        self.pydantic_agent = agent
        self.max_turns = max_turns
        self.max_output_tokens = max_output_tokens
        self.prompt = prompt
        self.deps = deps
        self.model = model
        self.settle_grace_seconds = settle_grace_seconds
        self.tool_timeout_seconds = tool_timeout_seconds
        self.max_tool_calls_per_turn = max_tool_calls_per_turn
        self.deadline_seconds = deadline_seconds
        self.stream = bool(stream)
        first = turn_step(name, "turn", lease_seconds, self.turn)
        super().__init__(name, first=first, description=description, budget=budget)

    # -- the turn ---------------------------------------------------------------------------
    async def turn(self, ctx: StepContext, self_step: type[Step]) -> Outcome:
        state = _State.load(ctx, STATE_KEY, self.deadline_seconds)
        past = state.past_deadline(ctx)
        if past is not None:
            return past
        committed = await ctx.transcript.messages()
        history = from_transcript(committed)
        results = await self._settled(ctx, state)
        if isinstance(results, Wait):
            return results
        past = state.past_turn_limit(self.max_turns)
        if past is not None:
            return past
        span = state.traced(ctx)
        capability = OrchestratorCapability(self, ctx, state.turn)
        prompt = None if committed else self.prompt(ctx.input)
        # The settled calls stay pending in the checkpoint until a turn that told the model of
        # them commits: a turn cut short (a budget wait) hands them over again when it resumes.
        told_pending, state.pending = state.pending, []
        left = state.seconds_left(ctx)
        try:
            with anyio.move_on_after(math.inf if left is None else left) as bounded:
                messages, trailing, ended = await self._one_request(
                    ctx, capability, prompt, history, results
                )
        except BudgetExhausted as exhausted:
            state.pending = told_pending
            return state.out_of_budget(ctx, span, exhausted, self_step)
        if bounded.cancelled_caught:
            return state.failed(DEADLINE_PASSED)
        new_messages = list(messages[len(history) :])
        if trailing is not None:
            new_messages.append(trailing)
        state.add_usage(capability)
        try:
            new = to_transcript(new_messages, state.turn)
        except InvalidInput as unstorable:  # thousands of calls: asking again would not help
            span.set_status(Status(StatusCode.ERROR, "reply cannot be stored"))
            return state.failed(str(unstorable))
        if trailing is not None:
            return state.committed(self_step, new)
        if isinstance(ended, DeferredToolRequests):
            return self._deferred(ended, capability, state, new, self_step)
        output = to_jsonable_python(ended)
        problem = unstorable_json(output, "the answer")
        if problem is not None:  # asked again, as the next turn (max_turns bounds it)
            ask = f"Your answer cannot be stored ({problem}). Answer again without it."
            new += to_transcript([ModelRequest(parts=[UserPromptPart(ask)])], state.turn)
            return state.committed(self_step, new)
        return Finish(result=state.result(output), messages=new)

    async def _one_request(
        self,
        ctx: StepContext,
        capability: OrchestratorCapability,
        prompt: str | None,
        history: list[ModelMessage],
        results: DeferredToolResults | None,
    ) -> tuple[list[ModelMessage], ModelRequest | None, Any]:
        """The Pydantic AI run from the committed history up to its second model request
        (returned unsent, the turn's tools done) or its end (its output returned)."""
        output_type = self.pydantic_agent.output_type
        outputs = [*output_type] if isinstance(output_type, list | tuple) else [output_type]
        requests = 0
        run: AgentRun[Any, Any]
        async with self.pydantic_agent.iter(
            prompt,
            message_history=history,
            deferred_tool_results=results,
            output_type=[*outputs, DeferredToolRequests],
            capabilities=[capability, LiveOutput(ctx.output)] if self.stream else [capability],
            deps=self.deps(ctx) if self.deps is not None else None,
            model=self.model() if callable(self.model) else self.model,
        ) as run:
            node: Any = run.next_node
            while True:
                if isinstance(node, ModelRequestNode):
                    requests += 1
                    if requests == 2:  # the turn's tools are done: commit before asking again
                        return run.all_messages(), node.request, None
                elif isinstance(node, End):
                    return run.all_messages(), None, node.data.output
                node = await run.next(node)

    def _deferred(
        self,
        requested: DeferredToolRequests,
        capability: OrchestratorCapability,
        state: _State,
        new: list[Message],
        self_step: type[Step],
    ) -> Outcome:
        """The turn's effect calls: recorded in its commit; the next turn waits for them."""
        pending: list[dict[str, JSON]] = []
        effects: list[Effect] = []
        children: list[Child] = []
        for call in [*requested.calls, *requested.approvals]:
            child = capability.children.get(call.tool_call_id)
            if child is not None:
                children.append(child)
                pending.append(
                    {"call_id": call.tool_call_id, "tool": call.tool_name, "child_key": child.key}
                )
                continue
            made = capability.deferred.get(call.tool_call_id)
            if made is None:
                return state.failed(
                    f"tool {call.tool_name} was deferred by the agent itself (requires_approval "
                    "or an external tool); mark it with effects={...} so orchestrator sends it"
                )
            effects.append(made)
            pending.append(
                {
                    "call_id": call.tool_call_id,
                    "tool": call.tool_name,
                    "effect_key": made.key,
                    "approval": made.requires_approval,
                }
            )
        state.pending = pending
        return state.committed(self_step, new, effects, children)

    async def _settled(self, ctx: StepContext, state: _State) -> DeferredToolResults | Wait | None:
        """The previous turn's effect calls as ``DeferredToolResults`` once every record has
        settled; while some have not, a ``Wait`` for them (after a short grace with the lease)."""
        if not state.pending:
            return None
        calls = await state.calls_ended(ctx, self.settle_grace_seconds)
        if isinstance(calls, Wait):
            return calls
        return deferred_results(state.pending, *calls, self.effects)


def _classified(
    name: str,
    read_only: Collection[str],
    effects: Mapping[str, EffectfulTool] | None,
    agents: Mapping[str, ChildAgentTool] | None,
) -> tuple[frozenset[str], dict[str, EffectfulTool], dict[str, ChildAgentTool]]:
    """The agent's tools as it declared them: those that run inline, those that are effects,
    those that run another agent (each tool one of them; any other is hidden from the model)."""
    if isinstance(read_only, str):
        raise InvalidInput(f"agent {name}: read_only is a list of tool names, not a string")
    marked = dict(effects or {})
    runs_agents = dict(agents or {})
    for field, specs, kind, shape in (
        ("effects", marked, EffectfulTool, "effect(kind, ...)"),
        ("agents", runs_agents, ChildAgentTool, "child_agent(agent, ...)"),
    ):
        for tool_name, spec in specs.items():
            if not isinstance(spec, kind):
                raise InvalidInput(
                    f"agent {name}: {field}[{tool_name!r}] must be {shape}, "
                    f"not {type(spec).__name__}"
                )
    named = [*read_only, *marked, *runs_agents]
    twice = sorted({tool for tool in named if named.count(tool) > 1})
    if twice:
        raise InvalidInput(
            f"agent {name}: {', '.join(twice)} is declared more than once (read-only, an effect "
            "or an agent: one of them)"
        )
    return frozenset(read_only), marked, runs_agents


class _State(TurnState):
    """The turn loop's checkpoint: the turn state, with the model requests it made."""

    SUMMARY = ("input_tokens", "output_tokens", "model_requests")

    def __init__(self, key: str, rest: dict[str, JSON]) -> None:
        super().__init__(key, rest)
        self.model_requests = 0

    def add_usage(self, capability: OrchestratorCapability) -> None:
        self.input_tokens += capability.input_tokens
        self.output_tokens += capability.output_tokens
        self.model_requests += capability.requests


__all__ = ["PydanticAIAgent"]
