"""From a step's outcome to what its commit writes, in one place: the outcome is checked and its
JSON encoded once (``validate``), then turned into a ``StepCommit`` (``Next``, ``Wait``) or a
``RunFinish`` (``Finish``, ``Fail``) for the group committer. Pure: the execution decides when
to commit, this module only what."""

from __future__ import annotations

from collections.abc import Container, Mapping, Sequence
from typing import Any, NamedTuple

from orchestrator.agent.budgets import RunBudget
from orchestrator.agent.children import Child, new_children
from orchestrator.agent.steps import Fail, Finish, Next, Outcome, Wait, encode_json, validate_json
from orchestrator.db.budgets import Spend
from orchestrator.db.signals import Signal
from orchestrator.db.store import Park, RunFinish, StepCommit
from orchestrator.effect_model import Effect
from orchestrator.ids import new_run_id
from orchestrator.models import JSON, ROLES, Lease, Message, RunState


class Extras(NamedTuple):
    """What a step's commit settles besides its checkpoint: the signals it was given (their
    seqs) and what it spent of the run's budget."""

    signal_seqs: tuple[int, ...]
    spend: Spend | None


NOTHING_ELSE = Extras((), None)


def step_extras(signals: Sequence[Signal], budget: RunBudget | None) -> Extras:
    """What a step given ``signals`` settles in its commit (``NOTHING_ELSE``, built once, for
    the usual step: no signals, no budget)."""
    if not signals and budget is None:
        return NOTHING_ELSE
    return Extras(
        tuple(signal.seq for signal in signals), None if budget is None else budget.settlement()
    )


class Encoded(NamedTuple):
    """A step outcome's JSON as validated: sent to the database as it is."""

    result: str | None
    checkpoint: str | None


class Limits(NamedTuple):
    """How large a step's JSON may be, in bytes."""

    checkpoint: int
    """A checkpoint, a result, an effect's payload, failure details."""
    message: int
    """A transcript message's body or usage."""


def validate(outcome: Outcome, agent: str, steps: Container[str], limits: Limits) -> Encoded:
    """Check the step's outcome; returns its JSON, encoded once here for the commit."""
    if isinstance(outcome, Finish):
        _check_effects(outcome.effects, limits.checkpoint)
        _check_messages(outcome.messages, limits.message)
        return Encoded(
            _encoded(outcome.result, "result", limits.checkpoint),
            _encoded(outcome.checkpoint, "checkpoint", limits.checkpoint),
        )
    if isinstance(outcome, Next | Wait):
        kind = "Next" if isinstance(outcome, Next) else "Wait"
        _check_effects(
            outcome.effects if isinstance(outcome, Next) else outcome.new_effects,
            limits.checkpoint,
        )
        _check_messages(outcome.messages, limits.message)
        for child in started_children(outcome):  # encoded by the commit: refused here, before it
            validate_json(
                child.input, what=f"child {child.key}'s input", max_bytes=limits.checkpoint
            )
        if outcome.step_name not in steps:
            raise LookupError(
                f"{kind} names step {outcome.step_name!r}, which agent {agent} does not have"
            )
        return Encoded(None, _encoded(outcome.checkpoint, "checkpoint", limits.checkpoint))
    if isinstance(outcome, Fail):
        _encoded(outcome.details, "failure details", limits.checkpoint)
        return Encoded(None, None)
    raise TypeError(f"a step must return Next, Finish, Fail or Wait, not {type(outcome).__name__}")


def step_commit(
    outcome: Next | Wait,
    lease: Lease,
    version: int,
    encoded: Encoded,
    messages: Sequence[Message],
    extras: Extras,
    *,
    current_checkpoint: JSON,
    claimed_version: int,
    agent_version: str | None = None,
    traceparent: str | None = None,
    budget_limits: Mapping[str, JSON] | None = None,
    keep_checkpoint: bool = False,
) -> StepCommit:
    """The commit of a step that goes on: to its next step, or parked until what ``Wait``
    names happens (a ``Wait`` without a checkpoint keeps ``current_checkpoint``)."""
    park: Park | None = None
    if isinstance(outcome, Next):
        checkpoint, effects = outcome.checkpoint, tuple(outcome.effects)
    else:
        checkpoint = current_checkpoint if encoded.checkpoint is None else outcome.checkpoint
        effects = tuple(outcome.new_effects)
        # Progress since the claim: a step committed before this one, or this one was given
        # signals (a wait found already satisfied is then no spin).
        progressed = version != claimed_version or bool(extras.signal_seqs)
        park = Park(outcome.stored().as_json(), outcome.until, progressed=progressed)
    return StepCommit(
        lease,
        version,
        outcome.step_name,
        checkpoint,
        effects=effects,
        checkpoint_text=encoded.checkpoint,
        messages=messages,
        park=park,
        signal_seqs=extras.signal_seqs,
        spend=extras.spend,
        agent_version=agent_version,
        children=spawns(started_children(outcome), traceparent),
        budget_limits=budget_limits,
        keep_checkpoint=keep_checkpoint,
    )


def started_children(outcome: Next | Wait) -> Sequence[Child]:
    """The child runs a step's commit starts (a ``Wait`` may also name earlier ones by key)."""
    return outcome.children if isinstance(outcome, Next) else new_children(outcome.children)


def spawns(children: Sequence[Child], traceparent: str | None) -> tuple[dict[str, Any], ...]:
    """The children a commit starts, each with a new run id (a child whose key its parent
    spawned before keeps the run it has: the database returns that one)."""
    return tuple(child.spawn(new_run_id(), traceparent) for child in children)


def run_finish(
    outcome: Finish | Fail,
    lease: Lease,
    version: int,
    encoded: Encoded,
    messages: Sequence[Message],
    extras: Extras,
    agent_version: str | None = None,
) -> RunFinish:
    """The run's final commit: succeeded with ``Finish``'s result, or failed with ``Fail``'s
    (which keeps the checkpoint, and so the version it was written under)."""
    if isinstance(outcome, Finish):
        return RunFinish(
            lease,
            version,
            RunState.SUCCEEDED,
            outcome.result,
            None,
            outcome.checkpoint,
            effects=tuple(outcome.effects),
            result_text=encoded.result,
            checkpoint_text=encoded.checkpoint,
            messages=messages,
            signal_seqs=extras.signal_seqs,
            spend=extras.spend,
            agent_version=agent_version,
        )
    failure: dict[str, JSON] = {"type": "Fail", "message": outcome.message}
    if outcome.details is not None:
        failure["details"] = outcome.details
    return RunFinish(
        lease,
        version,
        RunState.FAILED,
        None,
        failure,
        None,
        signal_seqs=extras.signal_seqs,
        spend=extras.spend,
        agent_version=agent_version,  # whose code decided (checked against a cutover)
    )


def _encoded(value: JSON, what: str, limit: int) -> str | None:
    # None stays SQL NULL (for a final checkpoint: keep the last one).
    return None if value is None else encode_json(value, what=what, max_bytes=limit)


def _check_effects(effects: Sequence[Effect], limit: int) -> None:
    for effect in effects:
        if not isinstance(effect, Effect):
            raise TypeError(f"effects must be Effect objects, not {type(effect).__name__}")
        validate_json(effect.payload, what=f"effect {effect.key} payload", max_bytes=limit)


def _check_messages(messages: Sequence[Message], limit: int) -> None:
    for message in messages:
        if not isinstance(message, Message) or message.role not in ROLES:
            raise TypeError("messages must be Message objects with a role of " + "/".join(ROLES))
        what = f"the {message.role} message of turn {message.turn}"
        validate_json(message.body, what=what, max_bytes=limit)
        if message.usage is not None:
            validate_json(message.usage, what=f"{what}'s usage", max_bytes=limit)
