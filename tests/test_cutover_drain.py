"""A drained cutover (docs/upgrades.md): workers of another version claim nothing more of the
agent, but each run one of them holds commits the step it is in, under the fence it had, and is
given back in that commit's transaction for a worker of the new version."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import anyio
import asyncpg

from orchestrator.agent.steps import Agent, Fail, Finish, Next, Outcome, Step, StepContext, Wait
from orchestrator.db.agents import AgentStore
from orchestrator.db.signals import SignalStore
from orchestrator.db.store import RunStore
from orchestrator.models import JSON, RunState
from orchestrator.settings import Settings
from orchestrator.testing import running_worker
from test_flow_control import cli
from test_runtime import FAST
from test_upgrades import until_state


class Work(Step):
    """Sleeps ``input["seconds"]``, then on to ``Read`` (or a wait for ``go``)."""

    name = "Work"

    async def run(self, ctx: StepContext) -> Outcome:
        await anyio.sleep(float(ctx.input.get("seconds", 0)))
        if ctx.input.get("wait"):
            return Wait(then="Read", signals=["go"], checkpoint={"n": 1})
        return Next("Read", checkpoint={"n": 1})


class WorkV2(Work):
    async def run(self, ctx: StepContext) -> Outcome:
        return Next("Read", checkpoint={"count": 1})


class ReadV1(Step):
    name = "Read"

    async def run(self, ctx: StepContext) -> Outcome:
        return Finish(result={"read": ctx.checkpoint, "by": 1})


class ReadV2(Step):
    name = "Read"

    async def run(self, ctx: StepContext) -> Outcome:
        assert set(ctx.checkpoint or {}) == {"count"}, ctx.checkpoint
        return Finish(result={"read": ctx.checkpoint, "by": 2})


def to_v2(checkpoint: JSON) -> JSON:
    assert isinstance(checkpoint, dict)
    return {"count": checkpoint["n"]}


paced_v1 = Agent("paced", first=Work, steps=[ReadV1], version=1)
paced_v2 = Agent("paced", first=WorkV2, steps=[ReadV2], version=2, upgrades={1: to_v2})
COMMON: dict[str, Any] = {"expected_version": 0, "next_step": "Read", "checkpoint": {"n": 1}}


async def test_a_drained_run_commits_the_step_it_is_in_then_the_new_version_goes_on(
    settings: Settings, store: RunStore, pool: asyncpg.Pool
) -> None:
    run_id = (await store.submit("paced", {"seconds": 5})).run.run_id  # mid-step at the cutover
    async with running_worker(settings, [paced_v1], **FAST):
        held = await until_state(store, run_id, RunState.RUNNING)
        done = await AgentStore(pool).cutover("paced", 2, drain=True)
        assert (done.drain, done.runs_draining, done.runs_cut) == (True, 1, 0)
        run = await store.get(run_id)  # still the old worker's, under the same fence
        assert (run.state, run.fence, run.lease_owner) == (
            RunState.RUNNING,
            held.fence,
            held.lease_owner,
        )
        later = (await store.submit("paced", {"seconds": 0})).run.run_id
        given_back = await until_state(store, run_id, RunState.QUEUED)
        await anyio.sleep(1)  # the old worker may not claim either run again
        assert (await store.get(run_id)).state is RunState.QUEUED
        assert (await store.get(later)).state is RunState.QUEUED
    assert (given_back.step, given_back.agent_version, given_back.fence) == (
        "Read",
        "1",
        held.fence,
    )
    assert given_back.lease_owner is None and given_back.checkpoint == {"n": 1}
    released = [e for e in await store.events(run_id) if e.kind == "released"]
    assert [(e.fence, e.worker_id) for e in released] == [(held.fence, held.lease_owner)]
    assert "version 2" in json.dumps(released[0].details)
    async with running_worker(settings, [paced_v2], **FAST):
        for each, read in ((run_id, {"count": 1}), (later, {"count": 1})):
            finished = await until_state(store, each, RunState.SUCCEEDED, RunState.DEAD)
            assert finished.result == {"read": read, "by": 2}, finished.error
            assert finished.agent_version == "2"
    assert await pool.fetchval("SELECT count(*) FROM cutover_drains") == 0
    [audit] = await pool.fetch("SELECT detail FROM audit_log WHERE action = 'agent_cutover'")
    details = audit["detail"]
    assert (details["drain"], details["runs_draining"], details["runs_cut"]) == (True, 1, 0)


async def test_a_drained_step_that_waits_parks_and_is_woken_for_the_new_version(
    settings: Settings, store: RunStore, pool: asyncpg.Pool
) -> None:
    run_id = (await store.submit("paced", {"seconds": 4, "wait": True})).run.run_id
    async with running_worker(settings, [paced_v1], **FAST):
        await until_state(store, run_id, RunState.RUNNING)
        assert (await AgentStore(pool).cutover("paced", 2, drain=True)).runs_draining == 1
        parked = await until_state(store, run_id, RunState.WAITING)
    assert parked.agent_version == "1" and parked.lease_owner is None
    assert await pool.fetchval("SELECT count(*) FROM cutover_drains") == 0
    async with running_worker(settings, [paced_v2], **FAST):
        await SignalStore(pool).send(run_id, "go")
        finished = await until_state(store, run_id, RunState.SUCCEEDED, RunState.DEAD)
    assert finished.result == {"read": {"count": 1}, "by": 2}, finished.error


async def test_a_drain_lets_one_step_commit_under_the_fence_it_had_and_no_more(
    store: RunStore, pool: asyncpg.Pool
) -> None:
    await store.submit("paced", {})
    [claimed] = (await store.claim("w1", ["paced"], limit=1, lease_seconds=30)).claimed
    assert (await AgentStore(pool).cutover("paced", 2, drain=True)).runs_draining == 1
    committed = await store.commit_step(claimed.lease, agent_version="1", **COMMON)
    assert committed is not None and committed.drained
    assert await store.release_drained("w1", [claimed.run_id], db=pool) == {claimed.run_id}
    run = await store.get(claimed.run_id)
    assert (run.state, run.lease_owner, run.fence) == (RunState.QUEUED, None, claimed.fence)
    again = {**COMMON, "expected_version": 1}
    assert await store.commit_step(claimed.lease, agent_version="1", **again) is None
    # Claimed again (by a worker of the new version): the old fence's drain allows nothing.
    versions = {"paced": ["2", "1"]}
    [reclaimed] = (
        await store.claim("w2", ["paced"], limit=1, lease_seconds=30, versions=versions)
    ).claimed
    assert reclaimed.fence > claimed.fence
    assert await store.commit_step(reclaimed.lease, agent_version="1", **again) is None
    assert await store.commit_step(reclaimed.lease, agent_version="2", **again) is not None


async def test_a_plain_cutover_after_a_drain_takes_the_draining_runs_at_once(
    store: RunStore, pool: asyncpg.Pool
) -> None:
    await store.submit("paced", {})
    [claimed] = (await store.claim("w1", ["paced"], limit=1, lease_seconds=30)).claimed
    agents = AgentStore(pool)
    assert (await agents.cutover("paced", 2, drain=True)).runs_draining == 1
    taken = await agents.cutover("paced", 3)
    assert (taken.previous, taken.runs_cut, taken.drain) == ("2", 1, False)
    assert await store.commit_step(claimed.lease, agent_version="1", **COMMON) is None
    assert await pool.fetchval("SELECT count(*) FROM cutover_drains") == 0
    cut = await store.get(claimed.run_id)
    assert cut.fence > claimed.fence
    assert (claimed.attempt, cut.attempt) == (1, 0)  # a cutover is not the run's failure


async def test_a_drain_from_the_command_line_says_how_many_runs_finish_their_step(
    settings: Settings, store: RunStore
) -> None:
    await store.submit("paced", {})
    await store.claim("w1", ["paced"], limit=1, lease_seconds=30)
    done = await asyncio.to_thread(
        cli, settings, "agents", "cutover", "paced", "--to", "2", "--drain"
    )
    assert done.returncode == 0, done.stderr
    assert "1 run to finish the step they are in" in done.stdout, done.stdout
    done = await asyncio.to_thread(
        cli, settings, "agents", "cutover", "paced", "--to", "3", "--drain", "--json"
    )
    assert json.loads(done.stdout) == {
        "agent": "paced",
        "version": "3",
        "previous": "2",
        "runs_cut": 0,
        "drain": True,
        "runs_draining": 1,
    }


async def test_the_cutover_function_takes_a_null_drain_as_no_drain(pool: asyncpg.Pool) -> None:
    row = await pool.fetchrow(
        "SELECT * FROM orchestrator_cutover('paced', '2', NULL, NULL, NULL, NULL)"
    )
    assert row is not None and row["drain"] is False


class Refuse(Step):
    name = "Work"

    async def run(self, ctx: StepContext) -> Outcome:
        return Fail("not this one")


async def test_a_step_of_the_version_cut_over_to_may_fail_the_run(
    settings: Settings, store: RunStore, pool: asyncpg.Pool
) -> None:
    """Fail keeps the checkpoint, and its version, but is committed by the version that ran."""
    await AgentStore(pool).cutover("paced", 2)
    run_id = (await store.submit("paced", {})).run.run_id
    refusing = Agent("paced", first=Refuse, steps=[ReadV2], version=2)
    async with running_worker(settings, [refusing], **FAST):
        failed = await until_state(store, run_id, RunState.FAILED, RunState.DEAD)
    assert failed.state is RunState.FAILED and failed.error["message"] == "not this one"
    claims = [e for e in await store.events(run_id) if e.kind == "claimed"]
    assert len(claims) == 1  # committed at once, not lost and claimed again
