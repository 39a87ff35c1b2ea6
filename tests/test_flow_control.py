"""Flow control (docs/flow-control.md): limits count only the runs holding a lease, claims never
overfill them even when claimers race, keys are served in turns, priorities order a key's runs."""

from __future__ import annotations

import asyncio
import json
import math
import subprocess
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import anyio
import asyncpg
import httpx
import pytest

from orchestrator.access import Actor
from orchestrator.agent.steps import Agent, Finish, Outcome, Step, StepContext
from orchestrator.client import Client, SyncClient
from orchestrator.db.limits import LimitStore, RunningLimit
from orchestrator.db.rates import RateLimitStore
from orchestrator.db.run_reads import RunReads
from orchestrator.db.store import RunStore
from orchestrator.errors import InvalidInput
from orchestrator.models import ClaimedRun, RunState
from orchestrator.settings import Settings
from orchestrator.worker.metrics_endpoint import _limit_rows
from support import ServeProcess, serving
from test_console import console as running_console


class Finishes(Step):
    async def run(self, ctx: StepContext) -> Outcome:
        return Finish()


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


@pytest.mark.parametrize("per_key_only", [False, True])
async def test_racing_claimers_never_run_more_than_a_key_s_limit(
    store: RunStore, pool: asyncpg.Pool, per_key_only: bool
) -> None:
    # per_key_only: limits per key alone, and claims of one run per key the way a busy claimer
    # claims (not looking for expired leases), which the planner judges key by key.
    limits = LimitStore(pool)
    await limits.set("a", 2, per="key")
    if not per_key_only:
        await limits.set("a", 5, key_pattern="*", per="all")
    for key in ("k1", "k2", "k3"):
        await submit(store, 12, key)
    seen_most: Counter[str | None] = Counter()
    for round_ in range(20):
        batches: list[list[ClaimedRun]] = []

        async def claim(worker: str, into: list[list[ClaimedRun]]) -> None:
            batch = await store.claim(
                worker,
                ["a"],
                limit=3 if per_key_only else 4,
                lease_seconds=30,
                include_expired=not per_key_only,
            )
            into.append(batch.claimed)

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
        assert per_key_only or sum(running.values()) <= 5, running
        for held, count in running.items():
            seen_most[held] = max(seen_most[held], count)
        for batch in batches:
            await finish_all(store, batch)
    assert set(seen_most) == {"k1", "k2", "k3"}
    assert max(seen_most.values()) == 2  # the limits were reached, not merely respected


async def test_a_claim_passes_over_full_keys_to_the_next_ones_and_fills_no_limit_past_its_room(
    store: RunStore, pool: asyncpg.Pool
) -> None:
    limits = LimitStore(pool)
    await limits.set("a", 1, per="key")
    for i in range(10):
        await submit(store, 2, f"a{i:02d}")
    first = (await store.claim("w1", ["a"], limit=10, lease_seconds=60)).claimed
    assert Counter(run.input["key"] for run in first) == {f"a{i:02d}": 1 for i in range(10)}
    for i in range(10):
        await submit(store, 1, f"b{i:02d}")
    await limits.set("a", 15, key_pattern="*", per="all")
    # The first ten keys are full: the claim looks at the next ten, where the agent's limit has
    # room for five. Each full limit's first run passed over is held back by it.
    batch = await store.claim("w2", ["a"], limit=10, lease_seconds=60)
    assert sorted(run.input["key"] for run in batch.claimed) == [f"b{i:02d}" for i in range(5)]
    assert batch.held_back == 11
    running = await running_per_key(pool)
    assert max(running.values()) == 1 and sum(running.values()) == 15, running
    # Few keys with many runs: a key's runs beyond its room are not taken, in one claim.
    await limits.set("a", 3, key_pattern="c*", per="key")
    await limits.set("a", 30, key_pattern="*", per="all")
    await submit(store, 6, "c1")
    await submit(store, 6, "c2")
    batch = await store.claim("w3", ["a"], limit=20, lease_seconds=60)
    running = await running_per_key(pool)
    assert running["c1"] == running["c2"] == 1, running  # "a per key" (1) is the tighter
    await limits.set("a", 5, per="key")
    await limits.set("a", 34, key_pattern="*", per="all")
    batch = await store.claim("w3", ["a"], limit=40, lease_seconds=60)
    running = await running_per_key(pool)
    assert running["c1"] + running["c2"] <= 6, running  # now "c*" (3) is the tighter
    assert sum(running.values()) == 34, running  # and the agent's limit is reached, not passed


async def test_room_taken_in_a_claim_s_first_keys_is_not_offered_again_to_its_next_ones(
    store: RunStore, pool: asyncpg.Pool
) -> None:
    limits = LimitStore(pool)
    await limits.set("a", 1, per="key")
    for i in range(5):
        await submit(store, 2, f"a{i:02d}")
    assert len((await store.claim("w1", ["a"], limit=5, lease_seconds=60)).claimed) == 5
    for i in range(5, 10):
        await submit(store, 1, f"a{i:02d}")
    for i in range(10):
        await submit(store, 1, f"b{i:02d}")
    await limits.set("a", 12, key_pattern="*", per="all")
    # Five of the first ten keys are full, so the claim takes five runs there and looks at five
    # more keys, where the agent's limit has room for two more: not for seven.
    batch = await store.claim("w2", ["a"], limit=10, lease_seconds=60)
    assert sorted(run.input["key"] for run in batch.claimed) == [
        *(f"a{i:02d}" for i in range(5, 10)),
        "b00",
        "b01",
    ]
    assert sum((await running_per_key(pool)).values()) == 12


async def test_many_keys_under_limits_per_key_take_turns_until_each_is_full(
    store: RunStore, pool: asyncpg.Pool
) -> None:
    # As many keys as a claim takes, under limits per key only, claimed the way a busy claimer
    # does (not looking for expired leases): each claim takes one run of each key until the key
    # is full, racing claimers included.
    limits = LimitStore(pool)
    await limits.set("a", 2, per="key")
    await limits.set("a", 3, key_pattern="t1*", per="key")
    for i in range(20):
        await submit(store, 5, f"t{i:02d}")
    taken: list[int] = []
    held: list[int] = []

    async def claim(worker: str) -> None:
        batch = await store.claim(worker, ["a"], limit=20, lease_seconds=60, include_expired=False)
        taken.append(len(batch.claimed))
        held.append(batch.held_back)

    for _ in range(4):
        async with anyio.create_task_group() as group:
            for worker in ("w1", "w2", "w3"):
                group.start_soon(claim, worker)
        running = await running_per_key(pool)
        assert all(count <= 2 for count in running.values()), running
    assert running == {f"t{i:02d}": 2 for i in range(20)}, running  # full, not merely below
    assert sum(taken) == 40
    # Nothing more: each key's next run is passed over for its key's limit, and said so once.
    batch = await store.claim("w4", ["a"], limit=20, lease_seconds=60, include_expired=False)
    assert batch.claimed == [] and batch.held_back == 20
    assert await pool.fetchval("SELECT count(DISTINCT run_id) FROM run_holds") == 20


async def test_no_pattern_and_key_can_pass_for_another_pair_s_slot(
    store: RunStore, pool: asyncpg.Pool
) -> None:
    # Joined with a separator alone, "*" with key "q<US>z<US>q" and "*<US>q" with key "z<US>q"
    # spell one slot (US: the unit separator, a character keys and patterns may hold), and the
    # second key was judged by the first's room.
    us = "\x1f"
    limits = LimitStore(pool)
    await limits.set("a", 5, key_pattern="*", per="key")
    await limits.set("a", 1, key_pattern=f"*{us}q", per="key")
    await submit(store, 3, f"q{us}z{us}q")
    await submit(store, 3, f"z{us}q")
    await store.claim("w1", ["a"], limit=10, lease_seconds=60)
    running = await running_per_key(pool)
    assert running[f"z{us}q"] == 1 and running[f"q{us}z{us}q"] == 1, running


@pytest.mark.parametrize("include_expired", [True, False])
async def test_a_claim_with_no_room_takes_nothing_and_fails_nothing(
    store: RunStore, pool: asyncpg.Pool, include_expired: bool
) -> None:
    await LimitStore(pool).set("a", 2, per="key")
    await submit(store, 3, "k1")
    await submit(store, 1, None)
    batch = await store.claim(
        "w1", ["a"], limit=0, lease_seconds=60, include_expired=include_expired
    )
    assert batch.claimed == [] and batch.held_back == 0
    assert len((await store.claim("w1", ["a"], limit=5, lease_seconds=60)).claimed) == 3


async def test_a_limit_s_slot_is_computed_inline_not_called_per_slot(pool: asyncpg.Pool) -> None:
    # The planner computes a slot for each key it looks at: the function must stay an immutable
    # expression so that PostgreSQL inlines it (a call per slot cost a fifth of a keyed claim).
    await LimitStore(pool).set("a", 2, per="key")
    plan = "\n".join(
        row[0]
        for row in await pool.fetch(
            "EXPLAIN (VERBOSE) SELECT orchestrator_limit_slot(l, 'a', 'k') FROM flow_limits AS l"
        )
    )
    assert "orchestrator_limit_slot" not in plan, plan


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


async def test_a_run_held_back_by_a_full_limit_is_listed_with_it_and_its_timeline_says_once(
    store: RunStore, pool: asyncpg.Pool
) -> None:
    await LimitStore(pool).set("a", 1, per="key")
    await submit(store, 3, "acme")
    (first,) = (await store.claim("w1", ["a"], limit=1, lease_seconds=60)).claimed
    await store.submit("a", {"free": True})
    held_back = 0
    for _ in range(5):  # claim after claim passes the same runs over
        batch = await store.claim("w2", ["a"], limit=5, lease_seconds=60)
        held_back += batch.held_back
        await finish_all(store, batch.claimed)  # the run without a key, the first time
    assert held_back == 5  # acme's head run, once a claim
    listed = {run.run_id: run for run in await RunReads(pool).list_runs(agent="a")}
    queued = [run for run in listed.values() if run.state is RunState.QUEUED]
    assert len(queued) == 2
    assert {run.held_back for run in queued} == {"a per key, keys *: at most 1 running"}
    assert listed[first.run_id].held_back is None  # running, waiting for nothing
    events = await pool.fetch(
        "SELECT run_id, details FROM run_events WHERE kind = 'held_back' ORDER BY event_id"
    )
    assert len(events) == 1, events  # five claims passed it over: one event
    assert events[0]["details"] == {
        "by": "limit",
        "limit": "a per key, keys *: at most 1 running",
    }
    await finish_all(store, [first])  # its slot is free: nothing holds them back now
    assert {run.held_back for run in await RunReads(pool).list_runs(agent="a")} == {None}
    assert len((await store.claim("w2", ["a"], limit=5, lease_seconds=60)).claimed) == 1


async def test_limits_an_agent_declares_in_code_are_written_and_an_operator_s_win(
    pool: asyncpg.Pool,
) -> None:
    limits = LimitStore(pool)
    declared = [RunningLimit(20), RunningLimit(2, per="key"), RunningLimit(1, "key", "trial-*")]
    assert await limits.declare("a", declared, "code of w1") == 3
    assert await limits.declare("a", declared, "code of w2") == 0  # the same: nothing written
    found = {(lim.key_pattern, lim.per): lim for lim in await limits.list("a")}
    assert {k: (v.max_running, v.declared) for k, v in found.items()} == {
        ("*", "all"): (20, True),
        ("*", "key"): (2, True),
        ("trial-*", "key"): (1, True),
    }
    await limits.set("a", 5, per="key")  # an operator raises one during an incident
    assert await limits.declare("a", [RunningLimit(20)], "code of w3") == 1  # trial-* removed
    found = {(lim.key_pattern, lim.per): lim for lim in await limits.list("a")}
    assert {k: (v.max_running, v.declared) for k, v in found.items()} == {
        ("*", "all"): (20, True),
        ("*", "key"): (5, False),  # the operator's stands
    }


@pytest.mark.parametrize(
    ("limit", "why"),
    [
        (lambda: RunningLimit(-1), "a limit must be"),
        (lambda: RunningLimit(math.nan), "a limit must be"),  # type: ignore[arg-type]
        (lambda: RunningLimit(1, per="tenant"), "per"),  # type: ignore[arg-type]
        (lambda: RunningLimit(1, keys=""), "key pattern"),
        (lambda: RunningLimit(1, keys="x\x00"), "key pattern"),
        (lambda: Agent("a", first=Finishes, limits=[RunningLimit(1), RunningLimit(2)]), "same"),
        (lambda: Agent("a", first=Finishes, limits=[3]), "RunningLimit"),  # type: ignore[list-item]
    ],
)
def test_a_bad_declared_limit_is_one_line(limit: Callable[[], object], why: str) -> None:
    with pytest.raises(InvalidInput, match=why) as raised:
        limit()
    assert "\n" not in str(raised.value)


async def test_serve_writes_the_limits_its_agents_declare(
    settings: Settings, pool: asyncpg.Pool
) -> None:
    url = str(settings.database_url)
    with ServeProcess(url, *serving("support.agents_for_tests"), name="w1"), anyio.fail_after(60):
        while not (rows := await LimitStore(pool).list("limited")):  # noqa: ASYNC110
            await anyio.sleep(0.1)
    assert [(r.key_pattern, r.per, r.max_running, r.declared) for r in rows] == [
        ("*", "key", 1, True)
    ]
    assert rows[0].set_by == "code of w1"


async def test_limit_gauges_are_per_agent_and_limit_name_never_per_key(
    store: RunStore, pool: asyncpg.Pool
) -> None:
    await LimitStore(pool).set("a", 2, per="key")
    await RateLimitStore(pool).set("model:m", requests=5)
    for key in ("k1", "k2", "k3"):
        await submit(store, 3, key)
    await store.claim("w1", ["a"], limit=9, lease_seconds=60)
    limits, rates = await _limit_rows(pool)
    assert limits == [
        {
            "agent": "a",
            "limit": "a per key, keys *",
            "running": 2,
            "backlog": 3,
            "max_running": 2,
        }
    ]
    assert rates == [{"limit": "model:m", "paused": 0, "waiting": 0}]


async def test_the_console_s_runs_page_names_the_limit_holding_a_run_back(
    database_url: str, store: RunStore, pool: asyncpg.Pool, tmp_path: Path
) -> None:
    await LimitStore(pool).set("a", 0, per="key", key_pattern="trial-*")
    held = (await store.submit("a", {}, concurrency_key="trial-bob")).run.run_id
    free = (await store.submit("a", {})).run.run_id
    async with (
        running_console(database_url, tmp_path) as running,
        httpx.AsyncClient(base_url=running.url) as client,
    ):
        page = (await client.get("/runs")).text
    rows = {run_id: page[page.index(run_id) :].split("</tr>")[0] for run_id in (held, free)}
    assert "held back by" in page
    assert "a per key, keys trial-*: at most 0 running" in rows[held]
    assert "at most" not in rows[free] and "trial-bob" in rows[held]


async def test_the_client_sets_lists_and_clears_limits_and_rate_limits(
    settings: Settings, store: RunStore
) -> None:
    async with await Client.connect(settings) as client:
        assert await client.limits.set("a", 3, per="key") is None
        assert await client.limits.set("a", 4, per="key") == 3
        [limit] = await client.limits.list("a")
        assert (limit.max_running, limit.per, limit.declared) == (4, "key", False)
        await client.limits.set_rate("model:m", requests=10, tokens=5000, per_seconds=1)
        [rate] = await client.limits.rates()
        assert (rate.requests, rate.tokens, rate.per_seconds) == (10, 5000, 1.0)
        with pytest.raises(InvalidInput, match="requests must be"):
            await client.limits.set_rate("model:m", requests=0)
        await client.limits.clear_rate("model:m")
        assert await client.limits.clear("a", per="key") == 4
        assert await client.limits.list() == [] and await client.limits.rates() == []


def test_the_sync_client_has_the_same_limits_handle(settings: Settings) -> None:
    with SyncClient(settings) as client:
        client.limits.set("a", 2)
        assert [limit.max_running for limit in client.limits.list()] == [2]
        client.limits.set_rate("effect:crm", requests=5)
        assert [rate.name for rate in client.limits.rates()] == ["effect:crm"]
