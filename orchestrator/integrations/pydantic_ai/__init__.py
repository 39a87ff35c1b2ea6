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
   becomes a fenced ``Effect`` keyed like a ``ToolAgent`` call (``effect_keys``). Any other tool
   is hidden from the model and refused if called.
3. One fenced commit holds the turn: its Pydantic AI messages (appended to the run's transcript,
   each message's JSON under ``body["pydantic_ai"]``), the effect records and a small checkpoint.
   A replaced worker resumes from the transcript and never asks the model again for a committed
   turn; a turn replayed before its commit proposes new calls, and nothing was sent for the old.

Only public Pydantic AI modules are used (``pydantic_ai``, ``pydantic_ai.capabilities``,
``pydantic_ai.messages``, ``pydantic_ai.tools``); see docs/pydantic-ai.md for the versions tested.
"""

from __future__ import annotations

import json
import math
import random
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from decimal import Decimal
from typing import Any

import anyio
from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode
from pydantic_core import to_jsonable_python

try:
    from pydantic_ai import (
        Agent as PydanticAgent,
    )
    from pydantic_ai import (
        AgentRun,
        ApprovalRequired,
        CallDeferred,
        ModelRequestNode,
        RetryModelRequest,
        RunContext,
        SkipToolValidation,
    )
    from pydantic_ai.capabilities import (
        AbstractCapability,
        RawToolArgs,
        ValidatedToolArgs,
        WrapModelRequestHandler,
        WrapToolExecuteHandler,
        WrapToolValidateHandler,
    )
    from pydantic_ai.exceptions import (
        ModelAPIError,
        ModelConnectionError,
        ModelRateLimitError,
        ModelServerError,
        ModelUnavailableError,
    )
    from pydantic_ai.messages import (
        ModelMessage,
        ModelMessagesTypeAdapter,
        ModelRequest,
        ModelResponse,
        TextPart,
        ToolCallPart,
        ToolReturnPart,
        UserPromptPart,
    )
    from pydantic_ai.models import ModelRequestContext
    from pydantic_ai.tools import (
        DeferredToolRequests,
        DeferredToolResults,
        ToolApproved,
        ToolDefinition,
        ToolDenied,
    )
    from pydantic_graph import End
except ImportError as error:  # pragma: no cover - the extra is missing
    from orchestrator.lazy import install_hint

    # The missing module's name is kept: ``serve --agents`` names the extra from it.
    raise ModuleNotFoundError(
        f"orchestrator.integrations.pydantic_ai needs Pydantic AI: {install_hint('pydantic-ai')}",
        name=error.name,
    ) from error

from orchestrator.agent.budgets import BudgetExhausted
from orchestrator.agent.llm import (
    BACKOFF_SECONDS,
    MODEL_ATTEMPTS,
    ModelRefused,
    ToolCall,
    refusal_message,
    refused_status,
    retryable_status,
)
from orchestrator.agent.steps import Agent, Fail, Finish, Next, Outcome, Step, StepContext, Wait
from orchestrator.agent.stored_replies import (
    StoredReply,
    arguments_problem,
    flood_message,
    stored_json,
    stored_reply,
    unstorable_json,
)
from orchestrator.agent.tool_loop import effect_keys
from orchestrator.agent.tools import DEFAULT_TOOL_TIMEOUT_SECONDS
from orchestrator.agent.turns import (
    DEFAULT_MAX_TOOL_CALLS_PER_TURN,
    DEFAULT_SETTLE_GRACE_SECONDS,
    default_prompt,
    default_result,
    settled_records,
    turn_committed,
)
from orchestrator.effect_model import (
    DEFAULT_APPROVAL_SECONDS,
    MAX_APPROVAL_SECONDS,
    Effect,
    EffectPolicy,
    EffectRecord,
    EffectStatus,
    validate_effect_key,
)
from orchestrator.errors import InvalidInput, PermanentFailure
from orchestrator.jsontext import compact
from orchestrator.models import DEFAULT_MAX_MESSAGE_BYTES, JSON, Message, Role
from orchestrator.storable import storable_text
from orchestrator.telemetry import (
    ATTEMPT,
    LEASE_UNTIL,
    RUN_FENCE,
    RUN_ID,
    WORKER_ID,
    model_metrics,
    start_span,
)

_HALF_A_MESSAGE = DEFAULT_MAX_MESSAGE_BYTES // 2
"""What a model response's calls may take: each message is kept twice (Pydantic AI's JSON and the
chat view beside it)."""
STATE_KEY = "pydantic_ai"
"""The checkpoint key holding the turn loop's own state."""
DEFAULT_WORST_OUTPUT_TOKENS = 4096
"""The output reserved per model request when the agent sets no ``max_output_tokens``."""


@dataclass(frozen=True)
class EffectfulTool:
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
    """What the model is told of the settled record (default: ``tools.default_result``)."""

    def needs_approval(self, arguments: Mapping[str, Any]) -> bool:
        """The ``approve`` predicate on the call's arguments; one that raises asks a person."""
        if isinstance(self.approve, bool):
            return self.approve
        try:
            return bool(self.approve(**arguments))
        except Exception:
            return True

    def told(self, record: EffectRecord) -> JSON:
        result: JSON = to_jsonable_python((self.result or default_result)(record))
        return result


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
    validate_effect_key(kind)
    if not (isinstance(approve, bool) or callable(approve)):
        raise InvalidInput("effect approve= takes True, or a predicate on the call's arguments")
    if not 0 < approval_seconds <= MAX_APPROVAL_SECONDS:
        raise InvalidInput("effect approval_seconds must be above 0, at most a year")
    if not isinstance(policy, EffectPolicy):
        raise InvalidInput(f"effect policy must be an EffectPolicy, not {policy!r}")
    return EffectfulTool(kind, policy, approve, approval_seconds, payload, result)


class PydanticAIAgent(Agent):
    """An existing ``pydantic_ai.Agent`` as an orchestrator agent (see the module docstring).

    ``read_only``: names of tools that run inline in the worker (they may run again after a
    crash). ``effects``: tool name → ``effect(kind, ...)``. Every tool the agent offers must be
    in one of them; an unlisted tool is hidden from the model and refused if called. ``model``:
    the model to run with instead of the agent's own (a ``Model``, a name, or a function
    returning one, called on each turn: e.g. to read the worker's environment). A read-only
    tool that does not answer within ``tool_timeout_seconds`` is told to the model as an error.
    ``max_turns`` and ``deadline_seconds`` (from the first turn, on the database clock; waits
    included) bound the loop: past either, the run fails.
    """

    def __init__(
        self,
        name: str,
        agent: PydanticAgent[Any, Any],
        *,
        read_only: Collection[str] = (),
        effects: Mapping[str, EffectfulTool] | None = None,
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
    ) -> None:
        if not isinstance(agent, PydanticAgent):
            raise InvalidInput(
                f"agent {name}: {agent!r} is not a pydantic_ai.Agent; pass the Agent itself"
            )
        if isinstance(read_only, str):
            raise InvalidInput(f"agent {name}: read_only is a list of tool names, not a string")
        effects = dict(effects or {})
        for tool_name, marked in effects.items():
            if not isinstance(marked, EffectfulTool):
                raise InvalidInput(
                    f"agent {name}: effects[{tool_name!r}] must be effect(kind, ...), "
                    f"not {type(marked).__name__}"
                )
        both = sorted(set(read_only) & set(effects))
        if both:
            raise InvalidInput(f"agent {name}: {', '.join(both)} cannot be read-only and an effect")
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
        self.read_only = frozenset(read_only)
        self.effects = effects
        self.max_turns = max_turns
        self.max_output_tokens = max_output_tokens
        self.prompt = prompt
        self.deps = deps
        self.model = model
        self.settle_grace_seconds = settle_grace_seconds
        self.tool_timeout_seconds = tool_timeout_seconds
        self.max_tool_calls_per_turn = max_tool_calls_per_turn
        self.deadline_seconds = deadline_seconds
        wrapper = self

        class Turn(Step):
            """One model turn of the Pydantic AI run, traced as ``invoke_agent``."""

            @classmethod
            def span(cls, agent: str) -> str:
                return f"invoke_agent {agent}"

            @classmethod
            def span_attributes(cls, agent: str) -> dict[str, Any]:
                return {"gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": agent}

            async def run(self, ctx: StepContext) -> Outcome:
                return await wrapper.turn(ctx, type(self))

        Turn.name = "turn"
        Turn.lease_seconds = lease_seconds
        Turn.__qualname__ = f"{name}.turn"
        super().__init__(name, first=Turn, description=description, budget=budget)

    # -- the turn ---------------------------------------------------------------------------
    async def turn(self, ctx: StepContext, self_step: type[Step]) -> Outcome:
        rest = dict(ctx.checkpoint) if isinstance(ctx.checkpoint, dict) else {}
        state = _State.load(rest.pop(STATE_KEY, None), ctx, self.deadline_seconds)
        left = state.seconds_left(ctx)
        if left is not None and left <= 0:
            return Fail("the agent's deadline passed", details=state.summary())
        committed = await ctx.transcript.messages()
        history = _history(committed)
        results = await self._settled(ctx, state)
        if isinstance(results, Wait):
            return results
        if state.turn >= self.max_turns:
            return Fail(f"the turn limit of {self.max_turns} was reached", details=state.summary())
        span = trace.get_current_span()
        span.set_attribute("gen_ai.conversation.id", ctx.run_id)
        span.set_attribute("orchestrator.turn", state.turn)
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
            span.set_attribute("orchestrator.budget.exhausted", exhausted.dimension)
            if ctx.budget is not None and ctx.budget.limits.on_exhausted == "fail":
                return Fail(str(exhausted), details=state.summary())
            return Wait(
                self_step,
                reason="budget",
                until=state.deadline,
                checkpoint={**rest, STATE_KEY: state.dump()},
            )
        if bounded.cancelled_caught:
            return Fail("the agent's deadline passed", details=state.summary())
        new_messages = list(messages[len(history) :])
        if trailing is not None:
            new_messages.append(trailing)
        state.add_usage(capability)
        try:
            new = _to_transcript(new_messages, state.turn)
        except InvalidInput as unstorable:  # thousands of calls: asking again would not help
            span.set_status(Status(StatusCode.ERROR, "reply cannot be stored"))
            return Fail(str(unstorable), details=state.summary())
        if trailing is not None:
            state.turn += 1
            return Next(self_step, checkpoint={**rest, STATE_KEY: state.dump()}, messages=new)
        if isinstance(ended, DeferredToolRequests):
            return self._deferred(ended, capability, state, rest, new, self_step)
        output = to_jsonable_python(ended)
        problem = unstorable_json(output, "the answer")
        if problem is not None:  # asked again, as the next turn (max_turns bounds it)
            ask = f"Your answer cannot be stored ({problem}). Answer again without it."
            new += _to_transcript([ModelRequest(parts=[UserPromptPart(ask)])], state.turn)
            state.turn += 1
            return Next(self_step, checkpoint={**rest, STATE_KEY: state.dump()}, messages=new)
        return Finish(
            result={"output": output, **state.summary(), "turns": state.turn + 1}, messages=new
        )

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
            capabilities=[capability],
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
        rest: dict[str, JSON],
        new: list[Message],
        self_step: type[Step],
    ) -> Outcome:
        """The turn's effect calls: recorded in its commit; the next turn waits for them."""
        pending: list[dict[str, JSON]] = []
        effects: list[Effect] = []
        for call in [*requested.calls, *requested.approvals]:
            made = capability.deferred.get(call.tool_call_id)
            if made is None:
                return Fail(
                    f"tool {call.tool_name} was deferred by the agent itself (requires_approval "
                    "or an external tool); mark it with effects={...} so orchestrator sends it",
                    details=state.summary(),
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
        state.turn += 1
        checkpoint = {**rest, STATE_KEY: state.dump()}
        return turn_committed(
            self_step,
            checkpoint=checkpoint,
            effects=effects,
            messages=new,
            deadline=state.deadline,
        )

    async def _settled(self, ctx: StepContext, state: _State) -> DeferredToolResults | Wait | None:
        """The previous turn's effect calls as ``DeferredToolResults`` once every record has
        settled; while some have not, a ``Wait`` for them (after a short grace with the lease)."""
        if not state.pending:
            return None
        keys = [str(p["effect_key"]) for p in state.pending]
        grace = self.settle_grace_seconds
        left = state.seconds_left(ctx)
        if left is not None:
            grace = min(grace, left)
        records, unsettled = await settled_records(ctx.effects, keys, grace)
        if unsettled:
            return Wait(ctx.step, effects=unsettled, until=state.deadline, reason="effects")
        results = DeferredToolResults()
        for pending in state.pending:
            call_id, tool = str(pending["call_id"]), str(pending["tool"])
            record = records[str(pending["effect_key"])]
            marked = self.effects.get(tool)
            told = marked.told(record) if marked is not None else default_result(record)
            if not pending.get("approval"):
                results.calls[call_id] = told
            elif record.status is EffectStatus.REJECTED and record.decided_by is not None:
                note = record.error.get("message") if isinstance(record.error, dict) else None
                results.approvals[call_id] = ToolDenied(str(note or "denied by reviewer"))
            else:  # approved (and sent, or failed): the settled record is the call's return
                results.approvals[call_id] = ToolApproved()
                results.metadata[call_id] = {_SETTLED: told}
        return results


_SETTLED = "orchestrator_settled_result"


class OrchestratorCapability(AbstractCapability[Any]):
    """The hooks one turn runs with: spans and budget on model requests, tools classified."""

    def __init__(self, wrapper: PydanticAIAgent, ctx: StepContext, turn: int) -> None:
        self.wrapper = wrapper
        self.step = ctx
        self.turn = turn
        self.deferred: dict[str, Effect] = {}
        """Effects this turn's calls became, by tool call id."""
        self.input_tokens = 0
        self.output_tokens = 0
        self.requests = 0
        self.calls = 0
        """Tool calls this turn made, against the run's tool-call budget."""
        self.failed_attempts: list[Exception] = []
        """The failed attempts of the model request in flight."""
        self.stored: dict[int, tuple[ModelResponse, StoredReply]] = {}
        """What the transcript can hold of each model response of the turn, by the response's
        id (computed once per response, for all its calls; the response is kept with it, so its
        id is not reused meanwhile)."""
        self.refused: dict[str, str] = {}
        """Why each refused call (by tool call id) is not run: its tool error."""
        self.places: dict[str, tuple[int, ModelResponse, int]] = {}
        """Each tool call id of the run's responses: the response's place among them (the turn
        its calls are keyed under), the response, the call's place in it. Built once per
        response, not once per call: a reply of thousands of calls must not cost their square."""

    def _attributes(self) -> dict[str, Any]:
        ctx = self.step
        return {
            RUN_ID: ctx.run_id,
            RUN_FENCE: ctx.fence,
            WORKER_ID: ctx.worker_id,
            ATTEMPT: ctx.attempt,
            LEASE_UNTIL: ctx.lease_until.isoformat(),
            "orchestrator.turn": self.turn,
        }

    async def prepare_tools(
        self, ctx: RunContext[Any], tool_defs: list[ToolDefinition]
    ) -> list[ToolDefinition]:
        """Only classified tools are offered to the model."""
        known = self.wrapper.read_only | self.wrapper.effects.keys()
        return [t for t in tool_defs if t.name in known]

    async def wrap_model_request(
        self,
        ctx: RunContext[Any],
        *,
        request_context: ModelRequestContext,
        handler: WrapModelRequestHandler,
    ) -> ModelResponse:
        model = request_context.model.model_name
        budget = self.step.budget
        worst_input = worst_output = 0
        # This capability is the one retry layer (on_model_request_error): not the SDK's own.
        settings: dict[str, Any] = dict(request_context.model_settings or {})
        settings["max_retries"] = 0
        request_context.model_settings = settings  # type: ignore[assignment]
        self.failed_attempts = []
        if budget is not None:
            worst_input = len(ModelMessagesTypeAdapter.dump_json(request_context.messages))
            worst_output = self.wrapper.max_output_tokens or DEFAULT_WORST_OUTPUT_TOKENS
            settings["max_tokens"] = min(
                int(settings.get("max_tokens") or worst_output), worst_output
            )
            await budget.reserve(
                turns=1,
                input_tokens=worst_input,
                output_tokens=worst_output,
                cost_usd=self._cost(model, worst_input, worst_output),
            )
        attributes = {
            "gen_ai.operation.name": "chat",
            "gen_ai.provider.name": request_context.model.system,
            "gen_ai.request.model": model,
            **self._attributes(),
        }
        began = time.monotonic()
        with start_span(f"chat {model}", attributes=attributes) as span:
            try:
                response = await handler(request_context)
            except Exception as error:
                span.set_attribute("error.type", type(error).__name__)
                model_metrics().record(
                    model,
                    time.monotonic() - began,
                    error=type(error).__name__,
                    input_tokens=None,
                    output_tokens=None,
                )
                if budget is not None:  # may have been billed: its worst case is spent
                    self._spend(model, worst_input, worst_output, turns=0)
                raise
            usage = response.usage
            span.set_attribute("gen_ai.response.model", response.model_name or model)
            span.set_attribute("gen_ai.usage.input_tokens", usage.input_tokens)
            span.set_attribute("gen_ai.usage.output_tokens", usage.output_tokens)
            model_metrics().record(
                model,
                time.monotonic() - began,
                error=None,
                input_tokens=usage.input_tokens,
                output_tokens=usage.output_tokens,
            )
        self.requests += 1
        self.input_tokens += usage.input_tokens
        self.output_tokens += usage.output_tokens
        if budget is not None:
            # An attempt cut off without an answer may have been billed: its worst case counts.
            unanswered = sum(1 for e in self.failed_attempts if isinstance(e, ModelConnectionError))
            self._spend(
                model,
                usage.input_tokens + unanswered * worst_input,
                usage.output_tokens + unanswered * worst_output,
                turns=1,
            )
        if not self._stored(self.turn, response).fits:  # thousands of calls: none is run
            raise PermanentFailure(flood_message(len(response.tool_calls), _HALF_A_MESSAGE))
        return response

    async def on_model_request_error(
        self,
        ctx: RunContext[Any],
        *,
        request_context: ModelRequestContext,
        error: Exception,
    ) -> ModelResponse:
        """408, 409, 429, 5xx, timeouts, dropped connections and answers that are not UTF-8 are
        tried again with backoff (the server's ``Retry-After`` honoured), up to
        ``llm.MODEL_ATTEMPTS`` attempts, as ``llm.complete`` does; any other 4xx fails the run
        at once (``llm.ModelRefused``: the same request would be refused again); other errors
        are not retried here."""
        transient = (
            ModelRateLimitError,
            ModelServerError,
            ModelUnavailableError,
            ModelConnectionError,
        )
        status = getattr(error, "status_code", None)
        if isinstance(status, int) and refused_status(status):
            model = request_context.model
            where = model.base_url or f"{model.system}'s own endpoint"
            message = refusal_message(status, model.model_name, where, getattr(error, "body", None))
            if status == 404 and type(model).__name__ == "OpenAIResponsesModel":
                message += (
                    "; openai:NAME speaks the Responses API, which chat completions servers "
                    "(vLLM, Ollama) do not have: use openai-chat:NAME there"
                )
            raise ModelRefused(message, ()) from error
        # An answer that was not UTF-8 or not JSON (a broken server): the next may be readable.
        unreadable = isinstance(error.__cause__, UnicodeDecodeError | json.JSONDecodeError)
        if (
            not isinstance(error, transient)
            and not unreadable
            and not (isinstance(status, int) and retryable_status(status))
        ):
            raise error
        self.failed_attempts.append(error)
        attempts = len(self.failed_attempts)
        with start_span(
            f"chat {request_context.model.model_name}",
            attributes={
                "gen_ai.operation.name": "chat",
                "error.type": type(error).__name__,
                "orchestrator.model.attempt": attempts,
                **self._attributes(),
            },
        ):
            pass
        if attempts >= MODEL_ATTEMPTS:
            raise error
        after = error.retry_after if isinstance(error, ModelAPIError) else None
        wait = (
            after if after is not None else BACKOFF_SECONDS[attempts - 1] * random.uniform(0.5, 1)
        )
        await anyio.sleep(min(wait, 30.0))
        raise RetryModelRequest()

    def _cost(self, model: str, input_tokens: int, output_tokens: int) -> Decimal:
        budget = self.step.budget
        assert budget is not None
        if budget.limits.cost_usd is None and model not in budget.prices.models:
            return Decimal(0)
        return budget.prices.cost(model, input_tokens, output_tokens)

    def _spend(self, model: str, input_tokens: int, output_tokens: int, *, turns: int) -> None:
        budget = self.step.budget
        assert budget is not None
        budget.spend(
            turns=turns,
            input_tokens=input_tokens,
            output_tokens=output_tokens,
            cost_usd=self._cost(model, input_tokens, output_tokens),
        )

    async def wrap_tool_execute(
        self,
        ctx: RunContext[Any],
        *,
        call: ToolCallPart,
        tool_def: ToolDefinition,
        args: ValidatedToolArgs,
        handler: WrapToolExecuteHandler,
    ) -> Any:
        name = call.tool_name
        marked = self.wrapper.effects.get(name)
        if marked is None and name not in self.wrapper.read_only:
            return {"error": f"tool {name!r} is not allowed in this run"}
        refusal = self.refused.get(call.tool_call_id)
        if refusal is None and not ctx.tool_call_approved:
            problem = arguments_problem(args)  # what an effect's record could not hold
            refusal = None if problem is None else f"invalid arguments for {name}: {problem}"
        if refusal is not None:
            return {"error": refusal}
        budget = self.step.budget
        if budget is not None and not ctx.tool_call_approved:
            # The run's tool-call budget, as ToolAgent keeps it: calls past it are not run.
            left = budget.tool_calls_left
            if left is not None and self.calls >= left:
                return {"error": "not run: the run's tool-call budget is exhausted"}
            self.calls += 1
            budget.spend(tool_calls=1)
        if marked is None:
            with start_span(
                f"execute_tool {name}",
                attributes={
                    "gen_ai.operation.name": "execute_tool",
                    "gen_ai.tool.name": name,
                    "gen_ai.tool.call.id": call.tool_call_id,
                    "gen_ai.tool.type": "function",
                    **self._attributes(),
                },
            ):
                seconds = self.wrapper.tool_timeout_seconds
                try:
                    with anyio.fail_after(seconds):
                        return await handler(args)
                except TimeoutError:
                    return {"error": f"{name} did not answer within {seconds:g}s"}
        if ctx.tool_call_approved:
            # A resumed, approved call: the dispatcher sent it; its settled record is the return.
            settled = ctx.tool_call_metadata
            if isinstance(settled, dict) and _SETTLED in settled:
                return settled[_SETTLED]
            raise RuntimeError(f"approved call {call.tool_call_id} of {name} has no settled record")
        key = self._effect_key(ctx, call)
        payload: JSON = to_jsonable_python(
            marked.payload(**args) if marked.payload is not None else args
        )
        made = Effect(
            key,
            marked.kind,
            payload,
            marked.policy,
            requires_approval=marked.needs_approval(args),
            approval_seconds=marked.approval_seconds,
        )
        self.deferred[call.tool_call_id] = made
        with start_span(
            f"execute_tool {name}",
            attributes={
                "gen_ai.operation.name": "execute_tool",
                "gen_ai.tool.name": name,
                "gen_ai.tool.call.id": call.tool_call_id,
                "gen_ai.tool.type": "extension",
                "orchestrator.effect.key": key,
                "orchestrator.effect.requires_approval": made.requires_approval,
                **self._attributes(),
            },
        ):
            pass  # the call is recorded, not made: its span marks the effect key it became
        metadata: dict[str, Any] = {"effect_key": key}
        if made.requires_approval:
            raise ApprovalRequired(metadata)
        raise CallDeferred(metadata)

    def _effect_key(self, ctx: RunContext[Any], call: ToolCallPart) -> str:
        """The call's key among its response's calls, as ``ToolAgent`` keys them, the turn being
        the response's place among the run's responses: the same response's calls, run again
        for any reason, meet the records (and the vendor's lookups) they already have."""
        turn, response, index = self._placed(ctx, call)
        calls = response.tool_calls if response is not None else [call]
        return effect_keys(turn, [_openai_call(c) for c in calls])[index]

    def _stored(self, turn: int, response: ModelResponse) -> StoredReply:
        """What the transcript can hold of ``response`` (computed once, for all its calls)."""
        if id(response) not in self.stored:
            text = "".join(p.content for p in response.parts if isinstance(p, TextPart))
            calls = [
                ToolCall(c.tool_call_id, c.tool_name, _raw_arguments(c))
                for c in response.tool_calls
            ]
            stored = stored_reply(
                turn,
                text or None,
                calls,
                max_calls=self.wrapper.max_tool_calls_per_turn,
                max_bytes=_HALF_A_MESSAGE,
            )
            self.stored[id(response)] = (response, stored)
        return self.stored[id(response)][1]

    def _placed(
        self, ctx: RunContext[Any], call: ToolCallPart
    ) -> tuple[int, ModelResponse | None, int]:
        """The response holding ``call`` (``None`` if none does: then this turn, and its place
        0), its place among the run's responses and the call's place in it."""
        if call.tool_call_id not in self.places:
            responses = [m for m in ctx.messages if isinstance(m, ModelResponse)]
            for number, response in enumerate(responses):
                for index, part in enumerate(response.tool_calls):
                    self.places[part.tool_call_id] = (number, response, index)
        return self.places.get(call.tool_call_id, (self.turn, None, 0))

    async def wrap_tool_validate(
        self,
        ctx: RunContext[Any],
        *,
        call: ToolCallPart,
        tool_def: ToolDefinition,
        args: RawToolArgs,
        handler: WrapToolValidateHandler,
    ) -> ValidatedToolArgs:
        """A call the transcript cannot hold as it came (``stored_replies``) is refused before
        it is validated: the history keeps what can be stored of its arguments, and
        ``wrap_tool_execute`` tells the model why it was not run."""
        turn, response, index = self._placed(ctx, call)
        if response is None:  # not a call of the run's responses: nothing of it is stored
            return await handler(args)
        stored = self._stored(turn, response)
        refusal = stored.refused.get(index)
        if refusal is None:
            return await handler(args)
        self.refused[call.tool_call_id] = refusal
        kept = stored.body["tool_calls"][index]["function"]["arguments"]
        if kept != _raw_arguments(call):
            call.args = kept  # the history part: what the transcript will hold
        raise SkipToolValidation({})


def _raw_arguments(call: ToolCallPart) -> str:
    """The call's arguments as the model sent them (a JSON text, usually)."""
    if isinstance(call.args, str):
        return call.args
    return compact(call.args or {})


def _openai_call(call: ToolCallPart) -> dict[str, Any]:
    try:
        arguments = call.args_as_json_str()
    except ValueError:  # a lone surrogate: that call is refused, its key only has to exist
        arguments = storable_text(_raw_arguments(call))
    return {
        "id": call.tool_call_id,
        "type": "function",
        "function": {"name": call.tool_name, "arguments": arguments},
    }


def _history(committed: Sequence[Message]) -> list[ModelMessage]:
    """The Pydantic AI messages of the committed transcript."""
    stored = [m.body[STATE_KEY] for m in committed if STATE_KEY in m.body]
    if len(stored) != len(committed):
        raise InvalidInput(
            "this run's transcript holds messages not written by PydanticAIAgent; "
            "was the agent's code changed while runs were in flight?"
        )
    return ModelMessagesTypeAdapter.validate_python(stored)


def _to_transcript(messages: Sequence[ModelMessage], turn: int) -> list[Message]:
    """Each Pydantic AI message as one transcript message: its JSON under ``pydantic_ai`` and
    a chat-API rendering beside it, for ``runs show`` and the console."""
    dumped = ModelMessagesTypeAdapter.dump_python(list(messages), mode="json")
    out: list[Message] = []
    for message, body in zip(messages, dumped, strict=True):
        role: Role
        view: dict[str, Any]
        usage: JSON = None
        if isinstance(message, ModelResponse):
            role = "assistant"
            text = "".join(p.content for p in message.parts if isinstance(p, TextPart))
            view = {"role": role, "content": text or None}
            if message.tool_calls:
                view["tool_calls"] = [_openai_call(c) for c in message.tool_calls]
            usage = {
                "model": message.model_name,
                "input_tokens": message.usage.input_tokens,
                "output_tokens": message.usage.output_tokens,
            }
        else:
            returns = [p for p in message.parts if isinstance(p, ToolReturnPart)]
            prompts = [p for p in message.parts if isinstance(p, UserPromptPart)]
            if returns and not prompts:
                role = "tool"
                view = {
                    "role": role,
                    "tool_call_id": returns[0].tool_call_id,
                    "content": json.dumps([to_jsonable_python(r.content) for r in returns]),
                }
            else:
                role = "user"
                view = {
                    "role": role,
                    "content": " ".join(
                        p.content if isinstance(p.content, str) else "[content]" for p in prompts
                    )
                    or _describe(message),
                }
        stored = stored_json({**view, STATE_KEY: body}, DEFAULT_MAX_MESSAGE_BYTES)
        if stored is None:
            calls = len(message.tool_calls) if isinstance(message, ModelResponse) else 0
            raise InvalidInput(
                f"the {role} message of turn {turn} cannot be stored, even without its largest "
                f"values ({calls} tool calls: at most {DEFAULT_MAX_MESSAGE_BYTES:,} bytes a "
                "message)"
            )
        out.append(Message(turn, role, stored, usage))
    return out


def _describe(message: ModelRequest) -> str:
    return ", ".join(sorted({type(p).__name__ for p in message.parts})) or "(empty request)"


class _State:
    """The turn loop's checkpoint: small and bounded, whatever the conversation's length."""

    def __init__(self) -> None:
        self.turn = 0
        self.deadline: datetime | None = None
        self.pending: list[dict[str, JSON]] = []
        self.input_tokens = 0
        self.output_tokens = 0
        self.model_requests = 0

    @classmethod
    def load(cls, stored: Any, ctx: StepContext, deadline_seconds: float | None) -> _State:
        state = cls()
        if isinstance(stored, dict):
            for key in ("turn", "input_tokens", "output_tokens", "model_requests"):
                setattr(state, key, int(stored.get(key, 0)))
            state.pending = list(stored.get("pending", []))
            deadline = stored.get("deadline")
            state.deadline = datetime.fromisoformat(deadline) if deadline else None
        elif deadline_seconds is not None:  # the loop's first turn: on the database clock
            state.deadline = ctx.database_now() + timedelta(seconds=deadline_seconds)
        return state

    def seconds_left(self, ctx: StepContext) -> float | None:
        if self.deadline is None:
            return None
        return (self.deadline - ctx.database_now()).total_seconds()

    def add_usage(self, capability: OrchestratorCapability) -> None:
        self.input_tokens += capability.input_tokens
        self.output_tokens += capability.output_tokens
        self.model_requests += capability.requests

    def summary(self) -> dict[str, JSON]:
        return {
            "input_tokens": self.input_tokens,
            "output_tokens": self.output_tokens,
            "model_requests": self.model_requests,
        }

    def dump(self) -> dict[str, JSON]:
        return {
            "turn": self.turn,
            "pending": list(self.pending),
            "deadline": None if self.deadline is None else self.deadline.isoformat(),
            **self.summary(),
        }


__all__ = ["EffectfulTool", "OrchestratorCapability", "PydanticAIAgent", "effect"]
