"""The chaos campaign's ``deploy`` fault, piece by piece: the chaos agents' versions (each renames
its checkpoint's keys and upgrades every older version's, and a step that meets a checkpoint it
cannot read says so), and the checker's deploy rules, on a real database and on fabricated
timelines. ``tests/test_chaos.py`` runs campaigns with the fault."""

from __future__ import annotations

import collections
from datetime import UTC, datetime, timedelta
from typing import Any

import anyio
import asyncpg
import pytest

from orchestrator.agent.steps import Agent
from orchestrator.chaos.agents import (
    MISREAD,
    VERSION_ENV,
    served_version,
    steps_agent,
    tools_agent,
)
from orchestrator.chaos.checker import check_timelines
from orchestrator.chaos.deploy_checks import (
    CHECKPOINT_MISREAD,
    FINISHED_UNDER_OLD_VERSION,
    OLD_VERSION_COMMITTED,
    STRANDED,
    Cutover,
    check_deploys,
    read_cutovers,
)
from orchestrator.chaos.findings import Findings
from orchestrator.db.agents import AgentStore
from orchestrator.db.signals import SignalStore
from orchestrator.db.store import RunStore
from orchestrator.errors import InvalidInput
from orchestrator.models import JSON, RunState
from orchestrator.settings import Settings
from orchestrator.testing import running_worker
from test_runtime import FAST

SERVED = {"w-v1": "1", "w-v2": "2"}


async def until_state(store: RunStore, run_id: str, *states: RunState) -> Any:
    with anyio.fail_after(30):
        while (run := await store.get(run_id)).state not in states:  # noqa: ASYNC110
            await anyio.sleep(0.05)
    return run


async def parked_under_v1(settings: Settings, store: RunStore) -> str:
    """A ``chaos_steps`` run whose first step version 1 committed, waiting for ``go``."""
    run_id = (await store.submit("chaos_steps", {"customer": "c1", "signal": True})).run.run_id
    async with running_worker(settings, [steps_agent(1)], worker_id="w-v1", **FAST):
        run = await until_state(store, run_id, RunState.WAITING)
    assert (run.agent_version, run.checkpoint) == ("1", {"announced_v1": True})
    return run_id


async def runs_and_timelines(
    pool: asyncpg.Pool,
) -> tuple[dict[str, asyncpg.Record], dict[str, list[asyncpg.Record]]]:
    """Every run by id, and each run's timeline in order, as the checker reads them."""
    runs = {row["run_id"]: row for row in await pool.fetch("SELECT * FROM runs")}
    events: dict[str, list[asyncpg.Record]] = collections.defaultdict(list)
    for event in await pool.fetch("SELECT * FROM run_events ORDER BY event_id"):
        events[event["run_id"]].append(event)
    return runs, events


async def deploy_findings(pool: asyncpg.Pool) -> Findings:
    """The deploy rules on what the database holds."""
    runs, events = await runs_and_timelines(pool)
    found = Findings()
    check_deploys(found, runs, events, await read_cutovers(pool), SERVED)
    return found


async def test_a_newer_version_renames_the_checkpoint_and_its_next_step_reads_it(
    settings: Settings, store: RunStore, pool: asyncpg.Pool
) -> None:
    run_id = await parked_under_v1(settings, store)
    assert (await AgentStore(pool).cutover("chaos_steps", 2)).version == "2"
    async with running_worker(settings, [steps_agent(2)], worker_id="w-v2", **FAST):
        await SignalStore(pool).send(run_id, "go")
        run = await until_state(store, run_id, RunState.SUCCEEDED, RunState.DEAD)
    assert run.state is RunState.SUCCEEDED, run.error
    assert (run.started_version, run.agent_version) == ("1", "2")
    assert run.checkpoint == {"announced_v2": True, "went_v2": True}
    found = await deploy_findings(pool)
    assert found.violations == []
    assert (found.cutovers, found.runs_upgraded, found.runs_by_version) == (1, 1, {"2": 1})


def _as_it_is(checkpoint: JSON) -> JSON:
    return checkpoint


async def test_a_version_whose_upgrade_renames_nothing_misreads_and_the_checker_says_so(
    settings: Settings, store: RunStore, pool: asyncpg.Pool
) -> None:
    run_id = await parked_under_v1(settings, store)
    v2 = steps_agent(2)
    careless = Agent(
        v2.name,
        first=v2.first,
        steps=list(v2.steps.values()),
        version=2,
        upgrades={1: _as_it_is},
    )
    async with running_worker(settings, [careless], worker_id="w-v2", **FAST):
        await SignalStore(pool).send(run_id, "go")
        with anyio.fail_after(30):
            while not await pool.fetchval(  # noqa: ASYNC110
                "SELECT count(*) FROM run_events WHERE run_id = $1 AND kind = 'retry_scheduled'",
                run_id,
            ):
                await anyio.sleep(0.05)
    run = await store.get(run_id)
    assert (run.agent_version, run.checkpoint) == ("1", {"announced_v1": True})
    found = await deploy_findings(pool)
    [misread] = found.violations
    assert (misread.rule, misread.subject) == (CHECKPOINT_MISREAD, run_id)
    assert "version 2 cannot read {'announced_v1': True}" in misread.detail, misread.detail


def test_each_version_upgrades_every_older_one() -> None:
    v3 = steps_agent(3)
    assert v3.version == "3" and sorted(v3.upgrades) == ["1", "2"]
    assert v3.upgrades["1"]({"announced_v1": True}) == {"announced_v3": True}
    assert v3.upgrades["2"]({"announced_v2": True, "went_v2": True}) == {
        "announced_v3": True,
        "went_v3": True,
    }
    with pytest.raises(LookupError, match=MISREAD):
        v3.upgrades["2"]({"announced_v1": True})  # another version's shape: never guessed
    tools = tools_agent(3)
    assert tools.version == "3" and sorted(tools.upgrades) == ["1", "2"]


@pytest.mark.parametrize("text", ["0", "-1", "1.5", "two", "", "1" * 10])
def test_a_bad_version_in_the_environment_is_one_line(
    monkeypatch: pytest.MonkeyPatch, text: str
) -> None:
    monkeypatch.setenv(VERSION_ENV, text)
    with pytest.raises(InvalidInput, match=VERSION_ENV) as raised:
        served_version()
    assert "\n" not in str(raised.value)
    monkeypatch.setenv(VERSION_ENV, "12")
    assert served_version() == 12


T0 = datetime(2026, 12, 1, tzinfo=UTC)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def run_row(
    run_id: str, version: str | None, state: str = "succeeded", agent: str = "chaos_steps"
) -> dict[str, Any]:
    return {
        "run_id": run_id,
        "agent": agent,
        "state": state,
        "started_version": "1",
        "agent_version": version,
        "finished_at": at(40) if state == "succeeded" else None,
    }


def commit(worker: str, seconds: float, kind: str = "checkpoint") -> dict[str, Any]:
    return {"kind": kind, "worker_id": worker, "at": at(seconds), "details": {}}


def test_the_deploy_rules_on_fabricated_timelines() -> None:
    """``chaos_steps`` is cut over to version 2 at 10 s and to 3 at 20 s; ``chaos_tools`` never.
    Within the clock tolerance of a cutover either side of it may commit."""
    cutovers = [Cutover("chaos_steps", "2", at(10), 1), Cutover("chaos_steps", "3", at(20), 0)]
    served = {"w1": "1", "w2": "2", "w3": "3"}
    misread = {
        "kind": "retry_scheduled",
        "worker_id": "w3",
        "at": at(30),
        "details": {"error": {"message": f"{MISREAD}: version 3 cannot read {{}}"}},
    }
    timelines: dict[str, list[dict[str, Any]]] = {
        "r_kept": [
            commit("w1", 5),
            commit("w1", 10.1),
            commit("w2", 10.2),
            commit("w2", 19.9),
            commit("w3", 20.1),
            commit("w3", 30, "succeeded"),
        ],
        "r_old_after": [commit("w1", 5), commit("w1", 11), commit("w1", 12, "succeeded")],
        "r_new_before": [commit("w3", 15)],
        "r_never_cut": [commit("w1", 5), commit("w1", 30, "succeeded")],
        "r_misread": [commit("w2", 15), misread, misread],
        "r_finished_old": [],
        "r_stranded": [commit("w1", 5)],
    }
    runs = {
        "r_kept": run_row("r_kept", "3"),
        "r_old_after": run_row("r_old_after", "3"),
        "r_new_before": run_row("r_new_before", "3"),
        "r_never_cut": run_row("r_never_cut", "1", agent="chaos_tools"),
        "r_misread": run_row("r_misread", "2", state="waiting"),
        "r_finished_old": run_row("r_finished_old", "2"),
        "r_stranded": run_row("r_stranded", "1", state="queued"),
    }
    found = Findings()
    check_deploys(found, runs, timelines, cutovers, served)
    broken = {(v.rule, v.subject): v.detail for v in found.violations}
    assert set(broken) == {
        (OLD_VERSION_COMMITTED, "r_new_before"),
        (OLD_VERSION_COMMITTED, "r_old_after"),
        (CHECKPOINT_MISREAD, "r_misread"),  # once, though two attempts met it
        (FINISHED_UNDER_OLD_VERSION, "r_finished_old"),
        (STRANDED, "r_misread"),
        (STRANDED, "r_stranded"),
    }
    assert len(found.violations) == len(broken)
    assert broken[OLD_VERSION_COMMITTED, "r_old_after"] == (
        "checkpoint by w1, which ran version 1, while chaos_steps was cut over to 2 "
        "(and 1 more commits)"
    )
    assert broken[STRANDED, "r_stranded"] == (
        "queued with a checkpoint of version 1; chaos_steps is cut over to 3"
    )
    assert (found.cutovers, found.runs_cut_over) == (2, 1)


def test_a_cutover_raises_the_fence_the_timeline_rules_hold_commits_to() -> None:
    """The old owner's step and final commits after the run was cut over from it are stale."""

    def event(kind: str, fence: int, version: int | None = None) -> dict[str, Any]:
        return {"kind": kind, "fence": fence, "details": {"version": version}}

    kept = [event("claimed", 1), event("checkpoint", 1, 1), event("cut_over", 2)]
    kept += [event("claimed", 3), event("checkpoint", 3, 2), event("succeeded", 3, 3)]
    stale = [event("claimed", 1), event("cut_over", 2), event("checkpoint", 1, 1)]
    stale += [event("succeeded", 1, 2)]
    found = Findings()
    check_timelines(found, {"r_kept": kept, "r_stale": stale})
    assert [(v.rule, v.subject, v.detail) for v in found.violations] == [
        ("checkpoint by a stale fence", "r_stale", "checkpoint version 1 by fence 1, current 2"),
        ("checkpoint by a stale fence", "r_stale", "succeeded version 2 by fence 1, current 2"),
    ]
