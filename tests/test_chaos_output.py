"""Live output in the chaos campaign, piece by piece: the checker's output rules on what
attempts append and readers seal in the database, each against a build broken on purpose (it
must fail the rule) and the intact build (it must not), and on fabricated output; and the chaos
agents publishing under an in-process worker, a cancel taking some mid-step."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg
import pytest

from orchestrator.chaos.agents import leaf_agent, published_by, steps_agent, tree_agent
from orchestrator.chaos.findings import Findings
from orchestrator.chaos.output_checks import (
    COMMITTED_OUTPUT_RETRACTED,
    OUTPUT_AFTER_LEASE,
    OUTPUT_MISLABELLED,
    OUTPUT_POSITIONS_GAP,
    RETRACTION_NOT_ITS_OWN,
    STALE_OUTPUT_SHOWN,
    check_output,
    read_outputs,
    taken_back,
)
from orchestrator.db.output import OutputStore
from orchestrator.db.store import RunStore
from orchestrator.models import ClaimedRun, RunState
from orchestrator.settings import Settings
from orchestrator.testing import running_worker
from support.chaos_mutants import (
    APPEND_WITHOUT_LEASE_CHECK,
    PUBLISHER_RETRACTS_ANYTHING,
    RETRACTION_OF_COMMITTED_STEPS,
    RETRACTION_SKIPS_A_POSITION,
    SEAL_ON_EXPIRY,
    SEAL_WITHOUT_RETRACTION,
    STALE_APPENDS_RELABELLED,
)
from test_chaos_deploy import runs_and_timelines
from test_chaos_trees import until
from test_runtime import FAST

BUILDS = pytest.mark.parametrize("broken", [False, True], ids=["intact", "broken"])
LIMITS = {"max_events": 1000, "max_bytes": 1_000_000}


async def output_findings(pool: asyncpg.Pool) -> Findings:
    """The output rules on what the database holds, read (and sealed) as the checker reads it."""
    _, events = await runs_and_timelines(pool)
    found = Findings()
    check_output(found, events, await read_outputs(pool))
    return found


def rules(found: Findings) -> set[str]:
    return {violation.rule for violation in found.violations}


class Attempts:
    """A run's attempts driven at the database, as workers make them, publishing as the chaos
    steps do (each line naming the fence and version it runs under)."""

    def __init__(self, store: RunStore) -> None:
        self.store = store
        self.outputs = OutputStore(store.pool)
        self.run_id = ""

    @classmethod
    async def begun(cls, store: RunStore, mutant: str | None) -> tuple[Attempts, ClaimedRun]:
        """On the build ``mutant`` breaks (intact: ``None``), a run whose first attempt (w1)
        has published from version 0."""
        if mutant is not None:
            await store.pool.execute(mutant)
        run = cls(store)
        first = await run.claim("w1")
        assert await run.publish(first, 0) == "ok"
        return run, first

    async def claim(self, worker: str) -> ClaimedRun:
        if not self.run_id:
            self.run_id = (await self.store.submit("streams", {"n": 1})).run.run_id
        [claim] = (await self.store.claim(worker, ["streams"], lease_seconds=30)).claimed
        assert claim.run_id == self.run_id
        return claim

    async def publish(self, claim: ClaimedRun, version: int, what: str = "started") -> str:
        mark = f"[fence {claim.fence} v{version} step]"
        named = {"message": "m", "fence": claim.fence, "version": version, "step": "step"}
        events: list[Any] = [
            {"kind": "progress", "data": named},
            {"kind": "text", "data": {"text": f"{mark} {what}\n"}},
        ]
        return await self._append(claim, version, events)

    async def retract(self, claim: ClaimedRun, version: int, first: int, last: int) -> str:
        data = {"from_seq": first, "to_seq": last, "reason": "the call failed midway"}
        return await self._append(claim, version, [{"kind": "retracted", "data": data}])

    async def _append(self, claim: ClaimedRun, version: int, events: list[Any]) -> str:
        answer = await self.outputs.append(
            self.run_id, claim.lease.worker_id, claim.fence, version, events, **LIMITS
        )
        return answer.status

    async def commit(self, claim: ClaimedRun, version: int) -> None:
        committed = await self.store.commit_step(
            claim.lease, expected_version=version, next_step=f"s{version + 1}", checkpoint={}
        )
        assert committed is not None

    async def lease(self, seconds: float) -> None:
        """The run's lease ends ``seconds`` from now (before now: it has expired)."""
        await self.store.pool.execute(
            "UPDATE runs SET lease_until = clock_timestamp() + make_interval(secs => $2) "
            "WHERE run_id = $1",
            self.run_id,
            seconds,
        )

    async def read(self) -> None:
        """A reader's read: it seals what has ended."""
        await self.outputs.read(self.run_id)


# -- each rule against a build that breaks it ------------------------------------------------------
@pytest.mark.parametrize(
    ("mutant", "rule"),
    [
        (APPEND_WITHOUT_LEASE_CHECK, OUTPUT_AFTER_LEASE),
        (STALE_APPENDS_RELABELLED, OUTPUT_MISLABELLED),
    ],
    ids=["without-lease-check", "relabelled"],
)
@BUILDS
async def test_a_lost_attempt_adds_nothing_to_the_output(
    store: RunStore, mutant: str, rule: str, broken: bool
) -> None:
    """w1 publishes, its lease expires, w2 claims and publishes; w1 publishes again before w2
    commits. Intact: refused. Without the lease check w1's line follows w2's; relabelled with
    the run's fence as well, it passes for w2's, but says whose it is."""
    run, first = await Attempts.begun(store, mutant if broken else None)
    await run.lease(-1)
    second = await run.claim("w2")
    assert await run.publish(second, 0) == "ok"
    late = await run.publish(first, 0, "worked 2 of 3")
    await run.commit(second, 0)
    found = await output_findings(store.pool)
    if not broken:
        assert late == "stale" and found.violations == [], found.violations
        assert (found.output_events, found.output_retractions, found.output_retracted) == (4, 1, 2)
        return
    assert late == "ok"
    assert rule in rules(found), found.violations
    # w1's late lines follow the retraction its append made of w2's
    assert any(v.subject == f"{run.run_id}#7" for v in found.violations if v.rule == rule)


@pytest.mark.parametrize(
    ("mutant", "rule"),
    [
        (SEAL_WITHOUT_RETRACTION, STALE_OUTPUT_SHOWN),
        (RETRACTION_OF_COMMITTED_STEPS, COMMITTED_OUTPUT_RETRACTED),
        (RETRACTION_SKIPS_A_POSITION, OUTPUT_POSITIONS_GAP),
    ],
    ids=["never-retracts", "retracts-committed-steps", "skips-a-position"],
)
@BUILDS
async def test_a_lost_attempt_s_unfinished_output_alone_is_retracted(
    store: RunStore, mutant: str, rule: str, broken: bool
) -> None:
    """w1 commits its first step, publishes in its second and loses the run; a reader seals
    before w2 publishes and commits that step again. Intact: w1's second step's lines are
    retracted at the next position, its first step's stay. Broken: they stay shown, the first
    step's go too, or the retraction leaves a gap."""
    run, first = await Attempts.begun(store, mutant if broken else None)
    await run.commit(first, 0)
    assert await run.publish(first, 1) == "ok"
    await run.lease(-1)
    second = await run.claim("w2")
    await run.read()
    assert await run.publish(second, 1) == "ok"
    await run.commit(second, 1)
    found = await output_findings(store.pool)
    if not broken:
        assert found.violations == [], found.violations
        assert (found.output_events, found.output_retractions, found.output_retracted) == (6, 1, 2)
        assert found.output_steps_retracted == 1  # w1's second step
        return
    assert rules(found) == {rule}, found.violations
    if rule == STALE_OUTPUT_SHOWN:
        [violation] = found.violations
        assert violation.subject == f"{run.run_id}#3"
        assert violation.detail.startswith("2 events of fence 1 from version 1 are shown")


@BUILDS
async def test_a_step_committing_late_keeps_its_output(store: RunStore, broken: bool) -> None:
    """w1's lease expires while its commit, which judged the lease just before, is on its way;
    a reader reads meanwhile; the commit lands. Intact: the reader sealed nothing (an expired
    lease is not the end), so the committed step's lines stay. Sealing on expiry retracts a
    step that then commits."""
    run, first = await Attempts.begun(store, SEAL_ON_EXPIRY if broken else None)
    await run.lease(-1)
    await run.read()
    await run.lease(30)  # the commit judged the lease before it expired
    await run.commit(first, 0)
    found = await output_findings(store.pool)
    if not broken:
        assert found.violations == [] and found.output_retractions == 0, found.violations
        return
    assert rules(found) == {COMMITTED_OUTPUT_RETRACTED}, found.violations
    assert "the step fence 1 committed from version 0" in found.violations[0].detail


@BUILDS
async def test_a_publisher_takes_back_only_its_own_step_s_output(
    store: RunStore, broken: bool
) -> None:
    """w1, in its second step, takes back its committed first step's lines; w2, having taken
    over, takes back w1's. Intact: both refused. Accepted, the first takes back committed
    output, the second another fence's."""
    run, first = await Attempts.begun(store, PUBLISHER_RETRACTS_ANYTHING if broken else None)
    await run.commit(first, 0)
    assert await run.publish(first, 1) == "ok"  # 3, 4
    answers = []
    try:
        answers.append(await run.retract(first, 1, 1, 2))
    except asyncpg.InvalidParameterValueError:
        answers.append("refused")
    await run.lease(-1)
    second = await run.claim("w2")
    assert await run.publish(second, 1) == "ok"  # w1's unfinished retracted, then w2's lines
    try:
        answers.append(await run.retract(second, 1, 3, 4))
    except asyncpg.InvalidParameterValueError:
        answers.append("refused")
    await run.commit(second, 1)
    found = await output_findings(store.pool)
    if not broken:
        assert answers == ["refused", "refused"]
        assert found.violations == [], found.violations
        return
    assert answers == ["ok", "ok"]
    assert rules(found) == {COMMITTED_OUTPUT_RETRACTED, RETRACTION_NOT_ITS_OWN}, found.violations


# -- the rules on fabricated output ----------------------------------------------------------------
T0 = datetime(2026, 12, 1, 12, tzinfo=UTC)


@dataclass
class Output:
    """A run's output and timeline made up for a rule, from ``T0``."""

    events: list[dict[str, Any]] = field(default_factory=list)
    timeline: list[dict[str, Any]] = field(default_factory=list)

    def claimed(self, fence: int, second: float) -> None:
        at = T0 + timedelta(seconds=second)
        self.timeline.append({"kind": "claimed", "fence": fence, "at": at, "details": {}})

    def committed(self, fence: int, version: int, kind: str = "checkpoint") -> None:
        details = {"version": version}
        self.timeline.append({"kind": kind, "fence": fence, "at": T0, "details": details})

    def add(self, fence: int, version: int, kind: str, data: dict[str, Any], second: float) -> int:
        seq = len(self.events) + 1
        self.events.append(
            {"seq": seq, "fence": fence, "base_version": version, "kind": kind, "data": data,
             "created_at": T0 + timedelta(seconds=second)}
        )  # fmt: skip
        return seq

    def line(
        self, fence: int, version: int, what: str = "started", second: float = 0, names: int = 0
    ) -> int:
        """A chaos step's line of ``fence`` (naming fence ``names`` instead, when given)."""
        mark = f"[fence {names or fence} v{version} step]"
        return self.add(fence, version, "text", {"text": f"{mark} {what}\n"}, second)

    def retraction(
        self, fence: int, version: int, first: int, last: int, events: int, names: int = 0
    ) -> int:
        """A retraction of ``fence`` (its data naming fence ``names`` instead, when given)."""
        fields = {"fence": names or fence, "from_seq": first, "to_seq": last, "events": events}
        return self.add(fence, version, "retracted", {"reason": "r", **fields}, 0)

    def check(self) -> dict[tuple[str, str], str]:
        found = Findings()
        check_output(found, {"r": self.timeline}, {"r": self.events})
        broken = {(v.rule, v.subject): v.detail for v in found.violations}
        assert len(broken) == len(found.violations), found.violations
        return broken


def test_the_lease_rules_on_fabricated_output() -> None:
    """Fence 1 claimed at 0 s, fence 2 at 10 s. Fence 1's line at 10.1 s is within the
    tolerance; at 11 s it is not; fence 1's line after fence 2's is stale wherever the clocks
    put it. A line naming another fence than its own is mislabelled."""
    t = Output()
    t.claimed(1, 0)
    t.committed(1, 1)
    t.claimed(2, 10)
    t.committed(2, 2, "succeeded")
    t.line(1, 0, second=1)
    t.line(1, 0, second=10.1)
    late = t.line(1, 0, second=11)
    t.line(2, 1, second=12)
    after = t.line(1, 0, second=12)
    label = t.line(2, 1, second=13, names=3)
    broken = t.check()
    assert set(broken) == {
        (OUTPUT_AFTER_LEASE, f"r#{late}"),
        (OUTPUT_AFTER_LEASE, f"r#{after}"),
        (OUTPUT_MISLABELLED, f"r#{label}"),
        (STALE_OUTPUT_SHOWN, f"r#{label}"),  # fence 3 committed nothing
    }
    assert broken[OUTPUT_AFTER_LEASE, f"r#{after}"] == "text of fence 1 after position 4 of fence 2"
    assert broken[OUTPUT_MISLABELLED, f"r#{label}"] == (
        "written as fence 2 from version 1, published by fence 3 from version 1"
    )


def test_the_retraction_rules_on_fabricated_output() -> None:
    """Well formed: fence 1's unfinished step retracted, a withdrawn draft of a committed step,
    and a model's answer (naming no attempt) withdrawn in its step. Not: a range past the
    retraction, one over another fence's line, a wrong count or fence, a committed step's line
    taken back by a later step's retraction."""
    t = Output()
    t.claimed(1, 0)
    t.committed(1, 1)
    t.claimed(2, 5)
    t.committed(2, 2)
    t.line(1, 0)  # 1: committed, stays
    t.line(1, 0, "draft")  # 2
    t.retraction(1, 0, 2, 2, 1)  # 3: the draft withdrawn by its publisher: fine
    t.add(1, 0, "text", {"text": "a model's answer"}, 0)  # 4
    t.retraction(1, 0, 4, 4, 1)  # 5: withdrawn in its step: fine
    t.line(1, 1)  # 6: never committed by fence 1
    t.retraction(1, 1, 6, 6, 1)  # 7: the lost attempt's: fine
    t.line(2, 1, "draft")  # 8
    past = t.retraction(2, 1, 8, 10, 1)  # 9: names positions after itself
    other = t.retraction(2, 1, 6, 8, 2)  # 10: over fence 1's line
    count = t.retraction(2, 1, 8, 8, 2)  # 11: says 2 events
    named = t.retraction(2, 1, 8, 8, 1, names=1)  # 12: says fence 1
    committed = t.retraction(1, 1, 1, 1, 1)  # 13: fence 1's committed line, from version 1
    broken = t.check()
    assert set(broken) == {
        (RETRACTION_NOT_ITS_OWN, f"r#{past}"),
        (RETRACTION_NOT_ITS_OWN, f"r#{other}"),
        (RETRACTION_NOT_ITS_OWN, f"r#{count}"),
        (RETRACTION_NOT_ITS_OWN, f"r#{named}"),
        (COMMITTED_OUTPUT_RETRACTED, f"r#{committed}"),
    }
    assert "1 of other fences" in broken[RETRACTION_NOT_ITS_OWN, f"r#{other}"]


def test_what_readers_show_must_be_committed_by_its_fence() -> None:
    """Shown: fence 1's committed step and fence 2's final commit. Fence 2's retracted line is
    not shown; fence 1's line from version 1, which fence 1 never committed, is. A gap."""
    t = Output()
    t.claimed(1, 0)
    t.committed(1, 1)
    t.claimed(2, 5)
    t.committed(2, 2, "succeeded")
    t.line(1, 0)
    stale = t.line(1, 1)
    t.line(2, 1)
    t.line(2, 1, "draft")
    t.retraction(2, 1, 4, 4, 1)
    t.add(2, 1, "text", {"text": "answer"}, 0)
    t.events[-1]["seq"] = 7
    broken = t.check()
    assert set(broken) == {(STALE_OUTPUT_SHOWN, f"r#{stale}"), (OUTPUT_POSITIONS_GAP, "r")}
    assert broken[OUTPUT_POSITIONS_GAP, "r"] == "6 events, position 6 is 7 (last 7)"


def test_published_by_reads_what_the_chaos_steps_write() -> None:
    assert published_by({"text": "[fence 12 v3 ask_refund] worked 2 of 3\n"}) == (
        12,
        3,
        "ask_refund",
        "worked 2 of 3",
    )
    assert published_by({"message": "m", "fence": 2, "version": 0, "step": "reach"}) == (
        2,
        0,
        "reach",
        "progress",
    )
    assert published_by({"text": "Done for c1."}) is None
    assert published_by({"message": "m"}) is None


# -- the chaos agents publishing -------------------------------------------------------------------
async def test_the_chaos_agents_publish_and_keep_every_output_rule(
    settings: Settings, store: RunStore, pool: asyncpg.Pool
) -> None:
    """Step runs and a tree run by an in-process worker, a second tree cancelled while its
    leaves work: every step published under its attempt, every working step withdrew its
    draft, the cancelled leaves' unfinished output is retracted, and no output rule breaks."""
    agents = [steps_agent(1), tree_agent(1), leaf_agent(1)]
    leaves = [{"customer": f"c.{n}", "work_seconds": 0.3} for n in range(2)]
    tree = {"customer": "t", "fan": "next", "need": None, "tenant": None, "leaves": leaves}
    slow = [{"customer": f"s.{n}", "work_seconds": 30} for n in range(2)]
    async with running_worker(settings, agents, concurrency=8, **FAST):
        for n in range(2):
            step = {"customer": f"c{n}", "signal": False, "refund": None, "work_seconds": 0.2}
            await store.submit("chaos_steps", step)
        await store.submit("chaos_tree", tree)
        cut = (await store.submit("chaos_tree", {**tree, "fan": "wait", "leaves": slow})).run
        await until(
            pool,
            "SELECT count(*) = 2 FROM run_output o JOIN runs r USING (run_id) "
            "WHERE r.parent_run_id = $1 AND o.data->>'text' LIKE '%draft%'",
            cut.run_id,
        )
        await store.cancel(cut.run_id, reason="a test: leaves cut mid-step")
        await until(pool, "SELECT bool_and(state IN ('succeeded', 'cancelled')) FROM runs")
    states = {row["state"] for row in await pool.fetch("SELECT state FROM runs")}
    assert states == {RunState.SUCCEEDED.value, RunState.CANCELLED.value}
    found = await output_findings(pool)
    assert found.violations == [], found.violations
    assert found.runs_with_output == await pool.fetchval("SELECT count(*) FROM runs")
    # The two cancelled leaves' lines were retracted (and the working steps' drafts withdrawn).
    assert found.output_retractions >= 2 and found.output_steps_retracted == 2
    cancelled = await pool.fetch(
        "SELECT run_id FROM runs WHERE state = 'cancelled' AND parent_run_id = $1", cut.run_id
    )
    assert len(cancelled) == 2
    outputs = await read_outputs(pool)
    for row in cancelled:
        events = outputs[row["run_id"]]
        lines = [e["seq"] for e in events if e["kind"] in ("text", "progress")]
        assert lines and taken_back(events) == set(lines), events  # its step never committed
