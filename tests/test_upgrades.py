"""Versioned agents (docs/upgrades.md): a run records the version of the agent's code that
started it and that wrote its latest checkpoint; a claim hands it only to a worker serving that
version or upgrading from it; the upgrade runs once per claim, in memory, and is committed fenced
with the claim's first step."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import anyio
import asyncpg
import pytest

from orchestrator.agent.steps import Agent, Finish, Next, Outcome, Step, StepContext, Wait
from orchestrator.db.agents import AgentStore
from orchestrator.db.run_reads import RunReads
from orchestrator.db.signals import SignalStore
from orchestrator.db.store import RunFinish, RunStore, StepCommit
from orchestrator.db.workers import WorkerRegistry
from orchestrator.errors import InvalidInput
from orchestrator.models import JSON, RunState
from orchestrator.settings import Settings
from orchestrator.testing import running_worker
from orchestrator.worker.metrics_endpoint import stranded_runs
from test_flow_control import cli
from test_runtime import FAST


class Start(Step):
    name = "Start"

    async def run(self, ctx: StepContext) -> Outcome:
        return Wait(then="End", signals=["go", "again"], checkpoint={"n": 1})


class EndV1(Step):
    name = "End"

    async def run(self, ctx: StepContext) -> Outcome:
        return Finish(result={"read": ctx.checkpoint})


class EndV2(Step):
    """Version 2 reads ``{"count": ..., "upgrades": ...}``; woken by ``again``, it waits
    again keeping the checkpoint (which must then be the upgraded one)."""

    name = "End"

    async def run(self, ctx: StepContext) -> Outcome:
        if "again" in [signal.name for signal in ctx.signals]:
            return Wait(then="End", signals=["go"])
        assert set(ctx.checkpoint or {}) == {"count", "upgrades"}, ctx.checkpoint
        return Finish(result={"read": ctx.checkpoint})


def to_v2(checkpoint: JSON) -> JSON:
    assert isinstance(checkpoint, dict)
    return {"count": checkpoint["n"], "upgrades": checkpoint.get("upgrades", 0) + 1}


def broken(checkpoint: JSON) -> JSON:
    raise ValueError("no field n in this shape")


v1 = Agent("shipping", first=Start, steps=[EndV1], version=1)
v2 = Agent("shipping", first=Start, steps=[EndV2], version=2, upgrades={1: to_v2})
v2_broken = Agent("shipping", first=Start, steps=[EndV2], version=2, upgrades={1: broken})
v3_without_path = Agent("shipping", first=Start, steps=[EndV2], version="3.0")


async def parked_under_v1(settings: Settings, store: RunStore) -> str:
    """A run whose first step committed under version 1 and now waits for ``go``."""
    run_id = (await store.submit("shipping", {})).run.run_id
    async with running_worker(settings, [v1], **FAST):
        with anyio.fail_after(30):
            while (await store.get(run_id)).state is not RunState.WAITING:  # noqa: ASYNC110
                await anyio.sleep(0.05)
    run = await store.get(run_id)
    assert (run.started_version, run.agent_version, run.checkpoint) == ("1", "1", {"n": 1})
    return run_id


async def until_state(store: RunStore, run_id: str, *states: RunState) -> Any:
    with anyio.fail_after(30):
        while (run := await store.get(run_id)).state not in states:  # noqa: ASYNC110
            await anyio.sleep(0.05)
    return run


async def test_a_newer_worker_upgrades_the_checkpoint_once_and_commits_it_with_its_step(
    settings: Settings, store: RunStore, pool: asyncpg.Pool
) -> None:
    run_id = await parked_under_v1(settings, store)
    async with running_worker(settings, [v2], **FAST), running_worker(settings, [v2], **FAST):
        await SignalStore(pool).send(run_id, "go")
        run = await until_state(store, run_id, RunState.SUCCEEDED, RunState.DEAD)
    assert run.state is RunState.SUCCEEDED, run.error
    assert run.result == {"read": {"count": 1, "upgrades": 1}}  # two workers: upgraded once
    assert (run.started_version, run.agent_version) == ("1", "2")
    assert run.checkpoint == {"count": 1, "upgrades": 1}  # the finish kept the upgraded one
    shown = await asyncio.to_thread(cli, settings, "runs", "show", run_id)
    assert "2 (started under 1)" in shown.stdout, shown.stdout


async def test_a_finish_that_keeps_a_checkpoint_from_before_versions_records_its_version(
    settings: Settings, store: RunStore, pool: asyncpg.Pool
) -> None:
    """A checkpoint written by a release before versions (no version recorded): the finish that
    keeps it writes it again, under the version whose code finished the run."""
    run_id = await parked_under_v1(settings, store)
    await pool.execute("UPDATE runs SET agent_version = NULL WHERE run_id = $1", run_id)
    async with running_worker(settings, [v1], **FAST):
        await SignalStore(pool).send(run_id, "go")
        run = await until_state(store, run_id, RunState.SUCCEEDED, RunState.DEAD)
    assert run.state is RunState.SUCCEEDED, run.error
    assert (run.result, run.checkpoint, run.agent_version) == ({"read": {"n": 1}}, {"n": 1}, "1")


async def test_a_wait_that_keeps_its_checkpoint_keeps_the_upgraded_one(
    settings: Settings, store: RunStore, pool: asyncpg.Pool
) -> None:
    run_id = await parked_under_v1(settings, store)
    async with running_worker(settings, [v2], **FAST):
        await SignalStore(pool).send(run_id, "again")
        with anyio.fail_after(30):
            while (run := await store.get(run_id)).agent_version != "2":  # noqa: ASYNC110
                await anyio.sleep(0.05)
        assert run.state is RunState.WAITING
        assert run.checkpoint == {"count": 1, "upgrades": 1}
        await SignalStore(pool).send(run_id, "go")
        run = await until_state(store, run_id, RunState.SUCCEEDED, RunState.DEAD)
    assert run.result == {"read": {"count": 1, "upgrades": 1}}  # not upgraded a second time


async def test_an_upgrade_that_raises_fails_the_attempt_and_keeps_the_checkpoint(
    settings: Settings, store: RunStore, pool: asyncpg.Pool
) -> None:
    run_id = await parked_under_v1(settings, store)
    async with running_worker(settings, [v2_broken], **FAST):
        await SignalStore(pool).send(run_id, "go")
        with anyio.fail_after(30):
            while not (  # noqa: ASYNC110
                failed := await pool.fetch(
                    "SELECT details FROM run_events WHERE run_id = $1"
                    " AND kind IN ('retry_scheduled', 'dead_lettered')",
                    run_id,
                )
            ):
                await anyio.sleep(0.05)
    message = str(failed[0]["details"])
    assert "from version 1 to version 2 of agent shipping" in message, message
    assert "no field n in this shape" in message
    run = await store.get(run_id)
    assert (run.checkpoint, run.agent_version) == ({"n": 1}, "1")


async def test_a_claim_takes_only_runs_whose_checkpoint_its_worker_can_read(
    store: RunStore,
) -> None:
    fresh = (await store.submit("a", {"fresh": True})).run.run_id
    written = (await store.submit("a", {"fresh": False})).run.run_id
    for run_id in (fresh, written):
        claimed = await store.claim_run("w0", run_id, lease_seconds=30)
        assert claimed is not None and claimed.agent_version is None
        if run_id == written:
            assert await store.commit_step(
                claimed.lease, expected_version=0, next_step="b", checkpoint={}, agent_version="1"
            )
        assert await store.release(claimed.lease)
    batch = await store.claim("w2", ["a"], limit=5, versions={"a": ["2"]})
    assert [run.run_id for run in batch.claimed] == [fresh]  # never started: anyone's
    assert await store.claim_run("w2", written, versions={"a": ["2"]}) is None
    upgrading = await store.claim("w3", ["a"], limit=5, versions={"a": ["2", "1"]})
    assert [(run.run_id, run.agent_version) for run in upgrading.claimed] == [(written, "1")]


async def test_a_worker_without_an_upgrade_path_leaves_the_run_for_one_that_has_it(
    settings: Settings, store: RunStore, pool: asyncpg.Pool
) -> None:
    run_id = await parked_under_v1(settings, store)
    async with running_worker(settings, [v3_without_path], **FAST):
        await SignalStore(pool).send(run_id, "go")
        await anyio.sleep(1.5)  # several polls: it must not take the run
        run = await store.get(run_id)
        assert (run.state, run.fence, run.agent_version) == (RunState.WAITING, 1, "1")
        [listed_run] = await RunReads(pool).list_runs(agent="shipping")
        assert listed_run.held_back == "no worker serves version 1 of shipping"
        registry = WorkerRegistry(settings.schema)
        stranded = stranded_runs(await registry.agent_versions(pool))
        assert stranded == [{"agent": "shipping", "runs": 1}]  # orchestrator_runs_stranded
        shown = await asyncio.to_thread(cli, settings, "agents", "versions", "--json")
        assert shown.returncode == 0, shown.stderr
        listed = {row["version"]: row for row in json.loads(shown.stdout)}
        assert listed["1"]["unfinished_runs"] == 1 and listed["1"]["stranded"] is True
        assert listed["1"]["claimed_by"] == [] and len(listed["3.0"]["workers"]) == 1
        async with running_worker(settings, [v2], **FAST) as upgrading:
            [version_1] = [
                v
                for v in await WorkerRegistry(settings.schema).agent_versions(pool)
                if v.version == "1"
            ]
            assert version_1.claimed_by == [upgrading.worker_id] or version_1.unfinished_runs == 0
            run = await until_state(store, run_id, RunState.SUCCEEDED, RunState.DEAD)
    assert run.result == {"read": {"count": 1, "upgrades": 1}}
    versions = await pool.fetch("SELECT agent_versions FROM workers")
    assert all(
        row["agent_versions"] in ({"shipping": ["3.0"]}, {"shipping": ["2", "1"]})
        for row in versions
    )


@pytest.mark.parametrize(
    ("options", "why"),
    [
        ({"version": 0}, "1 or more"),
        ({"version": -3}, "1 or more"),
        ({"version": True}, "whole number or text"),
        ({"version": 1.5}, "whole number or text"),
        ({"version": ""}, "1-64 letters"),
        ({"version": "x" * 65}, "1-64 letters"),
        ({"version": "v1\x00"}, "1-64 letters"),
        ({"version": "two words"}, "1-64 letters"),
        ({"version": 2, "upgrades": {2: to_v2}}, "its own version"),
        ({"version": 2, "upgrades": {"": to_v2}}, "1-64 letters"),
        ({"version": 2, "upgrades": {1: "not a function"}}, "not a function"),
    ],
)
def test_a_bad_version_or_upgrade_is_one_line(options: dict[str, Any], why: str) -> None:
    with pytest.raises(InvalidInput, match=why) as raised:
        Agent("shipping", first=Start, **options)
    assert "\n" not in str(raised.value)


class Slow(Step):
    name = "Start"

    async def run(self, ctx: StepContext) -> Outcome:
        await anyio.sleep(float(ctx.input.get("seconds", 0)))
        return Next("End", checkpoint={"n": 1})


slow_v1 = Agent("slow", first=Slow, steps=[EndV1], version=1)
slow_v2 = Agent("slow", first=Slow, steps=[EndV1], version=2)


async def test_a_cutover_takes_the_runs_older_workers_hold_and_they_commit_nothing_after(
    settings: Settings, store: RunStore, pool: asyncpg.Pool
) -> None:
    run_id = (await store.submit("slow", {"seconds": 3})).run.run_id
    async with running_worker(settings, [slow_v1], **FAST):
        held = await until_state(store, run_id, RunState.RUNNING)
        done = await AgentStore(pool).cutover("slow", 2)
        assert (done.version, done.previous, done.runs_cut) == ("2", None, 1)
        run = await store.get(run_id)
        assert run.state is RunState.QUEUED and run.fence > held.fence and run.lease_owner is None
        later = (await store.submit("slow", {"seconds": 0})).run.run_id
        await anyio.sleep(4)  # the old worker's step ends meanwhile; it may not commit
        assert (await store.get(later)).state is RunState.QUEUED  # nor claim anew
    stale = await pool.fetch(
        "SELECT kind FROM run_events WHERE run_id = $1 AND fence = $2 AND kind <> 'claimed'",
        run_id,
        held.fence,
    )
    assert [row["kind"] for row in stale] in ([], ["lease_lost"]), stale
    async with running_worker(settings, [slow_v2], **FAST):
        for each in (run_id, later):
            finished = await until_state(store, each, RunState.SUCCEEDED, RunState.DEAD)
            assert finished.state is RunState.SUCCEEDED, finished.error
            assert (finished.started_version, finished.agent_version) == ("2", "2")
    events = [e.kind for e in await store.events(run_id)]
    assert "cut_over" in events
    actions = [r["action"] for r in await pool.fetch("SELECT action FROM audit_log")]
    assert actions == ["agent_cutover"]


async def test_a_commit_of_a_version_the_agent_is_not_cut_over_to_is_refused(
    store: RunStore, pool: asyncpg.Pool
) -> None:
    # A claim that raced the cutover (it read no cutover yet) still commits nothing.
    await store.submit("a", {})
    [claimed] = (await store.claim("w1", ["a"], limit=1, lease_seconds=30)).claimed
    await pool.execute(
        "INSERT INTO agent_cutovers (agent, version, set_by) VALUES ('a', '2', 'test')"
    )
    common: dict[str, Any] = {"expected_version": 0, "next_step": "b", "checkpoint": {}}
    assert await store.commit_step(claimed.lease, agent_version="1", **common) is None
    assert await store.commit_step(claimed.lease, **common) is None  # unversioned: refused too
    assert await store.commit_step(claimed.lease, agent_version="2", **common) is not None


async def test_batched_commits_of_a_version_the_agent_is_not_cut_over_to_are_refused(
    store: RunStore, pool: asyncpg.Pool
) -> None:
    # The group commit's statements (step commits, final commits) refuse them too, run by run.
    for _ in range(4):
        await store.submit("a", {})
    claimed = (await store.claim("w1", ["a"], limit=4, lease_seconds=30)).claimed
    await pool.execute(
        "INSERT INTO agent_cutovers (agent, version, set_by) VALUES ('a', '2', 'test')"
    )
    old_step, new_step, old_finish, new_finish = (run.lease for run in claimed)
    committed = await store.commit_steps(
        "w1",
        [
            StepCommit(old_step, 0, "b", {}, agent_version="1"),
            StepCommit(new_step, 0, "b", {}, agent_version="2"),
        ],
    )
    assert set(committed) == {new_step.run_id}
    finished = await store.finish_many(
        "w1",
        [
            RunFinish(old_finish, 0, RunState.SUCCEEDED, agent_version="1"),
            RunFinish(new_finish, 0, RunState.SUCCEEDED, agent_version="2"),
        ],
    )
    assert finished == {new_finish.run_id}
    assert (await store.get(old_finish.run_id)).state is RunState.RUNNING


async def test_a_cutover_to_an_older_version_or_of_a_bad_name_is_one_line(
    settings: Settings, pool: asyncpg.Pool
) -> None:
    agents = AgentStore(pool)
    for agent, version in (("bad name", 1), ("slow", 0), ("slow", "v\x00"), ("slow", "x" * 65)):
        with pytest.raises(InvalidInput):
            await agents.cutover(agent, version)
    await agents.cutover("slow", 3)
    done = await asyncio.to_thread(cli, settings, "agents", "cutover", "slow", "--to", "2")
    assert done.returncode == 1, done.stderr
    assert "older version 2 is refused" in done.stderr
    assert done.stderr.strip().count("\n") == 0
    done = await asyncio.to_thread(
        cli, settings, "agents", "cutover", "slow", "--to", "4", "--json"
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {
        "agent": "slow",
        "version": "4",
        "previous": "3",
        "runs_cut": 0,
        "drain": False,
        "runs_draining": 0,
    }
    assert await pool.fetchval("SELECT version FROM agent_cutovers WHERE agent = 'slow'") == "4"
