"""Fences that carry an epoch (migration 0015): within an epoch a claim adds one, and the first
claim on a promoted server jumps to its epoch's floor. tests/test_failover.py does this through a
real promotion; here the rule itself on one server, whose epoch a test database may pretend to
move by redefining ``fence_epoch()`` (each test has a database of its own)."""

from __future__ import annotations

import asyncpg
import pytest

from orchestrator.db.grants import quote_ident
from orchestrator.db.store import RunStore
from orchestrator.effect_model import Effect
from orchestrator.effects.store import EffectStore
from orchestrator.fences import EPOCH_BITS, describe_fence, epoch_of

PROMOTED = (
    "CREATE OR REPLACE FUNCTION fence_epoch() RETURNS bigint LANGUAGE sql AS $$ SELECT 1::bigint $$"
)


def test_a_fence_reads_with_its_epoch_after_a_failover() -> None:
    assert describe_fence(7) == "7"
    promoted = (2 << EPOCH_BITS) + 3
    assert epoch_of(promoted) == 2
    assert describe_fence(promoted) == f"{promoted} (epoch 2, #3)"


async def _claim(store: RunStore, pool: asyncpg.Pool, run_id: str) -> int:
    claimed = await store.claim_run("w", run_id, lease_seconds=30)
    assert claimed is not None
    await pool.execute(
        "UPDATE runs SET lease_until = clock_timestamp() - interval '1s' WHERE run_id = $1", run_id
    )
    return claimed.lease.fence


async def test_a_server_never_promoted_is_epoch_zero_and_counts_by_one(
    pool: asyncpg.Pool, store: RunStore
) -> None:
    assert await pool.fetchval("SELECT fence_epoch()") == 0
    run_id = (await store.submit("noop", {})).run.run_id
    assert await pool.fetchval("SELECT born_epoch FROM runs WHERE run_id = $1", run_id) == 0
    assert [await _claim(store, pool, run_id) for _ in range(3)] == [1, 2, 3]


async def test_the_first_claim_after_a_promotion_jumps_past_the_lost_timeline(
    pool: asyncpg.Pool, store: RunStore
) -> None:
    born_before = (await store.submit("noop", {})).run.run_id
    assert await _claim(store, pool, born_before) == 1
    await pool.execute(PROMOTED)
    born_after = (await store.submit("noop", {})).run.run_id
    # Whatever the lost primary granted (< 2**40), the promoted server grants more; then +1.
    first, second = await _claim(store, pool, born_before), await _claim(store, pool, born_before)
    assert (first, second) == (1 << EPOCH_BITS, (1 << EPOCH_BITS) + 1)
    assert await _claim(store, pool, born_after) == 1 << EPOCH_BITS
    # A cancel raises the fence past the floor too.
    await store.cancel(born_after)
    assert (
        await pool.fetchval("SELECT fence FROM runs WHERE run_id = $1", born_after)
        == (1 << EPOCH_BITS) + 1
    )


async def test_effects_of_a_run_born_before_the_promotion_are_looked_up_first(
    pool: asyncpg.Pool, store: RunStore
) -> None:
    born_before = (await store.submit("noop", {})).run.run_id
    await pool.execute(PROMOTED)
    born_after = (await store.submit("noop", {})).run.run_id
    effects = EffectStore(pool)
    for run_id in (born_before, born_after):
        claimed = await store.claim_run("w", run_id, lease_seconds=30)
        assert claimed is not None
        await effects.accept(
            pool, run_id, claimed.lease.fence, Effect("mail", "crm", {"to": "a"}), worker_id="w"
        )
    claims = {
        c.record.run_id: c
        for c in await effects.claim(pool, "d", ["crm"], limit=10, lease_seconds=30)
    }
    assert claims[born_before].must_reconcile and not claims[born_after].must_reconcile
    # Answered once: the flag is gone after that claim.
    flags = await pool.fetch("SELECT run_id, lookup_first FROM effects")
    assert not any(row["lookup_first"] for row in flags)


async def test_an_effect_asked_for_under_a_fence_of_a_lost_epoch_is_looked_up_first(
    pool: asyncpg.Pool, store: RunStore
) -> None:
    """A step claimed before the promotion commits after it (its claim was replicated): the
    lost primary may have taken that commit too and sent its effect, so the copy here is
    looked up before any send."""
    run_id = (await store.submit("noop", {})).run.run_id
    claimed = await store.claim_run("w", run_id, lease_seconds=30)
    assert claimed is not None and epoch_of(claimed.lease.fence) == 0
    await pool.execute(PROMOTED)
    effects = EffectStore(pool)
    await effects.accept(
        pool, run_id, claimed.lease.fence, Effect("mail", "crm", {"to": "a"}), worker_id="w"
    )
    [claim] = await effects.claim(pool, "d", ["crm"], limit=10, lease_seconds=30)
    assert claim.must_reconcile


async def test_an_effect_accepted_before_the_promotion_is_looked_up_before_its_send_after_it(
    pool: asyncpg.Pool, store: RunStore
) -> None:
    """Accepted and replicated, then claimed and sent by a dispatcher on the lost primary (that
    claim lost with it): here it still reads 'accepted', never dispatched."""
    run_id = (await store.submit("noop", {})).run.run_id
    claimed = await store.claim_run("w", run_id, lease_seconds=30)
    assert claimed is not None
    effects = EffectStore(pool)
    for key in ("before", "trusted"):
        await effects.accept(
            pool, run_id, claimed.lease.fence, Effect(key, "crm", {"to": "a"}), worker_id="w"
        )
    await pool.execute(PROMOTED)
    [before] = await effects.claim(pool, "d", ["crm"], limit=1, lease_seconds=30)
    [trusted] = await effects.claim(
        pool, "d", ["crm"], limit=1, lease_seconds=30, trust_sync_replication=True
    )
    assert before.must_reconcile and not before.sent_before
    assert not trusted.must_reconcile
    # The claim records the epoch it was made in: a claim in the same epoch again is plain.
    await pool.execute(
        "UPDATE effects SET status = 'accepted', dispatcher = NULL, dispatcher_until = NULL"
    )
    again = await effects.claim(pool, "d", ["crm"], limit=10, lease_seconds=30)
    assert len(again) == 2 and not any(c.lost_timeline for c in again)


async def test_a_dispatcher_trusting_sync_replication_sends_without_a_lookup(
    pool: asyncpg.Pool, store: RunStore
) -> None:
    run_id = (await store.submit("noop", {})).run.run_id
    await pool.execute(PROMOTED)
    claimed = await store.claim_run("w", run_id, lease_seconds=30)
    assert claimed is not None
    effects = EffectStore(pool)
    await effects.accept(
        pool, run_id, claimed.lease.fence, Effect("mail", "email", {"to": "a"}), worker_id="w"
    )
    [claim] = await effects.claim(
        pool, "d", ["email"], limit=10, lease_seconds=30, trust_sync_replication=True
    )
    assert not claim.must_reconcile


async def set_offset(pool: asyncpg.Pool, offset: str | None) -> None:
    """``ALTER DATABASE ... SET orchestrator.fence_epoch_offset`` (None: RESET), as an operator
    does after a logical restore."""
    database = quote_ident(await pool.fetchval("SELECT current_database()"))
    if offset is None:
        await pool.execute(f"ALTER DATABASE {database} RESET orchestrator.fence_epoch_offset")
    else:
        await pool.execute(
            f"ALTER DATABASE {database} SET orchestrator.fence_epoch_offset = '{offset}'"
        )


async def test_after_a_logical_restore_the_operator_raises_the_epoch(pool: asyncpg.Pool) -> None:
    """pg_restore into a new cluster starts at timeline 1 again; the restored fences' epoch is
    set as an offset (docs/high-availability.md), so the next promotion still grants above."""
    await set_offset(pool, "2")
    try:
        assert await pool.fetchval("SELECT fence_epoch()") == 2
        assert await pool.fetchval("SELECT fence_floor()") == 2 << EPOCH_BITS
    finally:
        await set_offset(pool, None)
    assert await pool.fetchval("SELECT fence_epoch()") == 0


async def test_a_sessions_own_offset_moves_no_fence_and_no_epoch(
    pool: asyncpg.Pool, store: RunStore
) -> None:
    """Only the database's setting counts: a session's SET (any role may make one) reaches into
    no claim, cancel or submission, definer functions included."""
    async with pool.acquire() as connection:
        await connection.execute("SET orchestrator.fence_epoch_offset = '8388607'")
        assert await connection.fetchval("SELECT fence_epoch()") == 0
        run_id = "r_born_in_a_session_epoch"
        born = await connection.fetchval(
            "SELECT born_epoch FROM orchestrator_submit_run($1, 'noop', '{}', 5, NULL, NULL, NULL)",
            run_id,
        )
        assert born == 0
        claimed = await RunStore(pool).claim_run("w", run_id, lease_seconds=30, db=connection)
        assert claimed is not None and claimed.lease.fence == 1
        await connection.execute("RESET orchestrator.fence_epoch_offset")
    cancelled = await store.cancel(run_id)
    assert cancelled.fence == 2


async def test_an_offset_that_is_no_whole_number_or_too_large_is_a_clear_error(
    pool: asyncpg.Pool, store: RunStore
) -> None:
    """Never a floor that silently wraps: 2^23 << 40 would be a negative bigint."""
    run_id = (await store.submit("noop", {})).run.run_id
    try:
        for offset, message in (
            ("abc", "not a whole number"),
            ("-1", "not a whole number"),
            ("8388608", "past 8388607"),
        ):
            await set_offset(pool, offset)
            with pytest.raises(asyncpg.RaiseError, match=message):
                await RunStore(pool).claim_run("w", run_id, lease_seconds=30)
    finally:
        await set_offset(pool, None)
    assert (await store.get(run_id)).fence == 0
