"""The lease protocol on a real PostgreSQL: claims, renewals, fenced commits, retries, cancel."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import asyncpg
import pytest

from orchestrator.db.connections import GENERIC_PLANS, create_pool
from orchestrator.db.executor import TransactionConnection
from orchestrator.db.queries import query
from orchestrator.db.store import RunStore, StepEvent
from orchestrator.errors import (
    IdempotencyConflict,
    InvalidInput,
    InvalidTransition,
    RunAlreadyExists,
    RunNotFound,
)
from orchestrator.models import ClaimedRun, CommitResult, Lease, RunState
from orchestrator.settings import Settings

SHORT = 0.3  # seconds: a lease that a test can outwait


async def snapshot(pool: asyncpg.Pool, run_id: str) -> tuple[dict[str, Any], int]:
    """The whole run row and the number of its events: what 'changes nothing' compares."""
    row = await pool.fetchrow("SELECT * FROM runs WHERE run_id = $1", run_id)
    count = await pool.fetchval("SELECT count(*) FROM run_events WHERE run_id = $1", run_id)
    assert row is not None
    return dict(row), int(count)


async def claim_one(store: RunStore, worker: str, lease_seconds: float = 30.0) -> ClaimedRun:
    batch = await store.claim(worker, ["agent"], limit=1, lease_seconds=lease_seconds)
    assert len(batch.claimed) == 1, batch
    return batch.claimed[0]


async def test_claim_raises_fence_and_counts_attempt(store: RunStore) -> None:
    run = (await store.submit("agent", {"n": 1})).run
    assert (run.state, run.fence, run.attempt) == (RunState.QUEUED, 0, 0)
    claimed = await claim_one(store, "w1")
    assert (claimed.run_id, claimed.fence, claimed.attempt) == (run.run_id, 1, 1)
    stored = await store.get(run.run_id)
    assert (stored.state, stored.lease_owner, stored.fence) == (RunState.RUNNING, "w1", 1)
    # A valid lease is not claimable by anyone, the owner included.
    assert (await store.claim("w2", ["agent"], limit=5)).claimed == []
    assert await store.claim_run("w2", run.run_id) is None


async def test_a_claim_hands_the_worker_every_field_it_resumes_from(
    store: RunStore, pool: asyncpg.Pool
) -> None:
    # ClaimedRun is built positionally from the claim's row (a hot path): each field must be
    # the column it names. A taken-over run fills them all (previous owner, checkpoint, step).
    run_id = (await store.submit("agent", {"x": 1}, max_attempts=4)).run.run_id
    first = await claim_one(store, "A", lease_seconds=SHORT)
    assert await store.commit_step(
        first.lease, expected_version=0, next_step="two", checkpoint={"k": 1}
    )
    previous_lease_until = (await store.get(run_id)).lease_until
    await asyncio.sleep(SHORT + 0.1)
    claimed = await claim_one(store, "B")
    row = await pool.fetchrow("SELECT * FROM runs WHERE run_id = $1", run_id)
    claimed_at = await pool.fetchval(
        "SELECT at FROM run_events WHERE run_id = $1 AND kind = 'claimed' AND fence = 2", run_id
    )
    assert row is not None
    assert claimed.lease == Lease(run_id, "B", 2)
    assert (claimed.agent, claimed.input, claimed.step) == ("agent", {"x": 1}, "two")
    assert (claimed.checkpoint, claimed.checkpoint_version) == ({"k": 1}, 1)
    assert (claimed.attempt, claimed.max_attempts) == (row["attempt"], 4)
    assert claimed.lease_until == row["lease_until"]
    assert claimed.previous_owner == "A"
    assert claimed.previous_lease_until == previous_lease_until
    assert abs((claimed.claimed_at - claimed_at).total_seconds()) < 0.1


async def test_claim_only_serves_the_named_agents(store: RunStore) -> None:
    await store.submit("other", {})
    assert (await store.claim("w1", ["agent"], limit=5)).claimed == []
    assert len((await store.claim("w1", ["agent", "other"], limit=5)).claimed) == 1


async def test_claim_batch_takes_up_to_the_limit(store: RunStore) -> None:
    for n in range(7):
        await store.submit("agent", {"n": n})
    first = await store.claim("w1", ["agent"], limit=5)
    second = await store.claim("w2", ["agent"], limit=5)
    assert len(first.claimed) == 5
    assert len(second.claimed) == 2
    assert not {c.run_id for c in first.claimed} & {c.run_id for c in second.claimed}


async def test_a_claim_without_expired_leases_takes_only_due_runs(store: RunStore) -> None:
    await store.submit("agent", {})
    expired = await claim_one(store, "A", lease_seconds=SHORT)
    await asyncio.sleep(SHORT + 0.1)
    due = (await store.submit("agent", {})).run
    batch = await store.claim("B", ["agent"], limit=5, include_expired=False)
    assert [run.run_id for run in batch.claimed] == [due.run_id]
    # Looking again, with expired leases, takes the expired one over.
    batch = await store.claim("B", ["agent"], limit=5)
    assert [(run.run_id, run.previous_owner) for run in batch.claimed] == [(expired.run_id, "A")]


async def test_renew_with_the_old_fence_after_a_reclaim_fails(store: RunStore) -> None:
    await store.submit("agent", {})
    a = await claim_one(store, "A", lease_seconds=SHORT)
    await asyncio.sleep(SHORT + 0.1)
    b = await claim_one(store, "B")
    assert b.fence == a.fence + 1
    assert b.previous_owner == "A"
    assert await store.renew(a.lease) is None
    # Even the same worker id with the old fence is refused: the fence, not the name, proves it.
    assert await store.renew(Lease(a.run_id, "B", a.fence)) is None
    assert await store.renew(b.lease) is not None


async def test_renew_after_expiry_fails_even_if_nobody_reclaimed(store: RunStore) -> None:
    await store.submit("agent", {})
    a = await claim_one(store, "A", lease_seconds=SHORT)
    assert await store.renew(a.lease, lease_seconds=SHORT) is not None
    await asyncio.sleep(SHORT + 0.1)
    assert await store.renew(a.lease) is None
    run = await store.get(a.run_id)
    assert run.lease_owner == "A"  # not yet reclaimed, but the lease cannot be revived


async def test_renew_of_a_cancelled_run_fails(store: RunStore) -> None:
    await store.submit("agent", {})
    a = await claim_one(store, "A")
    cancelled = await store.cancel(a.run_id, reason="operator")
    assert cancelled.state is RunState.CANCELLED
    assert cancelled.fence == a.fence + 1
    assert await store.renew(a.lease) is None
    assert (
        await store.commit_step(a.lease, expected_version=0, next_step="x", checkpoint={}) is None
    )


async def test_renew_extends_by_the_database_clock(store: RunStore) -> None:
    await store.submit("agent", {})
    a = await claim_one(store, "A", lease_seconds=5)
    renewed = await store.renew(a.lease, lease_seconds=60)
    now = await store.database_now()
    assert renewed is not None
    assert 55 < (renewed - now).total_seconds() <= 60


async def test_batched_renewal_reports_which_leases_held(store: RunStore) -> None:
    for n in range(4):
        await store.submit("agent", {"n": n})
    claims = (await store.claim("A", ["agent"], limit=4, lease_seconds=30)).claimed
    await store.cancel(claims[1].run_id)
    stale = Lease(claims[2].run_id, "A", claims[2].fence - 1)
    held = await store.renew_many(
        "A", [claims[0].lease, claims[1].lease, stale, claims[3].lease], lease_seconds=30
    )
    assert set(held) == {claims[0].run_id, claims[3].run_id}
    with pytest.raises(ValueError, match="one worker at a time"):
        await store.renew_many("A", [Lease(claims[0].run_id, "B", 1)], lease_seconds=30)


async def test_commit_with_stale_fence_or_version_commits_nothing(
    store: RunStore, pool: asyncpg.Pool
) -> None:
    await store.submit("agent", {})
    a = await claim_one(store, "A", lease_seconds=SHORT)
    committed = await store.commit_step(
        a.lease, expected_version=0, next_step="two", checkpoint={"k": 1}
    )
    assert committed is not None and committed.checkpoint_version == 1
    await asyncio.sleep(SHORT + 0.1)
    b = await claim_one(store, "B")
    before = await snapshot(pool, a.run_id)

    calls: list[str] = []

    async def extra_write(connection: TransactionConnection, result: CommitResult) -> None:
        calls.append("ran")

    # Stale fence (A was replaced), right version.
    assert (
        await store.commit_step(
            a.lease,
            expected_version=1,
            next_step="three",
            checkpoint={"k": "A"},
            events=[StepEvent("note", {})],
            in_transaction=extra_write,
        )
        is None
    )
    # Current fence, stale version.
    assert (
        await store.commit_step(
            b.lease,
            expected_version=0,
            next_step="three",
            checkpoint={"k": "B0"},
            in_transaction=extra_write,
        )
        is None
    )
    assert not await store.finish(a.lease, expected_version=1, result={})
    assert not await store.fail(a.lease, expected_version=1, error={"type": "X"})
    assert await store.fail_attempt(a.lease, error={"type": "X"}) is None
    assert not await store.release(a.lease)
    assert calls == []
    assert await snapshot(pool, a.run_id) == before

    ok = await store.commit_step(
        b.lease,
        expected_version=1,
        next_step="three",
        checkpoint={"k": "B"},
        events=[StepEvent("note", {"by": "B"})],
        in_transaction=extra_write,
    )
    assert ok is not None and ok.checkpoint_version == 2
    assert calls == ["ran"]
    kinds = [(e.kind, e.fence) for e in await store.events(a.run_id)]
    assert kinds[-2:] == [("checkpoint", 2), ("note", 2)]


async def test_commit_after_lease_expiry_commits_nothing(
    store: RunStore, pool: asyncpg.Pool
) -> None:
    await store.submit("agent", {})
    a = await claim_one(store, "A", lease_seconds=SHORT)
    await asyncio.sleep(SHORT + 0.1)
    before = await snapshot(pool, a.run_id)
    assert (
        await store.commit_step(a.lease, expected_version=0, next_step="x", checkpoint={}) is None
    )
    assert await snapshot(pool, a.run_id) == before


async def test_extra_writes_roll_back_with_the_commit(store: RunStore, pool: asyncpg.Pool) -> None:
    await store.submit("agent", {})
    a = await claim_one(store, "A")
    before = await snapshot(pool, a.run_id)

    async def failing_write(connection: TransactionConnection, result: CommitResult) -> None:
        raise RuntimeError("effect record rejected")

    with pytest.raises(RuntimeError):
        await store.commit_step(
            a.lease, expected_version=0, next_step="x", checkpoint={}, in_transaction=failing_write
        )
    assert await snapshot(pool, a.run_id) == before


async def test_finish_keeps_the_last_checkpoint_and_clears_the_lease(store: RunStore) -> None:
    await store.submit("agent", {})
    a = await claim_one(store, "A")
    await store.commit_step(a.lease, expected_version=0, next_step="two", checkpoint={"k": 1})
    assert await store.finish(a.lease, expected_version=1, result={"answer": 42})
    run = await store.get(a.run_id)
    assert run.state is RunState.SUCCEEDED
    assert (run.result, run.checkpoint, run.lease_owner, run.lease_until) == (
        {"answer": 42},
        {"k": 1},
        None,
        None,
    )
    assert run.finished_at is not None
    with pytest.raises(InvalidTransition, match="already succeeded"):
        await store.cancel(a.run_id)


async def test_failed_attempts_back_off_then_dead_letter(store: RunStore) -> None:
    run = (await store.submit("agent", {}, max_attempts=2)).run
    a = await claim_one(store, "A")
    outcome = await store.fail_attempt(a.lease, error={"type": "Boom", "message": "first"})
    assert outcome is not None and outcome.state is RunState.WAITING
    now = await store.database_now()
    assert outcome.retry_at is not None
    delay = (outcome.retry_at - now).total_seconds()
    assert 0 < delay <= store.backoff.ceiling(1)
    # Not claimable until the backoff passes (judged by the database clock).
    assert (await store.claim("B", ["agent"])).claimed == []
    await asyncio.sleep(delay + 0.05)
    b = await claim_one(store, "B")
    assert b.attempt == 2
    outcome = await store.fail_attempt(b.lease, error={"type": "Boom", "message": "second"})
    assert outcome is not None and outcome.state is RunState.DEAD
    dead = await store.get(run.run_id)
    assert dead.state is RunState.DEAD
    assert dead.error == {"type": "Boom", "message": "second"}
    kinds = [e.kind for e in await store.events(run.run_id)]
    assert kinds == ["submitted", "claimed", "retry_scheduled", "claimed", "dead_lettered"]


async def test_expired_lease_counts_as_an_attempt_and_poison_runs_dead_letter(
    store: RunStore,
) -> None:
    run = (await store.submit("agent", {}, max_attempts=2)).run
    first = await claim_one(store, "crashing-1", lease_seconds=SHORT)
    await asyncio.sleep(SHORT + 0.1)
    second = await claim_one(store, "crashing-2", lease_seconds=SHORT)
    assert (first.attempt, second.attempt) == (1, 2)
    await asyncio.sleep(SHORT + 0.1)
    batch = await store.claim("w3", ["agent"], limit=5)
    assert batch.claimed == []
    assert batch.dead_lettered == [run.run_id]
    dead = await store.get(run.run_id)
    assert dead.state is RunState.DEAD
    assert dead.error is not None and dead.error["type"] == "LeaseExpired"


async def test_committed_progress_restarts_the_attempt_count(store: RunStore) -> None:
    await store.submit("agent", {}, max_attempts=2)
    a = await claim_one(store, "A", lease_seconds=SHORT)
    await asyncio.sleep(SHORT + 0.1)
    b = await claim_one(store, "B", lease_seconds=SHORT)
    assert b.attempt == 2
    assert await store.commit_step(b.lease, expected_version=0, next_step="s", checkpoint={})
    await asyncio.sleep(SHORT + 0.1)
    c = await claim_one(store, "C")
    assert c.attempt == 2  # 1 (B's claim, reset by its commit) + this claim
    assert c.fence == a.fence + 2


async def test_retry_requeues_a_dead_run_with_fresh_attempts(store: RunStore) -> None:
    run = (await store.submit("agent", {}, max_attempts=1)).run
    a = await claim_one(store, "A")
    await store.fail_attempt(a.lease, error={"type": "Boom"})
    requeued = await store.retry(run.run_id)
    assert (requeued.state, requeued.attempt) == (RunState.QUEUED, 0)
    b = await claim_one(store, "B")
    assert b.fence == a.fence + 1
    with pytest.raises(InvalidTransition, match="not dead"):
        await store.retry(run.run_id)


async def test_release_keeps_the_fence_and_does_not_count_an_attempt(store: RunStore) -> None:
    await store.submit("agent", {})
    a = await claim_one(store, "A")
    assert await store.release(a.lease, reason="shutdown")
    run = await store.get(a.run_id)
    assert (run.state, run.fence, run.attempt, run.lease_owner) == (RunState.QUEUED, 1, 0, None)
    b = await claim_one(store, "B")
    assert (b.fence, b.attempt) == (2, 1)
    assert not await store.release(a.lease)


async def test_cancel_queued_and_waiting_runs(store: RunStore) -> None:
    queued = (await store.submit("agent", {})).run
    cancelled = await store.cancel(queued.run_id, reason="not needed")
    assert (cancelled.state, cancelled.fence) == (RunState.CANCELLED, 1)
    assert (await store.claim("A", ["agent"])).claimed == []
    events = await store.events(queued.run_id)
    assert events[-1].kind == "cancelled"
    assert events[-1].details["reason"] == "not needed"


async def test_submit_idempotency(store: RunStore) -> None:
    first = await store.submit("agent", {"x": 1}, idempotency_key="order-17")
    again = await store.submit("agent", {"x": 1}, idempotency_key="order-17")
    assert first.created and not again.created
    assert again.run.run_id == first.run.run_id
    with pytest.raises(IdempotencyConflict, match="order-17"):
        await store.submit("agent", {"x": 2}, idempotency_key="order-17")
    assert len(await store.list_runs()) == 1


async def test_submit_rejects_bad_input_and_changes_nothing(store: RunStore) -> None:
    small = RunStore(store.pool, max_input_bytes=100)
    bad: list[tuple[str, Any, dict[str, Any]]] = [
        ("agent", [1, 2], {}),
        ("agent", "text", {}),
        ("agent", {"blob": "x" * 200}, {}),
        ("bad agent!", {}, {}),
        ("agent", {}, {"run_id": "has space"}),
        ("agent", {}, {"run_id": "9starts-with-digit"}),
        ("agent", {}, {"max_attempts": 0}),
        ("agent", {"nan": float("nan")}, {}),
    ]
    for agent, payload, options in bad:
        with pytest.raises(InvalidInput):
            await small.submit(agent, payload, **options)
    assert await store.list_runs() == []


async def test_explicit_run_id_must_be_unique(store: RunStore) -> None:
    await store.submit("agent", {}, run_id="r_fixed")
    with pytest.raises(RunAlreadyExists):
        await store.submit("agent", {}, run_id="r_fixed")


async def test_unknown_and_malformed_run_ids(store: RunStore) -> None:
    with pytest.raises(RunNotFound):
        await store.get("r_missing")
    with pytest.raises(RunNotFound):
        await store.cancel("r_missing")
    with pytest.raises(InvalidInput, match="malformed run id"):
        await store.get("r_1; drop table runs")


async def test_list_filters_by_state_and_agent(store: RunStore) -> None:
    for agent in ("a", "a", "b"):
        await store.submit(agent, {})
    await store.claim("w", ["b"])
    assert {r.agent for r in await store.list_runs(agent="a")} == {"a"}
    assert [r.agent for r in await store.list_runs(state=RunState.RUNNING)] == ["b"]
    assert len(await store.list_runs(limit=2)) == 2


async def test_group_commit_checks_each_run_and_refuses_only_the_stale_ones(
    store: RunStore, pool: asyncpg.Pool
) -> None:
    from orchestrator.db.store import RunFinish, StepCommit

    for n in range(4):
        await store.submit("agent", {"n": n})
    claims = (await store.claim("W", ["agent"], limit=4, lease_seconds=30)).claimed
    await store.cancel(claims[1].run_id)  # raises the fence: W's lease on it is stale
    before = await snapshot(pool, claims[1].run_id)
    committed = await store.commit_steps(
        "W",
        [
            # A JSON list checkpoint must stay a list (not become another array dimension).
            StepCommit(claims[0].lease, 0, "next", [1, [2, 3]], [StepEvent("note", {"a": 1})]),
            StepCommit(claims[1].lease, 0, "next", {"k": "stale"}),
            StepCommit(claims[2].lease, 7, "next", {"k": "wrong version"}),
            StepCommit(claims[3].lease, 0, "next", None),
        ],
    )
    assert set(committed) == {claims[0].run_id, claims[3].run_id}
    assert (await store.get(claims[0].run_id)).checkpoint == [1, [2, 3]]
    assert await snapshot(pool, claims[1].run_id) == before
    assert (await store.get(claims[2].run_id)).checkpoint_version == 0
    kinds = [e.kind for e in await store.events(claims[0].run_id)]
    assert kinds[-2:] == ["checkpoint", "note"]

    finished = await store.finish_many(
        "W",
        [
            RunFinish(claims[0].lease, 1, RunState.SUCCEEDED, result=["a", "b"]),
            RunFinish(claims[1].lease, 0, RunState.SUCCEEDED, result="stale"),
            RunFinish(claims[3].lease, 1, RunState.FAILED, error={"type": "Fail"}),
        ],
    )
    assert finished == {claims[0].run_id, claims[3].run_id}
    done = await store.get(claims[0].run_id)
    assert (done.state, done.result, done.checkpoint) == (
        RunState.SUCCEEDED,
        ["a", "b"],
        [1, [2, 3]],
    )
    failed = await store.get(claims[3].run_id)
    assert (failed.state, failed.error) == (RunState.FAILED, {"type": "Fail"})
    assert await snapshot(pool, claims[1].run_id) == before
    with pytest.raises(ValueError, match="one worker at a time"):
        await store.commit_steps("other", [StepCommit(claims[2].lease, 0, "n", {})])


async def test_claim_with_a_repeated_agent_name_still_fills_the_limit(store: RunStore) -> None:
    for _ in range(2):
        await store.submit("agent", {})
    batch = await store.claim("W", ["agent", "agent"], limit=2)
    assert len(batch.claimed) == 2


async def test_a_run_is_only_finished_as_succeeded_or_failed(store: RunStore) -> None:
    from orchestrator.db.store import RunFinish

    await store.submit("agent", {})
    run = await claim_one(store, "W")
    for state in (RunState.QUEUED, RunState.CANCELLED, RunState.DEAD):
        with pytest.raises(ValueError, match="succeeded or failed"):
            await store.finish_many("W", [RunFinish(run.lease, 0, state)])
    assert (await store.get(run.run_id)).state is RunState.RUNNING


def _most_rows_removed_by_a_join_filter(plan: Any) -> int:
    """The largest "Rows Removed by Join Filter" (times its loops) anywhere in a JSON plan."""
    if isinstance(plan, list):
        return max((_most_rows_removed_by_a_join_filter(item) for item in plan), default=0)
    if not isinstance(plan, dict):
        return 0
    own = int(plan.get("Rows Removed by Join Filter", 0)) * int(plan.get("Actual Loops", 1))
    nested = [_most_rows_removed_by_a_join_filter(value) for value in plan.values()]
    return max([own, *nested])


def _scans_of_runs(plan: Any) -> set[tuple[str, str | None]]:
    """(node type, index) of every node of a JSON plan that reads the runs table."""
    if isinstance(plan, list):
        return set().union(*(_scans_of_runs(item) for item in plan))
    if not isinstance(plan, dict):
        return set()
    own = (
        {(plan["Node Type"], plan.get("Index Name"))}
        if plan.get("Relation Name") == "runs"
        else set()
    )
    return own.union(*(_scans_of_runs(value) for value in plan.values()))


async def _queue_analyzed(pool: asyncpg.Pool, count: int) -> None:
    """``count`` queued no-op runs, and statistics taken while every one of them is queued."""
    await pool.execute(
        "INSERT INTO runs (run_id, agent, input) "
        "SELECT 'r_plan' || lpad(g::text, 5, '0'), 'noop', '{}' "
        "FROM generate_series(1, $1::int) AS g",
        count,
    )
    await pool.execute("ANALYZE runs")


async def test_batched_writes_reach_each_run_by_its_key_whatever_the_statistics(
    store: RunStore, pool: asyncpg.Pool
) -> None:
    # Statistics taken while nothing runs say no run is running or owned by this worker, and
    # that no lease is unexpired. Written the plain way, the batched statements then re-read
    # the whole batch once per running run (n x n rows), or hashed a scan of the whole table
    # (every run, finished or queued, for each batch).
    await _queue_analyzed(pool, 20000)
    claimed = (await store.claim("w1", ["noop"], limit=300, lease_seconds=60)).claimed
    count = len(claimed)
    assert count == 300
    ids = [run.run_id for run in claimed]
    fences = [run.fence for run in claimed]
    statements: list[tuple[str, tuple[Any, ...]]] = [
        ("renew_leases", (ids, fences, [60.0] * count, "w1")),
        (
            "commit_steps",
            (
                "w1",
                ids,
                fences,
                [0] * count,
                ["Done"] * count,
                ["{}"] * count,
                ['[{"kind": "checkpoint", "details": {}}]'] * count,
                ["1"] * count,
            ),
        ),
        (
            "finish_runs",
            (
                "w1",
                ids,
                fences,
                [1] * count,
                ["succeeded"] * count,
                ['{"ok": true}'] * count,
                [None] * count,
                [None] * count,
                ["1"] * count,
            ),
        ),
    ]
    for name, arguments in statements:
        text = await pool.fetchval("EXPLAIN (ANALYZE, FORMAT JSON) " + query(name), *arguments)
        plan = json.loads(text) if isinstance(text, str) else text
        assert _most_rows_removed_by_a_join_filter(plan) < count, (name, plan)
        # Through its primary key only (a bitmap scan is over runs_pkey: nothing else
        # matches a run id); never a sequential scan or the partial indexes.
        reads = _scans_of_runs(plan) - {("ModifyTable", None)}
        assert reads and reads <= {("Index Scan", "runs_pkey"), ("Bitmap Heap Scan", None)}, (
            name,
            reads,
        )
    states = await pool.fetch(
        "SELECT state, checkpoint_version, count(*) FROM runs GROUP BY 1, 2 ORDER BY 1"
    )
    assert [tuple(row) for row in states] == [("queued", 0, 19700), ("succeeded", 2, 300)]


async def test_single_run_writes_reach_the_run_by_its_key_under_a_generic_plan(
    settings: Settings, store: RunStore, pool: asyncpg.Pool
) -> None:
    # asyncpg prepares every statement, and after five executions PostgreSQL may keep a generic
    # plan. With `state = 'running'` in their WHERE, the single-run writes then matched the
    # partial indexes runs_owner and runs_running, and read every running run of the owner
    # (1.3 ms a commit with 2,000 leases held) instead of one primary-key lookup.
    await _queue_analyzed(pool, 20000)
    claimed = (await store.claim("w1", ["noop"], limit=300, lease_seconds=60)).claimed
    run = claimed[0]
    statements: list[tuple[str, str]] = [
        ("renew_lease", f"'{run.run_id}', 'w1', {run.fence}, 60.0"),
        ("commit_step", f"'{run.run_id}', 'w1', {run.fence}, 0, 'Done', '{{}}', '[]', '1'"),
        ("fail_attempt", f"'{run.run_id}', 'w1', {run.fence}, '{{}}', 1.0, 60.0"),
        ("release_lease", f"'{run.run_id}', 'w1', {run.fence}, 'test'"),
    ]
    generic = await create_pool(
        settings, application_name="test-plans", max_size=1, session_settings=GENERIC_PLANS
    )
    try:
        async with generic.acquire() as connection:
            for name, arguments in statements:
                await connection.execute(f"PREPARE {name} AS " + query(name))
                text = await connection.fetchval(
                    f"EXPLAIN (FORMAT JSON) EXECUTE {name}({arguments})"
                )
                plan = json.loads(text) if isinstance(text, str) else text
                reads = _scans_of_runs(plan) - {("ModifyTable", None)}
                assert reads == {("Index Scan", "runs_pkey")}, (name, plan)
            # The budget's reservation is a function: its lookup shows in the index counters.
            scans = (
                "SELECT indexrelname, idx_scan FROM pg_stat_user_indexes "
                "WHERE indexrelname IN ('runs_pkey', 'runs_owner', 'runs_running')"
            )
            lease = claimed[1]
            await connection.execute("SELECT pg_stat_force_next_flush()")
            before = {row[0]: row[1] for row in await connection.fetch(scans)}
            for _ in range(10):
                outcome = await connection.fetchval(
                    "SELECT outcome FROM orchestrator_reserve_budget($1, 'w1', $2, '{}'::jsonb, "
                    "1, 0, 0, 0)",
                    lease.run_id,
                    lease.fence,
                )
                assert outcome == "reserved"
            await connection.execute("SELECT pg_stat_force_next_flush()")
            await connection.execute("SELECT pg_stat_clear_snapshot()")
            after = {row[0]: row[1] for row in await connection.fetch(scans)}
            assert after["runs_owner"] == before["runs_owner"], (before, after)
            assert after["runs_running"] == before["runs_running"], (before, after)
            assert after["runs_pkey"] >= before["runs_pkey"] + 10, (before, after)
    finally:
        await generic.close()


@pytest.mark.parametrize("keyed_elsewhere", [0, 20000])
async def test_the_claim_statements_generic_plan_reads_runs_only_through_indexes(
    settings: Settings, pool: asyncpg.Pool, keyed_elsewhere: int
) -> None:
    # The supervisor claims on a connection with GENERIC_PLANS (planned once, whatever the
    # parameters), so that one plan must be good for every claim: due runs found through
    # runs_due, expired leases through runs_running, each claimed row updated through its key.
    # Another agent's backlog of keyed runs must not change that: the question whether this
    # agent has a due keyed run was planned as a scan of the whole table once the statistics
    # counted many keyed runs (40 ms a claim at 100,000 of them).
    await pool.execute(
        "INSERT INTO runs (run_id, agent, input, concurrency_key) "
        "SELECT 'r_keyed' || g, 'tenants', '{}', 'k' || g % 1000 "
        "FROM generate_series(1, $1::int) AS g",
        keyed_elsewhere,
    )
    await _queue_analyzed(pool, 20000)
    claims = await create_pool(
        settings, application_name="test-claims", max_size=1, session_settings=GENERIC_PLANS
    )
    try:
        async with claims.acquire() as connection:
            assert await connection.fetchval("SHOW plan_cache_mode") == "force_generic_plan"
            await connection.execute("PREPARE claim AS " + query("claim"))
            for include_expired in ("true", "false"):
                text = await connection.fetchval(
                    "EXPLAIN (FORMAT JSON) EXECUTE claim('w1', '{noop}', 200, 45.0, "
                    f'{include_expired}, NULL, NULL, \'{{"noop": ["1"]}}\')'
                )
                plan = json.loads(text) if isinstance(text, str) else text
                assert _scans_of_runs(plan) == {
                    ("Index Scan", "runs_running"),
                    ("Index Scan", "runs_due_plain"),
                    ("Index Only Scan", "runs_due_keyed"),  # is any keyed run due? (flow)
                    ("Index Scan", "runs_pkey"),
                    ("ModifyTable", None),
                }, plan
            claimed = await connection.fetch(
                query("claim"), "w1", ["noop"], 200, 45.0, True, None, None, {"noop": ["1"]}
            )
            assert len(claimed) == 200
    finally:
        await claims.close()
