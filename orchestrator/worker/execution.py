"""One claimed run's execution: its steps, guarded by the run's heartbeat, then its end.

A ``RunExecution`` is the body of the run's own task: the steps, then a bounded, shielded
wrap-up. The run's ``LeaseHandle`` (see ``heartbeat``) cancels the steps the moment ownership is
lost or can no longer be proven: a refused renewal, a cancel, a refused commit, or the local
deadline passing without a confirmed renewal. The step then stops wherever it is awaiting (a
model or tool call in flight is cancelled) and nothing more is committed. Every commit is fenced
in the database as well, so even a step that ignored cancellation could not commit after losing
its lease.

A run's last commit (finish or fail) is the one thing its task does not wait for: the task hands
it to the group committer and ends (``execute`` returns ``None``), and the committer's answer
settles the run (``_settle``): the host is told ``run_ended`` with the disposition, or, when the
commit did not finish the run, ``run_needs_cleanup``, and it runs ``clean_up`` as the run's
task. Nothing of the run is left to cancel by then, and the database's answer, not the local
view, decides how the run ended.
"""

from __future__ import annotations

import asyncio
import enum
import functools
import time
import traceback
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import anyio
from opentelemetry.trace import INVALID_SPAN, Span, Status, StatusCode

from orchestrator.budgets import Prices, RunBudget
from orchestrator.db.deadlines import DATABASE_ERRORS, pooled
from orchestrator.db.store import Park, RunFinish, RunStore, StepCommit
from orchestrator.effects.store import EffectNotFound
from orchestrator.errors import error_fields
from orchestrator.models import (
    DEFAULT_MAX_MESSAGE_BYTES,
    JSON,
    ClaimedRun,
    CommitResult,
    Message,
    RunState,
    StoredWait,
)
from orchestrator.signals import Signal, SignalStore
from orchestrator.steps import (
    DEFAULT_MAX_CHECKPOINT_BYTES,
    Agent,
    AgentRegistry,
    EffectView,
    Fail,
    Finish,
    Next,
    Outcome,
    Step,
    StepContext,
    Wait,
    WaitState,
)
from orchestrator.telemetry import (
    ATTEMPT,
    CHECKPOINT_VERSION,
    DISPOSITION,
    LEASE_UNTIL,
    RUN_FENCE,
    RUN_ID,
    WORKER_ID,
    Metrics,
    RunLogger,
    as_current,
    debug_enabled,
    open_span,
    start_span,
)
from orchestrator.transcript import Transcript
from orchestrator.worker.group_commit import (
    CommitAnswer,
    CommitRefused,
    Committed,
    GroupCommitter,
    Refused,
    Unknown,
)
from orchestrator.worker.heartbeat import LeaseHandle, LeaseKeeper
from orchestrator.worker.outcomes import (
    NOTHING_ELSE,
    Extras,
    Limits,
    run_finish,
    step_commit,
    validate,
)

T = TypeVar("T")
COMMITTED = "orchestrator.committed"
NOT_THE_OWNER = "refused: not the owner any more"
"""Ends the reason a lease was lost when the database refused a fenced write (a stale fence),
as opposed to the worker's own lease check (a refused renewal, the local deadline)."""
"""On every step's span: whether the step's commit took effect (a refused or replayed step is
labelled, not hidden)."""


class Disposition(enum.StrEnum):
    """How one execution of a run ended, as this worker saw it (the run's state is in the row)."""

    SUCCEEDED = "succeeded"
    FAILED = "failed"
    """The step returned ``Fail``: failed for good."""
    RETRY_SCHEDULED = "retry_scheduled"
    """The step raised: the run waits for its retry's backoff."""
    DEAD = "dead"
    """The step raised on its last attempt: dead-lettered."""
    WAITING = "waiting"
    """The step returned ``Wait``: committed, lease and slot given back until woken."""
    RELEASED = "released"
    """Given back at shutdown, fence unchanged, attempt not counted."""
    LOST = "lost"
    """Ownership was lost or could not be proven: nothing more was committed."""
    CANCELLED = "cancelled"
    """The run was cancelled while this worker held it: nothing more was committed."""
    CRASHED = "crashed"
    """A bug in the runtime ended the execution (logged); the lease is left to expire."""


_FINAL_DISPOSITIONS = {
    RunState.SUCCEEDED: Disposition.SUCCEEDED,
    RunState.FAILED: Disposition.FAILED,
}


class RunHost(Protocol):
    """The worker, as an execution whose final commit was with the group committer sees it."""

    def draining(self) -> bool:
        """Whether the worker is shutting down (no new step then: the lease is given back)."""
        ...

    def run_ended(self, execution: RunExecution, disposition: Disposition) -> None:
        """The final commit finished the run: it is over."""
        ...

    def run_needs_cleanup(self, execution: RunExecution) -> None:
        """The final commit did not finish the run: run ``execution.clean_up()`` as its task."""
        ...


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
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES

    @functools.cached_property
    def limits(self) -> Limits:
        """The size limits every step's outcome is checked against (built once)."""
        return Limits(self.max_checkpoint_bytes, self.max_message_bytes)


_OUTCOME_ATTRIBUTES: dict[type, dict[str, str]] = {
    kind: {"outcome": kind.__name__.lower()} for kind in (Next, Finish, Fail, Wait)
}
"""Metric attributes per outcome type, built once."""

STEP_OUTCOMES = (*(attributes["outcome"] for attributes in _OUTCOME_ATTRIBUTES.values()), "error")
"""The ``outcome`` label values of the steps counter (``error``: the step raised)."""

_DISPOSITION_ATTRIBUTES = {
    disposition: {DISPOSITION: disposition.value} for disposition in Disposition
}


def _outcome_attributes(outcome: Outcome) -> dict[str, str]:
    for kind, attributes in _OUTCOME_ATTRIBUTES.items():  # a subclass counts as its outcome
        if isinstance(outcome, kind):
            return attributes
    return {"outcome": type(outcome).__name__.lower()}


def _ids(claimed: ClaimedRun, worker_id: str) -> dict[str, str | int]:
    return {RUN_ID: claimed.run_id, RUN_FENCE: claimed.fence, WORKER_ID: worker_id}


def _log_context(claimed: ClaimedRun, worker_id: str) -> dict[str, str | int]:
    return {**_ids(claimed, worker_id), "agent": claimed.agent}


@dataclass(frozen=True, slots=True)
class RunServices:
    """What every execution of one worker shares: built once, handed to each."""

    store: RunStore
    committer: GroupCommitter
    keeper: LeaseKeeper
    registry: AgentRegistry
    config: RunnerConfig
    metrics: Metrics
    host: RunHost
    prices: Prices = field(default_factory=Prices)


class RunExecution:
    """Executes one claimed run until it finishes, fails, is released, or ownership is lost."""

    __slots__ = (
        "_cancel_requested",
        "_in_steps",
        "_refusal",
        "claimed",
        "effects",
        "handle",
        "log",
        "services",
        "shutdown_requested",
        "signalled",
        "span",
        "task",
        "transcript",
    )

    def __init__(
        self,
        claimed: ClaimedRun,
        handle: LeaseHandle,
        services: RunServices,
        effects: EffectView,
    ) -> None:
        self.claimed = claimed
        self.handle = handle
        self.effects = effects
        self.services = services
        self.transcript = Transcript(services.store, claimed.run_id)
        self.span: Span = INVALID_SPAN
        """The attempt's span (see ``open_span``), ended when the attempt ends."""
        self.shutdown_requested = False
        self.task: asyncio.Task[None] | None = None
        """The run's own task, which ``cancel`` cancels; set by whoever starts it (or found
        when ``execute`` starts)."""
        self.signalled = False
        """Signals may be waiting for the next step (set by the worker on a signal's NOTIFY)."""
        self._in_steps = False
        self._cancel_requested = False
        self._refusal: CommitRefused | None = None
        """Why the final commit was refused its effect, for ``clean_up``."""
        # A function of the claim, not a method: a bound method would tie the execution into a
        # reference cycle, left for the garbage collector instead of freed when the run ends.
        self.log = RunLogger(
            "orchestrator.run", functools.partial(_log_context, claimed, services.config.worker_id)
        )

    @property
    def ids(self) -> dict[str, str | int]:
        """The ids every span and log line about this run carries (built only when needed)."""
        return _ids(self.claimed, self.services.config.worker_id)

    def open_span(self, start_time: int | None = None) -> Span:
        """The attempt's span, the root of a trace of its own (the claim's worker opens it at the
        claim, to link it; ``execute`` otherwise)."""
        self.span = open_span(
            f"run {self.claimed.agent}",
            attributes=self._run_attributes,
            root=True,
            start_time=start_time,
        )
        return self.span

    def stop_now(self) -> None:
        """Shutdown grace is over: cancel the step and give the lease back."""
        self.shutdown_requested = True
        self.cancel()

    def cancel(self) -> None:
        """Cancel the run's steps wherever they are awaiting; called by the lease handle.

        The execution is the run's own task, cancelled natively (no cancel scope per run). Only
        the steps are cancelled (never the wrap-up that follows them), at most once, and
        ``execute`` takes back exactly its own cancellation, so a cancellation of the whole
        worker still propagates. Nothing is cancelled when the run's own task declares the loss
        (a refused commit): it returns at once by itself, and a cancellation it never awaited
        would instead cut its cleanup short.
        """
        if (
            self._in_steps
            and not self._cancel_requested
            and self.task is not None
            and asyncio.current_task() is not self.task
        ):
            self._cancel_requested = True
            self.task.cancel("the run's execution was cancelled")

    async def execute(self) -> Disposition | None:
        """Run the steps and wrap up; the disposition, or ``None`` while the run's final commit
        is with the group committer (the host then hears how the run ended)."""
        if self.task is None:
            self.task = asyncio.current_task()
        if self.span is INVALID_SPAN:
            self.open_span()
        disposition: Disposition | None = Disposition.LOST
        try:
            with as_current(self.span):
                try:
                    disposition = await self._guarded_steps()
                finally:
                    if disposition is not None:  # also when the worker itself is cancelled
                        disposition = await self._wrap_up(disposition)
        finally:
            if disposition is not None:
                self._conclude(disposition)
        return disposition

    async def _guarded_steps(self) -> Disposition | None:
        """The steps, cancelled by the lease handle on a loss; the worker's cancellation passes."""
        self._in_steps = True
        try:
            # Lost already (a cancel that arrived before this task started)? Then the
            # cancellation is delivered at the first await; _steps checks too.
            self.handle.guard(self.cancel)
            return await self._steps()
        except asyncio.CancelledError:
            if not self._cancel_requested or self._cancelling() > 1:
                raise  # not (only) ours: the worker itself is being cancelled
            return Disposition.LOST
        finally:
            self._in_steps = False
            if self._cancel_requested and self.task is not None:
                self.task.uncancel()

    async def _wrap_up(self, disposition: Disposition) -> Disposition:
        """Stop renewing; give the lease back at shutdown, or record a loss (bounded)."""
        self.services.keeper.untrack(self.handle)
        if self.shutdown_requested and not self.handle.lost and disposition is Disposition.LOST:
            return await self._cleanup(self._release)
        if self.handle.lost:
            return await self._cleanup(self._record_lost)
        return disposition

    def _conclude(self, disposition: Disposition) -> None:
        """The one place an execution's end is recorded: its span and the metric."""
        span = self.span
        if span.is_recording():
            span.set_attribute(DISPOSITION, disposition.value)
            if disposition is Disposition.LOST:
                span.set_status(Status(StatusCode.ERROR, self.handle.lost_reason or "lost"))
            span.end()
        self.services.metrics.runs_finished.add(1, _DISPOSITION_ATTRIBUTES[disposition])

    def _ownership_lost(self) -> bool:
        # A call, not the attribute: the handle changes under every await (mypy must not
        # narrow it to False for the rest of the loop).
        return self.handle.lost

    def _cancelling(self) -> int:
        return self.task.cancelling() if self.task is not None else 0

    def _step_attributes(
        self, version: int, step: str, step_class: type[Step], agent: str
    ) -> dict[str, Any]:
        return {
            **self.ids,
            CHECKPOINT_VERSION: version,
            "orchestrator.step.name": step,
            ATTEMPT: self.claimed.attempt,
            LEASE_UNTIL: self.handle.lease_until.isoformat(),
            **step_class.span_attributes(agent),
        }

    def _run_attributes(self) -> dict[str, str | int]:
        return {
            **self.ids,
            LEASE_UNTIL: self.claimed.lease_until.isoformat(),
            ATTEMPT: self.claimed.attempt,
            CHECKPOINT_VERSION: self.claimed.checkpoint_version,
        }

    # -- steps --------------------------------------------------------------------------------
    async def _db(self, function: Callable[[Any], Awaitable[T]]) -> T:
        pool = self.services.store.pool
        async with pooled(pool, within=self.services.config.statement_seconds) as connection:
            return await function(connection)

    async def _steps(self) -> Disposition | None:
        claimed = self.claimed
        services = self.services
        agent = services.registry.get(claimed.agent)
        step_name = claimed.step
        checkpoint = claimed.checkpoint
        version = claimed.checkpoint_version
        lease = claimed.lease
        budget = self._budget(agent)
        signals: tuple[Signal, ...] = ()
        if claimed.signals is not None:
            # Any the claim did not give (over 100) go to the steps after this one.
            signals = tuple(Signal.from_json(value) for value in claimed.signals)
        woken: WaitState | None = None
        if claimed.wait is not None:
            woken, still_waiting = await self._wait_state(claimed.wait, signals)
            if still_waiting:  # woken by one of several awaited effects: wait on
                return await self._wait_again(claimed.wait, woken)
        while True:
            if self._ownership_lost():
                return Disposition.LOST  # no step starts without ownership
            if services.host.draining():
                self.handle.finishing = True
                released = await self._guarded(
                    lambda db: services.store.release(lease, reason="worker shutting down", db=db),
                    "release",
                )
                return Disposition.RELEASED if released else Disposition.LOST
            try:
                step_class = agent.step(step_name)
            except Exception as error:
                return await self._fail_attempt(error)
            wanted = step_class.lease_seconds or services.config.lease_seconds
            if wanted != self.handle.lease_seconds and not await services.keeper.renew_now(
                self.handle, wanted
            ):
                self.handle.lose("could not extend the lease for the step's own duration")
                return Disposition.LOST
            this_step = step_class.step_name()
            if self.signalled:
                signals = await self._signals(woken.signals if woken is not None else ())
            if budget is not None:
                budget.reset()
            context = StepContext(
                run_id=lease.run_id,
                agent=agent.name,
                step=this_step,
                fence=lease.fence,
                attempt=claimed.attempt,
                max_attempts=claimed.max_attempts,
                worker_id=lease.worker_id,
                input=claimed.input,
                checkpoint=checkpoint,
                checkpoint_version=version,
                lease_until=self.handle.lease_until,
                log=self.log.bind(step=this_step),
                effects=self.effects,
                transcript=self.transcript,
                database_now=self.handle.database_now,
                signals=signals,
                wait=woken,
                budget=budget,
            )
            woken = None
            started = time.monotonic()
            # A span its owner ends: a final commit's span ends with the committer's answer, so
            # that every step's span says whether the step was committed.
            span = open_span(
                step_class.span(agent.name),
                attributes=functools.partial(
                    self._step_attributes, version, this_step, step_class, agent.name
                ),
            )
            handed_over = committed_here = False
            try:
                with as_current(span):
                    try:
                        outcome = await step_class().run(context)
                        encoded = validate(outcome, agent.name, agent.steps, services.config.limits)
                    except Exception as error:
                        span.record_exception(error)
                        span.set_status(Status(StatusCode.ERROR, type(error).__name__))
                        services.metrics.steps.add(1, {"outcome": "error"})
                        return await self._fail_attempt(error)
                    services.metrics.steps.add(1, _outcome_attributes(outcome))
                    if self._ownership_lost():
                        # Lost while the step ran (it ignored the cancellation): commit nothing.
                        return Disposition.LOST
                    messages: Sequence[Message] = ()
                    if not isinstance(outcome, Fail) and outcome.messages:
                        messages = await self.transcript.numbered(outcome.messages, lease.fence)
                    extras = (
                        NOTHING_ELSE
                        if not signals and budget is None
                        else Extras(
                            tuple(signal.seq for signal in signals),
                            None if budget is None else budget.settlement(),
                        )
                    )
                    if isinstance(outcome, (Finish, Fail)):
                        finish = run_finish(outcome, lease, version, encoded, messages, extras)
                        self._finish(finish, started, span)
                        handed_over = True
                        return None
                    if isinstance(outcome, Wait):
                        self.handle.finishing = True  # the park ends the lease itself
                    commit = step_commit(
                        outcome,
                        lease,
                        version,
                        encoded,
                        messages,
                        extras,
                        current_checkpoint=checkpoint,
                        claimed_version=claimed.checkpoint_version,
                    )
                    try:
                        committed = await self._commit(commit)
                    except CommitRefused as error:  # nothing of the step was committed
                        span.set_status(Status(StatusCode.ERROR, type(error).__name__))
                        return await self._fail_attempt(error)
                    services.metrics.step_seconds.record(time.monotonic() - started)
                    if committed is None:
                        return self._lost(f"commit {NOT_THE_OWNER}")
                    self.transcript.committed(messages)
                    committed_here = True
                    span.set_attribute(CHECKPOINT_VERSION, committed.checkpoint_version)
                    if isinstance(outcome, Wait):
                        return Disposition.WAITING
                    if committed.signals_pending > len(signals):
                        self.signalled = True  # some came after the step was given its own
                    signals = ()  # consumed by this commit
                    version, checkpoint, step_name = (
                        committed.checkpoint_version,
                        outcome.checkpoint,
                        outcome.step_name,
                    )
            finally:
                if not handed_over:
                    span.set_attribute(COMMITTED, committed_here)
                    span.end()

    async def _wait_again(self, wait: JSON, state: WaitState) -> Disposition:
        """Woken before what the run waits for has all happened (one of several effects
        settled): park it again as it was, without running its step."""
        self.handle.finishing = True
        commit = StepCommit(
            self.claimed.lease,
            self.claimed.checkpoint_version,
            self.claimed.step or self.services.registry.get(self.claimed.agent).first.step_name(),
            self.claimed.checkpoint,
            park=Park(wait, state.until),
        )
        committed = await self._commit(commit)
        return Disposition.LOST if committed is None else Disposition.WAITING

    async def _commit(self, commit: StepCommit) -> CommitResult | None:
        """The commit's result; ``None`` when it did not take effect (the lease is then lost if
        its outcome is unknown). Raises the refusal of a commit that could not be written."""
        answer = await self.services.committer.commit_step(commit)
        if isinstance(answer, Committed):
            return answer.result
        if isinstance(answer, Refused):
            raise answer.error
        if isinstance(answer, Unknown):
            self.handle.lose(f"commit outcome unknown ({answer.error})")
        return None

    def _finish(self, finish: RunFinish, started: float, span: Span) -> None:
        """Hand the final commit to the group committer; ``_settle`` takes its answer."""
        self.handle.finishing = True
        self.services.committer.finish(
            finish,
            functools.partial(self._settle, _FINAL_DISPOSITIONS[finish.state], started, span),
        )

    def _settle(
        self,
        final: Disposition,
        started: float,
        step_span: Span,
        answer: CommitAnswer,
    ) -> None:
        """The final commit's answer, from the group committer: how the run ends.

        The database decides: a run it finished has succeeded (or failed) even if the local
        view lost it meanwhile (a cancel or the local deadline while the batch was in flight:
        the fenced statement could only finish it while this worker still held the lease). A
        refused effect fails the attempt; a refused or unknown outcome is a loss. Both are
        wrapped up by ``clean_up``, bounded, in a task the host starts.
        """
        services = self.services
        services.metrics.step_seconds.record(time.monotonic() - started)
        services.keeper.untrack(self.handle)
        if step_span.is_recording():
            step_span.set_attribute(COMMITTED, isinstance(answer, Committed))
            step_span.end()
        if isinstance(answer, Committed):
            if debug_enabled():
                self.log.debug("run finished", disposition=final.value)
            self._conclude(final)
            services.host.run_ended(self, final)
            return
        if isinstance(answer, Refused):
            self._refusal = answer.error
        elif isinstance(answer, Unknown):
            self.handle.lose(f"{final.value} outcome unknown ({answer.error})")
        else:
            self.handle.lose(f"{final.value} {NOT_THE_OWNER}")
        services.host.run_needs_cleanup(self)

    async def clean_up(self) -> Disposition:
        """After a final commit that did not finish the run: fail the attempt if its effect was
        refused, record the loss otherwise (bounded and shielded)."""
        disposition = Disposition.LOST
        try:
            with as_current(self.span):
                if self._refusal is not None:
                    disposition = await self._fail_attempt(self._refusal)
                if self.handle.lost:
                    disposition = await self._cleanup(self._record_lost)
        finally:
            self._conclude(disposition)
        return disposition

    # -- waits, signals, budgets --------------------------------------------------------------
    def _budget(self, agent: Agent) -> RunBudget | None:
        if agent.budget is None:
            return None
        return RunBudget(
            agent.budget,
            self.claimed.lease,
            self.services.store.pool,
            self.services.prices,
            statement_seconds=self.services.config.statement_seconds,
        )

    async def _signals(self, awaited: Sequence[str]) -> tuple[Signal, ...]:
        """The run's unconsumed signals, those it was woken for first (read when a commit or a
        NOTIFY says there are more)."""
        self.signalled = False
        run_id = self.claimed.run_id
        return await self._db(lambda db: SignalStore(db).pending(run_id, awaited))

    async def _wait_state(self, wait: JSON, signals: tuple[Signal, ...]) -> tuple[WaitState, bool]:
        """What the run waited for; and whether it must wait on (nothing it waits for has
        happened yet, and its time has not come)."""
        stored = StoredWait.from_json(wait)
        names, keys, until, reason = stored.signals, stored.effects, stored.until, stored.reason
        signalled = any(signal.name in names for signal in signals)
        settled = bool(keys) and all([await self._settled(key) for key in keys])
        happened = signalled or settled or reason == "budget"
        due = until is not None and self.claimed.claimed_at >= until  # the database's clock
        state = WaitState(names, keys, until, reason, timed_out=due and not happened)
        return state, not happened and not due and bool(names or keys)

    async def _settled(self, effect_key: str) -> bool:
        try:
            record = await self.effects.get(effect_key)
        except EffectNotFound:  # never recorded: nothing to wait for
            return True
        return record.status.settled

    async def _fail_attempt(self, error: BaseException) -> Disposition:
        self.handle.finishing = True
        described = describe_error(error)
        self.log.warning("step raised", error=described["message"], error_type=described["type"])
        store = self.services.store
        outcome = await self._guarded(
            lambda db: store.fail_attempt(self.claimed.lease, error=described, db=db),
            "fail_attempt",
        )
        if outcome is None:
            return self._lost(f"failure record {NOT_THE_OWNER}")
        if outcome.state is RunState.DEAD:
            return Disposition.DEAD
        return Disposition.RETRY_SCHEDULED

    async def _guarded(self, function: Callable[[Any], Awaitable[T]], what: str) -> T | None:
        """A fenced write. A database error means its outcome is unknown: ownership is unproven."""
        try:
            return await self._db(function)
        except DATABASE_ERRORS as error:
            self._lost(f"{what} outcome unknown ({type(error).__name__}: {error})")
            return None

    def _lost(self, reason: str) -> Disposition:
        self.handle.lose(reason)
        return Disposition.LOST

    # -- cleanup (shielded, bounded) ----------------------------------------------------------
    async def _cleanup(self, action: Callable[[], Awaitable[Disposition]]) -> Disposition:
        with anyio.move_on_after(self.services.config.cleanup_seconds, shield=True):
            try:
                return await action()
            except DATABASE_ERRORS as error:
                self.log.warning("cleanup write failed", **error_fields(error))
        return Disposition.LOST

    async def _release(self) -> Disposition:
        store = self.services.store
        released = await self._db(
            lambda db: store.release(self.claimed.lease, reason="worker shutting down", db=db)
        )
        self.log.info("lease released at shutdown", released=released)
        return Disposition.RELEASED if released else Disposition.LOST

    async def _record_lost(self) -> Disposition:
        reason = self.handle.lost_reason or "unknown"
        worker_id = self.services.config.worker_id
        self.services.metrics.lost_leases.add(1)
        with start_span("lease_lost", attributes={**self.ids, "reason": reason}):
            self.log.warning("lease lost", reason=reason)
            await self._db(
                lambda db: self.services.store.record_event(
                    self.claimed.run_id,
                    "lease_lost",
                    fence=self.claimed.fence,
                    worker_id=worker_id,
                    details={"reason": reason},
                    db=db,
                )
            )
        # A cancel reaches the owner as a lost lease (a notice or a refused renewal): the run's
        # row says which it was, so the worker's counts do not call a cancel a loss.
        run = await self._db(lambda db: self.services.store.get(self.claimed.run_id, db=db))
        return Disposition.CANCELLED if run.state is RunState.CANCELLED else Disposition.LOST
