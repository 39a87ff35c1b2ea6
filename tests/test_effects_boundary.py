"""The fenced effect boundary's rules, on a real database (invariants 4 and 5)."""

from __future__ import annotations

import asyncio
from typing import Any

import asyncpg
import pytest

from orchestrator.effects.model import Effect, EffectPolicy, EffectStatus, idempotency_key
from orchestrator.effects.store import EffectStore
from orchestrator.models import ClaimedRun
from orchestrator.store import RunStore

EMAIL = Effect("summary-email", "email", {"to": "a@example.com", "subject": "s", "body": "b"})


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
    await store.submit("agent", {})
    a = await claim(store, "A", lease=0.2)
    await accept(pool, a, EMAIL)
    await asyncio.sleep(0.3)
    b = await claim(store, "B")
    changed = Effect("summary-email", "email", {"to": "other@example.com"})
    answer = await accept(pool, b, changed)
    assert answer.outcome == "existing"
    (row,) = await effect_rows(pool)
    assert (row["fence"], row["payload"]["to"]) == (1, "a@example.com")
    assert await pool.fetchval("SELECT fence FROM effect_fences") == 2


async def test_replaceable_newer_fence_supersedes_an_undispatched_record(
    store: RunStore, pool: asyncpg.Pool
) -> None:
    crm = Effect("crm-status", "crm", {"status": "draft"}, EffectPolicy.REPLACEABLE)
    await store.submit("agent", {})
    a = await claim(store, "A", lease=0.2)
    await accept(pool, a, crm)
    await asyncio.sleep(0.3)
    b = await claim(store, "B")
    answer = await accept(
        pool, b, Effect("crm-status", "crm", {"status": "final"}, EffectPolicy.REPLACEABLE)
    )
    assert answer.outcome == "replaced"
    (row,) = await effect_rows(pool)
    assert (row["fence"], row["payload"], row["status"]) == (2, {"status": "final"}, "accepted")
    superseded = [e for e in await store.events(a.run_id) if e.kind == "effect_superseded"]
    assert [(e.fence, e.details["by_fence"]) for e in superseded] == [(1, 2)]
    assert superseded[0].details["superseded_payload"] == {"status": "draft"}


async def test_replaceable_record_already_dispatched_is_not_replaced(
    store: RunStore, pool: asyncpg.Pool
) -> None:
    crm = Effect("crm-status", "crm", {"status": "draft"}, EffectPolicy.REPLACEABLE)
    await store.submit("agent", {})
    a = await claim(store, "A", lease=0.2)
    await accept(pool, a, crm)
    async with pool.acquire() as db:
        claimed = await EffectStore(pool).claim(db, "d1", ["crm"], limit=5, lease_seconds=30)
    assert len(claimed) == 1
    await asyncio.sleep(0.3)
    b = await claim(store, "B")
    answer = await accept(
        pool, b, Effect("crm-status", "crm", {"status": "final"}, EffectPolicy.REPLACEABLE)
    )
    assert (answer.outcome, answer.status) == ("existing", EffectStatus.DISPATCHING)
    (row,) = await effect_rows(pool)
    assert row["payload"] == {"status": "draft"}


async def test_a_stale_fence_is_rejected_recorded_and_changes_nothing(
    store: RunStore, pool: asyncpg.Pool
) -> None:
    await store.submit("agent", {})
    a = await claim(store, "A", lease=0.2)
    await asyncio.sleep(0.3)
    b = await claim(store, "B")
    # B has not asked for anything yet; A, woken up, asks first: still stale (fence 1 < 2).
    before = await effect_rows(pool)
    answer = await accept(pool, a, EMAIL)
    assert (answer.outcome, answer.accepted_fence) == ("stale", 2)
    assert await effect_rows(pool) == before
    rejected = [e for e in await store.events(a.run_id) if e.kind == "stale_fence_rejected"]
    assert [(e.fence, e.worker_id, e.details["accepted_fence"]) for e in rejected] == [(1, "A", 2)]
    assert (await accept(pool, b, EMAIL)).outcome == "accepted"


async def test_the_high_water_mark_alone_rejects_lower_fences(
    store: RunStore, pool: asyncpg.Pool
) -> None:
    """For a boundary that cannot see the runs table: only effect_fences decides."""
    other_run = "r_elsewhere"
    store_e = EffectStore(pool)
    async with pool.acquire() as db:
        first = await store_e.accept(db, other_run, 5, EMAIL, worker_id="x")
        lower = await store_e.accept(
            db, other_run, 4, Effect("k2", "email", {"to": "b@example.com"}), worker_id="y"
        )
        higher = await store_e.accept(
            db, other_run, 6, Effect("k3", "email", {"to": "c@example.com"}), worker_id="z"
        )
    assert (first.outcome, lower.outcome, higher.outcome) == ("accepted", "stale", "accepted")
    assert await pool.fetchval("SELECT fence FROM effect_fences WHERE run_id = $1", other_run) == 6


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
