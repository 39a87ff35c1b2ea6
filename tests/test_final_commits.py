"""A run's final commit is settled by the group committer's answer, not awaited by its task.

The run's task ends as it hands the final commit over; the run stays active until the answer
is in. These tests hold that answer back with a real row lock on the run (the fenced
``finish_runs`` statement waits for it in PostgreSQL), then decide it: the database finishes
the run, or the committer's connection is terminated mid-statement.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import replace
from functools import partial

import anyio
import asyncpg

from orchestrator.agent.steps import Agent, Finish, Outcome, Step, StepContext
from orchestrator.db.connections import create_pool
from orchestrator.db.store import RunFinish, RunStore
from orchestrator.models import Message, RunState
from orchestrator.settings import Settings
from orchestrator.testing import running_worker
from orchestrator.worker.group_commit import Committed, GroupCommitter
from test_runtime import FAST, eventually

FINISH_WAITING_FOR_A_LOCK = """
SELECT pid FROM pg_stat_activity
WHERE wait_event_type = 'Lock'
  AND query LIKE '%AS u(run_id, fence, expected_version, state, result, error, checkpoint,%'
"""


class FinishOnCue(Step):
    """Finishes as soon as the test says so."""

    started: anyio.Event | None = None
    cue: anyio.Event | None = None

    async def run(self, ctx: StepContext) -> Outcome:
        assert FinishOnCue.started is not None and FinishOnCue.cue is not None
        FinishOnCue.started.set()
        await FinishOnCue.cue.wait()
        return Finish(result={"finished": True})


async def started_run(store: RunStore) -> tuple[Agent, str]:
    FinishOnCue.started, FinishOnCue.cue = anyio.Event(), anyio.Event()
    run_id = (await store.submit("on_cue", {})).run.run_id
    return Agent("on_cue", first=FinishOnCue), run_id


@asynccontextmanager
async def final_commit_held(pool: asyncpg.Pool, run_id: str) -> AsyncIterator[int]:
    """Lock the run's row, cue its step to finish, and yield once the final commit waits for
    the lock (the pid of the backend running it). The lock goes when the block ends."""
    assert FinishOnCue.started is not None and FinishOnCue.cue is not None
    with anyio.fail_after(60):
        await FinishOnCue.started.wait()
    async with pool.acquire() as connection, connection.transaction():
        await connection.execute("SELECT 1 FROM runs WHERE run_id = $1 FOR UPDATE", run_id)
        FinishOnCue.cue.set()
        pid = None
        with anyio.fail_after(60):
            while pid is None:
                pid = await pool.fetchval(FINISH_WAITING_FOR_A_LOCK)
                await anyio.sleep(0.01)
        yield pid


async def test_the_database_answer_decides_how_a_run_ended(
    store: RunStore, pool: asyncpg.Pool, settings: Settings
) -> None:
    # Lost in the local view while the fenced final commit waits in the database: the lease
    # still holds there, so the statement finishes the run. The run succeeded, and the worker
    # says so: no "lost" disposition, no lease_lost event contradicting the timeline.
    agent, run_id = await started_run(store)
    async with running_worker(settings, [agent], concurrency=1, **FAST) as worker:
        async with final_commit_held(pool, run_id):
            worker.active[run_id].handle.lose("test: lost locally during the final commit")
            await anyio.sleep(0.2)
            assert run_id in worker.active  # the answer is not in yet
        await eventually(lambda: run_id not in worker.active, within=60)
        assert worker.counters.finished == {"succeeded": 1}
        assert len(worker.run_tasks) == 0
    run = await store.get(run_id)
    assert run.state is RunState.SUCCEEDED
    assert run.result == {"finished": True}
    kinds = [event.kind for event in await store.events(run_id)]
    assert kinds[-1] == "succeeded"
    assert "lease_lost" not in kinds


async def test_a_final_commit_with_an_unknown_outcome_ends_the_run_lost(
    store: RunStore, pool: asyncpg.Pool, settings: Settings
) -> None:
    # The committer's connection dies mid-statement: the outcome is unknown, so the run is
    # lost (a task of its own records it, bounded and shielded), and nothing was committed.
    agent, run_id = await started_run(store)
    async with running_worker(settings, [agent], concurrency=1, **FAST) as worker:
        async with final_commit_held(pool, run_id) as pid:
            assert await pool.fetchval("SELECT pg_terminate_backend($1)", pid)
            await eventually(lambda: run_id not in worker.active, within=60)
        assert worker.counters.finished == {"lost": 1}
    run = await store.get(run_id)
    assert run.state is RunState.RUNNING  # left to expire, or to be taken over
    assert run.result is None
    lost = [event for event in await store.events(run_id) if event.kind == "lease_lost"]
    assert len(lost) == 1
    assert "succeeded outcome unknown" in str(lost[0].details["reason"])


async def test_a_graceful_stop_waits_for_final_commits_in_flight(
    store: RunStore, pool: asyncpg.Pool, settings: Settings
) -> None:
    # A settling run has no task left, yet the worker drains it like any other active run.
    agent, run_id = await started_run(store)
    async with (
        running_worker(settings, [agent], concurrency=1, **FAST) as worker,
        final_commit_held(pool, run_id),
    ):
        worker.request_stop()
        await anyio.sleep(0.3)
        assert run_id in worker.active
    assert worker.counters.finished == {"succeeded": 1}
    assert (await store.get(run_id)).state is RunState.SUCCEEDED


async def test_a_failing_answer_handler_does_not_keep_other_runs_from_theirs(
    store: RunStore,
) -> None:
    for _ in range(2):
        await store.submit("noop", {})
    first, second = (await store.claim("w-answers", ["noop"], limit=2, lease_seconds=30)).claimed
    committer = GroupCommitter(store, "w-answers", statement_seconds=5)
    answers: dict[str, object] = {}

    def broken(answer: object) -> None:
        raise RuntimeError("a bug in one run's bookkeeping")

    with anyio.fail_after(60):
        async with anyio.create_task_group() as group:
            group.start_soon(committer.run)
            committer.finish(RunFinish(first.lease, 0, RunState.SUCCEEDED, {"n": 1}), broken)
            committer.finish(
                RunFinish(second.lease, 0, RunState.SUCCEEDED, {"n": 2}),
                lambda answer: answers.setdefault(second.run_id, answer),
            )
            await eventually(lambda: second.run_id in answers, within=60)
            group.cancel_scope.cancel()
    assert answers == {second.run_id: Committed()}
    for claimed in (first, second):
        assert (await store.get(claimed.run_id)).state is RunState.SUCCEEDED


def ours(text: str) -> bool:
    """Not asyncpg's introspection of a type the connection meets for the first time."""
    return "typeinfo_tree" not in text and "'jit'" not in text


def first_word(text: str) -> str:
    return text.split()[0].rstrip(";")


async def test_plain_final_commits_are_one_statement_and_others_share_a_transaction(
    store: RunStore, settings: Settings
) -> None:
    # A batch of final commits that write only their runs' rows and events is one statement,
    # its own transaction: no BEGIN and COMMIT round trips for a busy worker's loop to answer.
    # A final commit that appends messages shares one transaction with them.
    for _ in range(2):
        await store.submit("noop", {})
    plain, talking = (await store.claim("w-tx", ["noop"], limit=2, lease_seconds=120)).claimed
    message = Message(turn=0, role="assistant", body={"role": "assistant", "content": "done"})
    finishes = {
        plain.run_id: RunFinish(plain.lease, 0, RunState.SUCCEEDED, {"n": 1}),
        talking.run_id: RunFinish(
            talking.lease, 0, RunState.SUCCEEDED, {"n": 2}, messages=[replace(message, seq=0)]
        ),
    }
    sent: list[str] = []
    one_connection = await create_pool(
        settings, application_name="test-sent", max_size=1, keep_session_state=True
    )
    try:
        async with one_connection.acquire() as connection:
            connection.add_query_logger(lambda logged: sent.append(logged.query))
        committer = GroupCommitter(RunStore(one_connection), "w-tx", statement_seconds=60)
        answers: dict[str, object] = {}
        statements: dict[str, list[str]] = {}
        with anyio.fail_after(120):
            async with anyio.create_task_group() as group:
                group.start_soon(committer.run)
                for run_id, finish in finishes.items():
                    sent.clear()
                    committer.finish(finish, partial(answers.setdefault, run_id))
                    await eventually(partial(answers.__contains__, run_id), within=60)
                    statements[run_id] = [first_word(text) for text in sent if ours(text)]
                group.cancel_scope.cancel()
    finally:
        await one_connection.close()
    assert statements[plain.run_id] == ["WITH"]  # finish_runs alone
    assert statements[talking.run_id] == ["BEGIN", "WITH", "INSERT", "COMMIT"]
    assert answers == {plain.run_id: Committed(), talking.run_id: Committed()}
    for run_id in finishes:
        assert (await store.get(run_id)).state is RunState.SUCCEEDED
    assert [m.body["content"] for m in await store.messages(talking.run_id)] == ["done"]
