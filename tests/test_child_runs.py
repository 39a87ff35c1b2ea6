"""Runs that start runs (docs/child-runs.md): children spawned in the parent's fenced commit,
fan-in without a lease, cascading cancel, and bad spawns refused with nothing committed."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import anyio
import asyncpg
import pytest

from orchestrator.agent.children import Child
from orchestrator.agent.steps import Agent, Fail, Finish, Next, Outcome, Step, StepContext, Wait
from orchestrator.db.store import RunStore
from orchestrator.effect_model import AcceptOutcome, Effect
from orchestrator.effects.store import EffectStore
from orchestrator.errors import InvalidInput
from orchestrator.ids import new_run_id
from orchestrator.models import RunState
from orchestrator.settings import Settings
from orchestrator.testing import capture_spans, running_worker
from test_flow_control import cli
from test_runtime import FAST
from test_upgrades import until_state


class Work(Step):
    """A child: doubles ``input["n"]`` after ``input["seconds"]``; fails when told to."""

    async def run(self, ctx: StepContext) -> Outcome:
        await anyio.sleep(float(ctx.input.get("seconds", 0)))
        if ctx.input.get("fail"):
            return Fail("told to fail", details={"n": ctx.input["n"]})
        return Finish(result={"twice": 2 * ctx.input["n"]})


class FanOut(Step):
    async def run(self, ctx: StepContext) -> Outcome:
        children = [
            Child("worker", {"n": n, "fail": n in ctx.input.get("failing", [])}, key=f"c{n}")
            for n in range(ctx.input["children"])
        ]
        return Wait(then=FanIn, children=children, need=ctx.input.get("need"), checkpoint={})


class FanIn(Step):
    async def run(self, ctx: StepContext) -> Outcome:
        assert ctx.wait is not None and ctx.wait.children is not None
        outcomes = ctx.wait.children
        return Finish(
            result={
                "sum": sum(o.result["twice"] for o in outcomes.values() if o.succeeded),
                "ended": sorted(k for k, o in outcomes.items() if o.ended),
                "failed": {k: o.error for k, o in outcomes.items() if o.state is RunState.FAILED},
            }
        )


worker_agent = Agent("worker", first=Work)
parent_agent = Agent("parent", first=FanOut, steps=[FanIn])
AGENTS = [worker_agent, parent_agent]


async def test_a_parent_fans_out_to_100_children_and_is_woken_once_all_have_ended(
    settings: Settings, store: RunStore, pool: asyncpg.Pool
) -> None:
    run_id = (await store.submit("parent", {"children": 100})).run.run_id
    async with running_worker(settings, AGENTS, concurrency=20, **FAST):
        with anyio.fail_after(60):
            while (await store.get(run_id)).state is not RunState.WAITING:  # noqa: ASYNC110
                await anyio.sleep(0.02)
        waiting = await store.get(run_id)
        assert waiting.lease_owner is None and waiting.lease_until is None  # no lease held
        done = await until_state(store, run_id, RunState.SUCCEEDED, RunState.DEAD)
    assert done.result["sum"] == sum(2 * n for n in range(100)), done.error
    assert len(done.result["ended"]) == 100 and done.result["failed"] == {}
    children = await pool.fetch(
        "SELECT child_key, root_run_id, depth, state FROM runs WHERE parent_run_id = $1", run_id
    )
    assert len(children) == 100 and {c["state"] for c in children} == {"succeeded"}
    assert {(c["root_run_id"], c["depth"]) for c in children} == {(run_id, 1)}
    spawned = await pool.fetch(
        "SELECT details FROM run_events WHERE run_id = $1 AND kind = 'spawned'", run_id
    )
    assert [len(row["details"]["children"]) for row in spawned] == [100]
    listed = await asyncio.to_thread(
        cli, settings, "runs", "list", "--parent", run_id, "--limit", "1000", "--json"
    )
    assert listed.returncode == 0, listed.stderr
    assert len(json.loads(listed.stdout)) == 100
    shown = await asyncio.to_thread(cli, settings, "runs", "show", listed_child(listed.stdout))
    assert f"{run_id} (child c" in shown.stdout, shown.stdout


def listed_child(listing: str) -> str:
    return str(json.loads(listing)[0]["run_id"])


@pytest.mark.parametrize("need", [1, 3])
async def test_a_parent_waiting_for_n_children_is_woken_by_the_nth_and_reads_failures(
    settings: Settings, store: RunStore, need: int
) -> None:
    run_id = (
        await store.submit("parent", {"children": 5, "need": need, "failing": [0]})
    ).run.run_id
    async with running_worker(settings, AGENTS, **FAST):
        done = await until_state(store, run_id, RunState.SUCCEEDED, RunState.DEAD)
    assert done.state is RunState.SUCCEEDED, done.error
    assert len(done.result["ended"]) >= need
    if "c0" in done.result["ended"]:  # a child's failure reaches its parent, typed
        assert done.result["failed"]["c0"]["message"] == "told to fail"


async def test_a_stale_parent_spawns_nothing_and_a_retried_step_no_second_child(
    store: RunStore, pool: asyncpg.Pool
) -> None:
    await store.submit("parent", {})
    [first] = (await store.claim("w1", ["parent"], limit=1, lease_seconds=30)).claimed
    child = Child("worker", {"n": 1}, key="only")
    spawned = await store.spawn_children(first.lease, [child.spawn(new_run_id())], db=pool)
    assert spawned is not None
    again = await store.spawn_children(first.lease, [child.spawn(new_run_id())], db=pool)
    assert again == spawned  # the same key: the same child
    await pool.execute("UPDATE runs SET lease_until = now() WHERE run_id = $1", first.run_id)
    [second] = (await store.claim("w2", ["parent"], limit=1, lease_seconds=30)).claimed
    other = Child("worker", {"n": 2}, key="other")
    assert await store.spawn_children(first.lease, [other.spawn(new_run_id())], db=pool) is None
    assert await store.spawn_children(second.lease, [child.spawn(new_run_id())], db=pool) == (
        spawned
    )
    keys = await pool.fetch("SELECT child_key FROM runs WHERE parent_run_id = $1", first.run_id)
    assert [row["child_key"] for row in keys] == ["only"]


async def tree(store: RunStore, pool: asyncpg.Pool) -> tuple[list[Any], str]:
    """A root, its child and grandchild, each claimed (held) by a worker; the grandchild with
    an effect accepted and not yet sent."""
    await store.submit("parent", {})
    [root] = (await store.claim("w1", ["parent"], limit=1, lease_seconds=60)).claimed
    made = await store.spawn_children(
        root.lease, [Child("middle", {}, key="m").spawn(new_run_id())], db=pool
    )
    assert made is not None
    [middle] = (await store.claim("w2", ["middle"], limit=1, lease_seconds=60)).claimed
    made = await store.spawn_children(
        middle.lease, [Child("leaf", {}, key="l").spawn(new_run_id())], db=pool
    )
    assert made is not None
    [leaf] = (await store.claim("w3", ["leaf"], limit=1, lease_seconds=60)).claimed
    async with pool.acquire() as db, db.transaction():
        await EffectStore(pool).accept(
            db, leaf.run_id, leaf.fence, Effect("note", "crm", {"x": 1}), worker_id="w3"
        )
    return [root, middle, leaf], made["l"]


async def test_cancelling_a_root_cancels_its_tree_and_no_descendant_can_act_after(
    store: RunStore, pool: asyncpg.Pool
) -> None:
    (root, middle, leaf), _ = await tree(store, pool)
    await store.cancel(root.run_id, reason="wrong customer")
    for claimed in (root, middle, leaf):
        run = await store.get(claimed.run_id)
        assert run.state is RunState.CANCELLED and run.fence > claimed.fence
        common: dict[str, Any] = {"expected_version": 0, "next_step": "x", "checkpoint": {}}
        assert await store.commit_step(claimed.lease, **common) is None
    effect = await EffectStore(pool).get(leaf.run_id, "note")
    assert effect.status.value == "rejected"  # withdrawn: never sent
    async with pool.acquire() as db, db.transaction():
        late = await EffectStore(pool).accept(
            db, leaf.run_id, leaf.fence, Effect("late", "crm", {"x": 2}), worker_id="w3"
        )
    assert late.outcome is not AcceptOutcome.ACCEPTED
    events = await pool.fetch(
        "SELECT run_id, details FROM run_events WHERE kind = 'cancelled' ORDER BY run_id"
    )
    assert len(events) == 3
    assert sum(1 for e in events if e["details"].get("with_ancestor") == root.run_id) == 2
    [audit] = await pool.fetch("SELECT detail FROM audit_log WHERE action = 'cancel'")
    assert audit["detail"]["descendants_cancelled"] == 2


@pytest.mark.parametrize(
    ("make", "why"),
    [
        (lambda: Next("FanIn", {}, children=[Child("worker", {}, "a")] * 2), "same key"),
        (lambda: Wait(then="FanIn", children=["a", "a"]), "a child twice"),
        (lambda: Wait(then="FanIn", children=["a"], need=2), "need is 1 to"),
        (lambda: Wait(then="FanIn", children=["a"], need=0), "need is 1 to"),
        (lambda: Wait(then="FanIn", children="a"), "are lists"),
        (lambda: Child("worker", {}, "bad key!"), "a child key is"),
        (lambda: Child("bad agent!", {}, "k"), "agent"),
        (lambda: Child("worker", {}, "k", max_attempts=0), "max_attempts"),
        (
            lambda: Next("FanIn", {}, children=[Child("worker", {}, f"k{n}") for n in range(1001)]),
            "at most 1000",
        ),
    ],
)
def test_a_bad_spawn_is_one_line(make: Any, why: str) -> None:
    with pytest.raises(InvalidInput, match=why) as raised:
        make()
    assert "\n" not in str(raised.value)


class SpawnUnknown(Step):
    async def run(self, ctx: StepContext) -> Outcome:
        return Next(FanIn, checkpoint={}, children=[Child("nobody_serves_this", {}, "x")])


async def test_a_spawn_of_an_agent_no_worker_serves_fails_the_attempt_and_spawns_nothing(
    settings: Settings, store: RunStore, pool: asyncpg.Pool
) -> None:
    agent = Agent("lost", first=SpawnUnknown, steps=[FanIn])
    run_id = (await store.submit("lost", {}, max_attempts=1)).run.run_id
    async with running_worker(settings, [agent], **FAST):
        dead = await until_state(store, run_id, RunState.DEAD)
    assert "no worker serves" in json.dumps(dead.error) and "nobody_serves_this" in json.dumps(
        dead.error
    )
    assert await pool.fetchval("SELECT count(*) FROM runs WHERE parent_run_id = $1", run_id) == 0


async def test_the_database_refuses_a_spawn_too_deep_or_malformed_and_spawns_nothing(
    store: RunStore, pool: asyncpg.Pool
) -> None:
    await store.submit("parent", {})
    [claimed] = (await store.claim("w1", ["parent"], limit=1, lease_seconds=30)).claimed
    bad: list[list[dict[str, Any]]] = [
        [{"run_id": new_run_id(), "agent": "worker", "input": {}, "key": "a b"}],
        [{"run_id": "not an id", "agent": "worker", "input": {}, "key": "a"}],
        [{"run_id": new_run_id(), "agent": "worker", "input": {}, "key": "a"}] * 2,
        [{"run_id": new_run_id(), "agent": "worker", "input": {}, "key": "a", "priority": 5000}],
    ]
    for children in bad:
        with pytest.raises(asyncpg.InvalidParameterValueError):
            await store.spawn_children(claimed.lease, children, db=pool)
    await pool.execute("UPDATE runs SET depth = 16 WHERE run_id = $1", claimed.run_id)
    deep = [{"run_id": new_run_id(), "agent": "worker", "input": {}, "key": "a"}]
    with pytest.raises(asyncpg.InvalidParameterValueError, match="levels"):
        await store.spawn_children(claimed.lease, deep, db=pool)
    assert await pool.fetchval("SELECT count(*) FROM runs WHERE parent_run_id IS NOT NULL") == 0


async def test_a_cancel_racing_a_child_s_final_commit_neither_deadlocks_nor_loses_the_child(
    store: RunStore, pool: asyncpg.Pool
) -> None:
    """The child's commit holds the child and then wants its waiting parent (to wake it); the
    cancel holds the parent and wants the child. The cancel lets go and tries again."""
    await store.submit("parent", {})
    [parent] = (await store.claim("w1", ["parent"], limit=1, lease_seconds=60)).claimed
    made = await store.spawn_children(
        parent.lease, [Child("worker", {"n": 1}, key="k").spawn(new_run_id())], db=pool
    )
    assert made is not None
    await pool.execute(
        "UPDATE runs SET state = 'waiting', lease_owner = NULL, lease_until = NULL,"
        " available_at = 'infinity', wait = $2, children_awaited = 1 WHERE run_id = $1",
        parent.run_id,
        {"step": "FanIn", "children": ["k"], "need": None},
    )
    async with pool.acquire() as child_commit:
        transaction = child_commit.transaction()
        await transaction.start()
        await child_commit.execute("SELECT 1 FROM runs WHERE run_id = $1 FOR UPDATE", made["k"])
        cancelling = asyncio.ensure_future(store.cancel(parent.run_id))
        await anyio.sleep(0.5)  # the cancel holds the parent (or is trying to)
        await child_commit.execute(
            "UPDATE runs SET state = 'succeeded', finished_at = now() WHERE run_id = $1",
            made["k"],
        )
        await transaction.commit()
    with anyio.fail_after(30):
        cancelled = await cancelling
    assert cancelled.state is RunState.CANCELLED
    assert (await store.get(made["k"])).state is RunState.SUCCEEDED


async def test_a_child_s_trace_links_to_the_step_that_spawned_it(
    settings: Settings, store: RunStore
) -> None:
    exporter = capture_spans()
    assert exporter is not None
    exporter.clear()
    run_id = (await store.submit("parent", {"children": 2})).run.run_id
    async with running_worker(settings, AGENTS, **FAST):
        done = await until_state(store, run_id, RunState.SUCCEEDED, RunState.DEAD)
    assert done.state is RunState.SUCCEEDED, done.error
    spans = exporter.get_finished_spans()
    [spawning] = [s for s in spans if s.name == "step parent.FanOut"]
    children = [s for s in spans if s.name == "run worker"]
    assert len(children) == 2
    for child in children:  # each attempt is a trace of its own, linked to where it began
        linked = [(link.context.trace_id, link.context.span_id) for link in child.links]
        assert (spawning.context.trace_id, spawning.context.span_id) in linked


async def test_a_child_inherits_its_parent_s_concurrency_key_unless_it_sets_its_own(
    store: RunStore, pool: asyncpg.Pool
) -> None:
    await store.submit("parent", {}, concurrency_key="tenant-a")
    [claimed] = (await store.claim("w1", ["parent"], limit=1, lease_seconds=30)).claimed
    children = [
        Child("worker", {}, key="same").spawn(new_run_id()),
        Child("worker", {}, key="own", concurrency_key="tenant-b").spawn(new_run_id()),
    ]
    spawned = await store.spawn_children(claimed.lease, children, db=pool)
    assert spawned is not None
    keys = {key: (await store.get(run_id)).concurrency_key for key, run_id in spawned.items()}
    assert keys == {"same": "tenant-a", "own": "tenant-b"}


class SpawnThenFail(Step):
    async def run(self, ctx: StepContext) -> Outcome:
        if ctx.checkpoint is None:
            children = [
                Child("slow_worker", {"seconds": 60}, key="tied", cancel_with_parent=True),
                Child("slow_worker", {"seconds": 0.2}, key="free"),
            ]
            return Next(SpawnThenFail, checkpoint={"spawned": True}, children=children)
        return Fail("the parent gives up")


class SlowWork(Step):
    async def run(self, ctx: StepContext) -> Outcome:
        await anyio.sleep(float(ctx.input.get("seconds", 2)))
        return Finish(result={"done": True})


async def test_a_failed_parent_cancels_the_children_that_asked_to_be_and_no_others(
    settings: Settings, store: RunStore, pool: asyncpg.Pool
) -> None:
    failing = Agent("quitter", first=SpawnThenFail)
    slow = Agent("slow_worker", first=SlowWork)
    run_id = (await store.submit("quitter", {})).run.run_id
    async with running_worker(settings, [failing, slow], **FAST):
        failed = await until_state(store, run_id, RunState.FAILED, RunState.DEAD)
        children = {c.child_key: c for c in await store.list_runs(parent=run_id)}
        free = await until_state(store, children["free"].run_id, RunState.SUCCEEDED)
    assert failed.state is RunState.FAILED
    tied = await store.get(children["tied"].run_id)
    assert tied.state is RunState.CANCELLED and free.state is RunState.SUCCEEDED
    [event] = [e for e in await store.events(tied.run_id) if e.kind == "cancelled"]
    assert event.details["reason"] == f"its parent {run_id} failed"


class SpawnUnstorable(Step):
    async def run(self, ctx: StepContext) -> Outcome:
        bad: Any = {"when": {1, 2}} if ctx.input.get("kind") == "set" else {"x": "y" * 2_000_000}
        return Next(FanIn, checkpoint={}, children=[Child("worker", bad, "bad")])


async def test_a_child_whose_input_cannot_be_stored_fails_the_attempt_and_the_worker_goes_on(
    settings: Settings, store: RunStore, pool: asyncpg.Pool
) -> None:
    spawner = Agent("unstorable", first=SpawnUnstorable, steps=[FanIn])
    runs = [
        (await store.submit("unstorable", {"kind": kind}, max_attempts=1)).run.run_id
        for kind in ("set", "huge")
    ]
    async with running_worker(settings, [spawner, *AGENTS], **FAST):
        for run_id in runs:
            dead = await until_state(store, run_id, RunState.DEAD)
            assert "child bad's input" in json.dumps(dead.error), dead.error
        fine = (await store.submit("parent", {"children": 2})).run.run_id
        assert (await until_state(store, fine, RunState.SUCCEEDED)).result["sum"] == 2
    assert await pool.fetchval("SELECT count(*) FROM runs WHERE child_key = 'bad'") == 0
