"""A fenced cutover with real processes (docs/upgrades.md): old and new `serve` processes of one
agent side by side, runs and effects in flight, the old one SIGSTOPped mid-step when the cutover
commits. It commits nothing after the cutover, every note reaches the vendor once, every run
finishes under the new version, and a run whose version has no upgrade path is parked and
listed."""

from __future__ import annotations

import asyncio
import json
import signal
from pathlib import Path

import anyio
import asyncpg
import pytest

from orchestrator.db.signals import SignalStore
from orchestrator.db.store import RunStore
from orchestrator.models import RunState
from orchestrator.testing import LocalVendor
from support import ServeProcess, cli, crm_kind, write_vendors_config
from test_upgrades import until_state

pytestmark = pytest.mark.slow
AGENTS = ["--agents", "support.versioned_agents_for_tests", "--poll-seconds", "0.2"]
RUNS = 4
STEPS = 2


def serve_version(database_url: str, version: int) -> ServeProcess:
    """`serve` of version ``version`` of the test agents; a lease long enough that only the
    cutover, never an expiry, takes runs from a stopped worker. Effects are sent by a dispatcher
    of their own, which the test never stops."""
    args = [*AGENTS, "--lease-seconds", "60", "--heartbeat-seconds", "1"]
    return ServeProcess(
        database_url,
        *args,
        name=f"v{version}",
        env={"ORCHESTRATOR_TEST_AGENT_VERSION": str(version)},
    )


async def until_all(store: RunStore, run_ids: list[str], *states: RunState) -> None:
    for run_id in run_ids:
        await until_state(store, run_id, *states)


async def test_a_cutover_while_the_old_worker_is_stopped_mid_step_commits_nothing_of_it(
    database_url: str, store: RunStore, pool: asyncpg.Pool, tmp_path: Path
) -> None:
    async with LocalVendor() as vendor:
        config = write_vendors_config(tmp_path, {"crm": crm_kind(vendor)})
        dispatch = ("effects", "dispatch")
        options = ["--effects-config", config, "--poll-seconds", "0.1"]
        run_ids = [
            (await store.submit("versioned", {"steps": STEPS, "seconds": 1.5})).run.run_id
            for _ in range(RUNS)
        ]
        held = (await store.submit("legacy", {})).run.run_id
        with (
            ServeProcess(
                database_url, *options, "--dispatcher-id", "D", name="D", command=dispatch
            ),
            serve_version(database_url, 1) as old,
        ):
            await until_state(store, held, RunState.WAITING)
            await until_all(store, run_ids, RunState.RUNNING)
            # Mid-step: at least one run has committed its first step under version 1.
            with anyio.fail_after(60):
                while not await pool.fetchval(  # noqa: ASYNC110 - database state, polled
                    "SELECT count(*) FROM runs WHERE agent = 'versioned'"
                    " AND state = 'running' AND checkpoint_version >= 1"
                ):
                    await anyio.sleep(0.05)
            old.signal(signal.SIGSTOP)
            try:
                with serve_version(database_url, 2):
                    for agent in ("versioned", "legacy"):
                        done = await asyncio.to_thread(
                            cli, database_url, "agents", "cutover", agent, "--to", "2"
                        )
                        assert done.returncode == 0, done.stderr
                    await until_all(store, run_ids, RunState.SUCCEEDED, RunState.DEAD)
                    old.signal(signal.SIGCONT)
                    await anyio.sleep(3)  # the old worker's steps end: it may commit none
                    await SignalStore(pool).send(held, "go")  # due now: nobody may claim it
                    await anyio.sleep(1)  # several polls of both workers
                    listed = await asyncio.to_thread(
                        cli, database_url, "runs", "list", "--agent", "legacy", "--json"
                    )
                    versions = await asyncio.to_thread(
                        cli, database_url, "agents", "versions", "--agent", "legacy", "--json"
                    )
            finally:
                old.signal(signal.SIGCONT)
        for run_id in run_ids:
            run = await store.get(run_id)
            assert run.state is RunState.SUCCEEDED, run.error
            assert run.result == {"steps": STEPS, "version": 2}
            assert (run.started_version, run.agent_version) in (("1", "2"), ("2", "2"))
        cut_at = await pool.fetchval("SELECT set_at FROM agent_cutovers WHERE agent = 'versioned'")
        after = await pool.fetch(
            "SELECT run_id, kind FROM run_events WHERE worker_id = 'v1' AND at > $1"
            " AND kind NOT IN ('lease_lost', 'stale_fence_rejected')",
            cut_at,
        )
        assert after == [], after  # the old worker committed nothing after the cutover
        upgraded = await pool.fetchval(
            "SELECT count(*) FROM runs WHERE agent = 'versioned' AND started_version = '1'"
            " AND agent_version = '2'"
        )
        assert upgraded >= 1  # a checkpoint written by version 1 was read by version 2
        notes = await pool.fetch("SELECT status FROM effects WHERE kind = 'crm'")
        assert len(notes) == RUNS * STEPS and {n["status"] for n in notes} == {"confirmed"}
        assert len(vendor.deliveries) == RUNS * STEPS
        assert set(vendor.requests_by_key.values()) == {1}  # no note sent twice
    # The run started under version 1 of `legacy` (no upgrade path): parked, and said so.
    parked = await store.get(held)
    assert (parked.state, parked.agent_version, parked.fence) == (RunState.WAITING, "1", 1)
    assert listed.returncode == 0, listed.stderr
    [row] = json.loads(listed.stdout)
    assert row["held_back"] == "no worker serves version 1 of legacy"
    assert versions.returncode == 0, versions.stderr
    stranded = {v["version"]: v["stranded"] for v in json.loads(versions.stdout)}
    assert stranded["1"] is True
