"""The API agent authors write against: steps, their context, their outcomes, agents.

A step is a small class whose async ``run(ctx)`` reads the run's input and last checkpoint,
does one bounded piece of work (a model call, a tool call), and returns what happens next:

    class Outline(Step):
        async def run(self, ctx: StepContext) -> Outcome:
            outline = await summarise(ctx.input["doc"])
            return Next(Review, checkpoint={"outline": outline})

The framework commits the returned checkpoint in one fenced transaction, only while this worker
still owns the run; if it no longer does, nothing is committed and the step's result is dropped.
A step may therefore run more than once (a crash before its commit), but its committed effects
never repeat. Raise an exception for a failure worth retrying; return ``Fail`` for one that is not
(code deeper down that cannot return it raises ``orchestrator.PermanentFailure``: a model endpoint
that refuses the request does).
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from orchestrator.agent.children import (
    Child,
    ChildOutcome,
    check_children,
    new_children,
    validate_child_key,
)
from orchestrator.agent.output import StepOutput
from orchestrator.db.limits import RunningLimit
from orchestrator.db.signals import validate_signal_name
from orchestrator.effect_model import Effect, validate_effect_key
from orchestrator.errors import InvalidInput, OrchestratorError
from orchestrator.ids import agent_version_text, validate_agent_name
from orchestrator.jsontext import compact, utf8_size
from orchestrator.lazy import install_hint, missing_extra
from orchestrator.models import JSON, StoredWait
from orchestrator.storable import check_json, needs_full_check
from orchestrator.telemetry import RunLogger

if TYPE_CHECKING:
    from orchestrator.agent.budgets import Budget, RunBudget
    from orchestrator.agent.transcript import TranscriptView
    from orchestrator.db.signals import Signal
    from orchestrator.effect_model import EffectRecord
    from orchestrator.models import Message

DEFAULT_MAX_CHECKPOINT_BYTES = 1024 * 1024
_STEP_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_.-]{0,63}$")


@dataclass(slots=True)
class StepContext:
    """What a step may read. Everything here came from the database at claim time.

    Read-only by contract (changing a field changes nothing that is committed). Not a frozen
    dataclass: one is built per step, and a frozen one's constructor costs several times as much
    (docs/performance.md).
    """

    run_id: str
    agent: str
    step: str
    fence: int
    attempt: int
    max_attempts: int
    worker_id: str
    input: JSON
    checkpoint: JSON
    checkpoint_version: int
    lease_until: datetime
    log: RunLogger
    """A structlog logger bound with run.id, run.fence, worker.id and the step name."""
    effects: EffectView
    """Read and await the outcomes of effects that earlier steps of this run requested."""
    transcript: TranscriptView
    """The run's committed conversation (messages earlier steps appended)."""
    database_now: Callable[[], datetime]
    """The database clock now, as this worker estimates it (leases are judged by it)."""
    signals: tuple[Signal, ...] = ()
    """Signals sent to the run and not yet consumed, in the order they came: this step's commit
    consumes them (a step that dies before committing leaves them for its replay)."""
    wait: WaitState | None = None
    """Set on the first step after a ``Wait``: what the run waited for, and whether its time
    ran out before that happened."""
    budget: RunBudget | None = None
    """The run's budget (``ctx.budget.reserve`` before spending, ``.spend`` after); ``None``
    when the agent declares no ``Budget``."""
    output: StepOutput = field(default_factory=StepOutput)
    """The run's live output: ``ctx.output.text(...)``, ``ctx.output.progress(...)``, read by
    clients, the console and ``runs watch`` as the step runs (docs/streaming.md)."""


@dataclass(frozen=True, slots=True)
class WaitState:
    """What a run waited for before this claim woke it."""

    signals: tuple[str, ...]
    effects: tuple[str, ...]
    until: datetime | None
    reason: str
    timed_out: bool
    """The time given by ``until`` passed before a listed signal came or the listed effects
    all settled."""
    children: Mapping[str, ChildOutcome] | None = None
    """The children the run waited for, by key: each one's state, and its result or error once
    it ended (``None``: it waited for none)."""


class EffectView(Protocol):
    async def get(self, effect_key: str) -> EffectRecord: ...

    async def wait(self, effect_key: str, *, within: float) -> EffectRecord:
        """The record once it is confirmed, failed, rejected or parked (or TimeoutError)."""
        ...


class Step:
    """Subclass and implement ``run``. One instance runs one step execution."""

    name: ClassVar[str] = ""
    """The step's name in checkpoints and timelines; defaults to the class name."""
    lease_seconds: ClassVar[float | None] = None
    """A lease for this step other than the worker's default (e.g. a long tool call)."""

    @classmethod
    def step_name(cls) -> str:
        return cls.name or cls.__name__

    @classmethod
    def span(cls, agent: str) -> str:
        """The name of the span each execution of this step is traced under."""
        return f"step {agent}.{cls.step_name()}"

    @classmethod
    def span_attributes(cls, agent: str) -> dict[str, Any]:
        """Attributes of this step's span beyond the run's ids (none by default)."""
        return {}

    async def run(self, ctx: StepContext) -> Outcome:
        raise NotImplementedError(f"{type(self).__name__}.run is not implemented")


@dataclass(frozen=True)
class Next:
    """Continue with ``step`` after committing ``checkpoint`` and requesting ``effects``."""

    step: type[Step] | str
    checkpoint: JSON
    effects: Sequence[Effect] = ()
    messages: Sequence[Message] = ()
    """Appended to the run's transcript in the same commit."""
    children: Sequence[Child] = ()
    """Child runs started by the same commit, under this run's fence (docs/child-runs.md)."""

    def __post_init__(self) -> None:
        check_children(tuple(self.children))

    @property
    def step_name(self) -> str:
        return self.step if isinstance(self.step, str) else self.step.step_name()


@dataclass(frozen=True)
class Finish:
    """The run succeeded with ``result``; ``checkpoint`` (optional) is kept as the last one.

    ``effects`` are recorded with the final commit (and sent afterwards by the dispatcher).
    """

    result: JSON = None
    checkpoint: JSON = None
    effects: Sequence[Effect] = ()
    messages: Sequence[Message] = ()


@dataclass(frozen=True)
class Fail:
    """The run failed for good: no retry. ``details`` is stored with the error."""

    message: str
    details: JSON = None


@dataclass(frozen=True)
class Wait:
    """Commit, give the lease and the worker slot back, and continue with ``then`` once woken.

    The run is woken by a signal named in ``signals``, by every effect in ``effects`` having
    settled (confirmed, failed or rejected: a denied or expired approval is a rejection), or by
    ``until`` passing, whichever comes first; it is then claimed like any run (a new fence) and
    ``ctx.wait`` tells the step what it waited for and whether it timed out. ``effects`` may name
    effects requested earlier (their keys) and hold new ``Effect`` objects, recorded with this
    commit. ``checkpoint`` left ``None`` keeps the current one.
    """

    then: type[Step] | str
    signals: Sequence[str] = ()
    effects: Sequence[Effect | str] = ()
    until: datetime | None = None
    checkpoint: JSON = None
    messages: Sequence[Message] = ()
    reason: str = ""
    """Why, in the timeline; ``budget`` (used by the runtime) waits for a top-up instead."""
    children: Sequence[Child | str] = ()
    """Child runs to wait for: new ``Child`` objects, started by this commit, and keys of
    children spawned earlier. The run is woken once ``need`` of them (all, when ``None``) have
    ended, whichever way; ``ctx.wait.children`` then holds each one's outcome."""
    need: int | None = None

    def __post_init__(self) -> None:
        if (
            isinstance(self.signals, str)
            or isinstance(self.effects, str)
            or isinstance(self.children, str)
        ):
            raise InvalidInput("Wait signals, effects and children are lists (of names and keys)")
        check_children(new_children(self.children))
        keys = self.child_keys
        for key in keys:
            validate_child_key(key)
        if len(set(keys)) != len(keys):
            raise InvalidInput("a Wait names a child twice")
        if self.need is not None and (
            isinstance(self.need, bool) or not 1 <= self.need <= max(len(keys), 1)
        ):
            raise InvalidInput(
                f"a Wait's need is 1 to the number of children it waits for ({len(keys)}), "
                f"not {self.need!r}"
            )
        if self.need is not None and not keys:
            raise InvalidInput("a Wait's need counts children: name the children to wait for")
        for name in self.signals:
            validate_signal_name(name)
        for effect in self.effects:
            if isinstance(effect, str):
                validate_effect_key(effect)
            elif not isinstance(effect, Effect):
                raise InvalidInput(
                    f"Wait effects are Effect objects or effect keys, not {type(effect).__name__}"
                )
        if self.until is not None and (
            not isinstance(self.until, datetime) or self.until.utcoffset() is None
        ):
            raise InvalidInput(
                "Wait until must be a timezone-aware datetime (e.g. ctx.database_now() + "
                "timedelta(hours=1))"
            )
        if len(self.reason) > 200:
            raise InvalidInput("a Wait reason is at most 200 characters")
        if (
            not (self.signals or self.effects or self.until or self.children)
            and self.reason != "budget"
        ):
            raise InvalidInput(
                "a Wait needs something to wake it: signals, effects, children or until (a run "
                "waiting for nothing would wait forever)"
            )

    @property
    def step_name(self) -> str:
        return self.then if isinstance(self.then, str) else self.then.step_name()

    @property
    def effect_keys(self) -> list[str]:
        return [e if isinstance(e, str) else e.key for e in self.effects]

    @property
    def new_effects(self) -> list[Effect]:
        return [e for e in self.effects if not isinstance(e, str)]

    @property
    def child_keys(self) -> list[str]:
        return [c if isinstance(c, str) else c.key for c in self.children]

    def stored(self) -> StoredWait:
        """What the run waits for, as ``runs.wait`` (and the timeline) hold it."""
        return StoredWait(
            self.step_name,
            tuple(dict.fromkeys(self.signals)),
            tuple(dict.fromkeys(self.effect_keys)),
            self.until,
            self.reason,
            tuple(self.child_keys),
            self.need,
        )


Outcome = Next | Finish | Fail | Wait


class UnknownStep(OrchestratorError):
    """A checkpoint names a step the agent does not have (code and data out of step)."""


class UnknownAgent(OrchestratorError):
    """No loaded module defines an agent of that name."""


def encode_json(value: JSON, *, what: str, max_bytes: int) -> str:
    """A checkpoint or result must be JSON and reasonably small: it lives in a database row.

    Returns the compact JSON text, which the commit then sends as it is (encoded once).
    """
    try:
        text = compact(value)
    except (TypeError, ValueError) as error:
        check_json(value, what)  # names the bad value and where it is
        raise InvalidInput(f"{what} is not JSON-serialisable: {error}") from None
    if needs_full_check(text):
        check_json(value, what)
    size = utf8_size(text)
    if size > max_bytes:
        raise InvalidInput(f"{what} is {size:,} bytes, over the {max_bytes:,}-byte limit")
    return text


def validate_json(value: JSON, *, what: str, max_bytes: int) -> None:
    """``encode_json`` for callers that only need the check."""
    encode_json(value, what=what, max_bytes=max_bytes)


class Agent:
    """A named set of steps with a first step."""

    def __init__(
        self,
        name: str,
        *,
        first: type[Step],
        steps: Iterable[type[Step]] = (),
        description: str = "",
        budget: Budget | None = None,
        limits: Iterable[RunningLimit] = (),
        version: int | str = 1,
        upgrades: Mapping[int | str, Callable[[JSON], JSON]] | None = None,
        keep_checkpoints: bool = False,
    ) -> None:
        self.name = validate_agent_name(name)
        self.keep_checkpoints = bool(keep_checkpoints)
        """Keep each step's checkpoint, so that a run can be forked from any of them
        (docs/child-runs.md); otherwise a fork starts from the start."""
        self.version = agent_version_text(version, f"agent {name}'s version")
        """The version of this code (docs/upgrades.md): a run's checkpoint is written under it,
        and only a worker serving it (or upgrading from it) claims the run."""
        self.upgrades: dict[str, Callable[[JSON], JSON]] = {}
        """From each older version, the function that turns a checkpoint written under it into
        one this code reads; applied once, before the first step of a claim."""
        for older, upgrade in (upgrades or {}).items():
            older_text = agent_version_text(older, f"agent {name}: an upgrade's version")
            if older_text == self.version:
                raise InvalidInput(
                    f"agent {name}: an upgrade from version {older_text} is its own version"
                )
            if not callable(upgrade):
                raise InvalidInput(
                    f"agent {name}: the upgrade from version {older_text} is not a function"
                )
            self.upgrades[older_text] = upgrade
        self.first = first
        self.description = description
        self.budget = budget
        """Each run's limits (see ``orchestrator.agent.budgets``); ``None``: no budget."""
        self.limits = tuple(limits)
        """How many of its runs may run at once, in all or per concurrency key
        (docs/flow-control.md): written to the database by each ``serve`` that runs it."""
        for limit in self.limits:
            if not isinstance(limit, RunningLimit):
                raise InvalidInput(
                    f"agent {name}: limits are RunningLimit objects, not {type(limit).__name__}"
                )
        if len({(limit.keys, limit.per) for limit in self.limits}) < len(self.limits):
            raise InvalidInput(f"agent {name}: two limits have the same keys and per")
        self.steps: dict[str, type[Step]] = {}
        for step in (first, *steps):
            step_name = step.step_name()
            if not _STEP_NAME.fullmatch(step_name):
                raise InvalidInput(f"agent {name}: malformed step name {step_name!r}")
            known = self.steps.get(step_name)
            if known is not None and known is not step:
                raise InvalidInput(f"agent {name}: two steps are named {step_name!r}")
            if step.lease_seconds is not None and step.lease_seconds <= 0:
                raise InvalidInput(f"agent {name}: step {step_name} has a non-positive lease")
            self.steps[step_name] = step

    def step(self, name: str | None) -> type[Step]:
        if name is None:
            return self.first
        try:
            return self.steps[name]
        except KeyError:
            raise UnknownStep(
                f"agent {self.name} has no step {name!r} (it has {', '.join(self.steps)}); "
                "was a step renamed while runs were checkpointed at it?"
            ) from None

    def __repr__(self) -> str:
        return f"Agent({self.name!r}, steps={list(self.steps)})"


class AgentRegistry:
    """The agents a worker serves, by name."""

    def __init__(self, agents: Iterable[Agent] = ()) -> None:
        self._agents: dict[str, Agent] = {}
        for agent in agents:
            self.add(agent)

    def add(self, agent: Agent) -> None:
        existing = self._agents.get(agent.name)
        if existing is not None and existing is not agent:
            raise InvalidInput(f"two different agents are named {agent.name!r}")
        self._agents[agent.name] = agent

    def get(self, name: str) -> Agent:
        try:
            return self._agents[name]
        except KeyError:
            raise UnknownAgent(
                f"unknown agent {name!r}; this worker serves: {', '.join(self.names) or 'none'}"
            ) from None

    @property
    def names(self) -> list[str]:
        return sorted(self._agents)

    @property
    def claimable(self) -> dict[str, list[str]]:
        """Per agent, the versions a run's checkpoint may be written under for this worker to
        claim it: its own, and those it declares an upgrade from."""
        return {
            name: [agent.version, *sorted(agent.upgrades)]
            for name, agent in sorted(self._agents.items())
        }

    @classmethod
    def from_modules(cls, modules: Sequence[str]) -> AgentRegistry:
        """Import each module and collect the ``Agent`` objects it defines at top level."""
        registry = cls()
        for module_name in modules:
            try:
                module = importlib.import_module(module_name)
            except ImportError as error:
                missing = missing_extra(error)
                if missing is not None:  # the module is there; an extra it needs is not
                    raise InvalidInput(
                        f"cannot import agent module {module_name!r}: it imports {missing[0]}, "
                        f"which is not installed: {install_hint(missing[1])}"
                    ) from None
                raise InvalidInput(
                    f"cannot import agent module {module_name!r}: {error}. Pass a module path "
                    "importable from here, e.g. orchestrator.agents.sleepy"
                ) from None
            found = [value for value in vars(module).values() if isinstance(value, Agent)]
            if not found:
                raise InvalidInput(f"module {module_name!r} defines no Agent at its top level")
            for agent in found:
                registry.add(agent)
        return registry
