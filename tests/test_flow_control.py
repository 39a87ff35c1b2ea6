"""Flow control (docs/flow-control.md): limits count only the runs holding a lease, claims never
overfill them even when claimers race, keys are served in turns, priorities order a key's runs."""

from __future__ import annotations

import asyncio
import json
import math
import subprocess
import sys
from collections import Counter

import anyio
import asyncpg
import pytest

from orchestrator.access import Actor
from orchestrator.db.limits import LimitStore
from orchestrator.db.store import RunStore
from orchestrator.errors import InvalidInput
from orchestrator.models import ClaimedRun
from orchestrator.settings import Settings
from support import ServeProcess, serving


async def running_per_key(pool: asyncpg.Pool, agent: str = "a") -> Counter[str | None]:
    rows = await pool.fetch(
        "SELECT concurrency_key FROM runs WHERE agent = $1 AND state = 'running'"
        " AND lease_until > clock_timestamp()",
        agent,
    )
    return Counter(row["concurrency_key"] for row in rows)


async def submit(store: RunStore, count: int, key: str | None, **options: object) -> None:
    for i in range(count):
        await store.submit("a", {"i": i, "key": key}, concurrency_key=key, **options)  # type: ignore[arg-type]


async def finish_all(store: RunStore, claimed: list[ClaimedRun]) -> None:
    for run in claimed:
        assert await store.finish(run.lease, expected_version=run.checkpoint_version)


async def test_racing_claimers_never_run_more_than_a_key_s_limit(
    store: RunStore, pool: asyncpg.Pool
) -> None:
    limits = LimitStore(pool)
    await limits.set("a", 2, per="key")
    await limits.set("a", 5, key_pattern="*", per="all")
    for key in ("k1", "k2", "k3"):
        await submit(store, 12, key)
    seen_most: Counter[str | None] = Counter()
    for round_ in range(20):
        batches: list[list[ClaimedRun]] = []

        async def claim(worker: str, into: list[list[ClaimedRun]]) -> None:
            into.append((await store.claim(worker, ["a"], limit=4, lease_seconds=30)).claimed)

        async def jump_the_queue(round_: int) -> None:
            # Urgent runs arriving while claims are planned: a claimer that sees them plans
            # other runs than one that does not, so only the limit's lock keeps them apart.
            for key in ("k1", "k2", "k3"):
                await store.submit("a", {"urgent": round_}, concurrency_key=key, priority=9)

        async with anyio.create_task_group() as group:
            group.start_soon(jump_the_queue, round_)
            for worker in ("w1", "w2", "w3", "w4"):
                group.start_soon(claim, worker, batches)
        running = await running_per_key(pool)
        assert all(count <= 2 for count in running.values()), running
        assert sum(running.values()) <= 5, running
        for held, count in running.items():
            seen_most[held] = max(seen_most[held], count)
        for batch in batches:
            await finish_all(store, batch)
    assert set(seen_most) == {"k1", "k2", "k3"}
    assert max(seen_most.values()) == 2  # the limits were reached, not merely respected


async def test_a_slot_is_free_when_its_lease_ends_and_a_parked_run_holds_none(
    store: RunStore, pool: asyncpg.Pool
) -> None:
    await LimitStore(pool).set("a", 1)
    await submit(store, 3, "tenant")
    (first,) = (await store.claim("w1", ["a"], limit=3, lease_seconds=1)).claimed
    assert (await store.claim("w2", ["a"], limit=3, lease_seconds=30)).claimed == []
    # The first worker dies: nothing gives its slot back but the lease running out.
    with anyio.fail_after(30):
        while not (batch := await store.claim("w2", ["a"], limit=3, lease_seconds=30)).claimed:  # noqa: ASYNC110
            await anyio.sleep(0.2)
    assert len(batch.claimed) == 1  # the expired run or a queued one, never both
    await finish_all(store, batch.claimed)
    assert not await store.finish(first.lease, expected_version=first.checkpoint_version)


async def test_a_key_with_one_run_is_not_kept_waiting_behind_a_backlog_of_another(
    store: RunStore, pool: asyncpg.Pool
) -> None:
    await pool.execute(
        "INSERT INTO runs (run_id, agent, input, concurrency_key, available_at)"
        " SELECT 'r_bulk_' || i, 'a', '{}', 'backfill', clock_timestamp() - interval '1 hour'"
        " FROM generate_series(1, 100000) AS i"
    )
    await store.submit("a", {"lonely": True}, concurrency_key="small-tenant")
    claimed = (await store.claim("w1", ["a"], limit=10, lease_seconds=30)).claimed
    keys = Counter(run.input.get("lonely") for run in claimed)
    assert keys[True] == 1, "the lonely run waited behind the backfill"


async def test_keys_take_turns_and_a_key_s_runs_go_by_priority(
    store: RunStore, pool: asyncpg.Pool
) -> None:
    for key in ("x", "y", "z"):
        await submit(store, 4, key)
    await store.submit("a", {"i": "urgent"}, concurrency_key="x", priority=10)
    await store.submit("a", {"i": "later"}, concurrency_key="x", priority=-10)
    claimed = (await store.claim("w1", ["a"], limit=6, lease_seconds=30)).claimed
    keys = Counter(run.input.get("key", "x") for run in claimed)
    assert keys == {"x": 2, "y": 2, "z": 2}
    inputs = [run.input["i"] for run in claimed]
    assert "urgent" in inputs and "later" not in inputs


async def test_lowering_a_limit_stops_no_running_run_and_raising_it_claims_more(
    store: RunStore, pool: asyncpg.Pool
) -> None:
    limits = LimitStore(pool)
    await limits.set("a", 3, per="key")
    await submit(store, 6, "t")
    running = (await store.claim("w1", ["a"], limit=6, lease_seconds=30)).claimed
    assert len(running) == 3
    assert await limits.set("a", 1, per="key") == 3
    assert (await store.claim("w1", ["a"], limit=6, lease_seconds=30)).claimed == []
    for run in running:  # still theirs: each commits
        assert await store.commit_step(
            run.lease, expected_version=run.checkpoint_version, next_step="s", checkpoint={}
        )
    await limits.set("a", 5, per="key")
    assert len((await store.claim("w1", ["a"], limit=6, lease_seconds=30)).claimed) == 2
    (listed,) = await limits.list("a")
    assert (listed.running, listed.max_running, listed.backlog) == (5, 5, 1)


async def test_runs_without_a_key_count_against_an_agent_s_limit_and_are_claimed_as_before(
    store: RunStore, pool: asyncpg.Pool
) -> None:
    await submit(store, 3, None)
    assert len((await store.claim("w1", ["a"], limit=5, lease_seconds=30)).claimed) == 3
    await submit(store, 3, None)
    await LimitStore(pool).set("a", 4)
    assert len((await store.claim("w1", ["a"], limit=5, lease_seconds=30)).claimed) == 1


@pytest.mark.parametrize(
    ("value", "why"),
    [(-1, "0 to"), (1_000_001, "0 to"), (math.nan, "0 to"), (2.5, "0 to"), (True, "0 to")],
)
async def test_a_bad_limit_is_one_line_and_changes_nothing(
    pool: asyncpg.Pool, value: object, why: str
) -> None:
    limits = LimitStore(pool)
    with pytest.raises(InvalidInput, match=why):
        await limits.set("a", value)  # type: ignore[arg-type]
    assert await limits.list() == []


@pytest.mark.parametrize(
    "key", ["", "x" * 201, "tenant\x00one", "\ud800"], ids=["empty", "long", "nul", "surrogate"]
)
async def test_a_bad_key_is_refused_before_anything_is_written(
    store: RunStore, pool: asyncpg.Pool, key: str
) -> None:
    with pytest.raises(InvalidInput):
        await store.submit("a", {}, concurrency_key=key)
    with pytest.raises(InvalidInput):
        await LimitStore(pool).set("a", 1, key_pattern=key)
    assert await pool.fetchval("SELECT count(*) FROM runs") == 0
    assert await pool.fetchval("SELECT count(*) FROM flow_limits") == 0


@pytest.mark.parametrize("priority", [-1001, 1001, True, 2**40])
async def test_a_bad_priority_is_refused(store: RunStore, priority: int) -> None:
    with pytest.raises(InvalidInput, match="priority"):
        await store.submit("a", {}, priority=priority)


async def test_clearing_a_limit_that_is_not_there_says_so_and_audits_nothing(
    pool: asyncpg.Pool,
) -> None:
    limits = LimitStore(pool)
    with pytest.raises(InvalidInput, match="no limit of a"):
        await limits.clear("a", per="key")
    await limits.set("a", 2, per="key", actor=Actor.acting(None, "ops note"))
    assert await limits.clear("a", per="key") == 2
    actions = [r["action"] for r in await pool.fetch("SELECT action FROM audit_log ORDER BY seq")]
    assert actions == ["limit_set", "limit_cleared"]


def cli(settings: Settings, *arguments: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "orchestrator.cli",
            "--database-url",
            str(settings.database_url),
            *arguments,
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )


async def test_the_cli_sets_lists_and_clears_limits_and_submits_keyed_runs(
    settings: Settings, store: RunStore
) -> None:
    done = await asyncio.to_thread(
        cli, settings, "submit", "a", "--concurrency-key", "acme", "--priority", "7", "--json"
    )
    assert done.returncode == 0, done.stderr
    run = json.loads(done.stdout)["run"]
    assert (run["concurrency_key"], run["priority"]) == ("acme", 7)
    done = await asyncio.to_thread(
        cli, settings, "limits", "set", "a", "--max-running", "3", "--per-key", "--json"
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["limit"]["max_running"] == 3
    done = await asyncio.to_thread(cli, settings, "limits", "list", "--json")
    (listed,) = json.loads(done.stdout)
    assert (listed["per"], listed["backlog"], listed["running"]) == ("key", 1, 0)
    for bad in (["--max-running", "-1"], ["--max-running", "x"]):
        done = await asyncio.to_thread(cli, settings, "limits", "set", "a", *bad)
        assert done.returncode == 2 and "max-running" in done.stderr
    done = await asyncio.to_thread(cli, settings, "limits", "clear", "a")
    assert done.returncode == 1
    assert done.stderr.strip().count("\n") == 0 and "no limit of a" in done.stderr
    done = await asyncio.to_thread(cli, settings, "limits", "clear", "a", "--per-key")
    assert done.returncode == 0, done.stderr


async def test_three_workers_and_a_sigkill_never_run_more_than_the_limit_and_leak_no_slot(
    settings: Settings, store: RunStore, pool: asyncpg.Pool
) -> None:
    # Three `serve` processes claim one tenant's runs (a per-key limit of 2) and another's
    # (1); one is SIGKILLed while it holds runs. The running set, sampled all along, never
    # exceeds a limit; the killed worker's slots come free when its leases run out, and every
    # run finishes.
    limits = LimitStore(pool)
    await limits.set("sleepy", 2, per="key")
    await limits.set("sleepy", 1, key_pattern="solo", per="key")
    for key, count in (("acme", 8), ("solo", 3)):
        for _ in range(count):
            await store.submit("sleepy", {"steps": 2, "seconds": 0.4}, concurrency_key=key)
    options = [
        *serving("orchestrator.agents.sleepy"),
        "--lease-seconds",
        "2",
        "--heartbeat-seconds",
        "0.5",
        "--no-takeover",
    ]
    url = str(settings.database_url)
    most: Counter[str | None] = Counter()
    with (
        ServeProcess(url, *options, name="w1") as w1,
        ServeProcess(url, *options, name="w2") as w2,
        ServeProcess(url, *options, name="w3") as w3,
    ):
        workers = {worker.name: worker for worker in (w1, w2, w3)}
        holder = None
        with anyio.fail_after(60):
            while holder is None:
                running = await running_per_key(pool, "sleepy")
                assert running["acme"] <= 2 and running["solo"] <= 1, running
                most = most | running
                holder = await pool.fetchval(
                    "SELECT lease_owner FROM runs WHERE state = 'running' LIMIT 1"
                )
                await anyio.sleep(0.05)
        workers[holder].kill()
        with anyio.fail_after(120):
            while await pool.fetchval(
                "SELECT count(*) FROM runs WHERE agent = 'sleepy' AND state <> 'succeeded'"
            ):
                running = await running_per_key(pool, "sleepy")
                assert running["acme"] <= 2 and running["solo"] <= 1, running
                most = most | running
                await anyio.sleep(0.05)
    assert most["acme"] == 2 and most["solo"] == 1, most
