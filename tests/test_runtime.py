"""The worker runtime in-process: step outcomes, retries, heartbeat deadlines, the harness."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from datetime import UTC, datetime
from typing import Any, ClassVar

import anyio
import asyncpg
import pytest

from orchestrator.agent.output import StepOutput
from orchestrator.agent.steps import (
    Agent,
    AgentRegistry,
    Fail,
    Finish,
    Next,
    Outcome,
    Step,
    StepContext,
)
from orchestrator.agents.noop import noop
from orchestrator.agents.sleepy import sleepy
from orchestrator.db.store import RunStore
from orchestrator.errors import InvalidInput, SchemaTooNew
from orchestrator.models import Lease, RunState
from orchestrator.settings import Settings
from orchestrator.testing import run_agent, running_worker, wait_for_run
from orchestrator.worker.heartbeat import (
    NO_DEADLINE_CONFIRMATION,
    LeaseDeadlines,
    LeaseHandle,
    safety_margin,
)
from orchestrator.worker.run_tasks import RunTasks
from orchestrator.worker.worker import Worker, WorkerConfig
from support import run_to_the_end

FAST: dict[str, Any] = {"lease_seconds": 3.0, "heartbeat_seconds": 1.0, "poll_seconds": 0.1}


def fresh_handle(*, lease_seconds: float, confirmed_at: float) -> LeaseHandle:
    """A handle as a claim makes it: its last confirmed renewal sent at ``confirmed_at``."""
    return LeaseHandle(
        lease=Lease("r_x", "w", 1),
        lease_seconds=lease_seconds,
        lease_until=datetime.now(UTC),
        confirmed_sent_at=confirmed_at,
    )


NO_RENEWAL = "no confirmed renewal before the local deadline"


@contextmanager
def cancelled_by_its_guard(handle: LeaseHandle, reason: str) -> Iterator[None]:
    """Run the block under ``handle``'s guard; it must end cancelled by the guard, the lease
    lost for ``reason``."""
    with anyio.CancelScope() as scope:
        handle.guard(scope.cancel)
        yield
    assert scope.cancelled_caught
    assert handle.lost_reason == reason


async def eventually(condition: Callable[[], bool], *, within: float) -> None:
    """Poll an in-memory condition of the worker under test (there is no event to wait on)."""
    with anyio.fail_after(within):
        for _ in range(int(within * 1000) + 1):
            if condition():
                return
            await anyio.sleep(0.005)


class Refuse(Step):
    async def run(self, ctx: StepContext) -> Outcome:
        return Fail("the contract is unsigned", details={"field": "signature"})


class ReturnsGarbage(Step):
    async def run(self, ctx: StepContext) -> Outcome:
        return "not an outcome"  # type: ignore[return-value]


class NextToNowhere(Step):
    async def run(self, ctx: StepContext) -> Outcome:
        return Next("missing", checkpoint={})


class Flaky(Step):
    """Fails on the first attempt, succeeds on the second."""

    async def run(self, ctx: StepContext) -> Outcome:
        if ctx.attempt == 1:
            raise ConnectionError("vendor hiccup")
        return Next(Finisher, checkpoint={"recovered_on": ctx.attempt})


class Finisher(Step):
    async def run(self, ctx: StepContext) -> Outcome:
        from orchestrator.agent.steps import Finish

        return Finish(result=ctx.checkpoint)


async def test_harness_runs_an_agent_to_completion(settings: Settings) -> None:
    run, events = await run_agent(settings, sleepy, {"steps": 3, "seconds": 0.01}, **FAST)
    assert run.state is RunState.SUCCEEDED
    assert run.result == {"count": 3}
    assert run.checkpoint_version == 3
    assert [e.kind for e in events] == [
        "submitted",
        "claimed",
        "checkpoint",
        "checkpoint",
        "succeeded",
    ]


class RecordsItsContext(Step):
    seen: ClassVar[dict[str, object]] = {}

    async def run(self, ctx: StepContext) -> Outcome:
        RecordsItsContext.seen = {f.name: getattr(ctx, f.name) for f in dataclasses.fields(ctx)}
        return Finish(result=None)


async def test_a_step_reads_each_field_of_its_context(settings: Settings, store: RunStore) -> None:
    agent = Agent("introspective", first=RecordsItsContext)
    run, _ = await run_agent(settings, agent, {"question": 42}, worker_id="w-ctx", **FAST)
    seen = RecordsItsContext.seen
    claimed = next(e for e in await store.events(run.run_id) if e.kind == "claimed")
    assert {key: seen[key] for key in ("run_id", "agent", "step", "fence", "worker_id")} == {
        "run_id": run.run_id,
        "agent": "introspective",
        "step": "RecordsItsContext",
        "fence": 1,
        "worker_id": "w-ctx",
    }
    assert (seen["attempt"], seen["max_attempts"]) == (1, run.max_attempts)
    assert seen["input"] == {"question": 42}
    assert (seen["checkpoint"], seen["checkpoint_version"]) == (None, 0)
    assert isinstance(seen["lease_until"], datetime)
    assert seen["lease_until"] == datetime.fromisoformat(claimed.details["lease_until"])
    assert callable(getattr(seen["log"], "info", None))
    assert seen["effects"] is not None and callable(getattr(seen["effects"], "wait", None))
    assert callable(getattr(seen["transcript"], "messages", None))
    database_now = seen["database_now"]
    assert callable(database_now) and isinstance(database_now(), datetime)
    assert (seen["signals"], seen["wait"], seen["budget"]) == ((), None, None)
    assert isinstance(seen["output"], StepOutput)


async def test_fail_outcome_fails_the_run_for_good(settings: Settings) -> None:
    agent = Agent("refuser", first=Refuse)
    run, events = await run_agent(settings, agent, {}, **FAST)
    assert run.state is RunState.FAILED
    assert run.error == {
        "type": "Fail",
        "message": "the contract is unsigned",
        "details": {"field": "signature"},
    }
    assert [e.kind for e in events].count("claimed") == 1


@pytest.mark.parametrize("step", [ReturnsGarbage, NextToNowhere])
async def test_a_broken_step_is_retried_then_dead_lettered(
    settings: Settings, store: RunStore, step: type[Step]
) -> None:
    agent = Agent("broken", first=step)
    run = await run_to_the_end(settings, store, agent, {}, max_attempts=2, **FAST)
    assert run.state is RunState.DEAD
    assert run.error is not None and run.error["type"] in ("TypeError", "LookupError")
    assert "Traceback" in run.error["traceback"]
    kinds = [e.kind for e in await store.events(run.run_id)]
    assert kinds == ["submitted", "claimed", "retry_scheduled", "claimed", "dead_lettered"]


async def test_an_exception_is_retried_with_the_checkpoint_intact(
    settings: Settings, store: RunStore
) -> None:
    agent = Agent("flaky", first=Flaky, steps=[Finisher])
    run = await run_to_the_end(settings, store, agent, {}, **FAST)
    assert run.state is RunState.SUCCEEDED
    assert run.result == {"recovered_on": 2}
    events = await store.events(run.run_id)
    retry = next(e for e in events if e.kind == "retry_scheduled")
    assert retry.details["error"]["type"] == "ConnectionError"


async def test_cancel_during_a_step_stops_it_and_commits_nothing(
    settings: Settings, store: RunStore
) -> None:
    async with running_worker(settings, [sleepy], **FAST) as worker:
        run_id = (await store.submit("sleepy", {"steps": 3, "seconds": 2})).run.run_id
        await eventually(lambda: run_id in worker.active, within=60)
        await store.cancel(run_id)
        started = anyio.current_time()
        await eventually(lambda: run_id not in worker.active, within=FAST["heartbeat_seconds"])
        assert anyio.current_time() - started < FAST["heartbeat_seconds"]
        await anyio.sleep(2.5)  # past the end of the step that was cut short
    run = await store.get(run_id)
    events = await store.events(run_id)
    assert run.state is RunState.CANCELLED and run.checkpoint_version == 0
    assert "checkpoint" not in [e.kind for e in events]
    assert [e.details["reason"] for e in events if e.kind == "lease_lost"] == [
        "the run was cancelled"
    ]


async def test_a_worker_listens_for_cancels_before_it_claims(
    settings: Settings, store: RunStore
) -> None:
    """A run claimed before its worker listened would hear of a cancel only at its next
    heartbeat (it did once in CI, two seconds late): the worker listens, then claims."""
    run_id = (await store.submit("sleepy", {"steps": 1, "seconds": 30})).run.run_id
    options = {"lease_seconds": 30.0, "heartbeat_seconds": 10.0, "poll_seconds": 30.0}
    async with running_worker(
        settings, [sleepy], worker_id="w-listens", grace_seconds=0.1, **options
    ) as worker:
        await eventually(lambda: run_id in worker.active, within=60)
        # With a 30 s poll the listener's last statement is still its last LISTEN.
        listening = await store.pool.fetchrow(
            "SELECT query, query_start FROM pg_stat_activity WHERE application_name = $1",
            "w-listens:listen",
        )
    assert listening is not None and listening["query"].startswith("LISTEN")
    claimed = [e for e in await store.events(run_id) if e.kind == "claimed"]
    assert len(claimed) == 1 and listening["query_start"] <= claimed[0].at


async def test_graceful_stop_releases_unfinished_runs(settings: Settings, store: RunStore) -> None:
    async with running_worker(settings, [sleepy], grace_seconds=0.2, **FAST) as worker:
        run_id = (await store.submit("sleepy", {"steps": 1, "seconds": 30})).run.run_id
        await eventually(lambda: run_id in worker.active, within=60)
    run = await store.get(run_id)
    assert (run.state, run.fence, run.attempt, run.lease_owner) == (RunState.QUEUED, 1, 0, None)
    assert [e.kind for e in await store.events(run_id)][-1] == "released"


async def test_worker_claims_only_its_agents_and_many_at_once(
    settings: Settings, store: RunStore
) -> None:
    other = (await store.submit("sleepy", {})).run.run_id
    ids = [(await store.submit("noop", {})).run.run_id for _ in range(30)]
    async with running_worker(settings, [noop], concurrency=8, **FAST):
        runs = [await wait_for_run(store, run_id) for run_id in ids]
    assert {run.state for run in runs} == {RunState.SUCCEEDED}
    assert (await store.get(other)).state is RunState.QUEUED


async def test_guard_cancels_at_the_local_deadline_without_a_confirmed_renewal() -> None:
    now = anyio.current_time()
    handle = fresh_handle(lease_seconds=1.0, confirmed_at=now)
    with cancelled_by_its_guard(handle, NO_RENEWAL):
        await anyio.sleep(5)
    elapsed = anyio.current_time() - now
    # Never before the deadline; after it only by how late a loaded machine runs the loop.
    deadline = 1.0 - safety_margin(1.0)
    assert deadline <= elapsed < deadline + 2


async def test_guard_follows_confirmed_renewals_and_cancels_on_loss() -> None:
    start = anyio.current_time()
    handle = fresh_handle(lease_seconds=1.0, confirmed_at=start)

    async def renew_twice_then_lose() -> None:
        for _ in range(2):
            await anyio.sleep(0.5)
            handle.confirm(anyio.current_time(), datetime.now(UTC), 1.0)
        await anyio.sleep(0.2)
        handle.lose("renewal refused")

    async with anyio.create_task_group() as group:
        group.start_soon(renew_twice_then_lose)
        with cancelled_by_its_guard(handle, "renewal refused"):
            await anyio.sleep(5)
    assert anyio.current_time() - start >= 1.2  # outlived the first deadline thanks to renewals


async def test_unguarded_handle_cancels_nothing_after_its_run_ended() -> None:
    handle = fresh_handle(lease_seconds=0.5, confirmed_at=anyio.current_time())
    scope = anyio.CancelScope()
    handle.guard(scope.cancel)
    handle.unguard()
    await anyio.sleep(0.6)  # past the deadline: the handle was let go of with the scope
    handle.lose("late loss")
    assert not scope.cancel_called
    assert not handle.guarded and handle.scheduled_at is None


async def test_one_timer_keeps_every_deadline_while_ended_runs_are_swept(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Ended runs leave outdated entries behind; sweeping them, also while the timer is
    # firing and re-filing renewed handles, must keep every live deadline on time.
    monkeypatch.setattr(LeaseDeadlines, "SWEEP_MINIMUM", 2)
    loop = asyncio.get_running_loop()
    deadlines = LeaseDeadlines(loop)
    start = loop.time()
    lost_at: dict[int, float] = {}

    def guarded(lease_seconds: float) -> LeaseHandle:
        handle = fresh_handle(lease_seconds=lease_seconds, confirmed_at=start)
        handle.deadlines = deadlines
        handle.guard(lambda: lost_at.setdefault(id(handle), loop.time()))
        return handle

    renewed = [guarded(1.0) for _ in range(20)]
    for ended in [guarded(30.0) for _ in range(100)]:
        ended.unguard()
    assert len(deadlines) == 20
    await anyio.sleep(0.2)
    # Renewed 10 ms apart, the first two handles last: when their first deadline comes, the
    # timer re-files the first handle (arming for its late deadline), then the second (which
    # sweeps out the ended runs), then the rest, whose new deadlines are earlier: they must
    # not wait for the first handle's.
    for handle in [*renewed[2:], *renewed[:2]]:
        handle.confirm(loop.time(), datetime.now(UTC), 1.0)
        await anyio.sleep(0.01)
    await anyio.sleep(1.5)  # past every renewed deadline
    assert {handle.lost_reason for handle in renewed} == {NO_DEADLINE_CONFIRMATION}
    late = [lost_at[id(handle)] - handle.deadline for handle in renewed]
    assert max(late) < 0.08, late
    assert len(deadlines) == 0
    assert deadlines.filed() < 100  # the ended runs' entries were swept out


async def test_a_failing_cancel_does_not_keep_other_runs_past_their_deadline() -> None:
    loop = asyncio.get_running_loop()
    deadlines = LeaseDeadlines(loop)
    start = loop.time()

    def broken_cancel() -> None:
        raise RuntimeError("a bug in one run's scope")

    first, second = (fresh_handle(lease_seconds=0.5, confirmed_at=start) for _ in range(2))
    later = fresh_handle(lease_seconds=1.0, confirmed_at=start)
    cancelled: list[LeaseHandle] = []
    for handle, cancel in ((first, broken_cancel), (second, None), (later, None)):
        handle.deadlines = deadlines
        handle.guard(cancel or functools.partial(cancelled.append, handle))
    await anyio.sleep(1.2)
    assert cancelled == [second, later]
    assert {h.lost_reason for h in (first, second, later)} == {NO_DEADLINE_CONFIRMATION}


def test_registry_loading_errors_are_clear() -> None:
    with pytest.raises(InvalidInput, match=r"cannot import agent module 'no\.such\.module'"):
        AgentRegistry.from_modules(["no.such.module"])
    with pytest.raises(InvalidInput, match="defines no Agent"):
        AgentRegistry.from_modules(["orchestrator.backoff"])
    registry = AgentRegistry.from_modules(
        ["orchestrator.agents.sleepy", "orchestrator.agents.noop"]
    )
    assert registry.names == ["noop", "sleepy"]


def test_worker_config_refuses_a_heartbeat_too_slow_for_the_lease() -> None:
    config = WorkerConfig(agents=AgentRegistry([noop]), lease_seconds=10, heartbeat_seconds=6)
    with pytest.raises(ValueError, match="renew at least twice per lease"):
        Worker(Settings(), config)


def test_worker_config_refuses_a_reaper_interval_that_is_not_positive() -> None:
    config = WorkerConfig(agents=AgentRegistry([noop]), reap_seconds=0)
    with pytest.raises(ValueError, match="reaper interval must be positive"):
        Worker(Settings(), config)


async def test_serve_refuses_a_schema_newer_than_its_code(
    settings: Settings, store: RunStore
) -> None:
    await store.pool.execute(  # a newer release's migration that removed what this one uses
        "INSERT INTO orchestrator_schema_migrations (version, name, contracts)"
        " VALUES (999, 'future', true)"
    )
    supervisor = Worker(settings, WorkerConfig(agents=AgentRegistry([noop])))
    with pytest.raises(SchemaTooNew):
        await supervisor.run()


def test_serve_usage_errors(database_url: str) -> None:
    def serve(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "orchestrator.cli", "serve", *args],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
            env={"ORCHESTRATOR_DATABASE_URL": database_url, "PATH": ""},
        )

    missing = serve()
    assert missing.returncode == 2 and "no agents to serve" in missing.stderr
    bad_module = serve("--agents", "no.such.module")
    assert bad_module.returncode == 1 and "cannot import agent module" in bad_module.stderr
    slow = serve(
        "--agents", "orchestrator.agents.noop", "--lease-seconds", "3", "--heartbeat-seconds", "2"
    )
    assert slow.returncode == 1 and "renew at least twice" in slow.stderr
    no_reaper = serve("--agents", "orchestrator.agents.noop", "--reap-seconds", "0")
    assert no_reaper.returncode == 2 and "--reap-seconds" in no_reaper.stderr


@asynccontextmanager
async def lost_mid_step(
    store: RunStore, settings: Settings, agent: Agent, started: anyio.Event
) -> AsyncIterator[tuple[str, Worker]]:
    """Yield a run of ``agent``, alone on a worker, and that worker once the first step has set
    ``started``; the block makes the worker lose the run, and on leaving it the worker has let
    the run go and counted it lost."""
    run_id = (await store.submit(agent.name, {})).run.run_id
    async with running_worker(settings, [agent], concurrency=1, **FAST) as worker:
        with anyio.fail_after(60):
            await started.wait()
        yield run_id, worker
        await eventually(lambda: run_id not in worker.active, within=60)
        assert worker.counters.finished == {"lost": 1}


class SwallowsCancellation(Step):
    """A badly written step: it catches the cancellation and tries to carry on."""

    started: anyio.Event | None = None

    async def run(self, ctx: StepContext) -> Outcome:
        assert SwallowsCancellation.started is not None
        SwallowsCancellation.started.set()
        with contextlib.suppress(BaseException):  # deliberately wrong: that is the point
            await anyio.sleep(30)
        return Next(SwallowsCancellation, checkpoint={"carried_on": True})


async def test_a_step_that_swallows_its_cancellation_commits_nothing_after_a_local_loss(
    store: RunStore, settings: Settings
) -> None:
    # The loss is local only (as at the local deadline): the database would still accept the
    # commit, so only the runtime's own check stands between the step and a commit.
    SwallowsCancellation.started = anyio.Event()
    agent = Agent("swallower", first=SwallowsCancellation)
    async with lost_mid_step(store, settings, agent, SwallowsCancellation.started) as (
        run_id,
        worker,
    ):
        worker.active[run_id].handle.lose("test: ownership lost locally")
    run = await store.get(run_id)
    assert run.checkpoint_version == 0
    assert run.checkpoint is None
    kinds = [event.kind for event in await store.events(run_id)]
    assert "checkpoint" not in kinds
    assert "lease_lost" in kinds


async def test_a_run_cancelled_under_its_worker_is_counted_cancelled_not_lost(
    store: RunStore, settings: Settings
) -> None:
    """The status line's counts: a cancel is not a lost lease."""
    run_id = (await store.submit("sleepy", {"steps": 1, "seconds": 30})).run.run_id
    async with running_worker(settings, [sleepy], concurrency=1, **FAST) as worker:
        await eventually(lambda: run_id in worker.active, within=10)
        await store.cancel(run_id)
        await eventually(lambda: run_id not in worker.active, within=10)
        assert worker.counters.finished == {"cancelled": 1}
    assert (await store.get(run_id)).state is RunState.CANCELLED


async def test_a_worker_cancelled_as_a_whole_still_ends_its_run_tasks(
    store: RunStore, settings: Settings
) -> None:
    # The run scope takes back only its own cancellation; the worker's must go through.
    run_id = (await store.submit("sleepy", {"steps": 1, "seconds": 30})).run.run_id
    supervisor = Worker(settings, WorkerConfig(agents=AgentRegistry([sleepy]), **FAST))
    with anyio.fail_after(60):
        async with anyio.create_task_group() as group:
            group.start_soon(supervisor.run)
            await supervisor.ready.wait()
            await eventually(lambda: run_id in supervisor.active, within=60)
            group.cancel_scope.cancel()
    assert len(supervisor.run_tasks) == 0
    assert supervisor.active == {}
    # The run was not lost (its worker stopped): its task ended cancelled, not as "lost".
    assert supervisor.counters.finished == {}
    assert (await store.get(run_id)).state is RunState.RUNNING  # lease left to expire


class NapThenNext(Step):
    started: anyio.Event | None = None

    async def run(self, ctx: StepContext) -> Outcome:
        assert NapThenNext.started is not None
        NapThenNext.started.set()
        await anyio.sleep(0.5)
        return Next(NapThenNext, checkpoint={"after": "nap"})


async def test_a_refused_commit_ends_the_run_lost_and_records_it(
    store: RunStore, pool: asyncpg.Pool, settings: Settings
) -> None:
    # The run's own task finds out (its commit is refused): the loss must still be recorded by
    # the cleanup, which a cancellation of its own task must not cut short.
    NapThenNext.started = anyio.Event()
    agent = Agent("napper", first=NapThenNext)
    async with lost_mid_step(store, settings, agent, NapThenNext.started) as (run_id, _):
        # Another claimer's fence, without the NOTIFY a cancel sends: only the commit finds out.
        await pool.execute("UPDATE runs SET fence = fence + 1 WHERE run_id = $1", run_id)
    events = await store.events(run_id)
    lost = [event for event in events if event.kind == "lease_lost"]
    assert len(lost) == 1
    assert "commit refused" in str(lost[0].details["reason"])
    assert "checkpoint" not in [event.kind for event in events]


async def test_a_shorter_lease_brings_the_local_deadline_forward() -> None:
    # A step's own lease may be shorter than the worker's: the deadline then comes earlier
    # than the one the timer was armed for, and must not wait for it.
    start = anyio.current_time()
    handle = fresh_handle(lease_seconds=30.0, confirmed_at=start)
    with cancelled_by_its_guard(handle, NO_RENEWAL):
        await anyio.sleep(0.1)
        handle.confirm(anyio.current_time(), datetime.now(UTC), 0.5)
        await anyio.sleep(10)
    assert anyio.current_time() - start < 1.0


async def test_a_run_task_that_ends_as_it_starts_is_not_kept() -> None:
    # On Python 3.12+ run tasks start eagerly: a coroutine that never suspends has ended, and
    # has already said so, by the time start() returns; it must not be kept as a live task.
    tasks = RunTasks()

    async def body() -> None:
        task = asyncio.current_task()
        assert task is not None
        tasks.done(task)

    task = tasks.start(body())
    await task
    assert len(tasks) == 0


async def test_a_run_task_started_as_its_group_ends_still_runs_its_cleanup() -> None:
    # The claim loop may start a run (in a shielded section) after the worker's group was
    # cancelled and before the group's end reached the run tasks: before 3.12 that task has not
    # taken its first step, and cancelling it then skips its body, its cleanup and `done`.
    tasks = RunTasks()
    cleaned: list[bool] = []

    async def body() -> None:
        try:
            await anyio.sleep_forever()
        finally:
            cleaned.append(True)
            tasks.done(task)

    with anyio.fail_after(60):
        async with anyio.create_task_group() as group:
            group.start_soon(tasks.host)
            await anyio.sleep(0.05)  # the host is waiting for its group to end
            group.cancel_scope.cancel()  # the host is woken to end the run tasks ...
            task = tasks.start(body())  # ... and a run starts before the host has run
    assert task.done() and cleaned == [True]
    assert len(tasks) == 0
