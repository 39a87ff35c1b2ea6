"""What every fenced turn shares, whichever loop asks the model (``ToolAgent``'s own, or the
Pydantic AI integration's).

A turn is one step: the previous turn's effect calls are settled first, then the model is asked
once, then one fenced commit holds the turn's messages, its effect records and a small
checkpoint. What makes that safe to replay is the same for every loop, so it lives here once:

- effect keys: a call's key comes from its tool's name and its arguments
  (``call_effect_keys``), never from the model's call id;
- the effect spec (``EffectSpec``): the kind and policy of a call's effect, whether a person
  must approve it, and what the model is told of its settled record;
- settling: the previous turn's records, waited for briefly with the lease, then without it;
- the commit (``turn_committed``): a turn that needs a person's approval waits in that commit;
- the turn state (``TurnState``): the loop's entry in the checkpoint, with its deadline;
- spending (``Spending``): each model request's worst case reserved against ``ctx.budget``
  before it is sent, what it spent recorded after.
"""

from __future__ import annotations

import collections
import hashlib
import json
import re
from collections.abc import Awaitable, Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from datetime import datetime, timedelta
from decimal import Decimal
from typing import TYPE_CHECKING, Any, ClassVar, Self

import anyio
from opentelemetry import trace
from pydantic_core import to_jsonable_python

from orchestrator.agent.steps import EffectView, Fail, Next, Outcome, Step, StepContext, Wait
from orchestrator.effect_model import (
    MAX_APPROVAL_SECONDS,
    Effect,
    EffectPolicy,
    EffectRecord,
    EffectStatus,
    validate_effect_key,
)
from orchestrator.errors import InvalidInput
from orchestrator.models import JSON, Message
from orchestrator.telemetry import ATTEMPT, LEASE_UNTIL, RUN_FENCE, RUN_ID, WORKER_ID, start_span

if TYPE_CHECKING:
    from orchestrator.agent.budgets import BudgetExhausted, RunBudget
    from orchestrator.agent.children import Child, ChildOutcome

DEFAULT_SETTLE_GRACE_SECONDS = 2.0
"""How long a turn waits, holding its lease, for the previous turn's effects to settle before
it parks the run (``Wait``) until they do."""
DEFAULT_MAX_TOOL_CALLS_PER_TURN = 64
"""Calls of one model reply that are run; the rest are refused (each an invalid call)."""
DEFAULT_WORST_OUTPUT_TOKENS = 4096
"""The output reserved per model request when the agent sets no ``max_output_tokens``."""
TOOL_BUDGET_EXHAUSTED = "not run: the run's tool-call budget is exhausted"
"""What the model is told of a call past the run's tool-call budget."""
DEADLINE_PASSED = "the agent's deadline passed"
"""Why a run fails once its loop's ``deadline_seconds`` are up, whatever it was doing."""
_CALL_ID = re.compile(r"[^A-Za-z0-9_.-]")


def default_prompt(run_input: JSON) -> str:
    """The first user message: the input's ``prompt`` or ``message``, else the input as JSON."""
    if isinstance(run_input, dict):
        for key in ("prompt", "message"):
            if isinstance(run_input.get(key), str):
                return str(run_input[key])
    return json.dumps(run_input, ensure_ascii=False)


# -- effect keys ------------------------------------------------------------------------------
def call_effect_keys(turn: int, calls: Sequence[tuple[str, object]]) -> list[str]:
    """The effect key of each call (its tool's name, its arguments) of one model reply:
    ``call:TURN:TOOL:DIGEST`` (``:N`` on the N-th identical call), the digest of the arguments
    as canonical JSON. Not the model's call id: a turn replayed after a failover took its commit
    back gets new call ids, and the same action must meet the record (and the vendor's lookup)
    of the send it may already have had."""
    keys = []
    seen: collections.Counter[str] = collections.Counter()
    for tool_name, arguments in calls:
        name = _CALL_ID.sub("_", tool_name)[:64] or "_"
        canonical = _canonical_arguments(arguments)
        # surrogatepass: a lone surrogate the model sent must not stop its turn from being keyed
        # (that call is refused); every other text encodes as UTF-8 does.
        digest = hashlib.sha256(
            f"{name}\0{canonical}".encode("utf-8", "surrogatepass")
        ).hexdigest()[:20]
        key = f"call:{turn}:{name}:{digest}"
        seen[key] += 1
        keys.append(key if seen[key] == 1 else f"{key}:{seen[key]}")
    return keys


def legacy_call_key(turn: int, call_id: str) -> str:
    """The key earlier versions gave a call's effect (from the model's call id): runs recorded
    by them are still shown with their keys."""
    return f"call:{turn}:{_CALL_ID.sub('_', call_id)[:150]}"


def _canonical_arguments(arguments: object) -> str:
    """Arguments as the model sent them (a JSON text), in one spelling: keys sorted, no spaces."""
    if isinstance(arguments, str):
        text = arguments
        try:
            arguments = json.loads(text)
        except ValueError:
            return text  # never an effect call's (they must parse), but keyed all the same
    return json.dumps(arguments, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


# -- the effect spec --------------------------------------------------------------------------
def denial(record: EffectRecord) -> JSON | None:
    """Why a person (or expiry) denied the effect, or ``None`` when none did."""
    if record.status is EffectStatus.REJECTED and record.decided_by is not None:
        message = record.error.get("message") if isinstance(record.error, dict) else None
        return message or "denied by reviewer"
    return None


def default_result(record: EffectRecord) -> JSON:
    """What the model is told of a settled effect: its status, the vendor's id and answer; for
    one a person (or expiry) denied, "denied by reviewer: NOTE"."""
    denied = denial(record)
    if denied is not None:
        return {"status": "denied", "error": denied}
    return {
        "status": record.status.value,
        "external_id": record.external_id,
        "result": record.result,
        "error": record.error,
    }


def check_effect_spec(
    where: str, kind: str, approve: Callable[..., bool] | bool, approval_seconds: float
) -> None:
    """Refuse a spec no effect could be made of, in the words of ``where`` (who declared it)."""
    validate_effect_key(kind)  # kinds follow the effect key rule
    if not (isinstance(approve, bool) or callable(approve)):
        raise InvalidInput(f"{where} approve= takes True, or a predicate on the call's arguments")
    if not 0 < approval_seconds <= MAX_APPROVAL_SECONDS:
        raise InvalidInput(f"{where} approval_seconds must be above 0, at most a year")


class EffectSpec:
    """How a tool's call acts on the world: as a fenced effect of ``kind`` (a vendor in the
    dispatcher's configuration), sent once by the dispatcher after the turn commits. One rule
    for every loop: whether a call waits for a person, and what the model is told of it."""

    kind: str
    policy: EffectPolicy
    approve: Callable[..., bool] | bool
    approval_seconds: float
    result: Callable[[EffectRecord], JSON] | None

    def needs_approval(self, arguments: Mapping[str, Any]) -> bool:
        """Whether this call must wait for a person (the ``approve`` predicate on its arguments;
        a predicate that raises asks for approval: when unsure, a person decides)."""
        if isinstance(self.approve, bool):
            return self.approve
        try:
            return bool(self.approve(**arguments))
        except Exception:
            return True

    def effect(self, key: str, payload: JSON, arguments: Mapping[str, Any]) -> Effect:
        return Effect(
            key,
            self.kind,
            payload,
            self.policy,
            requires_approval=self.needs_approval(arguments),
            approval_seconds=self.approval_seconds,
        )

    def told(self, record: EffectRecord) -> JSON:
        """What the model is told once the effect has settled."""
        told: JSON = to_jsonable_python((self.result or default_result)(record))
        return told


# -- settling ---------------------------------------------------------------------------------
SETTLED_FOR_THE_MODEL = frozenset(
    (EffectStatus.CONFIRMED, EffectStatus.FAILED, EffectStatus.REJECTED)
)
"""Outcomes the model may be told; uncertain and parked ones are waited out, never reported."""


PERSON_DECIDES = frozenset((EffectStatus.AWAITING_APPROVAL, EffectStatus.PARKED))
"""Outcomes a person settles: never waited for while holding a lease."""


async def settled_records(
    effects: EffectView, keys: Sequence[str], grace: float
) -> tuple[dict[str, EffectRecord], list[str]]:
    """The records of a turn's effectful calls and the keys still unsettled for the model,
    after waiting up to ``grace`` seconds (holding the lease) for calls on their way to a
    vendor; none is waited for while one of them waits for a person."""
    records = {key: await effects.get(key) for key in keys}
    unsettled = [k for k in keys if records[k].status not in SETTLED_FOR_THE_MODEL]
    if unsettled and grace > 0 and not any(records[k].status in PERSON_DECIDES for k in unsettled):
        with anyio.move_on_after(grace):
            for key in unsettled:
                records[key] = await effects.wait(key, within=grace)
        for key in unsettled:
            if records[key].status not in SETTLED_FOR_THE_MODEL:
                records[key] = await effects.get(key)
        unsettled = [k for k in keys if records[k].status not in SETTLED_FOR_THE_MODEL]
    return records, unsettled


# -- the commit -------------------------------------------------------------------------------
def turn_committed(
    step: type[Step] | str,
    *,
    checkpoint: JSON,
    effects: Sequence[Effect],
    messages: Sequence[Message],
    deadline: datetime | None,
    children: Sequence[Child] = (),
) -> Next | Wait:
    """A turn that made effectful calls: committed with them, and waiting without the lease
    when one needs a person's approval, or for the child runs it started (in the same
    commit)."""
    if children:
        return Wait(
            step,
            children=children,
            effects=effects,
            until=deadline,
            checkpoint=checkpoint,
            messages=messages,
            reason="children",
        )
    if any(effect.requires_approval for effect in effects):
        return Wait(
            step,
            effects=effects,
            until=deadline,
            checkpoint=checkpoint,
            messages=messages,
            reason="approval",
        )
    return Next(step, checkpoint=checkpoint, effects=effects, messages=messages)


# -- the turn state ---------------------------------------------------------------------------
class TurnState:
    """A loop's entry in the checkpoint (under ``key``; the other keys, ``rest``, belong to the
    step graph): small and bounded, whatever the conversation's length, so that a replaced
    worker resumes where the last commit left the loop."""

    KEPT: ClassVar[tuple[str, ...]] = ()
    """The loop's own counters, kept before the usage in the checkpoint."""
    SUMMARY: ClassVar[tuple[str, ...]] = ("input_tokens", "output_tokens")
    """The counters a run's result and failure details tell, in their order."""

    def __init__(self, key: str, rest: dict[str, JSON]) -> None:
        self.key = key
        self.rest = rest
        self.resumed = False
        """Whether the checkpoint held the loop's state: a turn of it committed before."""
        self.turn = 0
        self.deadline: datetime | None = None
        self.pending: list[dict[str, JSON]] = []
        """The previous turn's effect calls, told to the model once their records settle."""
        self.input_tokens = 0
        self.output_tokens = 0

    @classmethod
    def load(cls, ctx: StepContext, key: str, deadline_seconds: float | None) -> Self:
        rest = dict(ctx.checkpoint) if isinstance(ctx.checkpoint, dict) else {}
        stored = rest.pop(key, None)
        state = cls(key, rest)
        if isinstance(stored, dict):
            for name in ("turn", *cls.KEPT, *cls.SUMMARY):
                setattr(state, name, int(stored.get(name, 0)))
            state.resumed = True
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

    def summary(self) -> dict[str, JSON]:
        return {name: getattr(self, name) for name in self.SUMMARY}

    def dump(self) -> dict[str, JSON]:
        return {
            "turn": self.turn,
            "pending": list(self.pending),
            "deadline": None if self.deadline is None else self.deadline.isoformat(),
            **{name: getattr(self, name) for name in self.KEPT},
            **self.summary(),
        }

    def result(self, output: JSON) -> dict[str, JSON]:
        """The run's result once the model has answered: the answer, the usage, the turns."""
        return {"output": output, **self.summary(), "turns": self.turn + 1}

    def checkpoint(self) -> dict[str, JSON]:
        return {**self.rest, self.key: self.dump()}

    def failed(self, message: str) -> Fail:
        return Fail(message, details=self.summary())

    def past_deadline(self, ctx: StepContext) -> Fail | None:
        left = self.seconds_left(ctx)
        if left is not None and left <= 0:
            return self.failed(DEADLINE_PASSED)
        return None

    def past_turn_limit(self, max_turns: int) -> Fail | None:
        if self.turn >= max_turns:
            return self.failed(f"the turn limit of {max_turns} was reached")
        return None

    def traced(self, ctx: StepContext) -> trace.Span:
        """The turn's own span (see ``turn_step``), marked with the run and the turn."""
        span = trace.get_current_span()
        span.set_attribute("gen_ai.conversation.id", ctx.run_id)
        span.set_attribute("orchestrator.turn", self.turn)
        return span

    async def settle(self, ctx: StepContext, grace: float) -> dict[str, EffectRecord] | Wait:
        """The records of the previous turn's effect calls once each has settled; while some
        have not, a ``Wait`` for them (after a short grace holding the lease: a fast vendor
        answers in milliseconds, a person or a parked effect takes longer)."""
        keys = [str(pending["effect_key"]) for pending in self.pending if "effect_key" in pending]
        if not keys:
            return {}
        left = self.seconds_left(ctx)
        if left is not None:
            grace = min(grace, left)
        records, unsettled = await settled_records(ctx.effects, keys, grace)
        if unsettled:
            return Wait(ctx.step, effects=unsettled, until=self.deadline, reason="effects")
        return records

    def committed(
        self,
        step: type[Step],
        messages: Sequence[Message],
        effects: Sequence[Effect] = (),
        children: Sequence[Child] = (),
    ) -> Next | Wait:
        """The turn done: the next one continues from this commit."""
        self.turn += 1
        return turn_committed(
            step,
            checkpoint=self.checkpoint(),
            effects=effects,
            messages=messages,
            deadline=self.deadline,
            children=children,
        )

    async def calls_ended(
        self, ctx: StepContext, grace: float
    ) -> tuple[dict[str, EffectRecord], dict[str, ChildOutcome | None]] | Wait:
        """The previous turn's calls once each has ended: the effects' settled records and
        the child runs' outcomes; while some have not, a ``Wait`` for them."""
        records = await self.settle(ctx, grace)
        if isinstance(records, Wait):
            return records
        ended = self.children_waited(ctx)
        if isinstance(ended, Wait):
            return ended
        return records, ended

    def children_waited(self, ctx: StepContext) -> dict[str, ChildOutcome | None] | Wait:
        """The previous turn's child runs (agent tool calls) once each has ended; while some
        have not, a ``Wait`` for them (they run for minutes: no grace holding the lease)."""
        keys = [str(pending["child_key"]) for pending in self.pending if "child_key" in pending]
        if not keys:
            return {}
        known = ctx.wait.children if ctx.wait is not None and ctx.wait.children else {}
        if all(key in known and known[key].ended for key in keys):
            return {key: known[key] for key in keys}
        if ctx.wait is not None and ctx.wait.timed_out:
            return {key: known.get(key) for key in keys}  # the model is told how they stand
        return Wait(ctx.step, children=keys, until=self.deadline, reason="children")

    def out_of_budget(
        self,
        ctx: StepContext,
        span: trace.Span,
        exhausted: BudgetExhausted,
        step: type[Step],
        messages: Sequence[Message] = (),
    ) -> Fail | Wait:
        """The run's budget refused the turn's model request: the run fails, or waits for a
        top-up and runs this turn again (its ``messages`` so far committed)."""
        span.set_attribute("orchestrator.budget.exhausted", exhausted.dimension)
        if ctx.budget is not None and ctx.budget.limits.on_exhausted == "fail":
            return self.failed(str(exhausted))
        return Wait(
            step,
            reason="budget",
            until=self.deadline,
            checkpoint=self.checkpoint(),
            messages=messages,
        )


# -- spending ---------------------------------------------------------------------------------
class Spending:
    """A turn's model requests against the run's budget: the worst case reserved before each,
    what was spent recorded after, at the model's price."""

    def __init__(self, budget: RunBudget | None, max_output_tokens: int | None) -> None:
        self.budget = budget
        self.worst_input = 0
        """At most the request's input tokens: the loop sets it from the request's size."""
        self.worst_output = max_output_tokens or DEFAULT_WORST_OUTPUT_TOKENS
        self.model = ""

    def cost(self, input_tokens: int, output_tokens: int) -> Decimal:
        assert self.budget is not None
        if self.budget.limits.cost_usd is None and self.model not in self.budget.prices.models:
            return Decimal(0)  # no cost limit and no price: nothing to count it against
        return self.budget.prices.cost(self.model, input_tokens, output_tokens)

    async def reserve(self, model: str, *, turns: int) -> None:
        assert self.budget is not None
        self.model = model
        await self.budget.reserve(
            turns=turns,
            input_tokens=self.worst_input,
            output_tokens=self.worst_output,
            cost_usd=self.cost(self.worst_input, self.worst_output),
        )

    def spend(
        self, *, turns: int, input_tokens: int, output_tokens: int, tool_calls: int = 0
    ) -> None:
        assert self.budget is not None
        self.budget.spend(
            turns=turns,
            tool_calls=tool_calls,
            input_tokens=input_tokens,
            output_tokens=output_tokens,
            cost_usd=self.cost(input_tokens, output_tokens) if self.model else Decimal(0),
        )


# -- telemetry --------------------------------------------------------------------------------
def turn_attributes(ctx: StepContext, turn: int) -> dict[str, str | int]:
    """What every span of a turn carries: the run, its fence and lease, the turn."""
    return {
        RUN_ID: ctx.run_id,
        RUN_FENCE: ctx.fence,
        WORKER_ID: ctx.worker_id,
        ATTEMPT: ctx.attempt,
        LEASE_UNTIL: ctx.lease_until.isoformat(),
        "orchestrator.turn": turn,
    }


def tool_span(
    ctx: StepContext,
    turn: int,
    name: str,
    call_id: str,
    *,
    effect: bool,
    attributes: Mapping[str, Any] | None = None,
) -> AbstractContextManager[trace.Span]:
    """The GenAI ``execute_tool`` span of one call (an effect call's marks the key it became)."""
    return start_span(
        f"execute_tool {name}",
        attributes={
            "gen_ai.operation.name": "execute_tool",
            "gen_ai.tool.name": name,
            "gen_ai.tool.call.id": call_id,
            "gen_ai.tool.type": "extension" if effect else "function",
            **(attributes or {}),
            **turn_attributes(ctx, turn),
        },
    )


def turn_step(
    agent: str,
    name: str,
    lease_seconds: float | None,
    run: Callable[[StepContext, type[Step]], Awaitable[Outcome]],
) -> type[Step]:
    """The step class of a loop's turn, traced as the GenAI ``invoke_agent`` span of ``agent``
    (the loop's, also when it is a stage of another agent); ``run`` gets the step class too, to
    continue with itself."""

    class Turn(Step):
        """One model turn of the loop, traced as the GenAI ``invoke_agent`` span."""

        @classmethod
        def span(cls, _agent: str) -> str:
            return f"invoke_agent {agent}"

        @classmethod
        def span_attributes(cls, _agent: str) -> dict[str, Any]:
            return {"gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": agent}

        async def run(self, ctx: StepContext) -> Outcome:
            return await run(ctx, type(self))

    Turn.name = name
    Turn.lease_seconds = lease_seconds
    Turn.__qualname__ = f"{agent}.{name}"
    return Turn


__all__ = [
    "DEADLINE_PASSED",
    "DEFAULT_MAX_TOOL_CALLS_PER_TURN",
    "DEFAULT_SETTLE_GRACE_SECONDS",
    "DEFAULT_WORST_OUTPUT_TOKENS",
    "PERSON_DECIDES",
    "SETTLED_FOR_THE_MODEL",
    "TOOL_BUDGET_EXHAUSTED",
    "EffectSpec",
    "Spending",
    "TurnState",
    "call_effect_keys",
    "check_effect_spec",
    "default_prompt",
    "default_result",
    "denial",
    "legacy_call_key",
    "settled_records",
    "tool_span",
    "turn_attributes",
    "turn_committed",
    "turn_step",
]
