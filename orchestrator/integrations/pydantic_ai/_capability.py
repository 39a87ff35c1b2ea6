"""``OrchestratorCapability``: the Pydantic AI hooks one turn runs with. Model requests get
the turn's spans, the run's budget and orchestrator's retry rule; tools are classified (a
read-only tool runs inline, an effect's call is deferred and becomes a fenced ``Effect``, any
other is hidden and refused); a call the transcript cannot hold is refused before it runs."""

from __future__ import annotations

import json
import random
import time
from collections.abc import Mapping
from typing import Any, Protocol

import anyio
from pydantic_ai import (
    ApprovalRequired,
    CallDeferred,
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
from pydantic_ai.messages import ModelMessagesTypeAdapter, ModelResponse, TextPart, ToolCallPart
from pydantic_ai.models import ModelRequestContext
from pydantic_ai.tools import ToolDefinition
from pydantic_core import to_jsonable_python

from orchestrator.agent.children import Child
from orchestrator.agent.llm import (
    BACKOFF_SECONDS,
    MODEL_ATTEMPTS,
    ModelCallFailed,
    ModelRefused,
    ToolCall,
    refusal_message,
    refused_status,
    retry_after_of,
    retryable_status,
)
from orchestrator.agent.rates import ModelCallRates, RateLimitWait, current_rates
from orchestrator.agent.steps import StepContext
from orchestrator.agent.stored_replies import (
    StoredReply,
    arguments_problem,
    flood_message,
    stored_reply,
)
from orchestrator.agent.turns import (
    TOOL_BUDGET_EXHAUSTED,
    Spending,
    call_effect_keys,
    tool_span,
    turn_attributes,
)
from orchestrator.effect_model import Effect
from orchestrator.errors import PermanentFailure
from orchestrator.integrations.pydantic_ai._effects import SETTLED, ChildAgentTool, EffectfulTool
from orchestrator.integrations.pydantic_ai._history import arguments_text, raw_arguments
from orchestrator.models import DEFAULT_MAX_MESSAGE_BYTES, JSON
from orchestrator.telemetry import model_metrics, start_span

_HALF_A_MESSAGE = DEFAULT_MAX_MESSAGE_BYTES // 2
"""What a model response's calls may take: each message is kept twice (Pydantic AI's JSON and the
chat view beside it)."""


class ClassifiedTools(Protocol):
    """What the capability reads of the agent it serves (``PydanticAIAgent``): a protocol, so
    that this module does not import the agent's, which imports it."""

    read_only: frozenset[str]
    effects: dict[str, EffectfulTool]
    agents: dict[str, ChildAgentTool]
    max_output_tokens: int | None
    max_tool_calls_per_turn: int
    tool_timeout_seconds: float


class OrchestratorCapability(AbstractCapability[Any]):
    """The hooks one turn runs with: spans and budget on model requests, tools classified."""

    def __init__(self, wrapper: ClassifiedTools, ctx: StepContext, turn: int) -> None:
        self.wrapper = wrapper
        self.step = ctx
        self.turn = turn
        self.deferred: dict[str, Effect] = {}
        self.children: dict[str, Child] = {}
        """The turn's agent calls: each call's child run, started by the turn's commit."""
        """Effects this turn's calls became, by tool call id."""
        self.input_tokens = 0
        self.output_tokens = 0
        self.requests = 0
        self.calls = 0
        """Tool calls this turn made, against the run's tool-call budget."""
        self.failed_attempts: list[Exception] = []
        """The failed attempts of the model request in flight."""
        self.rates = ModelCallRates("", 0, None)
        """The model request in flight's charge to its shared rate limit."""
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

    async def prepare_tools(
        self, ctx: RunContext[Any], tool_defs: list[ToolDefinition]
    ) -> list[ToolDefinition]:
        """Only classified tools are offered to the model."""
        known = self.wrapper.read_only | self.wrapper.effects.keys() | self.wrapper.agents.keys()
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
        spending = Spending(budget, self.wrapper.max_output_tokens)
        # This capability is the one retry layer (on_model_request_error): not the SDK's own.
        settings: dict[str, Any] = dict(request_context.model_settings or {})
        settings["max_retries"] = 0
        request_context.model_settings = settings  # type: ignore[assignment]
        self.failed_attempts = []
        if budget is not None:
            spending.worst_input = len(ModelMessagesTypeAdapter.dump_json(request_context.messages))
            worst_output = spending.worst_output
            settings["max_tokens"] = min(
                int(settings.get("max_tokens") or worst_output), worst_output
            )
            await spending.reserve(model, turns=1)
        self.rates = rates = ModelCallRates(
            model,
            len(ModelMessagesTypeAdapter.dump_json(request_context.messages))
            if current_rates() is not None
            else 0,
            settings.get("max_tokens"),
        )
        await self._rate_capacity()
        attributes = {
            "gen_ai.operation.name": "chat",
            "gen_ai.provider.name": request_context.model.system,
            "gen_ai.request.model": model,
            **turn_attributes(self.step, self.turn),
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
                    spending.spend(
                        turns=0,
                        input_tokens=spending.worst_input,
                        output_tokens=spending.worst_output,
                    )
                raise
            usage = response.usage
            await rates.answered(usage.input_tokens, usage.output_tokens)
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
            spending.spend(
                turns=1,
                input_tokens=usage.input_tokens + unanswered * spending.worst_input,
                output_tokens=usage.output_tokens + unanswered * spending.worst_output,
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
                **turn_attributes(self.step, self.turn),
            },
        ):
            pass
        if attempts >= MODEL_ATTEMPTS:
            raise error
        after = error.retry_after if isinstance(error, ModelAPIError) else None
        if after is None and error.__cause__ is not None:  # the OpenAI SDK's own error has it
            after = retry_after_of(error.__cause__)
        if status == 429 and await self.rates.refused_for_rate(after):
            after = 0.0  # every worker waits for the pause: this one in _rate_capacity
        wait = (
            after if after is not None else BACKOFF_SECONDS[attempts - 1] * random.uniform(0.5, 1)
        )
        await anyio.sleep(min(wait, 30.0))
        await self._rate_capacity()  # the retry is a request like any other
        raise RetryModelRequest()

    async def _rate_capacity(self) -> None:
        """Wait for the model's shared rate limit (docs/flow-control.md)."""
        try:
            await self.rates.before_attempt()
        except RateLimitWait as waited_out:
            raise ModelCallFailed(str(waited_out), ()) from None

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
        runs_agent = self.wrapper.agents.get(name)
        if marked is None and runs_agent is None and name not in self.wrapper.read_only:
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
                return {"error": TOOL_BUDGET_EXHAUSTED}
            self.calls += 1
            budget.spend(tool_calls=1)
        if runs_agent is not None:  # a child run, started by the turn's commit
            key = self._effect_key(ctx, call)
            self.children[call.tool_call_id] = runs_agent.child(key, args)
            marks = {"orchestrator.child.key": key}
            with tool_span(
                self.step, self.turn, name, call.tool_call_id, effect=True, attributes=marks
            ):
                pass
            raise CallDeferred({"child_key": key})
        if marked is None:
            with tool_span(self.step, self.turn, name, call.tool_call_id, effect=False):
                seconds = self.wrapper.tool_timeout_seconds
                try:
                    with anyio.fail_after(seconds):
                        return await handler(args)
                except TimeoutError:
                    return {"error": f"{name} did not answer within {seconds:g}s"}
        if ctx.tool_call_approved:
            # A resumed, approved call: the dispatcher sent it; its settled record is the return.
            settled = ctx.tool_call_metadata
            if isinstance(settled, dict) and SETTLED in settled:
                return settled[SETTLED]
            raise RuntimeError(f"approved call {call.tool_call_id} of {name} has no settled record")
        raise self._deferred(ctx, call, marked, args)

    def _deferred(
        self,
        ctx: RunContext[Any],
        call: ToolCallPart,
        marked: EffectfulTool,
        args: ValidatedToolArgs,
    ) -> CallDeferred | ApprovalRequired:
        """What an effect's call becomes instead of running: a fenced ``Effect`` of this turn,
        and Pydantic AI's deferral of the call (its approval, when a person must approve it)."""
        key = self._effect_key(ctx, call)
        payload: JSON = to_jsonable_python(
            marked.payload(**args) if marked.payload is not None else args
        )
        made = marked.effect(key, payload, args)
        self.deferred[call.tool_call_id] = made
        marks: Mapping[str, Any] = {
            "orchestrator.effect.key": key,
            "orchestrator.effect.requires_approval": made.requires_approval,
        }
        with tool_span(
            self.step, self.turn, call.tool_name, call.tool_call_id, effect=True, attributes=marks
        ):
            pass  # the call is recorded, not made: its span marks the effect key it became
        metadata: dict[str, Any] = {"effect_key": key}
        if made.requires_approval:
            return ApprovalRequired(metadata)
        return CallDeferred(metadata)

    def _effect_key(self, ctx: RunContext[Any], call: ToolCallPart) -> str:
        """The call's key among its response's calls, as ``ToolAgent`` keys them, the turn being
        the response's place among the run's responses: the same response's calls, run again
        for any reason, meet the records (and the vendor's lookups) they already have."""
        turn, response, index = self._placed(ctx, call)
        calls = response.tool_calls if response is not None else [call]
        return call_effect_keys(turn, [(c.tool_name, arguments_text(c)) for c in calls])[index]

    def _stored(self, turn: int, response: ModelResponse) -> StoredReply:
        """What the transcript can hold of ``response`` (computed once, for all its calls)."""
        if id(response) not in self.stored:
            text = "".join(p.content for p in response.parts if isinstance(p, TextPart))
            calls = [
                ToolCall(c.tool_call_id, c.tool_name, raw_arguments(c)) for c in response.tool_calls
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
        if kept != raw_arguments(call):
            call.args = kept  # the history part: what the transcript will hold
        raise SkipToolValidation({})


__all__ = ["ClassifiedTools", "OrchestratorCapability"]
