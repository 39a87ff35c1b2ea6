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
import dataclasses
import functools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, TypeAlias

from opentelemetry.trace import INVALID_SPAN, Span, Status, StatusCode

from orchestrator.agent import steps
from orchestrator.agent.budgets import Prices, RunBudget
from orchestrator.agent.output import OutputLimits, OutputTarget, StepOutput
from orchestrator.agent.rates import RateScope, rate_scope
from orchestrator.agent.transcript import Transcript
from orchestrator.db.output import OutputStore
from orchestrator.db.rates import RateLimitStore
from orchestrator.db.signals import Signal
from orchestrator.db.store import RunFinish, RunStore, StepCommit
from orchestrator.errors import PermanentFailure
from orchestrator.models import JSON, ClaimedRun, CommitResult, Message
from orchestrator.telemetry import (
    CHECKPOINT_VERSION,
    DISPOSITION,
    Metrics,
    RunLogger,
    as_current,
    debug_enabled,
    open_span,
    tracing_enabled,
)
from orchestrator.worker.attempt_writes import AttemptWrites, describe_error
from orchestrator.worker.disposition import (
    DISPOSITION_ATTRIBUTES,
    FINAL_DISPOSITIONS,
    NOT_THE_OWNER,
    Disposition,
)
from orchestrator.worker.group_commit import (
    CommitAnswer,
    CommitRefused,
    Committed,
    GroupCommitter,
    Refused,
    Unknown,
)
from orchestrator.worker.heartbeat import LeaseHandle, LeaseKeeper
from orchestrator.worker.outcomes import run_finish, step_commit, step_extras, validate
from orchestrator.worker.run_telemetry import (
    COMMITTED,
    STEP_OUTCOMES,
    log_context,
    open_step_span,
    outcome_attributes,
    run_attributes,
    run_ids,
)
from orchestrator.worker.runner_config import RunnerConfig
from orchestrator.worker.spawning import check_child_agents, spawn_context
from orchestrator.worker.upgrades import (
    UpgradeFailed,
    checkpoint_needs_storing,
    upgraded_checkpoint,
)
from orchestrator.worker.wakeups import claimed_signals, park_again, pending_signals, read_wait

__all__ = [
    "NOT_THE_OWNER",
    "STEP_OUTCOMES",
    "Disposition",
    "RunExecution",
    "RunHost",
    "RunServices",
    "RunnerConfig",
    "describe_error",
]


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


@dataclass(frozen=True, slots=True)
class RunServices:
    """What every execution of one worker shares: built once, handed to each."""

    store: RunStore
    committer: GroupCommitter
    keeper: LeaseKeeper
    registry: steps.AgentRegistry
    config: RunnerConfig
    metrics: Metrics
    host: RunHost
    rates: RateLimitStore
    """The shared rate limits the steps' model calls charge."""
    prices: Prices = field(default_factory=Prices)
    outputs: OutputStore | None = None
    """Where the steps' live output goes (``None``: it is not published)."""
    output_limits: OutputLimits = field(default_factory=OutputLimits)


Position: TypeAlias = tuple[str | None, JSON, int]
"""Where a run stands between two steps: the step to run (``None``: the first), its checkpoint
and that checkpoint's version. A plain tuple: one is built per step, a NamedTuple costs more."""


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
        effects: steps.EffectView,
    ) -> None:
        self.claimed = claimed
        self.handle = handle
        self.services = services
        self.effects = effects
        self.transcript = Transcript(
            services.store, claimed.run_id, empty=claimed.checkpoint_version == 0
        )
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
            "orchestrator.run", functools.partial(log_context, claimed, services.config.worker_id)
        )

    @property
    def ids(self) -> dict[str, str | int]:
        """The ids every span and log line about this run carries (built only when needed)."""
        return run_ids(self.claimed, self.services.config.worker_id)

    def open_span(self, start_time: int | None = None) -> Span:
        """The attempt's span, the root of a trace of its own (the claim's worker opens it at the
        claim, to link it; ``execute`` otherwise)."""
        if not tracing_enabled():  # its name and attributes are not even built then
            return self.span
        self.span = open_span(
            f"run {self.claimed.agent}",
            attributes=functools.partial(
                run_attributes, self.claimed, self.services.config.worker_id
            ),
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
            lease = self.claimed.lease
            scope = RateScope(self.services.rates, lease.run_id, lease.fence, lease.worker_id)
            with rate_scope(scope):  # the steps' model calls charge the shared rate limits
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
            writes = self._writes()
            return await writes.cleanup(writes.release)
        if self.handle.lost:
            writes = self._writes()
            return await writes.cleanup(writes.record_lost)
        return disposition

    def _conclude(self, disposition: Disposition) -> None:
        """The one place an execution's end is recorded: its span and the metric."""
        span = self.span
        if span.is_recording():
            span.set_attribute(DISPOSITION, disposition.value)
            if disposition is Disposition.LOST:
                span.set_status(Status(StatusCode.ERROR, self.handle.lost_reason or "lost"))
            span.end()
        self.services.metrics.runs_finished.add(1, DISPOSITION_ATTRIBUTES[disposition])

    def _ownership_lost(self) -> bool:
        # A call, not the attribute: the handle changes under every await (mypy must not
        # narrow it to False for the rest of the loop).
        return self.handle.lost

    def _cancelling(self) -> int:
        return self.task.cancelling() if self.task is not None else 0

    def _writes(self) -> AttemptWrites:
        """Built when needed: these writes are off a step's path, and most runs need none."""
        services = self.services
        return AttemptWrites(
            self.claimed, self.handle, services.store, services.config, services.metrics, self.log
        )

    # -- steps --------------------------------------------------------------------------------
    async def _steps(self) -> Disposition | None:
        """The step loop: each step's context, its run and validation, its commit, and on to
        the next; how the execution ends (``None``: its final commit is with the committer)."""
        claimed = self.claimed
        agent = self.services.registry.get(claimed.agent)
        budget = self._budget(agent)
        signals = claimed_signals(claimed)
        woken: steps.WaitState | None = None
        if claimed.wait is not None:
            woken, still_waiting = await read_wait(
                claimed, claimed.wait, signals, self.effects, self.services.store
            )
            if still_waiting:  # woken by one of several awaited effects: wait on
                return await self._wait_again(claimed.wait, woken)
        at: Position = (claimed.step, claimed.checkpoint, claimed.checkpoint_version)
        if claimed.agent_version not in (None, agent.version):
            try:  # committed (fenced) with the first step: never upgraded twice
                at = (claimed.step, upgraded_checkpoint(agent, claimed), at[2])
            except UpgradeFailed as error:  # the stored checkpoint stays as it was
                return await self._fail_attempt(error)
        while True:
            step_class = await self._next_step(agent, at)
            if isinstance(step_class, Disposition):
                return step_class
            if self.signalled:
                signals = await self._signals(woken.signals if woken is not None else ())
            if budget is not None:
                budget.reset()
            context = step_context(self, agent, step_class, at, signals, woken, budget)
            woken = None
            advanced = await self._step(agent, step_class, context, at, signals, budget)
            if not isinstance(advanced, tuple):
                return advanced
            at = advanced
            signals = ()  # consumed by this commit

    async def _next_step(self, agent: steps.Agent, at: Position) -> type[steps.Step] | Disposition:
        """The step to run at ``at``, under a lease as long as it asks for; or how the execution
        ends instead (ownership lost, the worker draining, no such step)."""
        if self._ownership_lost():
            return Disposition.LOST  # no step starts without ownership
        services = self.services
        if services.host.draining():
            return await self._writes().release_before_step()
        try:
            step_class = agent.step(at[0])
        except Exception as error:
            return await self._fail_attempt(error)
        wanted = step_class.lease_seconds or services.config.lease_seconds
        if wanted != self.handle.lease_seconds and not await services.keeper.renew_now(
            self.handle, wanted
        ):
            self.handle.lose("could not extend the lease for the step's own duration")
            return Disposition.LOST
        return step_class

    async def _step(
        self,
        agent: steps.Agent,
        step_class: type[steps.Step],
        context: steps.StepContext,
        at: Position,
        signals: tuple[Signal, ...],
        budget: RunBudget | None,
    ) -> Position | Disposition | None:
        """One step under its span: run, validate, commit. Where the run stands after its
        commit, or how the execution ends (``None``: the final commit is with the committer)."""
        services, lease = self.services, self.claimed.lease
        _, checkpoint, version = at
        started = time.monotonic()
        # A span its owner ends: a final commit's span ends with the committer's answer, so
        # that every step's span says whether the step was committed.
        span = open_step_span(
            self.claimed,
            services.config.worker_id,
            self.handle,
            version,
            context.step,
            step_class,
            agent.name,
        )
        handed_over = committed_here = False
        try:
            with as_current(span):
                try:
                    try:
                        with context.output:  # model calls publish their tokens to it
                            outcome = await step_class().run(context)
                    except PermanentFailure as failure:  # as if the step returned Fail
                        span.record_exception(failure)
                        outcome = steps.Fail(str(failure))
                    if (
                        isinstance(outcome, steps.Finish)
                        and outcome.checkpoint is None
                        and checkpoint_needs_storing(self.claimed, agent, version, checkpoint)
                    ):
                        # Keeping the checkpoint keeps the one this version reads (upgraded).
                        outcome = dataclasses.replace(outcome, checkpoint=checkpoint)
                    encoded = validate(outcome, agent.name, agent.steps, services.config.limits)
                    if isinstance(outcome, steps.Next | steps.Wait) and outcome.children:
                        await check_child_agents(
                            outcome,
                            services.registry.names,
                            services.store.pool,
                            within=services.config.statement_seconds,
                        )
                except Exception as error:
                    span.record_exception(error)
                    span.set_status(Status(StatusCode.ERROR, type(error).__name__))
                    services.metrics.steps.add(1, {"outcome": "error"})
                    return await self._fail_attempt(error)
                services.metrics.steps.add(1, outcome_attributes(outcome))
                if self._ownership_lost():
                    # Lost while the step ran (it ignored the cancellation): commit nothing.
                    return Disposition.LOST
                # Before the commit, so that a committed step's output is complete.
                await context.output.flush(services.config.statement_seconds)
                messages: Sequence[Message] = ()
                if not isinstance(outcome, steps.Fail) and outcome.messages:
                    messages = await self.transcript.numbered(outcome.messages, lease.fence)
                extras = step_extras(signals, budget)
                if isinstance(outcome, (steps.Finish, steps.Fail)):
                    finish = run_finish(
                        outcome, lease, version, encoded, messages, extras, agent.version
                    )
                    self._finish(finish, started, span)
                    handed_over = True
                    return None
                if isinstance(outcome, steps.Wait):
                    self.handle.finishing = True  # the park ends the lease itself
                commit = step_commit(
                    outcome,
                    lease,
                    version,
                    encoded,
                    messages,
                    extras,
                    current_checkpoint=checkpoint,
                    claimed_version=self.claimed.checkpoint_version,
                    agent_version=agent.version,
                    keep_checkpoint=agent.keep_checkpoints,
                    **spawn_context(agent, outcome),
                )
                try:
                    committed = await self._commit(commit)
                except CommitRefused as error:  # nothing of the step was committed
                    span.set_status(Status(StatusCode.ERROR, type(error).__name__))
                    return await self._fail_attempt(error)
                services.metrics.step_seconds.record(time.monotonic() - started)
                if committed is None:
                    self.handle.lose(f"commit {NOT_THE_OWNER}")
                    return Disposition.LOST
                self.transcript.committed(messages)
                committed_here = True
                span.set_attribute(CHECKPOINT_VERSION, committed.checkpoint_version)
                if isinstance(outcome, steps.Wait):
                    return Disposition.WAITING
                if committed.drained:  # its last step here: a newer version's worker goes on
                    self.handle.finishing = True
                    return Disposition.RELEASED
                if committed.signals_pending > len(signals):
                    self.signalled = True  # some came after the step was given its own
                return outcome.step_name, outcome.checkpoint, committed.checkpoint_version
        finally:
            context.output.close()
            if not handed_over:
                span.set_attribute(COMMITTED, committed_here)
                span.end()

    async def _wait_again(self, wait: JSON, state: steps.WaitState) -> Disposition:
        """Woken before what the run waits for has all happened (one of several effects
        settled): park it again as it was, without running its step."""
        self.handle.finishing = True
        commit = park_again(self.claimed, wait, state, self.services.registry)
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
            functools.partial(self._settle, FINAL_DISPOSITIONS[finish.state], started, span),
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
                writes = self._writes()
                if self._refusal is not None:
                    disposition = await writes.fail_attempt(self._refusal)
                if self.handle.lost:
                    disposition = await writes.cleanup(writes.record_lost)
        finally:
            self._conclude(disposition)
        return disposition

    # -- budgets, signals, failed attempts ----------------------------------------------------
    def _budget(self, agent: steps.Agent) -> RunBudget | None:
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
        services = self.services
        return await pending_signals(
            services.store,
            self.claimed.run_id,
            awaited,
            within=services.config.statement_seconds,
        )

    async def _fail_attempt(self, error: BaseException) -> Disposition:
        return await self._writes().fail_attempt(error)


def step_context(
    run: RunExecution,
    agent: steps.Agent,
    step_class: type[steps.Step],
    at: Position,
    signals: tuple[Signal, ...],
    woken: steps.WaitState | None,
    budget: RunBudget | None,
) -> steps.StepContext:
    """What the step at ``at`` may read, from what ``run``'s claim and commits hold."""
    claimed, lease = run.claimed, run.claimed.lease
    _, checkpoint, version = at
    this_step = step_class.step_name()
    services = run.services
    output = StepOutput(
        None
        if services.outputs is None
        else OutputTarget(
            services.outputs,
            lease.run_id,
            lease.worker_id,
            lease.fence,
            version,
            services.output_limits,
            run.log,
        )
    )
    return steps.StepContext(
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
        lease_until=run.handle.lease_until,
        log=run.log.bind(step=this_step),
        effects=run.effects,
        transcript=run.transcript,
        database_now=run.handle.database_now,
        signals=signals,
        wait=woken,
        budget=budget,
        output=output,
    )
