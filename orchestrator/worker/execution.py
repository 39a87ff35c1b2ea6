"""One claimed run's scope: the step task, guarded by the run's heartbeat.

The scope is the run's own task: its steps, then a bounded, shielded cleanup. The run's
``LeaseHandle`` (see ``heartbeat``) cancels the steps the moment ownership is lost or can no
longer be proven: a refused renewal, a cancel, a refused commit, or the local deadline passing
without a confirmed renewal. The step then stops wherever it is awaiting (a model or tool call
in flight is cancelled) and nothing more is committed. Every commit is fenced in the database
as well, so even a step that ignored cancellation could not commit after losing its lease.

A run's last commit (finish or fail) is the one thing its task does not wait for: the task
hands it to the group committer and ends, and the committer's answer settles the run
(``RunScope._settle``): finished, or lost and then the same bounded cleanup, in a task of its
own. Nothing of the run is left to cancel by then (its steps are over), and the database's
answer, not the local view, decides how the run ended.
"""

from __future__ import annotations

import asyncio
import functools
import time
import traceback
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, TypeVar

import anyio
from opentelemetry.trace import INVALID_SPAN, Span, Status, StatusCode

from orchestrator.db.deadlines import DATABASE_ERRORS, pooled
from orchestrator.db.store import RunFinish, RunStore, StepCommit
from orchestrator.effects.model import Effect
from orchestrator.models import JSON, ClaimedRun, RunState
from orchestrator.steps import (
    DEFAULT_MAX_CHECKPOINT_BYTES,
    AgentRegistry,
    EffectView,
    Fail,
    Finish,
    Next,
    Outcome,
    StepContext,
    encode_json,
    validate_json,
)
from orchestrator.telemetry import (
    CHECKPOINT_VERSION,
    DISPOSITION,
    LEASE_UNTIL,
    NO_SPAN,
    RUN_FENCE,
    RUN_ID,
    WORKER_ID,
    Metrics,
    RunLogger,
    as_current,
    debug_enabled,
    open_span,
    start_span,
    tracing_enabled,
)
from orchestrator.worker.group_commit import CommitOutcomeUnknown, EffectRefused, GroupCommitter
from orchestrator.worker.heartbeat import LeaseHandle, LeaseKeeper

T = TypeVar("T")

_new_tuple = tuple.__new__

LOST = "lost"
RELEASED = "released"
SETTLING = "settling"
"""What ``execute`` returns once the run's final commit is with the group committer: the run
is not over yet, and ``RunServices.ended`` will be told how it ends."""


def describe_error(error: BaseException) -> dict[str, JSON]:
    """Type, message and a short traceback: enough to debug, small enough for a row."""
    summary = traceback.format_exception(type(error), error, error.__traceback__, limit=8)
    return {
        "type": type(error).__name__,
        "message": str(error)[:2000],
        "traceback": "".join(summary)[-4000:],
    }


@dataclass
class RunnerConfig:
    worker_id: str
    lease_seconds: float
    statement_seconds: float
    cleanup_seconds: float = 5.0
    max_checkpoint_bytes: int = DEFAULT_MAX_CHECKPOINT_BYTES


_OUTCOME_ATTRIBUTES: dict[type, dict[str, str]] = {
    kind: {"outcome": kind.__name__.lower()} for kind in (Next, Finish, Fail)
}
"""Metric attributes per outcome type, built once (not a dict and a string per step)."""

_FINAL_STATES = {state: state.value for state in (RunState.SUCCEEDED, RunState.FAILED)}
"""A final commit's disposition (an enum's ``value`` is a Python-level property: 1 µs a read)."""

_DISPOSITION_ATTRIBUTES: dict[str, dict[str, str]] = {
    disposition: {DISPOSITION: disposition} for disposition in (*_FINAL_STATES.values(), LOST)
}


def _outcome_attributes(outcome: Outcome) -> dict[str, str]:
    attributes = _OUTCOME_ATTRIBUTES.get(type(outcome))
    if attributes is not None:
        return attributes
    for kind in (Next, Finish, Fail):  # a subclass of an outcome counts as that outcome
        if isinstance(outcome, kind):
            return _OUTCOME_ATTRIBUTES[kind]
    return {"outcome": type(outcome).__name__.lower()}


class Encoded(NamedTuple):
    """A step outcome's JSON as validated: sent to the database as it is."""

    result: str | None
    checkpoint: str | None


def _encoded(value: JSON, what: str, limit: int) -> str | None:
    # None stays SQL NULL (for a final checkpoint: keep the last one).
    return None if value is None else encode_json(value, what=what, max_bytes=limit)


def _validate_effects(effects: Sequence[Effect], limit: int) -> None:
    for effect in effects:
        if not isinstance(effect, Effect):
            raise TypeError(f"effects must be Effect objects, not {type(effect).__name__}")
        validate_json(effect.payload, what=f"effect {effect.key} payload", max_bytes=limit)


def _ids(claimed: ClaimedRun, worker_id: str) -> dict[str, str | int]:
    return {RUN_ID: claimed.run_id, RUN_FENCE: claimed.fence, WORKER_ID: worker_id}


def _log_context(claimed: ClaimedRun, worker_id: str) -> dict[str, str | int]:
    return {**_ids(claimed, worker_id), "agent": claimed.agent}


@dataclass(frozen=True, slots=True)
class RunServices:
    """What every run scope of one worker shares: built once, handed to each scope."""

    store: RunStore
    committer: GroupCommitter
    keeper: LeaseKeeper
    registry: AgentRegistry
    config: RunnerConfig
    metrics: Metrics
    draining: Callable[[], bool]
    """Whether the worker is shutting down (no new step then: the lease is given back)."""
    ended: Callable[[RunScope, str | Coroutine[Any, Any, str]], None]
    """How a run whose ``execute`` returned ``SETTLING`` ends, called once when the final
    commit's answer is in: its disposition, or, if it was lost, the cleanup still to run,
    which the worker runs as the run's task (it returns the disposition)."""


class RunScope:
    """Executes one claimed run until it finishes, fails, is released, or ownership is lost."""

    __slots__ = (
        "_cancel_requested",
        "_in_steps",
        "claimed",
        "committer",
        "config",
        "draining",
        "effects",
        "ended",
        "handle",
        "keeper",
        "log",
        "metrics",
        "registry",
        "shutdown_requested",
        "span",
        "store",
        "task",
    )

    def __init__(
        self,
        claimed: ClaimedRun,
        handle: LeaseHandle,
        services: RunServices,
        effects: EffectView | None = None,
    ) -> None:
        self.claimed = claimed
        self.handle = handle
        self.effects = effects
        self.store = services.store
        self.committer = services.committer
        self.keeper = services.keeper
        self.registry = services.registry
        self.config = services.config
        self.metrics = services.metrics
        self.draining = services.draining
        self.ended = services.ended
        self.span: Span = INVALID_SPAN
        """The run's span (opened by ``execute``, ended when the run ends)."""
        self.shutdown_requested = False
        self.task: asyncio.Task[None] | None = None
        """The run's own task, which this scope cancels; set by whoever starts it (or found
        when ``execute`` starts)."""
        self._in_steps = False
        self._cancel_requested = False
        # A function of the claim, not a method: a bound method would tie the scope into a
        # reference cycle, left for the garbage collector instead of freed when the run ends.
        self.log = RunLogger(
            "orchestrator.run", functools.partial(_log_context, claimed, self.config.worker_id)
        )

    @property
    def ids(self) -> dict[str, str | int]:
        """The ids every span and log line about this run carries (built only when needed)."""
        return _ids(self.claimed, self.config.worker_id)

    def stop_now(self) -> None:
        """Shutdown grace is over: cancel the step and give the lease back."""
        self.shutdown_requested = True
        self.cancel()

    def cancel(self) -> None:
        """Cancel the run's steps wherever they are awaiting; called by the lease handle.

        The scope is the run's own task, cancelled natively: an anyio cancel scope per run cost
        about 10% of a saturated worker. Only the steps are cancelled (never the cleanup that
        follows them), at most once, and ``execute`` takes back exactly its own cancellation,
        so a cancellation of the whole worker still propagates. Nothing is cancelled when the
        run's own task declares the loss (a refused commit): it returns at once by itself, and a
        cancellation it never awaited would instead cut its cleanup short.
        """
        if (
            self._in_steps
            and not self._cancel_requested
            and self.task is not None
            and asyncio.current_task() is not self.task
        ):
            self._cancel_requested = True
            self.task.cancel("the run's scope was cancelled")

    async def execute(self) -> str:
        """Run the steps; returns the disposition, or ``SETTLING`` (see ``RunServices.ended``)."""
        disposition = LOST
        if self.task is None:
            self.task = asyncio.current_task()
        self.span = open_span(f"run {self.claimed.agent}", attributes=self._run_attributes)
        try:
            with as_current(self.span):
                try:
                    self._in_steps = True
                    try:
                        # Lost already (a cancel that arrived before this task started)? Then
                        # the cancellation is delivered at the first await; _steps checks too.
                        self.handle.guard(self.cancel)
                        disposition = await self._steps()
                    except asyncio.CancelledError:
                        if not self._cancel_requested or self._cancelling() > 1:
                            raise  # not (only) ours: the worker itself is being cancelled
                    finally:
                        self._in_steps = False
                        if self._cancel_requested and self.task is not None:
                            self.task.uncancel()
                finally:
                    if disposition != SETTLING:
                        self.keeper.untrack(self.handle)
                        if self.shutdown_requested and not self.handle.lost and disposition == LOST:
                            disposition = await self._cleanup(self._release)
                        elif self.handle.lost:
                            disposition = LOST
                            await self._cleanup(self._record_lost)
        finally:
            if disposition != SETTLING:
                self._end_span(disposition)
        if disposition != SETTLING:
            self._count(disposition)
        return disposition

    def _end_span(self, disposition: str) -> None:
        span = self.span
        if span.is_recording():
            span.set_attribute(DISPOSITION, disposition)
            if disposition == LOST:
                span.set_status(Status(StatusCode.ERROR, self.handle.lost_reason or "lost"))
            span.end()

    def _count(self, disposition: str) -> None:
        self.metrics.runs_finished.add(
            1, _DISPOSITION_ATTRIBUTES.get(disposition) or {DISPOSITION: disposition}
        )

    def _ownership_lost(self) -> bool:
        # A call, not the attribute: the handle changes under every await (mypy must not
        # narrow it to False for the rest of the loop).
        return self.handle.lost

    def _cancelling(self) -> int:
        return self.task.cancelling() if self.task is not None else 0

    def _step_attributes(self, version: int, step: str) -> dict[str, str | int]:
        return {**self.ids, CHECKPOINT_VERSION: version, "step.name": step}

    def _run_attributes(self) -> dict[str, str | int]:
        return {**self.ids, LEASE_UNTIL: self.claimed.lease_until.isoformat()}

    # -- steps --------------------------------------------------------------------------------
    async def _db(self, function: Callable[[Any], Awaitable[T]]) -> T:
        async with pooled(self.store.pool, within=self.config.statement_seconds) as connection:
            return await function(connection)

    async def _steps(self) -> str:
        claimed = self.claimed
        agent = self.registry.get(claimed.agent)
        step_name = claimed.step
        checkpoint = claimed.checkpoint
        version = claimed.checkpoint_version
        lease = claimed.lease
        while True:
            if self._ownership_lost():
                return LOST  # no step starts without ownership
            if self.draining():
                self.handle.finishing = True
                released = await self._guarded(
                    lambda db: self.store.release(lease, reason="worker shutting down", db=db),
                    "release",
                )
                return RELEASED if released else LOST
            try:
                step_class = agent.step(step_name)
            except Exception as error:
                return await self._fail_attempt(error)
            wanted = step_class.lease_seconds or self.config.lease_seconds
            if wanted != self.handle.lease_seconds and not await self.keeper.renew_now(
                self.handle, wanted
            ):
                self.handle.lose("could not extend the lease for the step's own duration")
                return LOST
            this_step = step_class.step_name()
            # Positional, in StepContext's field order (a NamedTuple's keyword __new__ is a
            # Python function: 0.9 µs a step instead of 0.2). test_runtime checks each field.
            context: StepContext = _new_tuple(
                StepContext,
                (
                    lease.run_id,
                    agent.name,
                    this_step,
                    lease.fence,
                    claimed.attempt,
                    claimed.max_attempts,
                    lease.worker_id,
                    claimed.input,
                    checkpoint,
                    version,
                    self.handle.lease_until,
                    self.log.bind(step=this_step),
                    self.effects,
                ),
            )
            started = time.monotonic()
            with (
                start_span(
                    f"step {agent.name}.{this_step}",
                    attributes=functools.partial(self._step_attributes, version, this_step),
                )
                if tracing_enabled()
                else NO_SPAN
            ) as span:
                try:
                    outcome = await step_class().run(context)
                    encoded = self._validate(outcome, agent_steps=agent.steps)
                except Exception as error:
                    span.record_exception(error)
                    span.set_status(Status(StatusCode.ERROR, type(error).__name__))
                    self.metrics.steps.add(1, {"outcome": "error"})
                    return await self._fail_attempt(error)
                self.metrics.steps.add(1, _outcome_attributes(outcome))
                if self._ownership_lost():
                    # Lost while the step ran (it ignored the cancellation): commit nothing.
                    return LOST
                if isinstance(outcome, Next):
                    try:
                        committed = await self._commit_next(outcome, version, encoded)
                    except EffectRefused as error:  # nothing of the step was committed
                        span.set_status(Status(StatusCode.ERROR, type(error).__name__))
                        return await self._fail_attempt(error)
                    self.metrics.step_seconds.record(time.monotonic() - started)
                    if committed is None:
                        return self._lost("commit refused: not the owner any more")
                    span.set_attribute(CHECKPOINT_VERSION, committed)
                    version, checkpoint, step_name = (
                        committed,
                        outcome.checkpoint,
                        outcome.step_name,
                    )
                    continue
                return self._finish(outcome, version, encoded, started)

    async def _commit_next(self, outcome: Next, version: int, encoded: Encoded) -> int | None:
        """Commit the checkpoint; returns the new version, or ``None`` if nothing committed."""
        commit = StepCommit(
            self.claimed.lease,
            version,
            outcome.step_name,
            outcome.checkpoint,
            effects=tuple(outcome.effects),
            checkpoint_text=encoded.checkpoint,
        )
        try:
            committed = await self.committer.commit_step(commit)
        except CommitOutcomeUnknown as error:
            self.handle.lose(f"commit outcome unknown ({error})")
            return None
        return None if committed is None else committed.checkpoint_version

    def _finish(
        self, outcome: Finish | Fail, version: int, encoded: Encoded, started: float
    ) -> str:
        """Hand the final commit to the group committer; ``_settle`` takes its answer."""
        self.handle.finishing = True
        lease = self.claimed.lease
        if isinstance(outcome, Finish):
            finish = RunFinish(
                lease,
                version,
                RunState.SUCCEEDED,
                outcome.result,
                None,
                outcome.checkpoint,
                effects=tuple(outcome.effects),
                result_text=encoded.result,
                checkpoint_text=encoded.checkpoint,
            )
        else:
            failure: dict[str, JSON] = {"type": "Fail", "message": outcome.message}
            if outcome.details is not None:
                failure["details"] = outcome.details
            finish = RunFinish(lease, version, RunState.FAILED, None, failure, None)
        self.committer.finish(
            finish, functools.partial(self._settle, _FINAL_STATES[finish.state], started)
        )
        return SETTLING

    def _settle(
        self, final: str, started: float, answer: bool | CommitOutcomeUnknown | EffectRefused
    ) -> None:
        """The final commit's answer, from the group committer: how the run ends.

        The database decides: a run it finished has succeeded (or failed) even if the local
        view lost it meanwhile (a cancel or the local deadline while the batch was in flight:
        the fenced statement could only finish it while this worker still held the lease). A
        refused or unknown outcome is a loss, recorded by the bounded cleanup.
        """
        self.metrics.step_seconds.record(time.monotonic() - started)
        self.keeper.untrack(self.handle)
        if answer is True:
            if debug_enabled():
                self.log.debug("run finished", disposition=final)
            self._end_span(final)
            self._count(final)
            self.ended(self, final)
            return
        if isinstance(answer, EffectRefused):  # nothing was written: the attempt failed
            self.ended(self, self._after_refusal(answer))
            return
        if isinstance(answer, CommitOutcomeUnknown):
            self.handle.lose(f"{final} outcome unknown ({answer})")
        else:
            self.handle.lose(f"{final} refused: not the owner any more")
        self.ended(self, self._after_loss())

    async def _after_loss(self) -> str:
        """A settled run's cleanup after its final commit was refused or its outcome unknown."""
        try:
            with as_current(self.span):
                await self._cleanup(self._record_lost)
        finally:
            self._end_span(LOST)
        self._count(LOST)
        return LOST

    async def _after_refusal(self, error: EffectRefused) -> str:
        """A settled run whose final commit's effect was refused: the attempt failed."""
        disposition = LOST
        try:
            with as_current(self.span):
                disposition = await self._fail_attempt(error)
                if self.handle.lost:
                    await self._cleanup(self._record_lost)
        finally:
            self._end_span(disposition)
        self._count(disposition)
        return disposition

    def _validate(self, outcome: Outcome, *, agent_steps: dict[str, Any]) -> Encoded:
        """Check the step's outcome; returns its JSON, encoded once here for the commit."""
        limit = self.config.max_checkpoint_bytes
        if isinstance(outcome, Finish):
            _validate_effects(outcome.effects, limit)
            return Encoded(
                _encoded(outcome.result, "result", limit),
                _encoded(outcome.checkpoint, "checkpoint", limit),
            )
        if isinstance(outcome, Next):
            _validate_effects(outcome.effects, limit)
            if outcome.step_name not in agent_steps:
                raise LookupError(
                    f"Next names step {outcome.step_name!r}, which agent "
                    f"{self.claimed.agent} does not have"
                )
            return Encoded(None, _encoded(outcome.checkpoint, "checkpoint", limit))
        if isinstance(outcome, Fail):
            _encoded(outcome.details, "failure details", limit)
            return Encoded(None, None)
        raise TypeError(f"a step must return Next, Finish or Fail, not {type(outcome).__name__}")

    async def _fail_attempt(self, error: BaseException) -> str:
        self.handle.finishing = True
        described = describe_error(error)
        self.log.warning("step raised", error=described["message"], error_type=described["type"])
        outcome = await self._guarded(
            lambda db: self.store.fail_attempt(self.claimed.lease, error=described, db=db),
            "fail_attempt",
        )
        if outcome is None:
            return self._lost("failure record refused: not the owner any more")
        return outcome.state.value if outcome.state is RunState.DEAD else "retry_scheduled"

    async def _guarded(self, function: Callable[[Any], Awaitable[T]], what: str) -> T | None:
        """A fenced write. A database error means its outcome is unknown: ownership is unproven."""
        try:
            return await self._db(function)
        except DATABASE_ERRORS as error:
            self._lost(f"{what} outcome unknown ({type(error).__name__}: {error})")
            return None

    def _lost(self, reason: str) -> str:
        self.handle.lose(reason)
        return LOST

    # -- cleanup (shielded, bounded) ----------------------------------------------------------
    async def _cleanup(self, action: Callable[[], Awaitable[str]]) -> str:
        with anyio.move_on_after(self.config.cleanup_seconds, shield=True):
            try:
                return await action()
            except DATABASE_ERRORS as error:
                self.log.warning("cleanup write failed", error=str(error))
        return LOST

    async def _release(self) -> str:
        released = await self._db(
            lambda db: self.store.release(self.claimed.lease, reason="worker shutting down", db=db)
        )
        self.log.info("lease released at shutdown", released=released)
        return RELEASED if released else LOST

    async def _record_lost(self) -> str:
        reason = self.handle.lost_reason or "unknown"
        self.metrics.lost_leases.add(1, {WORKER_ID: self.config.worker_id})
        with start_span("lease_lost", attributes={**self.ids, "reason": reason}):
            self.log.warning("lease lost", reason=reason)
            await self._db(
                lambda db: self.store.record_event(
                    self.claimed.run_id,
                    "lease_lost",
                    fence=self.claimed.fence,
                    worker_id=self.config.worker_id,
                    details={"reason": reason},
                    db=db,
                )
            )
        return LOST
