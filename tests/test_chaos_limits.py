"""The chaos checker's flow-control rules: "limit exceeded" and "slot without lease" fail on a
database state that breaks them (made with SQL, as an owner could), stay quiet on one that keeps
them, survive the database going away, and a campaign of keyed runs under limits keeps them."""

from __future__ import annotations

from pathlib import Path

import anyio
import asyncpg
import pytest

from orchestrator.chaos import CampaignConfig, run_campaign
from orchestrator.chaos.checker import LIMIT_EXCEEDED, SLOT_WITHOUT_LEASE, check_leases_released
from orchestrator.chaos.findings import Findings
from orchestrator.chaos.limits import KEYS, LimitSampler, key_matches
from orchestrator.chaos.statements import CAMPAIGN_APPLICATION
from orchestrator.db.connections import create_pool
from orchestrator.db.embedded import EmbeddedPostgres
from orchestrator.db.limits import LimitStore
from orchestrator.db.store import RunStore
from support import started_and_migrated

ACME = "a/acme (per key *)"
BOLT = "a/bolt (per key *)"
IN_ALL = "a (keys * in all)"

COUNTER_WITHOUT_GRACE = """
CREATE OR REPLACE FUNCTION orchestrator_running(p_agent text, p_pattern text, p_per text,
                                                p_key text)
RETURNS integer LANGUAGE sql STABLE AS $$
    SELECT count(*)::integer FROM runs
    WHERE agent = p_agent AND state = 'running'
      AND lease_until > clock_timestamp() - interval '1 hour'
      AND (p_per = 'all' OR concurrency_key = p_key)
$$
"""
"""A broken build's counter: a lease that ended long ago still holds its slot."""


async def submit(store: RunStore, count: int, key: str | None) -> list[str]:
    return [
        (await store.submit("a", {"i": i}, concurrency_key=key)).run.run_id for i in range(count)
    ]


async def hold(pool: asyncpg.Pool, run_ids: list[str], seconds: int = 30) -> None:
    """Give runs a lease ending ``seconds`` from now, as a claim would."""
    await pool.execute(
        "UPDATE runs SET state = 'running', lease_owner = 'w-held', fence = fence + 1,"
        " lease_until = clock_timestamp() + make_interval(secs => $2)"
        " WHERE run_id = ANY($1::text[])",
        run_ids,
        seconds,
    )


def broken(sampler: LimitSampler) -> dict[tuple[str, str], str]:
    return {(v.rule, v.subject): v.detail for v in sampler.violations()}


async def test_more_runs_holding_a_lease_than_a_limit_allows_are_reported(
    store: RunStore, pool: asyncpg.Pool
) -> None:
    acme = await submit(store, 3, "acme")
    others = await submit(store, 1, "bolt") + await submit(store, 1, None)
    ended = await submit(store, 1, "acme")
    await hold(pool, acme + others)
    await hold(pool, ended, seconds=-5)  # ended beyond the grace: holds no slot
    limits = LimitStore(pool)
    await limits.set("a", 3, per="key")
    await limits.set("a", 5)
    await limits.set("a", 1, key_pattern="b*")  # bolt's run alone
    sampler = LimitSampler(pool)
    assert await sampler.sample()
    assert sampler.violations() == []
    assert sampler.peaks == {ACME: 3, BOLT: 1, IN_ALL: 5, "a (keys b* in all)": 1}
    # Lowered below what holds a lease (the campaign never lowers its limits).
    await limits.set("a", 2, per="key")
    await limits.set("a", 4)
    assert await sampler.sample() and await sampler.sample()
    found = broken(sampler)
    assert set(found) == {(LIMIT_EXCEEDED, ACME), (LIMIT_EXCEEDED, IN_ALL)}
    assert found[LIMIT_EXCEEDED, ACME].startswith("3 runs hold a lease, at most 2 may")
    assert found[LIMIT_EXCEEDED, IN_ALL].startswith("5 runs hold a lease, at most 4 may")
    assert all(detail.endswith("in 2 samples)") for detail in found.values())
    findings = Findings()
    sampler.report(findings)
    assert [v.rule for v in findings.violations] == [LIMIT_EXCEEDED, LIMIT_EXCEEDED]
    assert (findings.limit_samples, findings.limit_samples_skipped) == (3, 0)
    assert findings.as_json()["limit_peaks"][ACME] == 3


async def test_a_parked_run_keeping_its_owner_holds_a_slot_without_a_lease(
    store: RunStore, pool: asyncpg.Pool
) -> None:
    """As after a migration that relaxed the lease columns' check: the per-key counter (it reads
    the owner) counts a parked run."""
    running, parked = await submit(store, 2, "acme")
    await hold(pool, [running, parked])
    await LimitStore(pool).set("a", 5, per="key")
    await pool.execute("ALTER TABLE runs DROP CONSTRAINT runs_lease_matches_state")
    await pool.execute("UPDATE runs SET state = 'waiting' WHERE run_id = $1", parked)
    sampler = LimitSampler(pool)
    assert await sampler.sample()
    found = broken(sampler)
    assert set(found) == {(SLOT_WITHOUT_LEASE, parked), (SLOT_WITHOUT_LEASE, ACME)}
    assert found[SLOT_WITHOUT_LEASE, parked].startswith("waiting with lease owner w-held")
    assert found[SLOT_WITHOUT_LEASE, ACME].startswith("orchestrator_running counts 2, 1 hold")
    after = Findings()
    check_leases_released(after, await pool.fetch("SELECT * FROM runs"))
    assert [(v.rule, v.subject) for v in after.violations] == [(SLOT_WITHOUT_LEASE, parked)]


async def test_a_counter_that_keeps_an_ended_lease_s_slot_is_reported(
    store: RunStore, pool: asyncpg.Pool
) -> None:
    (ended,) = await submit(store, 1, "acme")
    await hold(pool, [ended], seconds=-10)
    await LimitStore(pool).set("a", 5, per="key")
    await LimitStore(pool).set("a", 5)
    sampler = LimitSampler(pool)
    assert await sampler.sample()
    assert sampler.violations() == []  # the counter as migrated frees it
    await pool.execute(COUNTER_WITHOUT_GRACE)
    assert await sampler.sample()
    found = broken(sampler)
    assert set(found) == {(SLOT_WITHOUT_LEASE, ACME), (SLOT_WITHOUT_LEASE, IN_ALL)}
    assert found[SLOT_WITHOUT_LEASE, IN_ALL].startswith("orchestrator_running counts 1, 0 hold")


async def test_a_sample_the_database_fails_is_skipped(own_server: EmbeddedPostgres) -> None:
    settings = await started_and_migrated(own_server)
    pool = await create_pool(
        settings, application_name=CAMPAIGN_APPLICATION, min_size=0, max_size=1
    )
    sampler = LimitSampler(pool)
    try:
        assert await sampler.sample()
        await anyio.to_thread.run_sync(lambda: own_server.stop(mode="fast"))
        assert not await sampler.sample()
        await sampler.run(within=0.3, every=0.1)  # bounded, and no sample raises
        await anyio.to_thread.run_sync(own_server.ensure_running)
        for _ in range(50):  # bounded: the first connections may meet the server starting
            if await sampler.sample():
                break
            await anyio.sleep(0.2)
    finally:
        await pool.close()
    assert sampler.taken == 2 and sampler.skipped >= 2
    assert sampler.violations() == []


def test_a_limit_s_glob_matches_as_the_database_s_does() -> None:
    assert key_matches("acme", "*") and key_matches(None, "*")
    assert key_matches("trial-bob", "trial-*") and not key_matches("bob", "trial-*")
    assert not key_matches(None, "trial-*") and not key_matches("a.c", "a_c")
    assert key_matches("x%y", "x%y") and not key_matches("xzy", "x%y")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_campaign_of_keyed_runs_under_limits_keeps_every_promise(tmp_path: Path) -> None:
    """Faults that hold or drop leases (stopped and killed workers, terminated backends, a
    restarted server) meet keyed runs under a per-key limit and an agent's limit."""
    config = CampaignConfig(
        seed=11,
        duration=20,
        runs=40,
        fault_rate=0.5,
        kinds=("sigstop_worker", "sigkill_worker", "pg_terminate_backend", "pg_restart"),
        work_dir=tmp_path / "campaign",
    )
    report = anyio.run(run_campaign, config)
    findings = report.findings
    assert findings.violations == [] and report.passed, findings.violations
    assert report.runs_submitted == 40 and report.runs_keyed >= 1
    assert findings.limit_samples >= 1
    per_key = [subject for subject in findings.limit_peaks if "/" in subject]
    assert per_key and all(subject.split("/")[1].split()[0] in KEYS for subject in per_key)
    for agent in ("chaos_steps", "chaos_tools", "chaos_tree", "chaos_leaf"):  # a tree's leaves too
        assert f"{agent} (keys * in all)" in findings.limit_peaks
