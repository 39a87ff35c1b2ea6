"""Group commit and effects: a run's refused effect refuses that run alone (issue 11).

A batch of final commits with effects, ordinary final commits and a run whose effect the
boundary refuses is written by one ``GroupCommitter``: the innocent runs commit once, with no
lease lost and no extra attempt; the refused run is told why and nothing of it is written.
"""

from __future__ import annotations

import functools

import anyio
import asyncpg

from orchestrator.agent.steps import Agent, Finish, Next, Outcome, Step, StepContext
from orchestrator.db.store import RunFinish, RunStore, StepCommit
from orchestrator.effect_model import Effect, EffectPolicy, EffectStatus
from orchestrator.effects.http import HttpAdapter
from orchestrator.effects.store import EffectStore
from orchestrator.models import RunState
from orchestrator.settings import Settings
from orchestrator.testing import LocalVendor, running_worker, wait_for_run
from orchestrator.worker.group_commit import Committed, EffectRefused, GroupCommitter, Refused
from test_runtime import FAST, eventually


def note(key: str = "final-note", kind: str = "crm") -> Effect:
    return Effect(key, kind, {"note": "done"}, EffectPolicy.IRREVERSIBLE)


async def test_a_batch_with_a_refused_effect_commits_every_other_run_once(
    store: RunStore, pool: asyncpg.Pool
) -> None:
    for _ in range(27):
        await store.submit("agent", {})
    claimed = (await store.claim("w", ["agent"], limit=27, lease_seconds=30)).claimed
    ordinary, with_effects, conflicting = claimed[:20], claimed[20:25], claimed[25:]
    boundary = EffectStore(pool)
    for run in conflicting:  # the key is already taken by another kind: the boundary refuses
        async with pool.acquire() as db, db.transaction():
            await boundary.accept(db, run.run_id, run.fence, note(kind="email"), worker_id="w")
    committer = GroupCommitter(store, "w", statement_seconds=5)
    answers: dict[str, object] = {}
    refused_step = conflicting[1]
    step_answer: list[object] = []

    async def commit_step() -> None:
        step_answer.append(
            await committer.commit_step(
                StepCommit(refused_step.lease, 0, "next", {}, effects=(note(),))
            )
        )

    with anyio.fail_after(60):
        async with anyio.create_task_group() as group:
            for run in ordinary:
                committer.finish(
                    RunFinish(run.lease, 0, RunState.SUCCEEDED, {"ok": True}),
                    functools.partial(answers.setdefault, run.run_id),
                )
            for run in [*with_effects, conflicting[0]]:
                committer.finish(
                    RunFinish(run.lease, 0, RunState.SUCCEEDED, {"ok": True}, effects=(note(),)),
                    functools.partial(answers.setdefault, run.run_id),
                )
            group.start_soon(commit_step)
            await anyio.sleep(0.05)  # all of them queued: one batch
            group.start_soon(committer.run)
            await eventually(lambda: len(answers) == 26 and bool(step_answer), within=60)
            group.cancel_scope.cancel()

    for run in [*ordinary, *with_effects]:
        assert answers[run.run_id] == Committed(), run.run_id
        assert (await store.get(run.run_id)).state is RunState.SUCCEEDED
        kinds = [event.kind for event in await store.events(run.run_id)]
        assert kinds.count("succeeded") == 1 and "lease_lost" not in kinds
    for run in with_effects:  # Finish(effects=...) commits its effect with the finish
        record = await boundary.get(run.run_id, "final-note")
        assert (record.status, record.fence) == (EffectStatus.ACCEPTED, run.fence)
    refusal = answers[conflicting[0].run_id]
    assert isinstance(refusal, Refused) and isinstance(refusal.error, EffectRefused)
    assert "already used with another kind" in str(refusal.error)
    [stepped] = step_answer
    assert isinstance(stepped, Refused) and isinstance(stepped.error, EffectRefused)
    for run in conflicting:  # nothing of the refused commits was written
        stored = await store.get(run.run_id)
        assert (stored.state, stored.checkpoint_version) == (RunState.RUNNING, 0)
        assert (await boundary.get(run.run_id, "final-note")).kind == "email"
    assert committer.batches == 1  # one batch: written again without the refused runs


class FinishWithNote(Step):
    async def run(self, ctx: StepContext) -> Outcome:
        return Finish(result={"noted": True}, effects=[note()])


class NoteThenConflict(Step):
    async def run(self, ctx: StepContext) -> Outcome:
        return Next(ConflictingFinish, checkpoint={}, effects=[note()])


class ConflictingFinish(Step):
    async def run(self, ctx: StepContext) -> Outcome:
        return Finish(result={}, effects=[note(kind="email")])  # the same key, another kind


class Quick(Step):
    async def run(self, ctx: StepContext) -> Outcome:
        return Finish(result={"quick": True})


async def test_finish_with_an_effect_commits_and_the_vendor_gets_it_once(
    store: RunStore, settings: Settings
) -> None:
    noting = Agent("noting", first=FinishWithNote)
    quick = Agent("quick", first=Quick)
    conflicted = Agent("conflicted", first=NoteThenConflict, steps=[ConflictingFinish])
    async with LocalVendor() as vendor:
        adapters = {"crm": HttpAdapter("crm", url=vendor.send_url, reconcile="replay")}
        noted = [(await store.submit("noting", {"n": n})).run.run_id for n in range(5)]
        plain = [(await store.submit("quick", {"n": n})).run.run_id for n in range(20)]
        bad = (await store.submit("conflicted", {}, max_attempts=2)).run.run_id
        async with running_worker(
            settings,
            [noting, quick, conflicted],
            concurrency=30,
            claim_batch=30,
            effect_adapters=adapters,
            **FAST,
        ):
            for run_id in [*noted, *plain, bad]:
                await wait_for_run(store, run_id, within=60)
            boundary = EffectStore(store.pool)
            for run_id in noted:
                record = await boundary.get(run_id, "final-note")
                with anyio.fail_after(60):
                    while not record.status.settled:
                        await anyio.sleep(0.05)
                        record = await boundary.get(run_id, "final-note")
                assert record.status is EffectStatus.CONFIRMED
    for run_id in [*noted, *plain]:
        assert (await store.get(run_id)).state is RunState.SUCCEEDED
        kinds = [event.kind for event in await store.events(run_id)]
        assert kinds.count("claimed") == 1 and "lease_lost" not in kinds, kinds
    assert sorted(vendor.requests_by_key.values()) == [1] * 6  # and the first step's note of `bad`
    dead = await store.get(bad)
    assert dead.state is RunState.DEAD
    assert dead.error["type"] == "EffectRefused"
    assert "already used with another kind" in dead.error["message"]
