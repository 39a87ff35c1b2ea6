"""Child runs with real `serve` processes (docs/child-runs.md): a parent stopped before or after
its spawning commit and replaced spawns each child once; a fan-out of 100 across a worker kill;
a cascading cancel of a three-level tree while its leaves are mid-step, with an effect asked
through the action proxy: nothing of the tree commits or reaches the vendor afterwards."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import anyio
import asyncpg
import pytest

from orchestrator.db.store import RunStore
from orchestrator.models import RunState
from orchestrator.testing import LocalVendor, wait_for_run
from support import ServeProcess, cli, crm_kind, serve_args, write_vendors_config
from test_effects_processes import start_dispatcher
from test_effects_proxy import auth, request, running_proxy

pytestmark = pytest.mark.slow
AGENTS = ["--agents", "support.tree_agents_for_tests", "--poll-seconds", "0.2"]


async def until(pool: asyncpg.Pool, sql: str, *args: object, within: float = 60) -> None:
    with anyio.fail_after(within):
        while not await pool.fetchval(sql, *args):  # noqa: ASYNC110 - database state, polled
            await anyio.sleep(0.05)


@pytest.mark.parametrize(
    ("when", "think", "linger"),
    [("before its spawning commit", 3, 0), ("after its spawning commit", 0, 3)],
)
async def test_a_parent_stopped_and_replaced_has_each_child_once(
    database_url: str,
    store: RunStore,
    pool: asyncpg.Pool,
    tmp_path: Path,
    when: str,
    think: float,
    linger: float,
) -> None:
    async with LocalVendor() as vendor:
        config = write_vendors_config(tmp_path, {"crm": crm_kind(vendor)})
        args = serve_args(AGENTS, config, lease_seconds="2", heartbeat_seconds="0.5")
        run_id = (
            await store.submit("tree_root", {"think": think, "linger": linger, "children": 3})
        ).run.run_id
        with ServeProcess(database_url, *args, name="A") as a:
            if think:  # mid-step in Plan: nothing spawned yet
                await until(
                    pool,
                    "SELECT count(*) FROM run_events WHERE run_id = $1 AND kind = 'claimed'"
                    " AND worker_id = 'A'",
                    run_id,
                )
            else:  # Plan committed its children; lingering in Gather
                await until(
                    pool,
                    "SELECT count(*) FROM runs WHERE run_id = $1 AND lease_owner = 'A'"
                    " AND checkpoint_version >= 1",
                    run_id,
                )
            a.signal(signal.SIGSTOP)
            with ServeProcess(database_url, *args, name="B"):
                done = await wait_for_run(store, run_id, within=90)
                a.signal(signal.SIGCONT)
                await anyio.sleep(3)  # A's step ends: its commit must be refused
                await until(pool, "SELECT count(*) = 3 FROM effects WHERE status = 'confirmed'")
        assert done.state is RunState.SUCCEEDED, (when, done.error)
        assert done.result["succeeded"] == 3
        children = await pool.fetch(
            "SELECT child_key, run_id, state FROM runs WHERE parent_run_id = $1", run_id
        )
        assert sorted(c["child_key"] for c in children) == ["c0", "c1", "c2"]
        spawned = await pool.fetch(
            "SELECT worker_id, fence FROM run_events WHERE run_id = $1 AND kind = 'spawned'",
            run_id,
        )
        assert len(spawned) == 1, spawned  # one commit spawned them
        assert spawned[0]["fence"] == done.result["planned_by"]
        assert spawned[0]["worker_id"] == ("B" if think else "A")
        parents = await pool.fetch(
            "SELECT (details ->> 'parent_fence')::bigint AS fence FROM run_events"
            " WHERE kind = 'submitted' AND run_id IN (SELECT run_id FROM runs"
            " WHERE parent_run_id = $1)",
            run_id,
        )
        assert {p["fence"] for p in parents} == {done.result["planned_by"]}
        assert len(vendor.deliveries) == 3 and set(vendor.requests_by_key.values()) == {1}


async def test_a_fan_out_of_100_survives_a_worker_kill_and_the_parent_holds_no_lease_waiting(
    database_url: str, store: RunStore, pool: asyncpg.Pool, tmp_path: Path
) -> None:
    async with LocalVendor() as vendor:
        config = write_vendors_config(tmp_path, {"crm": crm_kind(vendor)})
        args = serve_args(AGENTS, config, lease_seconds="2", heartbeat_seconds="0.5")
        run_id = (
            await store.submit("tree_root", {"children": 100, "child": {"think": 0.3}})
        ).run.run_id
        with (
            ServeProcess(database_url, *args, name="A") as a,
            ServeProcess(database_url, *args, name="B"),
        ):
            await until(
                pool,
                "SELECT count(*) >= 20 FROM runs WHERE parent_run_id = $1 AND state = 'succeeded'",
                run_id,
            )
            waiting = await store.get(run_id)
            assert (waiting.state, waiting.lease_owner) == (RunState.WAITING, None)
            a.kill()
            with ServeProcess(database_url, *args, name="C"):
                done = await wait_for_run(store, run_id, within=120)
                # The children's notes were committed with their final steps: sent after.
                await until(pool, "SELECT count(*) = 100 FROM effects WHERE status = 'confirmed'")
        assert done.state is RunState.SUCCEEDED, done.error
        assert done.result["succeeded"] == 100
        states = await pool.fetch(
            "SELECT state, count(*) FROM runs WHERE parent_run_id = $1 GROUP BY state", run_id
        )
        assert [(s["state"], s["count"]) for s in states] == [("succeeded", 100)]
        assert len(vendor.deliveries) == 100 and set(vendor.requests_by_key.values()) == {1}


async def test_cancelling_the_root_cuts_off_a_three_level_tree_mid_step_and_through_the_proxy(
    database_url: str, store: RunStore, pool: asyncpg.Pool, tmp_path: Path
) -> None:
    middle = {"children": 2, "child": {"think": 60}}
    run_id = (
        await store.submit(
            "tree_root", {"children": 2, "child_agent": "tree_middle", "child": middle}
        )
    ).run.run_id
    leaves = (
        "SELECT run_id, fence FROM runs WHERE depth = 2 AND state = 'running'"
        " AND lease_owner IS NOT NULL ORDER BY run_id"
    )
    async with LocalVendor() as vendor, running_proxy(database_url) as proxy:
        config = write_vendors_config(tmp_path, {"crm": crm_kind(vendor)})
        # No dispatcher yet: an effect accepted before the cancel waits, unsent.
        with ServeProcess(database_url, *AGENTS, "--lease-seconds", "30", name="W"):
            await until(pool, f"SELECT count(*) = 4 FROM ({leaves}) AS l")
            running = await pool.fetch(leaves)
            first, second = running[0], running[1]
            asked = await proxy.post(
                "/v1/effects",
                json=request(first["run_id"], first["fence"], effect_key="before-cancel"),
                headers=auth(),
            )
            assert asked.status_code == 201, asked.text
            cancelled = await asyncio.to_thread(cli, database_url, "runs", "cancel", run_id)
            assert cancelled.returncode == 0, cancelled.stderr
            cancel_at = await pool.fetchval(
                "SELECT at FROM run_events WHERE run_id = $1 AND kind = 'cancelled'", run_id
            )
            late = await proxy.post(
                "/v1/effects",
                json=request(second["run_id"], second["fence"], effect_key="after-cancel"),
                headers=auth(),
            )
            assert late.status_code == 409, late.text
            await anyio.sleep(2)  # the worker is told; its steps stop
        dispatcher = start_dispatcher(database_url, config, "--poll-seconds", "0.1")
        try:
            await anyio.sleep(3)  # several polls: it must find nothing to send
        finally:
            dispatcher.terminate()
            dispatcher.wait(60)
        states = await pool.fetch("SELECT state, count(*) FROM runs GROUP BY state ORDER BY state")
        assert [(s["state"], s["count"]) for s in states] == [("cancelled", 7)]
        after = await pool.fetch(
            "SELECT run_id, kind FROM run_events WHERE at > $1 AND worker_id IS NOT NULL"
            " AND kind NOT IN ('lease_lost', 'stale_fence_rejected', 'released')",
            cancel_at,
        )
        assert after == [], after  # no descendant committed after the cancel
        assert vendor.requests == 0  # nothing of the tree reached the vendor
        withdrawn = await pool.fetchval(
            "SELECT status FROM effects WHERE effect_key = 'before-cancel'"
        )
        assert withdrawn == "rejected"
