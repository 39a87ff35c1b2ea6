"""Forks that keep their receipts (docs/child-runs.md): a run forked from a kept checkpoint
carries the effects it had confirmed before that point; the fork's steps read them and no
dispatcher sends them again; effects after that point are the fork's own."""

from __future__ import annotations

import asyncio
import json

import asyncpg
import pytest

from orchestrator.agent.steps import Agent, Finish, Next, Outcome, Step, StepContext
from orchestrator.db.forks import ForkStore
from orchestrator.db.store import RunStore
from orchestrator.effect_model import Effect
from orchestrator.effects.http import HttpAdapter
from orchestrator.errors import InvalidInput
from orchestrator.models import RunState
from orchestrator.settings import Settings
from orchestrator.testing import LocalVendor, running_worker
from test_flow_control import cli
from test_runtime import FAST
from test_upgrades import until_state


class First(Step):
    async def run(self, ctx: StepContext) -> Outcome:
        email = Effect("email-1", "crm", {"to": "ana@example.com", "n": 1})
        return Next(Second, checkpoint={"sent": 1}, effects=[email])


class Second(Step):
    async def run(self, ctx: StepContext) -> Outcome:
        first = await ctx.effects.wait("email-1", within=30)
        email = Effect("email-2", "crm", {"to": "ana@example.com", "n": 2})
        checkpoint = {"sent": 2, "first": first.external_id}
        return Next(Third, checkpoint=checkpoint, effects=[email])


class Third(Step):
    async def run(self, ctx: StepContext) -> Outcome:
        second = await ctx.effects.wait("email-2", within=30)
        return Finish(result={"first": ctx.checkpoint["first"], "second": second.external_id})


mailer = Agent("mailer", first=First, steps=[Second, Third], keep_checkpoints=True)


async def test_a_fork_after_the_first_email_sends_only_the_second(
    settings: Settings, store: RunStore, pool: asyncpg.Pool
) -> None:
    async with LocalVendor() as vendor:
        adapters = {"crm": HttpAdapter("crm", url=vendor.send_url, reconcile="replay")}
        run_id = (await store.submit("mailer", {})).run.run_id
        async with running_worker(settings, [mailer], effect_adapters=adapters, **FAST):
            original = await until_state(store, run_id, RunState.SUCCEEDED, RunState.DEAD)
            assert original.state is RunState.SUCCEEDED, original.error
            kept = await pool.fetch(
                "SELECT version, step FROM run_checkpoints WHERE run_id = $1 ORDER BY version",
                run_id,
            )
            assert [(k["version"], k["step"]) for k in kept] == [(1, "Second"), (2, "Third")]
            done = await asyncio.to_thread(
                cli, settings, "runs", "fork", run_id, "--step", "Second", "--json"
            )
            assert done.returncode == 0, done.stderr
            fork = json.loads(done.stdout)
            assert (fork["version"], fork["step"], fork["receipts"]) == (1, "Second", 1)
            forked = await until_state(store, fork["run_id"], RunState.SUCCEEDED, RunState.DEAD)
    assert forked.state is RunState.SUCCEEDED, forked.error
    assert forked.forked_from == run_id and forked.forked_at_version == 1
    # The fork read the first email's receipt; it sent only the second, under its own key.
    assert forked.result["first"] == original.result["first"]
    assert forked.result["second"] != original.result["second"]
    assert sorted(vendor.requests_by_key.values()) == [1, 1, 1]
    payloads = sorted(d["payload"]["n"] for d in vendor.deliveries.values())
    assert payloads == [1, 2, 2]  # the first email once in total
    actions = [r["action"] for r in await pool.fetch("SELECT action FROM audit_log")]
    assert actions == ["fork"]


async def test_a_fork_is_refused_while_an_effect_before_its_point_is_unsettled(
    store: RunStore, pool: asyncpg.Pool
) -> None:
    await store.submit("mailer", {})
    [claimed] = (await store.claim("w1", ["mailer"], limit=1, lease_seconds=30)).claimed
    async with pool.acquire() as db, db.transaction():
        await db.execute(
            "UPDATE runs SET checkpoint_version = 1, step = 'Second' WHERE run_id = $1",
            claimed.run_id,
        )
        from orchestrator.effects.store import EffectStore

        await EffectStore(pool).accept(
            db, claimed.run_id, claimed.fence, Effect("email-1", "crm", {}), worker_id="w1"
        )
    await pool.execute(
        "INSERT INTO run_checkpoints (run_id, version, step, checkpoint, fence)"
        " VALUES ($1, 1, 'Second', '{}', $2)",
        claimed.run_id,
        claimed.fence,
    )
    await pool.execute("UPDATE effects SET status = 'uncertain'")
    forks = ForkStore(pool)
    with pytest.raises(asyncpg.ObjectNotInPrerequisiteStateError, match="email-1 \\(uncertain\\)"):
        await forks.fork(claimed.run_id, version=1)
    assert await forks.fork(claimed.run_id, version=0) is not None  # from the start: nothing
    with pytest.raises(InvalidInput, match="kept no checkpoint"):
        await forks.fork(claimed.run_id, step="Nowhere")
    with pytest.raises(asyncpg.InvalidParameterValueError, match="kept: 1"):
        await forks.fork(claimed.run_id, version=7)
    for bad in ({"version": -1}, {}, {"version": 1, "step": "Second"}, {"step": "a\x00"}):
        with pytest.raises(InvalidInput):
            await forks.fork(claimed.run_id, **bad)
