"""The fenced effect boundary's rules, on a real database (invariants 4 and 5)."""

from __future__ import annotations

import asyncio
from typing import Any

import anyio
import asyncpg
import pytest

from orchestrator.backoff import Backoff
from orchestrator.db.connections import connect
from orchestrator.db.migrations import migrate
from orchestrator.db.store import RunStore
from orchestrator.effect_model import Effect, EffectPolicy, EffectStatus, idempotency_key
from orchestrator.effects.store import EffectStore
from orchestrator.models import ClaimedRun
from orchestrator.settings import Settings
from support import install_an_earlier_release

EMAIL = Effect("summary-email", "email", {"to": "a@example.com", "subject": "s", "body": "b"})
DRAFT = Effect("crm-status", "crm", {"status": "draft"}, EffectPolicy.REPLACEABLE)
FINAL = Effect("crm-status", "crm", {"status": "final"}, EffectPolicy.REPLACEABLE)


async def claim(store: RunStore, worker: str, lease: float = 30) -> ClaimedRun:
    batch = await store.claim(worker, ["agent"], limit=1, lease_seconds=lease)
    assert len(batch.claimed) == 1
    return batch.claimed[0]


async def accept(
    pool: asyncpg.Pool, run: ClaimedRun, effect: Effect, fence: int | None = None
) -> Any:
    async with pool.acquire() as db, db.transaction():
        return await EffectStore(pool).accept(
            db,
            run.run_id,
            run.fence if fence is None else fence,
            effect,
            worker_id=run.lease.worker_id,
        )


async def claimed_by_a_briefly(store: RunStore) -> ClaimedRun:
    """A new run, claimed by A on a lease that lapses before ``taken_over_by_b``."""
    await store.submit("agent", {})
    return await claim(store, "A", lease=0.2)


async def taken_over_by_b(store: RunStore) -> ClaimedRun:
    await asyncio.sleep(0.3)  # past A's lease
    return await claim(store, "B")


async def retry_later(pool: asyncpg.Pool, run: ClaimedRun, *, seconds: float) -> None:
    """Fail the claimed attempt with its retry due in ``seconds``: the run waits meanwhile."""
    patient = RunStore(pool, backoff=Backoff(base_seconds=seconds))
    assert await patient.fail_attempt(run.lease, error={"message": "try again"})


async def effect_rows(pool: asyncpg.Pool) -> list[dict[str, Any]]:
    return [dict(r) for r in await pool.fetch("SELECT * FROM effects ORDER BY run_id, effect_key")]


async def test_a_new_request_is_accepted_with_a_stable_idempotency_key(
    store: RunStore, pool: asyncpg.Pool
) -> None:
    await store.submit("agent", {})
    run = await claim(store, "A")
    acceptance = await accept(pool, run, EMAIL)
    assert (acceptance.outcome, acceptance.accepted_fence) == ("accepted", 1)
    record = await EffectStore(pool).get(run.run_id, "summary-email")
    assert record.status is EffectStatus.ACCEPTED
    assert record.idempotency_key == idempotency_key(run.run_id, "summary-email")
    assert [e.kind for e in await store.events(run.run_id)][-1] == "effect_accepted"


async def test_the_same_request_again_gets_the_existing_record(
    store: RunStore, pool: asyncpg.Pool
) -> None:
    await store.submit("agent", {})
    run = await claim(store, "A")
    await accept(pool, run, EMAIL)
    again = await accept(pool, run, EMAIL)
    assert (again.outcome, again.status) == ("existing", EffectStatus.ACCEPTED)
    assert len(await effect_rows(pool)) == 1


async def test_irreversible_later_fence_gets_the_existing_outcome_never_a_second_record(
    store: RunStore, pool: asyncpg.Pool
) -> None:
    a = await claimed_by_a_briefly(store)
    await accept(pool, a, EMAIL)
    b = await taken_over_by_b(store)
    changed = Effect("summary-email", "email", {"to": "other@example.com"})
    answer = await accept(pool, b, changed)
    assert answer.outcome == "existing"
    (row,) = await effect_rows(pool)
    assert (row["fence"], row["payload"]["to"]) == (1, "a@example.com")
    assert await pool.fetchval("SELECT fence FROM effect_fences") == 2


async def test_replaceable_newer_fence_supersedes_an_undispatched_record(
    store: RunStore, pool: asyncpg.Pool
) -> None:
    a = await claimed_by_a_briefly(store)
    await accept(pool, a, DRAFT)
    b = await taken_over_by_b(store)
    answer = await accept(pool, b, FINAL)
    assert answer.outcome == "replaced"
    (row,) = await effect_rows(pool)
    assert (row["fence"], row["payload"], row["status"]) == (2, {"status": "final"}, "accepted")
    superseded = [e for e in await store.events(a.run_id) if e.kind == "effect_superseded"]
    assert [(e.fence, e.details["by_fence"]) for e in superseded] == [(1, 2)]
    assert superseded[0].details["superseded_payload"] == {"status": "draft"}


async def test_replaceable_record_already_dispatched_is_not_replaced(
    store: RunStore, pool: asyncpg.Pool
) -> None:
    a = await claimed_by_a_briefly(store)
    await accept(pool, a, DRAFT)
    async with pool.acquire() as db:
        claimed = await EffectStore(pool).claim(db, "d1", ["crm"], limit=5, lease_seconds=30)
    assert len(claimed) == 1
    b = await taken_over_by_b(store)
    answer = await accept(pool, b, FINAL)
    assert (answer.outcome, answer.status) == ("existing", EffectStatus.DISPATCHING)
    (row,) = await effect_rows(pool)
    assert row["payload"] == {"status": "draft"}


async def test_a_stale_fence_is_rejected_recorded_and_changes_nothing(
    store: RunStore, pool: asyncpg.Pool
) -> None:
    a = await claimed_by_a_briefly(store)
    b = await taken_over_by_b(store)
    # B has not asked for anything yet; A, woken up, asks first: still stale (fence 1 < 2).
    before = await effect_rows(pool)
    answer = await accept(pool, a, EMAIL)
    assert (answer.outcome, answer.accepted_fence) == ("stale", 2)
    assert await effect_rows(pool) == before
    rejected = [e for e in await store.events(a.run_id) if e.kind == "stale_fence_rejected"]
    assert [(e.fence, e.worker_id, e.details["accepted_fence"]) for e in rejected] == [(1, "A", 2)]
    assert (await accept(pool, b, EMAIL)).outcome == "accepted"


async def boundary_state(pool: asyncpg.Pool) -> tuple[Any, ...]:
    """Everything an effect request could change."""
    return (
        await effect_rows(pool),
        [dict(r) for r in await pool.fetch("SELECT run_id, fence FROM effect_fences")],
        await pool.fetchval("SELECT count(*) FROM run_events WHERE kind = 'effect_accepted'"),
    )


async def test_an_unknown_run_gets_nothing_recorded(store: RunStore, pool: asyncpg.Pool) -> None:
    before = await boundary_state(pool)
    async with pool.acquire() as db:
        answer = await EffectStore(pool).accept(db, "r_nobody", 1, EMAIL, worker_id="x")
    assert answer.outcome == "unknown_run" and answer.outcome.refused
    assert "no run with id 'r_nobody'" in answer.explain("r_nobody", EMAIL.key)
    assert await boundary_state(pool) == before
    assert await pool.fetchval("SELECT count(*) FROM run_events") == 0


async def test_a_fence_the_run_never_had_is_refused_and_fences_out_no_one(
    store: RunStore, pool: asyncpg.Pool
) -> None:
    """Invariant 8: one request with a fence from the future cannot fence out the owner."""
    await store.submit("agent", {})
    owner = await claim(store, "A")
    before = await boundary_state(pool)
    future = await accept(pool, owner, EMAIL, fence=1_000_000)
    assert (future.outcome, future.accepted_fence) == ("future_fence", owner.fence)
    assert "fence 1000000 was never granted" in future.explain(owner.run_id, EMAIL.key)
    assert await boundary_state(pool) == before
    refused = [e for e in await store.events(owner.run_id) if e.kind == "effect_refused"]
    assert [(e.fence, e.details["reason"], e.details["current_fence"]) for e in refused] == [
        (1_000_000, "future_fence", 1)
    ]
    # The live owner is untouched: its effect and its commit both go through.
    assert (await accept(pool, owner, EMAIL)).outcome == "accepted"
    assert await store.commit_step(owner.lease, expected_version=0, next_step="next", checkpoint={})


async def test_a_stale_fence_for_a_waiting_run_says_it_waits_not_that_another_worker_owns_it(
    store: RunStore, pool: asyncpg.Pool
) -> None:
    await store.submit("agent", {})
    first = await claim(store, "A")
    await retry_later(pool, first, seconds=0.001)
    await anyio.sleep(0.05)
    second = await claim(store, "B")
    assert (second.run_id, second.fence) == (first.run_id, first.fence + 1)
    await retry_later(pool, second, seconds=600)
    stale = await accept(pool, first, EMAIL)
    assert (stale.outcome, stale.run_state) == ("stale", "waiting")
    said = stale.explain(first.run_id, EMAIL.key)
    assert "another worker owns" not in said and "waiting" in said, said
    assert await effect_rows(pool) == []


async def test_effects_are_refused_for_a_run_not_running_under_that_fence(
    store: RunStore, pool: asyncpg.Pool
) -> None:
    """Waiting (a retry scheduled) and finished runs take no effects, even at their fence."""
    await store.submit("agent", {})
    a = await claim(store, "A")
    await retry_later(pool, a, seconds=600)
    waiting = await accept(pool, a, EMAIL)
    assert (waiting.outcome, waiting.run_state) == ("not_running", "waiting")
    assert "is waiting, not running" in waiting.explain(a.run_id, EMAIL.key)

    await store.submit("agent", {})
    b = await claim(store, "B")
    assert b.run_id != a.run_id  # a waits for its retry's backoff
    assert await store.finish(b.lease, expected_version=0, result={})
    finished = await accept(pool, b, EMAIL)
    assert (finished.outcome, finished.run_state) == ("not_running", "succeeded")
    assert "has already ended (succeeded)" in finished.explain(b.run_id, EMAIL.key)
    assert await effect_rows(pool) == []


async def test_migration_0005_lowers_a_mark_a_fence_from_the_future_had_raised(
    empty_database: str,
) -> None:
    """A database that took a fence the run never had (the old rule) lets its owner act again."""
    # A database of a release before 0.2: its objects in public, at version 4.
    connection = await connect(Settings(database_url=empty_database, schema="public"))
    try:
        await install_an_earlier_release(connection, migrations=4)
        await connection.execute(
            "INSERT INTO runs (run_id, agent, input, state, fence, lease_owner, lease_until) "
            "VALUES ('r_1', 'agent', '{}', 'running', 1, 'A', clock_timestamp() + interval '1h')"
        )
        old_answer = await connection.fetchval(
            "SELECT outcome FROM orchestrator_accept_effect('r_1', 'k', 1000000, 'email', "
            "'irreversible', '{}', 'idem-1', 'attacker')"
        )
        assert old_answer == "accepted"  # the defect: the mark is now 1,000,000
        await connection.close()
        connection = await connect(Settings(database_url=empty_database))
        await migrate(connection)
        assert await connection.fetchval("SELECT fence FROM effect_fences") == 1
        answer = await connection.fetchval(
            "SELECT outcome FROM orchestrator_accept_effect('r_1', 'k2', 1, 'email', "
            "'irreversible', '{}', 'idem-2', 'A', false, 86400)"
        )
        assert answer == "accepted"
    finally:
        await connection.close()


async def test_cancel_raises_the_boundary_fence_and_withdraws_undispatched_effects(
    store: RunStore, pool: asyncpg.Pool
) -> None:
    await store.submit("agent", {})
    a = await claim(store, "A")
    await accept(pool, a, EMAIL)
    await store.cancel(a.run_id)
    record = await EffectStore(pool).get(a.run_id, "summary-email")
    assert record.status is EffectStatus.REJECTED
    assert await pool.fetchval("SELECT fence FROM effect_fences") == 2
    later = await accept(pool, a, Effect("later", "email", {"to": "x@example.com"}))
    assert later.outcome == "stale"


async def test_a_key_reused_with_another_kind_is_a_conflict(
    store: RunStore, pool: asyncpg.Pool
) -> None:
    await store.submit("agent", {})
    a = await claim(store, "A")
    await accept(pool, a, EMAIL)
    answer = await accept(pool, a, Effect("summary-email", "sms", {"to": "+1"}))
    assert answer.outcome == "conflict"


def test_malformed_effect_keys_are_refused() -> None:
    from orchestrator.errors import InvalidInput

    with pytest.raises(InvalidInput, match="malformed effect key"):
        Effect("has space", "email", {})
