"""Retention: only finished runs past the age go, with everything kept for them; never a live run
or one whose effect is still in flight; the CLI's dry run changes nothing."""

from __future__ import annotations

import json
from datetime import timedelta

import asyncpg
import pytest

from orchestrator import Effect
from orchestrator.db.purges import RETENTION_LOCK, PurgeStore, purge, purge_round
from orchestrator.db.retention import parse_age, parse_retention
from orchestrator.db.store import RunStore
from orchestrator.effects.store import EffectStore
from orchestrator.errors import InvalidInput
from orchestrator.models import RunState
from support import cli

TABLES = (
    "runs",
    "run_events",
    "run_messages",
    "effects",
    "effect_fences",
    "run_signals",
    "run_budgets",
    "budget_ledger",
)


async def make_run(
    pool: asyncpg.Pool,
    store: RunStore,
    state: str,
    *,
    finished_days_ago: float | None,
    effect_status: str | None = None,
) -> str:
    """A run in ``state`` with an event, a message, a signal, a budget and an effect; even a live
    one gets an old ``finished_at`` when asked, so that only its state keeps it."""
    run_id = (await store.submit("noop", {"n": 1})).run.run_id
    await pool.execute(
        "INSERT INTO run_messages (run_id, seq, turn, role, body, fence) "
        "VALUES ($1, 0, 0, 'user', '{}', 1)",
        run_id,
    )
    await pool.execute(
        "INSERT INTO run_signals (run_id, name, data) VALUES ($1, 'note', 'null')", run_id
    )
    await pool.execute("INSERT INTO run_budgets (run_id, turns_limit) VALUES ($1, 5)", run_id)
    await pool.execute(
        "INSERT INTO budget_ledger (run_id, kind, turns) VALUES ($1, 'top_up', 1)", run_id
    )
    if effect_status is not None:
        await pool.execute(
            "UPDATE runs SET state = 'running', fence = 1, lease_owner = 'w', "
            "lease_until = clock_timestamp() + interval '1 minute' WHERE run_id = $1",
            run_id,
        )
        async with pool.acquire() as connection, connection.transaction():
            await EffectStore(pool).accept(
                connection, run_id, 1, Effect("mail", "email", {"to": "a@b.c"}), worker_id="w"
            )
        await pool.execute(
            "UPDATE effects SET status = $2 WHERE run_id = $1", run_id, effect_status
        )
    await pool.execute(
        "UPDATE runs SET state = $2, lease_owner = CASE WHEN $2 = 'running' THEN 'w' END, "
        "lease_until = CASE WHEN $2 = 'running' THEN clock_timestamp() + interval '1 hour' END, "
        "finished_at = CASE WHEN $3::float8 IS NULL THEN NULL "
        "ELSE clock_timestamp() - make_interval(secs => $3::float8 * 86400) END, "
        "created_at = clock_timestamp() - interval '400 days' WHERE run_id = $1",
        run_id,
        state,
        finished_days_ago,
    )
    return run_id


async def rows_of(pool: asyncpg.Pool, run_id: str) -> dict[str, int]:
    return {
        table: await pool.fetchval(f"SELECT count(*) FROM {table} WHERE run_id = $1", run_id)
        for table in TABLES
    }


async def test_only_old_finished_runs_are_deleted_with_everything_kept_for_them(
    pool: asyncpg.Pool, store: RunStore
) -> None:
    old = {
        state: await make_run(pool, store, state, finished_days_ago=40, effect_status="confirmed")
        for state in ("succeeded", "failed", "cancelled", "dead")
    }
    recent = await make_run(pool, store, "succeeded", finished_days_ago=5)
    live = {
        state: await make_run(pool, store, state, finished_days_ago=40)
        for state in ("queued", "waiting", "running")
    }
    in_flight = {
        status: await make_run(pool, store, "succeeded", finished_days_ago=40, effect_status=status)
        for status in ("accepted", "dispatching", "uncertain", "parked", "awaiting_approval")
    }
    for run_id in old.values():
        assert all((await rows_of(pool, run_id)).values())  # something in every table
    cutoff = await store.database_now() - timedelta(days=30)
    assert await PurgeStore(pool).count(cutoff) == 4

    purged = await purge(pool, cutoff, batch=3)  # two batches

    assert purged.runs == 4 and purged.other_rows >= 4 * (len(TABLES) - 1)
    for run_id in old.values():
        assert set((await rows_of(pool, run_id)).values()) == {0}, run_id
    for run_id in (recent, *live.values(), *in_flight.values()):
        assert (await rows_of(pool, run_id))["runs"] == 1, run_id
        assert (await rows_of(pool, run_id))["run_events"] >= 1
    for state, run_id in live.items():
        assert (await store.get(run_id)).state is RunState(state)
    assert await PurgeStore(pool).count(cutoff) == 0
    assert (await purge(pool, cutoff)).runs == 0


async def test_one_worker_purges_at_a_time(pool: asyncpg.Pool, store: RunStore) -> None:
    run_id = await make_run(pool, store, "succeeded", finished_days_ago=2)
    async with pool.acquire() as holder, holder.transaction():
        await holder.execute(
            "SELECT pg_advisory_xact_lock(hashtextextended($1 || current_schema(), 0))",
            RETENTION_LOCK,
        )
        assert await purge_round(pool, timedelta(days=1)) is None  # another worker purges
    purged = await purge_round(pool, timedelta(days=1))
    assert purged is not None and purged.runs == 1
    assert (await rows_of(pool, run_id))["runs"] == 0


async def test_the_cli_dry_run_changes_nothing_and_bad_ages_are_one_line(
    database_url: str, pool: asyncpg.Pool, store: RunStore
) -> None:
    run_id = await make_run(pool, store, "succeeded", finished_days_ago=10)
    dry = cli(database_url, "runs", "purge", "--older-than", "7d", "--dry-run", "--json")
    assert dry.returncode == 0, dry.stderr
    assert json.loads(dry.stdout)["runs"] == 1
    assert (await rows_of(pool, run_id))["runs"] == 1
    for bad in ("7", "-3d", "0s", "soon", "1000000d"):
        done = cli(database_url, "runs", "purge", "--older-than", bad)
        assert done.returncode == 1, bad
        assert done.stderr.count("\n") == 1 and "--older-than" in done.stderr, done.stderr
    real = cli(database_url, "runs", "purge", "--older-than", "7d", "--json")
    assert real.returncode == 0, real.stderr
    assert json.loads(real.stdout)["runs"] == 1
    assert (await rows_of(pool, run_id))["runs"] == 0


def test_ages_parse() -> None:
    assert parse_age("30d") == timedelta(days=30)
    assert parse_age(" 1.5h ") == timedelta(minutes=90)
    assert parse_age("2w") == timedelta(days=14)
    assert parse_retention("off") is None
    assert parse_retention("12h") == timedelta(hours=12)
    with pytest.raises(InvalidInput, match="--retention takes an age"):
        parse_retention("a while")


def test_serve_refuses_a_bad_retention_in_one_line(database_url: str) -> None:
    done = cli(database_url, "serve", "--agents", "orchestrator.agents.noop", "--retention", "soon")
    assert done.returncode == 1
    assert done.stderr.strip().startswith("error: --retention takes an age")
    assert done.stderr.count("\n") == 1
