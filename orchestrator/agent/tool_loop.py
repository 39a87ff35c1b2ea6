"""``ToolAgent``: a model chooses tool calls; the fenced commit decides; the dispatcher acts.

A tool agent is an ``Agent`` whose one step, ``turn``, is one model turn:

1. The effect calls of the previous turn are settled first: the step waits for their records to
   be confirmed, failed or rejected (never tells the model of an uncertain or parked outcome)
   and turns each into the tool message the model reads.
2. One model call (``llm.complete``: its own retries, each attempt's usage counted), with the
   committed transcript and the tools' schemas. Each message is encoded once per claim: a turn
   encodes only the messages committed since the previous one and its own new ones, and the
   request splices the kept bytes (``_request``).
3. Each tool call is checked: an unknown tool (or one a tool source, such as an MCP server,
   lists but its classification denies), malformed JSON or arguments that fail the schema go
   back to the model as a tool error, counted; so does a call the transcript cannot hold as the
   model sent it (``stored_replies``: a NUL or a lone surrogate, arguments too large for the
   message, a call past ``max_tool_calls_per_turn``), or whose arguments parse into what jsonb
   cannot hold (``"\\u0000"``, NaN): nothing is done for it, and the turn still commits. A
   read-only call runs now, with its timeout.
   An effect call only builds its payload: an ``Effect`` keyed by the turn, the tool and its
   arguments (``effect_keys``).
4. One fenced commit holds it all: the messages of the turn (tool results, the assistant message
   and its usage), the effect records, and a small checkpoint. If the commit is refused nothing
   of the turn exists: a replayed turn proposes new calls, and nothing was sent for the old ones.

An answer without tool calls ends the loop: checked against ``output`` when one is given (a bad
answer goes back to the model, up to ``output_retries`` times), then ``Finish`` (or ``Next(then)``
when the loop is one stage of a larger step graph, see ``stage``). ``max_turns`` and
``deadline_seconds`` (from the loop's first turn, on the database clock) bound it.
"""

from __future__ import annotations

import json
import weakref
from collections.abc import Callable, Container, Mapping, Sequence
from typing import Any

import anyio
import pydantic
from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode

from orchestrator.agent.budgets import Budget, BudgetExhausted
from orchestrator.agent.children import Child
from orchestrator.agent.llm import EncodedMessages, ModelAttempt, ModelReply, complete
from orchestrator.agent.steps import Agent, Fail, Finish, Next, Outcome, Step, StepContext, Wait
from orchestrator.agent.stored_replies import (
    arguments_problem,
    flood_message,
    stored_reply,
    unstorable_json,
)
from orchestrator.agent.tools import (
    AgentTool,
    EffectTool,
    ReadOnlyTool,
    Tool,
    ToolArgumentsInvalid,
    ToolContext,
    ToolSource,
)
from orchestrator.agent.turns import (
    DEFAULT_MAX_TOOL_CALLS_PER_TURN,
    DEFAULT_SETTLE_GRACE_SECONDS,
    TOOL_BUDGET_EXHAUSTED,
    Spending,
    TurnState,
    call_effect_keys,
    default_prompt,
    legacy_call_key,
    tool_span,
    turn_attributes,
    turn_step,
)
from orchestrator.effect_model import Effect
from orchestrator.errors import InvalidInput
from orchestrator.models import DEFAULT_MAX_MESSAGE_BYTES, JSON, Message

LOOP_KEY = "tool_loop"
"""The checkpoint key holding the loop's own state (other keys belong to the step graph)."""


def effect_keys(turn: int, tool_calls: Sequence[Any]) -> list[str]:
    """The effect key of each call of one assistant message, as the transcript holds its calls
    (chat-API dicts): see ``turns.call_effect_keys``."""
    return call_effect_keys(turn, [_name_and_arguments(call) for call in tool_calls])


def _name_and_arguments(call: Any) -> tuple[str, object]:
    function = call.get("function", {}) if isinstance(call, dict) else {}
    return str(function.get("name", "")), function.get("arguments")


def recorded_effect_keys(
    turn: int, tool_calls: Sequence[Any], recorded: Container[str]
) -> list[str | None]:
    """The key of each call's effect record among ``recorded``, None for a call without one
    (a read-only or invalid call). Earlier versions keyed effects ``call:TURN:CALL_ID``; a run
    recorded by one is shown with its keys too."""
    found: list[str | None] = []
    for call, key in zip(tool_calls, effect_keys(turn, tool_calls), strict=True):
        call_id = str(call.get("id", "")) if isinstance(call, dict) else ""
        legacy = legacy_call_key(turn, call_id)
        found.append(key if key in recorded else legacy if legacy in recorded else None)
    return found


class ToolAgent(Agent):
    """An agent whose steps are model turns with tools (see the module docstring)."""

    def __init__(
        self,
        name: str,
        *,
        instructions: str,
        tools: Sequence[Tool | ToolSource] = (),
        model: str | None = None,
        output: Any = None,
        max_turns: int = 20,
        deadline_seconds: float | None = None,
        output_retries: int = 2,
        max_invalid_calls: int = 10,
        max_tool_calls_per_turn: int = DEFAULT_MAX_TOOL_CALLS_PER_TURN,
        stream: bool = False,
        lease_seconds: float | None = None,
        prompt: Callable[[JSON], str] = default_prompt,
        description: str = "",
        budget: Budget | None = None,
        max_output_tokens: int | None = None,
        settle_grace_seconds: float = DEFAULT_SETTLE_GRACE_SECONDS,
    ) -> None:
        self.loop = ToolLoop(
            agent=name,
            instructions=instructions,
            tools=tools,
            model=model,
            output=output,
            max_turns=max_turns,
            deadline_seconds=deadline_seconds,
            output_retries=output_retries,
            max_invalid_calls=max_invalid_calls,
            max_tool_calls_per_turn=max_tool_calls_per_turn,
            stream=stream,
            prompt=prompt,
            max_output_tokens=max_output_tokens,
            settle_grace_seconds=settle_grace_seconds,
        )
        super().__init__(
            name,
            first=self.loop.step_class(lease_seconds=lease_seconds),
            description=description,
            budget=budget,
        )

    def stage(
        self, name: str, *, then: type[Step], lease_seconds: float | None = None
    ) -> type[Step]:
        """This agent's loop as a step of another agent: it continues with ``then``, whose
        checkpoint holds the loop's ``output``."""
        return self.loop.step_class(name=name, then=then, lease_seconds=lease_seconds)


class ToolLoop:
    """The loop's configuration and its one turn."""

    def __init__(
        self,
        *,
        agent: str,
        instructions: str,
        tools: Sequence[Tool | ToolSource],
        model: str | None,
        output: Any,
        max_turns: int,
        deadline_seconds: float | None,
        output_retries: int,
        max_invalid_calls: int,
        stream: bool,
        prompt: Callable[[JSON], str],
        max_tool_calls_per_turn: int = DEFAULT_MAX_TOOL_CALLS_PER_TURN,
        max_output_tokens: int | None = None,
        settle_grace_seconds: float = DEFAULT_SETTLE_GRACE_SECONDS,
    ) -> None:
        if max_output_tokens is not None and max_output_tokens < 1:
            raise InvalidInput(f"agent {agent}: max_output_tokens must be at least 1")
        if not settle_grace_seconds >= 0:
            raise InvalidInput(f"agent {agent}: settle_grace_seconds must be 0 or more")
        if (
            max_turns < 1
            or max_tool_calls_per_turn < 1
            or output_retries < 0
            or max_invalid_calls < 0
        ):
            raise InvalidInput(
                f"agent {agent}: max_turns and max_tool_calls_per_turn must be at least 1, "
                "output_retries and max_invalid_calls at least 0"
            )
        if deadline_seconds is not None and not deadline_seconds > 0:
            raise InvalidInput(f"agent {agent}: deadline_seconds must be above 0")
        self.agent = agent
        self.instructions = instructions
        self.tools: dict[str, Tool] = {}
        self.sources: list[ToolSource] = []
        for candidate in tools:
            if isinstance(candidate, ToolSource) and not isinstance(candidate, Tool):
                self.sources.append(candidate)  # its tools are loaded before the first turn
                continue
            if not isinstance(candidate, ReadOnlyTool | EffectTool | AgentTool):
                raise InvalidInput(
                    f"agent {agent}: {candidate!r} is not a tool; label each with "
                    "@tool.read_only, @tool.effect(kind) or @tool.agent(agent)"
                )
            if candidate.name in self.tools:
                raise InvalidInput(f"agent {agent}: two tools are named {candidate.name!r}")
            self.tools[candidate.name] = candidate
        self.definitions = [t.definition() for t in self.tools.values()]
        self._sources_loaded = not self.sources
        self._loading = anyio.Lock()
        self.model = model
        self.output = None if output is None else pydantic.TypeAdapter(output)
        self.max_turns = max_turns
        self.deadline_seconds = deadline_seconds
        self.output_retries = output_retries
        self.max_invalid_calls = max_invalid_calls
        self.max_tool_calls_per_turn = max_tool_calls_per_turn
        self.stream = stream
        self.prompt = prompt
        self.max_output_tokens = max_output_tokens
        self.settle_grace_seconds = settle_grace_seconds

    def step_class(
        self,
        *,
        name: str = "turn",
        then: type[Step] | None = None,
        lease_seconds: float | None = None,
    ) -> type[Step]:
        async def run(ctx: StepContext, self_step: type[Step]) -> Outcome:
            return await self.turn(ctx, self_step=self_step, then=then)

        return turn_step(self.agent, name, lease_seconds, run)

    async def load_sources(self) -> None:
        """Add the tools of the tool sources (MCP servers), once per process."""
        async with self._loading:
            if self._sources_loaded:
                return
            tools = dict(self.tools)
            for source in self.sources:
                for found in await source.load():
                    if found.name in tools:
                        raise InvalidInput(
                            f"agent {self.agent}: two tools are named {found.name!r} "
                            f"(one from {source.name})"
                        )
                    tools[found.name] = found
            self.tools = tools
            self.definitions = [t.definition() for t in tools.values()]
            self._sources_loaded = True

    # -- the turn ---------------------------------------------------------------------------
    async def turn(
        self, ctx: StepContext, *, self_step: type[Step], then: type[Step] | None
    ) -> Outcome:
        if not self._sources_loaded:
            await self.load_sources()
        state = _LoopState.load(ctx, LOOP_KEY, self.deadline_seconds)
        new: list[Message] = []
        if not state.resumed:
            if self.instructions:
                new.append(Message(0, "system", {"role": "system", "content": self.instructions}))
            new.append(Message(0, "user", {"role": "user", "content": self.prompt(ctx.input)}))
        past = state.past_deadline(ctx)
        if past is not None:
            return past
        results = await self._settled_effect_results(ctx, state)
        if isinstance(results, Wait):
            return results
        new += results
        past = state.past_turn_limit(self.max_turns)
        if past is not None:
            return past
        request = await _request(ctx, new)
        span = state.traced(ctx)
        spending = _Spending(ctx, self, request)
        try:
            reply = await complete(
                request,
                tools=self.definitions,
                model=self.model,
                stream=self.stream,
                budget_seconds=self._budget(ctx, state),
                response_format=self._response_format(),
                span_attributes=turn_attributes(ctx, state.turn),
                # With a budget, the output reserved is the output allowed.
                max_tokens=spending.worst_output
                if ctx.budget is not None
                else self.max_output_tokens,
                before_attempt=spending.before_attempt if ctx.budget is not None else None,
            )
        except BudgetExhausted as exhausted:
            spending.spent(spending.attempts, calls=0)
            return state.out_of_budget(ctx, span, exhausted, self_step, new)
        state.add_usage(reply)
        # What the transcript can hold of the reply: the calls it could not hold are refused.
        stored = stored_reply(
            state.turn,
            reply.content,
            reply.tool_calls,
            max_calls=self.max_tool_calls_per_turn,
            max_bytes=DEFAULT_MAX_MESSAGE_BYTES,
        )
        assistant = Message(state.turn, "assistant", stored.body, reply.usage())
        new.append(assistant)
        if reply.tool_calls:
            allowed = ctx.budget.tool_calls_left if ctx.budget is not None else None
            calls = len(reply.tool_calls)
            made = calls if allowed is None else min(calls, allowed)
            if (
                state.invalid_calls + len(stored.refused) > self.max_invalid_calls
                or not stored.fits
            ):
                # A flood of calls: refused before any of them runs.
                spending.spent(reply.attempts, calls=made)
                state.invalid_calls += len(stored.refused)
                return _too_many_calls(self, span, state, calls, stored.fits)
            children: list[Child] = []
            effects = await self._tool_calls(
                ctx, state, assistant, new, allowed, stored.refused, children
            )
            spending.spent(reply.attempts, calls=made)
            if state.invalid_calls > self.max_invalid_calls:
                return _too_many_calls(self, span, state, calls, stored.fits)
            return state.committed(self_step, new, effects, children)
        spending.spent(reply.attempts, calls=0)
        return self._answer(state, reply.content, stored.content_problem, new, self_step, then)

    def _answer(
        self,
        state: _LoopState,
        content: str | None,
        content_problem: str | None,
        new: list[Message],
        self_step: type[Step],
        then: type[Step] | None,
    ) -> Outcome:
        output: JSON = content
        # What is wrong with the answer (now, then), why, and what the model is asked to do.
        unstorable = ("cannot be stored", "could not be stored")
        wrong: tuple[tuple[str, str], str, str] | None = None
        if content_problem is not None:
            wrong = (unstorable, content_problem, "Answer again.")
        elif self.output is not None:
            try:
                output = self.output.dump_python(
                    self.output.validate_json(content or ""), mode="json"
                )
            except pydantic.ValidationError as error:
                schema = json.dumps(self.output.json_schema())
                wrong = (
                    ("does not match the required output", "did not match the required output"),
                    _problems(error),
                    f"Answer again with JSON matching this schema: {schema}",
                )
            else:
                problem = unstorable_json(output, "the answer")
                if problem is not None:
                    wrong = (unstorable, problem, "Answer again without it.")
        if wrong is not None:
            (present, past), problem, ask = wrong
            if state.output_retries >= self.output_retries:
                return state.failed(
                    f"the model's answer {past} after {state.output_retries + 1} tries: {problem}"
                )
            state.output_retries += 1
            asked = f"Your answer {present} ({problem}). {ask}"
            new.append(Message(state.turn, "user", {"role": "user", "content": asked}))
            return state.committed(self_step, new)
        result = state.result(output)
        if then is not None:
            return Next(then, checkpoint={**state.rest, "output": output}, messages=new)
        return Finish(result=result, messages=new)

    async def _tool_calls(
        self,
        ctx: StepContext,
        state: _LoopState,
        assistant: Message,
        new: list[Message],
        allowed: int | None,
        refused: Mapping[int, str],
        children: list[Child],
    ) -> list[Effect]:
        """Run the read-only calls, build the effect calls and (into ``children``) the agent
        calls' child runs; at most ``allowed`` calls (the run's tool-call budget), the rest told
        to the model as refused, as are the ``refused`` (by their place: calls the transcript
        could not hold as they came)."""
        effects: list[Effect] = []
        calls = assistant.body["tool_calls"]
        keys = effect_keys(state.turn, calls)
        for index, call in enumerate(calls):
            if allowed is not None and index >= allowed:
                state.tool_errors += 1
                new.append(_tool_error(state.turn, call["id"], TOOL_BUDGET_EXHAUSTED))
                continue
            call_id, name, arguments = call["id"], call["function"]["name"], call["function"]
            arguments = arguments["arguments"]
            found = self.tools.get(name)
            effectful = not isinstance(found, ReadOnlyTool)
            with tool_span(ctx, state.turn, name, call_id, effect=effectful) as span:
                if index in refused:
                    state.invalid_calls += 1
                    span.set_status(Status(StatusCode.ERROR, "refused"))
                    new.append(_tool_error(state.turn, call_id, refused[index]))
                    continue
                if found is None:
                    state.invalid_calls += 1
                    refusal = next(filter(None, (s.refusal(name) for s in self.sources)), None)
                    span.set_status(
                        Status(StatusCode.ERROR, "denied" if refusal else "unknown tool")
                    )
                    new.append(
                        _tool_error(
                            state.turn,
                            call_id,
                            refusal
                            or f"there is no tool named "
                            f"{name!r}; the tools are: {', '.join(self.tools) or 'none'}",
                        )
                    )
                    continue
                try:
                    parsed = found.parse(arguments)
                    unstorable = arguments_problem(parsed)  # what an effect could not record
                    if unstorable is not None:
                        raise ToolArgumentsInvalid(unstorable)
                except ToolArgumentsInvalid as error:
                    state.invalid_calls += 1
                    span.set_status(Status(StatusCode.ERROR, "invalid arguments"))
                    new.append(
                        _tool_error(state.turn, call_id, f"invalid arguments for {name}: {error}")
                    )
                    continue
                if isinstance(found, ReadOnlyTool):
                    new.append(await self._read_only(ctx, state, found, call_id, parsed))
                    continue
                key = keys[index]
                if isinstance(found, AgentTool):
                    children.append(await found.child(key, parsed))
                    span.set_attribute("orchestrator.child.key", key)
                    state.pending.append({"call_id": call_id, "tool": name, "child_key": key})
                    continue
                assert isinstance(found, EffectTool)
                effect = found.effect(key, await found.payload(parsed), parsed)
                effects.append(effect)
                span.set_attribute("orchestrator.effect.key", key)
                span.set_attribute(
                    "orchestrator.effect.requires_approval", effect.requires_approval
                )
                state.pending.append({"call_id": call_id, "tool": name, "effect_key": key})
        return effects

    async def _read_only(
        self,
        ctx: StepContext,
        state: _LoopState,
        found: ReadOnlyTool,
        call_id: str,
        arguments: dict[str, Any],
    ) -> Message:
        tool_ctx = ToolContext(
            ctx.run_id,
            ctx.fence,
            ctx.attempt,
            state.turn,
            call_id,
            ctx.input,
            ctx.log.bind(tool=found.name, tool_call_id=call_id),
        )
        try:
            with anyio.fail_after(found.timeout):
                result = await found.call(tool_ctx, arguments)
        except TimeoutError:
            state.tool_errors += 1
            return _tool_error(
                state.turn, call_id, f"{found.name} did not answer within {found.timeout:g}s"
            )
        except Exception as error:  # told to the model; the author's bug is logged
            state.tool_errors += 1
            ctx.log.warning("read-only tool raised", tool=found.name, error=repr(error))
            return _tool_error(state.turn, call_id, f"{found.name} failed: {error}")
        return Message(
            state.turn,
            "tool",
            {"role": "tool", "tool_call_id": call_id, "content": json.dumps(result)},
        )

    async def _settled_effect_results(
        self, ctx: StepContext, state: _LoopState
    ) -> list[Message] | Wait:
        """The previous turn's effect calls, as tool messages, once each record has settled; or,
        while some have not, a ``Wait`` for them (after a short grace holding the lease: a fast
        vendor answers in milliseconds, a person or a parked effect takes longer)."""
        calls = await state.calls_ended(ctx, self.settle_grace_seconds)
        if isinstance(calls, Wait):
            return calls
        records, ended = calls
        results: list[Message] = []
        for pending in state.pending:
            found = self.tools[str(pending["tool"])]
            if isinstance(found, AgentTool):
                told = found.told(ended[str(pending["child_key"])])
            else:
                assert isinstance(found, EffectTool)
                told = found.told(records[str(pending["effect_key"])])
            content = {
                "role": "tool",
                "tool_call_id": pending["call_id"],
                "content": json.dumps(told),
            }
            results.append(Message(state.turn, "tool", content))
        state.pending = []
        return results

    def _budget(self, ctx: StepContext, state: _LoopState) -> float | None:
        """How long the model call may take, its retries included: until the loop's deadline,
        if it has one. Not the lease: the heartbeat renews it while the call is in flight, and
        losing it cancels the call; each request is also bounded by the model timeout."""
        left = state.seconds_left(ctx)
        return None if left is None else max(0.0, left)

    def _response_format(self) -> dict[str, Any] | None:
        if self.output is None:
            return None
        return {
            "type": "json_schema",
            "json_schema": {"name": "output", "schema": self.output.json_schema()},
        }


class _LoopState(TurnState):
    """The loop's checkpoint: the turn state with the loop's own counters."""

    KEPT = ("output_retries",)
    SUMMARY = ("input_tokens", "output_tokens", "model_attempts", "invalid_calls", "tool_errors")

    def __init__(self, key: str, rest: dict[str, JSON]) -> None:
        super().__init__(key, rest)
        self.output_retries = 0
        self.invalid_calls = 0
        self.tool_errors = 0
        self.model_attempts = 0

    def add_usage(self, reply: ModelReply) -> None:
        self.input_tokens += reply.input_tokens
        self.output_tokens += reply.output_tokens
        self.model_attempts += len(reply.attempts)


class _Spending(Spending):
    """A turn's model call against the run's budget: the worst case reserved before each
    attempt, what was spent recorded after (an attempt that may have been billed without
    saying what it cost counts its worst case)."""

    UNBILLED = frozenset(("rate_limited", "server_error", "refused"))

    def __init__(self, ctx: StepContext, loop: ToolLoop, request: EncodedMessages) -> None:
        super().__init__(ctx.budget, loop.max_output_tokens)
        # Every token is at least one byte of the request: its size bounds the input tokens.
        # The messages' size is known without encoding them again; the tools' is small.
        self.worst_input = (
            request.array_size + len(json.dumps(loop.definitions).encode())
            if self.budget is not None
            else 0
        )
        self.attempts: tuple[ModelAttempt, ...] = ()

    async def before_attempt(self, model: str, attempts: Sequence[ModelAttempt]) -> None:
        self.attempts = tuple(attempts)
        await self.reserve(model, turns=0 if attempts else 1)

    def spent(self, attempts: Sequence[ModelAttempt], *, calls: int) -> None:
        if self.budget is None:
            return
        input_tokens = output_tokens = 0
        for attempt in attempts:
            if attempt.outcome in self.UNBILLED:
                continue
            if attempt.input_tokens is None and attempt.output_tokens is None:
                input_tokens += self.worst_input  # a timeout or a cut connection
                output_tokens += self.worst_output
            else:
                input_tokens += attempt.input_tokens or 0
                output_tokens += attempt.output_tokens or 0
        self.spend(
            turns=1 if any(a.outcome == "ok" for a in attempts) else 0,
            tool_calls=calls,
            input_tokens=input_tokens,
            output_tokens=output_tokens,
        )


class _Encoded:
    """What one claim encoded of its run's conversation: the committed messages, and the new
    messages of the last request (committed with that turn, unless its commit was refused)."""

    __slots__ = ("committed", "sent")

    def __init__(self) -> None:
        self.committed = EncodedMessages()
        self.sent: list[tuple[dict[str, Any], bytes]] = []
        """Each new message of the last request: its body (the very object) and its bytes."""


_ENCODED: weakref.WeakKeyDictionary[Any, _Encoded] = weakref.WeakKeyDictionary()
"""What each claim encoded, by the execution's transcript (``ctx.transcript``): kept for one
claim of one run, gone with it. A new claim has a transcript of its own, so it starts empty and
encodes what it reads once."""


async def _request(ctx: StepContext, new: Sequence[Message]) -> EncodedMessages:
    """The turn's request: the committed transcript then the turn's ``new`` messages, each
    message encoded once per claim. The messages committed since the last turn are encoded now,
    except those that the last turn sent as new and committed as they were (the same body)."""
    transcript = ctx.transcript
    try:
        kept = _ENCODED.get(transcript)
    except TypeError:  # a view that cannot be weakly referenced: encode it all, keep nothing
        return EncodedMessages.of(
            [m.body for m in await transcript.messages()] + [m.body for m in new]
        )
    if kept is None:
        kept = _ENCODED[transcript] = _Encoded()
    committed = kept.committed
    fresh = await transcript.messages(len(committed))
    if fresh and fresh[0].seq >= 0 and fresh[0].seq != len(committed):
        # Not the messages after those kept (a view numbered otherwise): encode it all again.
        kept = _ENCODED[transcript] = _Encoded()
        committed = kept.committed
        fresh = await transcript.messages()
    sent = kept.sent
    for index, message in enumerate(fresh):
        if index < len(sent) and sent[index][0] is message.body:
            committed.append(sent[index][1])
        else:
            committed.encode((message.body,))
    request = EncodedMessages.of(m.body for m in new)
    kept.sent = [(m.body, part) for m, part in zip(new, request, strict=True)]
    return committed + request


def _too_many_calls(
    loop: ToolLoop, span: trace.Span, state: _LoopState, calls: int, fits: bool
) -> Fail:
    """The run fails: no retry would make the model's calls valid, or storable."""
    span.set_status(Status(StatusCode.ERROR, "too many invalid tool calls"))
    if not fits:
        message = flood_message(calls, DEFAULT_MAX_MESSAGE_BYTES)
    else:
        cap = loop.max_tool_calls_per_turn
        message = (
            f"the model made {state.invalid_calls} invalid tool calls, more than the "
            f"{loop.max_invalid_calls} allowed"
            + (f" ({calls} calls in one reply, at most {cap} run per turn)" if calls > cap else "")
        )
    return state.failed(message)


def _tool_error(turn: int, call_id: str, text: str) -> Message:
    return Message(
        turn,
        "tool",
        {"role": "tool", "tool_call_id": call_id, "content": json.dumps({"error": text})},
    )


def _problems(error: pydantic.ValidationError) -> str:
    return "; ".join(
        f"{'.'.join(str(p) for p in e['loc']) or 'answer'}: {e['msg']}"
        for e in error.errors(include_url=False)[:10]
    )


__all__ = ["LOOP_KEY", "ToolAgent", "effect_keys", "recorded_effect_keys"]
