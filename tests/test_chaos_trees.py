"""Trees in the chaos campaign, piece by piece: the tree and leaf agents (versioned as the other
chaos agents are), the checker's tree rules on real trees a worker ran, against builds broken on
purpose (a cancel that does not cascade, a spawn that does not find the child a key names), and
on fabricated timelines. ``tests/test_chaos.py`` runs campaigns with trees and cascading
cancels."""

from __future__ import annotations

import collections
from datetime import UTC, datetime, timedelta
from typing import Any, cast

import anyio
import asyncpg
import pytest

from orchestrator.chaos.agents import leaf_agent, tree_agent
from orchestrator.chaos.caller_faults import TREE_ROOTS, CallerFaults
from orchestrator.chaos.campaign import plans
from orchestrator.chaos.checker import check_timelines
from orchestrator.chaos.context import FaultContext, FaultRecord, ScheduledFault
from orchestrator.chaos.findings import Findings
from orchestrator.chaos.tree_checks import (
    CHILD_MISREAD,
    CHILD_SPAWNED_TWICE,
    COMMITTED_AFTER_CANCEL,
    EFFECT_AFTER_CANCEL,
    SPAWNED_BY_STALE_PARENT,
    check_trees,
)
from orchestrator.db.agents import AgentStore
from orchestrator.db.store import RunStore
from orchestrator.models import RunState
from orchestrator.settings import Settings
from orchestrator.testing import running_worker
from support.chaos_mutants import CANCEL_WITHOUT_CASCADE, CHILD_KEYS_NOT_UNIQUE
from test_chaos_deploy import deploy_findings, runs_and_timelines, until_state
from test_runtime import FAST

ENDED = (RunState.SUCCEEDED, RunState.FAILED, RunState.CANCELLED, RunState.DEAD)


def tree(fan: str, need: int | None = None, work: float = 0.1, leaves: int = 3) -> dict[str, Any]:
    return {
        "customer": "c1",
        "fan": fan,
        "need": need,
        "tenant": None,
        "leaves": [{"customer": f"c1.{n}", "work_seconds": work} for n in range(leaves)],
    }


async def tree_findings(pool: asyncpg.Pool) -> Findings:
    """The tree rules and the timeline rules on what the database holds."""
    runs, events = await runs_and_timelines(pool)
    found = Findings()
    check_timelines(found, events)
    check_trees(found, runs, events, await pool.fetch("SELECT * FROM effects"))
    return found


async def until(pool: asyncpg.Pool, sql: str, *args: object) -> None:
    with anyio.fail_after(30):
        while not await pool.fetchval(sql, *args):  # noqa: ASYNC110 - database state, polled
            await anyio.sleep(0.05)


async def test_trees_spawn_each_leaf_once_and_read_how_each_ended(
    settings: Settings, store: RunStore, pool: asyncpg.Pool
) -> None:
    """Spawned and waited for by one commit (any one leaf), and spawned by a step whose next
    names the same children again (all of them): each key has one child."""
    agents = [tree_agent(1), leaf_agent(1)]
    async with running_worker(settings, agents, concurrency=8, **FAST):
        roots = [
            (await store.submit("chaos_tree", tree("wait", need=1))).run.run_id,
            (await store.submit("chaos_tree", tree("next"))).run.run_id,
        ]
        done = [await until_state(store, root, RunState.SUCCEEDED, RunState.DEAD) for root in roots]
        await until(pool, "SELECT bool_and(state = 'succeeded') FROM runs")
    assert [run.state for run in done] == [RunState.SUCCEEDED] * 2, [run.error for run in done]
    for run in done:
        assert sorted(run.result["read"]) == ["leaf-0", "leaf-1", "leaf-2"]
        assert run.checkpoint == {"spawned_v1": ["leaf-0", "leaf-1", "leaf-2"]}
    assert all(seen["state"] == "succeeded" for seen in done[1].result["read"].values())
    assert any(seen["state"] == "succeeded" for seen in done[0].result["read"].values())
    found = await tree_findings(pool)
    assert found.violations == []
    assert (found.trees, found.children, found.cascading_cancels) == (2, 6, 0)
    emails = await pool.fetchval("SELECT count(*) FROM effects WHERE effect_key = 'email'")
    assert emails == 6  # every leaf emailed once


async def test_the_checker_catches_a_spawn_that_starts_a_named_child_again(
    settings: Settings, store: RunStore, pool: asyncpg.Pool
) -> None:
    """Without the unique key, the step that names its children again starts each again."""
    await pool.execute(CHILD_KEYS_NOT_UNIQUE)
    async with running_worker(settings, [tree_agent(1), leaf_agent(1)], **FAST):
        root = (await store.submit("chaos_tree", tree("next", leaves=2))).run.run_id
        await until(pool, "SELECT count(*) >= 4 FROM runs WHERE parent_run_id = $1", root)
    found = await tree_findings(pool)
    twice = {v.subject for v in found.violations if v.rule == CHILD_SPAWNED_TWICE}
    assert twice == {f"{root}/leaf-0", f"{root}/leaf-1"}, found.violations


@pytest.mark.parametrize("cascade", [True, False], ids=["cascading", "not-cascading"])
async def test_a_cancel_of_a_root_with_its_leaves_mid_step(
    settings: Settings, store: RunStore, pool: asyncpg.Pool, cascade: bool
) -> None:
    """The leaves are mid-step when their root is cancelled: with the cascade nothing of theirs
    commits or is accepted afterwards; without it (a broken build) the checker says both."""
    if not cascade:
        await pool.execute(CANCEL_WITHOUT_CASCADE)
    async with running_worker(settings, [tree_agent(1), leaf_agent(1)], concurrency=8, **FAST):
        root = (await store.submit("chaos_tree", tree("wait", work=4))).run.run_id
        await until(
            pool,
            "SELECT count(*) = 3 FROM runs WHERE parent_run_id = $1 AND state = 'running'",
            root,
        )
        await store.cancel(root, reason="a test")
        await until(
            pool,
            "SELECT bool_and(state IN ('succeeded', 'cancelled')) FROM runs "
            "WHERE parent_run_id = $1",
            root,
        )
    found = await tree_findings(pool)
    leaves = await pool.fetch("SELECT run_id, state FROM runs WHERE parent_run_id = $1", root)
    if cascade:
        assert found.violations == []
        assert {leaf["state"] for leaf in leaves} == {"cancelled"}
        assert (found.cascading_cancels, found.descendants_cancelled) == (1, 3)
        assert not await pool.fetchval("SELECT count(*) FROM effects WHERE run_id <> $1", root)
        return
    broken = {(v.rule, v.subject.split("/")[0]) for v in found.violations}
    for leaf in leaves:
        assert (COMMITTED_AFTER_CANCEL, leaf["run_id"]) in broken, found.violations
        assert (EFFECT_AFTER_CANCEL, leaf["run_id"]) in broken, found.violations
    assert (found.cascading_cancels, found.descendants_cancelled) == (0, 0)


async def test_a_tree_waiting_under_one_version_is_merged_by_the_next(
    settings: Settings, store: RunStore, pool: asyncpg.Pool
) -> None:
    """The root parks under version 1 while its leaves are mid-step; both agents are cut over
    to 2 (taking the leaves from version 1), whose worker runs the leaves again and wakes the
    root, which reads its upgraded checkpoint."""
    v1 = [tree_agent(1), leaf_agent(1)]
    async with running_worker(settings, v1, worker_id="w-v1", concurrency=8, **FAST):
        root = (await store.submit("chaos_tree", tree("next", leaves=2, work=2))).run.run_id
        await until(
            pool,
            "SELECT count(*) = 2 FROM runs WHERE parent_run_id = $1 AND state = 'running'",
            root,
        )
        await until_state(store, root, RunState.WAITING)
        for agent in ("chaos_tree", "chaos_leaf"):
            await AgentStore(pool).cutover(agent, 2)
    v2 = [tree_agent(2), leaf_agent(2)]
    async with running_worker(settings, v2, worker_id="w-v2", concurrency=8, **FAST):
        run = await until_state(store, root, RunState.SUCCEEDED, RunState.DEAD)
    assert run.state is RunState.SUCCEEDED, run.error
    assert (run.started_version, run.agent_version) == ("1", "2")
    assert run.checkpoint == {"spawned_v2": ["leaf-0", "leaf-1"]}
    assert {seen["state"] for seen in run.result["read"].values()} == {"succeeded"}
    leaves = await pool.fetch("SELECT agent_version FROM runs WHERE parent_run_id = $1", root)
    assert [leaf["agent_version"] for leaf in leaves] == ["2", "2"]
    found = await deploy_findings(pool)
    assert found.violations == [] and found.runs_cut_over >= 2
    assert (await tree_findings(pool)).violations == []


async def test_a_tree_cancel_takes_a_root_whose_leaf_is_mid_step(pool: asyncpg.Pool) -> None:
    """Of the roots with unfinished children, the cancel fault takes one whose child is running
    when there is one; it cancels the tree, and says how many runs below went with it."""
    rows = [
        ("r_plain", "queued", None),
        ("r_queued", "waiting", None),
        ("r_queued.0", "queued", "r_queued"),
        ("r_busy", "waiting", None),
        ("r_busy.0", "running", "r_busy"),
        ("r_busy.1", "queued", "r_busy"),
        ("r_ended", "waiting", None),
        ("r_ended.0", "succeeded", "r_ended"),
    ]
    for run_id, state, parent in rows:
        await pool.execute(
            "INSERT INTO runs (run_id, agent, input, state, parent_run_id, child_key, "
            "root_run_id, depth, lease_owner, lease_until) VALUES ($1, 'chaos_tree', '{}', $2, "
            "$3, $4, $3, $5, $6, CASE WHEN $6::text IS NULL THEN NULL ELSE now() + "
            "interval '1 hour' END)",
            run_id,
            state,
            parent,
            None if parent is None else f"leaf-{run_id[-1]}",
            0 if parent is None else 1,
            "w" if state == "running" else None,
        )
    picks = await pool.fetch(f"{TREE_ROOTS} ORDER BY run_id")
    assert [pick["run_id"] for pick in picks] == ["r_busy"]
    context = FaultContext(
        cast(Any, None), cast(Any, None), cast(Any, None), pool, cast(Any, None), 0
    )
    context.trees = True
    record = FaultRecord(0, "cancel", "")
    await CallerFaults(context).cancel(ScheduledFault(0, "cancel", 2), record)
    assert (record.target, record.fired) == ("r_busy", True)
    assert record.detail == "a tree's root; runs cancelled below it: 2"
    picks = await pool.fetch(f"{TREE_ROOTS} ORDER BY run_id")
    assert [pick["run_id"] for pick in picks] == ["r_queued"]  # no child mid-step: any tree


def test_every_version_of_the_tree_agents_upgrades_every_older_one() -> None:
    tree3, leaf3 = tree_agent(3), leaf_agent(3)
    assert sorted(tree3.upgrades) == sorted(leaf3.upgrades) == ["1", "2"]
    assert tree3.upgrades["1"]({"spawned_v1": ["leaf-0"]}) == {"spawned_v3": ["leaf-0"]}
    assert leaf3.upgrades["2"]({"reached_v2": True}) == {"reached_v3": True}
    with pytest.raises(LookupError, match="checkpoint misread"):
        leaf3.upgrades["2"]({"reached_v1": True})


def test_the_workload_plans_trees_of_two_or_three_leaves() -> None:
    made = [plan for plan in plans(4, 60) if plan.agent == "chaos_tree"]
    assert len(made) == 20
    assert {len(plan.input["leaves"]) for plan in made} == {2, 3}
    assert {plan.input["fan"] for plan in made} == {"wait", "next"}
    assert {plan.input["need"] for plan in made} == {None, 1, 2}
    assert all(plan.input["tenant"] == plan.concurrency_key for plan in made)


T0 = datetime(2026, 12, 1, tzinfo=UTC)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


class Timelines:
    """Fabricated runs, timelines and effects, with event ids in the order they are added."""

    def __init__(self) -> None:
        self.runs: dict[str, dict[str, Any]] = {}
        self.events: dict[str, list[dict[str, Any]]] = collections.defaultdict(list)
        self.effects: list[dict[str, Any]] = []

    def run(
        self, run_id: str, parent: str | None = None, key: str | None = None, **row: Any
    ) -> None:
        row.setdefault("state", "succeeded")
        self.runs[run_id] = {
            "run_id": run_id,
            "parent_run_id": parent,
            "child_key": key,
            "input": {},
            "result": None,
            **row,
        }

    def event(self, run_id: str, kind: str, seconds: float, fence: int = 0, **details: Any) -> None:
        event_id = sum(len(timeline) for timeline in self.events.values()) + 1
        self.events[run_id].append(
            {
                "event_id": event_id,
                "kind": kind,
                "fence": fence,
                "at": at(seconds),
                "details": details,
            }
        )

    def effect(self, run_id: str, key: str, seconds: float) -> None:
        self.effects.append({"run_id": run_id, "effect_key": key, "created_at": at(seconds)})

    def check(self) -> dict[tuple[str, str], str]:
        found = Findings()
        check_trees(found, self.runs, self.events, self.effects)
        broken = {(v.rule, v.subject): v.detail for v in found.violations}
        assert len(broken) == len(found.violations), found.violations
        return broken


def test_the_spawn_rules_on_fabricated_timelines() -> None:
    """r_root spawns under fence 1; it is taken over (fence 2) and the stale owner spawns again
    under 1; r_other spawns after it was cancelled; r_twice has two children of one key."""
    t = Timelines()
    t.run("r_root")
    t.event("r_root", "claimed", 1, fence=1)
    t.run("c_kept", "r_root", "leaf-0")
    t.event("c_kept", "submitted", 2, parent_fence=1)
    t.event("r_root", "claimed", 3, fence=2)
    t.run("c_stale", "r_root", "leaf-1")
    t.event("c_stale", "submitted", 4, parent_fence=1)
    t.run("r_other")
    t.event("r_other", "claimed", 1, fence=1)
    t.event("r_other", "cancelled", 2, fence=2)
    t.run("c_after", "r_other", "leaf-0")
    t.event("c_after", "submitted", 3, parent_fence=2)
    t.run("c_unnamed", "r_other", "leaf-1")
    t.run("r_twice")
    t.event("r_twice", "claimed", 1, fence=1)
    for child in ("c_one", "c_two"):
        t.run(child, "r_twice", "leaf-0")
        t.event(child, "submitted", 2, parent_fence=1)
    broken = t.check()
    assert set(broken) == {
        (SPAWNED_BY_STALE_PARENT, "c_stale"),
        (SPAWNED_BY_STALE_PARENT, "c_after"),
        (SPAWNED_BY_STALE_PARENT, "c_unnamed"),
        (CHILD_SPAWNED_TWICE, "r_twice/leaf-0"),
        (COMMITTED_AFTER_CANCEL, "c_after"),  # its start, after its root's cancel
    }
    assert broken[SPAWNED_BY_STALE_PARENT, "c_stale"] == (
        "spawned under fence 1 of r_root, which held fence 2 then"
    )
    assert broken[SPAWNED_BY_STALE_PARENT, "c_after"] == (
        "spawned under fence 2 of r_other, which held no fence then"
    )
    assert broken[CHILD_SPAWNED_TWICE, "r_twice/leaf-0"] == "runs c_one, c_two"


def test_the_cancel_rules_on_fabricated_timelines() -> None:
    """r_root is cancelled at 10 s with its child c_cut and grandchild g_cut; c_late's cancel
    did not reach it and it committed on; g_late's effect was accepted after. Within the clock
    tolerance of the cancel, and before it, is allowed."""
    t = Timelines()
    t.run("r_root", state="cancelled")
    t.run("c_cut", "r_root", "leaf-0", state="cancelled")
    t.run("g_cut", "c_cut", "leaf-0", state="cancelled")
    t.run("c_late", "r_root", "leaf-1")
    t.run("g_late", "c_late", "leaf-0")
    t.event("r_root", "claimed", 1, fence=1)
    t.event("c_cut", "submitted", 2, parent_fence=1)
    t.event("c_late", "submitted", 2, parent_fence=1)
    t.event("c_cut", "claimed", 3, fence=1)
    t.event("c_late", "claimed", 3, fence=1)
    t.event("g_late", "submitted", 4, parent_fence=1)
    t.event("c_cut", "checkpoint", 9.9, fence=1, version=1)
    t.effect("c_cut", "email", 9.9)
    t.event("g_cut", "submitted", 9.9, parent_fence=1)
    t.event("r_root", "cancelled", 10, fence=2)
    t.event("c_cut", "cancelled", 10, fence=2, with_ancestor="r_root")
    t.event("g_cut", "cancelled", 10, fence=1, with_ancestor="r_root")
    t.effect("c_cut", "crm", 10.2)  # within the clock tolerance
    t.effect("g_late", "email", 11)
    t.event("c_late", "checkpoint", 12, fence=1, version=1)
    t.event("c_late", "succeeded", 13, fence=1, version=2)
    broken = t.check()
    assert set(broken) == {
        (COMMITTED_AFTER_CANCEL, "c_late"),
        (EFFECT_AFTER_CANCEL, "g_late/email"),
    }
    assert broken[COMMITTED_AFTER_CANCEL, "c_late"] == (
        "checkpoint 2.00s, succeeded 3.00s after the cancel of r_root committed"
    )
    assert broken[EFFECT_AFTER_CANCEL, "g_late/email"] == (
        "accepted 1.00s after the cancel of r_root committed"
    )
    found = Findings()
    check_trees(found, t.runs, t.events, t.effects)
    assert (found.trees, found.children, found.cascading_cancels) == (1, 4, 1)
    assert found.descendants_cancelled == 2


def test_the_read_rule_on_fabricated_results() -> None:
    """A root that read a leaf as it did not end, or was woken before its need was met."""
    t = Timelines()
    ok = {"state": "succeeded", "result": {"customer": "c1.0"}}
    running = {"state": "running", "result": None}
    t.run("r_kept", input={"need": 1}, result={"read": {"leaf-0": ok, "leaf-1": running}})
    wrong = {"state": "succeeded", "result": {"customer": "c9"}}
    failed = {"state": "failed", "result": None}
    t.run("r_wrong", result={"read": {"leaf-0": failed, "leaf-1": wrong}})
    t.run("r_early", input={"need": 2}, result={"read": {"leaf-0": ok, "leaf-1": running}})
    for root in ("r_kept", "r_wrong", "r_early"):
        t.event(root, "claimed", 0, fence=1)
        for n in range(2):
            t.run(f"{root}.{n}", root, f"leaf-{n}", result={"customer": f"c1.{n}"})
            t.event(f"{root}.{n}", "submitted", 1, parent_fence=1)
    broken = t.check()
    assert set(broken) == {
        (CHILD_MISREAD, "r_wrong/leaf-0"),  # another state
        (CHILD_MISREAD, "r_wrong/leaf-1"),  # another result
        (CHILD_MISREAD, "r_early"),
    }
    assert broken[CHILD_MISREAD, "r_early"] == "woken with 1 of 2 needed ended"
    assert broken[CHILD_MISREAD, "r_wrong/leaf-0"] == (
        "read {'state': 'failed', 'result': None}, but it ended ('succeeded', {'customer': 'c1.0'})"
    )
