"""Schedules in the chaos campaign, piece by piece: the checker's schedule rules on what schedulers
decide in the database, each against a build broken on purpose (it must fail the rule) and the
intact build (it must not), and on fabricated records; the campaign's schedules with an
in-process worker; and a short campaign with the schedulers under faults."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import anyio
import asyncpg
import pytest
import structlog

from orchestrator.chaos import CampaignConfig, run_campaign
from orchestrator.chaos.agents import TICK, tick_agent
from orchestrator.chaos.findings import Findings
from orchestrator.chaos.schedule_checks import (
    BUFFERED_SLOT_NEVER_STARTED,
    RUN_WITHOUT_ITS_SLOT_RECORD,
    SLOT_BEFORE_ITS_TIME,
    SLOT_BY_A_STALE_FENCE,
    SLOT_LOST,
    SLOT_RECORD_WITHOUT_ITS_RUN,
    SLOT_STARTED_TWICE,
    ScheduleRecords,
    check_schedules,
    read_schedule_records,
    refused_fires,
)
from orchestrator.chaos.schedules import CAMPAIGN_SCHEDULES, PENDING, create_schedules
from orchestrator.db.outages import DatabaseOutage
from orchestrator.db.schedules import ScheduleSpec, ScheduleStore
from orchestrator.db.store import RunStore
from orchestrator.scheduling.calendar import Calendar
from orchestrator.scheduling.plan import Plan
from orchestrator.settings import Settings
from orchestrator.testing import running_worker
from orchestrator.worker.scheduler import Scheduler, plan_for
from support.chaos_mutants import (
    BUFFERED_START_UNRECORDED,
    FIRE_WITHOUT_FENCE_CHECK,
    FIRST_SLOT_DROPPED,
    MISSED_FORGOTTEN,
    SLOTS_NOT_UNIQUE,
)
from test_chaos_deploy import runs_and_timelines
from test_runtime import FAST

MINUTE = Calendar(every=timedelta(minutes=1))
BUILDS = pytest.mark.parametrize("broken", [False, True], ids=["intact", "broken"])


async def schedule_findings(pool: asyncpg.Pool) -> Findings:
    """The schedule rules on what the database holds."""
    runs, events = await runs_and_timelines(pool)
    found = Findings()
    check_schedules(found, runs, events, await read_schedule_records(pool))
    return found


def rules(found: Findings) -> set[str]:
    return {violation.rule for violation in found.violations}


async def create(pool: asyncpg.Pool, name: str, due: int = 4, **policies: Any) -> ScheduleStore:
    """An every-minute schedule of ``chaos_tick``, created ``due - 1`` minutes ago (its cursor on
    the first minute then) with nothing fired since: ``due`` slots are due."""
    store = ScheduleStore(pool)
    await store.create(ScheduleSpec(name, TICK, MINUTE, **policies))
    await pool.execute(
        "UPDATE schedules SET next_fire_at = x.at, starts_at = x.at, created_at = x.at "
        "FROM (SELECT date_trunc('minute', clock_timestamp() - make_interval(mins => $2)) AS at)"
        " AS x WHERE name = $1",
        name,
        due - 1,
    )
    return store


def scheduler(pool: asyncpg.Pool, worker: str) -> Scheduler:
    log = structlog.get_logger()
    return Scheduler(pool, worker, 30.0, 10.0, log, DatabaseOutage(log))


async def expire_leases(pool: asyncpg.Pool) -> None:
    """The holder stopped longer than its lease."""
    await pool.execute(
        "UPDATE schedules SET lease_until = clock_timestamp() - interval '1 s' "
        "WHERE lease_owner IS NOT NULL"
    )


# -- each rule against a build that breaks it ------------------------------------------------------
@BUILDS
async def test_a_stale_holder_s_fire_starts_no_slot_twice(pool: asyncpg.Pool, broken: bool) -> None:
    """A holder stops between its claim and its fire; another claims the schedule under a higher
    fence and fires every due slot; the first goes on and fires what it planned. Intact: refused.
    Without the fence check and the slot's keys, each slot starts a second run."""
    if broken:
        await pool.execute(SLOTS_NOT_UNIQUE)
    store = await create(pool, "twice", overlap="allow_all", catch_up="all")
    [(stale, stale_now)] = await store.claim("stopped", 30.0, 10)
    await expire_leases(pool)
    [(fresh, fresh_now)] = await store.claim("fresh", 30.0, 10)
    fired = await store.fire(fresh, "fresh", plan_for(fresh, fresh_now))
    assert fired is not None and len(fired) == 4
    late = await store.fire(stale, "stopped", plan_for(stale, stale_now))
    found = await schedule_findings(pool)
    if not broken:
        assert late is None and found.violations == [], found.violations
        assert (found.scheduled_runs, found.slots_by_outcome) == (4, {"fired": 4})
        return
    assert late is not None and len(late) == 4
    twice = {v.subject for v in found.violations if v.rule == SLOT_STARTED_TWICE}
    assert twice == {f"twice@{slot.slot.isoformat()}" for slot in fired}, found.violations
    assert SLOT_BY_A_STALE_FENCE in rules(found)  # decided under fence 1 after fence 2
    assert found.scheduled_runs == 8


@BUILDS
async def test_a_stale_holder_s_fire_after_a_newer_fence_decided(
    pool: asyncpg.Pool, broken: bool
) -> None:
    """The stopped holder had planned the oldest slot while it was on time; the newer claim
    finds it too old (catch-up none) and fires the newest only. Intact: the stale fire is
    refused and the skipped slots are in ``missed``. Without the fence check, the stale holder
    decides the oldest slot under fence 1 after fence 2 decided: a stale fence."""
    if broken:
        await pool.execute(FIRE_WITHOUT_FENCE_CHECK)
    store = await create(
        pool, "late", overlap="allow_all", catch_up="none", catch_up_window=timedelta(minutes=1)
    )
    [(stale, _)] = await store.claim("stopped", 30.0, 10)
    assert stale.next_fire_at is not None
    oldest = stale.next_fire_at
    planned = Plan(fire=[oldest], missed=None, next=oldest + timedelta(minutes=1))
    await expire_leases(pool)
    [(fresh, fresh_now)] = await store.claim("fresh", 30.0, 10)
    fired = await store.fire(fresh, "fresh", plan_for(fresh, fresh_now))
    assert fired is not None and [slot.outcome for slot in fired] == ["fired"]
    late = await store.fire(stale, "stopped", planned)
    found = await schedule_findings(pool)
    if not broken:
        assert late is None and found.violations == [], found.violations
        assert found.slots_missed == 3  # catch-up none, and missed says so
        return
    assert late is not None and [slot.outcome for slot in late] == ["fired"]
    assert rules(found) == {SLOT_BY_A_STALE_FENCE}, found.violations
    [violation] = found.violations
    assert violation.subject == "late" and "under fence 1" in violation.detail
    assert "under fence 2" in violation.detail


@BUILDS
async def test_a_buffered_slot_s_run_has_its_record(pool: asyncpg.Pool, broken: bool) -> None:
    """buffer_one, three slots due: the first slot's run is unfinished, the second slot is
    buffered, the third skipped; once the first run ends the buffered slot starts, and its
    record says fired with that run. A build that starts the run without turning the record: a
    run without its slot record."""
    if broken:
        await pool.execute(BUFFERED_START_UNRECORDED)
    await create(pool, "buffered", 3, overlap="buffer_one", catch_up="all")
    assert await scheduler(pool, "w").round() == 1
    [first] = await pool.fetch("SELECT run_id FROM runs")
    await RunStore(pool).cancel(first["run_id"], reason="a test: the running run ends")
    assert await scheduler(pool, "w").round() == 1
    found = await schedule_findings(pool)
    assert found.scheduled_runs == 2
    if not broken:
        assert found.violations == [], found.violations
        assert found.slots_by_outcome == {"fired": 2, "skipped": 1}
        return
    assert rules(found) == {RUN_WITHOUT_ITS_SLOT_RECORD}, found.violations
    assert "its slot's record says buffered, run None" in found.violations[0].detail


@pytest.mark.parametrize(
    ("catch_up", "mutant"), [("all", FIRST_SLOT_DROPPED), ("none", MISSED_FORGOTTEN)]
)
@BUILDS
async def test_no_slot_is_lost_silently(
    pool: asyncpg.Pool, catch_up: str, mutant: str, broken: bool
) -> None:
    """Four slots due: catch-up all fires each; none fires the newest and says it skipped the
    others. A fire that drops its oldest slot, or forgets what its catch-up skipped, loses
    slots without a word."""
    if broken:
        await pool.execute(mutant)
    await create(
        pool, "lossy", overlap="allow_all", catch_up=catch_up, catch_up_window=timedelta(minutes=1)
    )
    assert await scheduler(pool, "w").round() == 1
    found = await schedule_findings(pool)
    if not broken:
        assert found.violations == [], found.violations
        assert found.slots_missed == (0 if catch_up == "all" else 3)
        return
    assert rules(found) == {SLOT_LOST}, found.violations
    assert found.violations[0].subject == "lossy"


# -- the rules on fabricated records ---------------------------------------------------------------
T0 = datetime(2026, 12, 1, 12, tzinfo=UTC)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


class Records:
    """Schedules, slot records and runs made up for a rule, every-second schedules from T0."""

    def __init__(self) -> None:
        self.schedules: list[dict[str, Any]] = []
        self.slots: list[dict[str, Any]] = []
        self.runs: dict[str, dict[str, Any]] = {}
        self.events: dict[str, list[dict[str, Any]]] = {}
        self.paused: set[str] = set()

    def schedule(self, name: str, **fields: Any) -> str:
        row = {
            "schedule_id": f"sch_{name}",
            "name": name,
            "cron": None,
            "every_seconds": 1,
            "timezone": "UTC",
            "catch_up": "all",
            "starts_at": T0,
            "created_at": T0,
            "ends_at": None,
            "next_fire_at": at(6),
            "missed": None,
            "fence": 9,
            "buffered_slot": None,
            **fields,
        }
        self.schedules.append(row)
        return str(row["schedule_id"])

    def slot(
        self,
        schedule_id: str,
        second: int,
        outcome: str = "fired",
        *,
        run: str | None = None,
        fence: int = 1,
        decided: float | None = None,
        by: str = "w1",
    ) -> None:
        self.slots.append(
            {
                "schedule_id": schedule_id,
                "slot": at(second),
                "outcome": outcome,
                "run_id": run,
                "fence": fence,
                "decided_by": by,
                "decided_at": at(second + 0.01 if decided is None else decided),
            }
        )

    def run(
        self,
        run_id: str,
        schedule_id: str,
        second: int,
        state: str = "succeeded",
        claimed: float = 0,
    ) -> None:
        self.runs[run_id] = {
            "run_id": run_id,
            "schedule_id": schedule_id,
            "schedule_slot": at(second),
            "state": state,
        }
        self.events[run_id] = [{"kind": "claimed", "at": at(second), "fence": 1}]

    def fired(self, schedule_id: str, second: int, run_id: str, **slot: Any) -> None:
        self.run(run_id, schedule_id, second)
        self.slot(schedule_id, second, run=run_id, **slot)

    def findings(self) -> Findings:
        found = Findings()
        records = ScheduleRecords(self.schedules, self.slots, frozenset(self.paused))
        check_schedules(found, self.runs, self.events, records)
        return found

    def check(self) -> dict[tuple[str, str], str]:
        found = self.findings()
        broken = {(v.rule, v.subject): v.detail for v in found.violations}
        assert len(broken) == len(found.violations), found.violations
        return broken


def test_the_slot_and_run_rules_on_fabricated_records() -> None:
    """Two runs for one slot; a record naming a run that does not exist, and one naming a run of
    another slot; a run no record names."""
    t = Records()
    a = t.schedule("a")
    for second in range(6):
        t.fired(a, second, f"r{second}")
    t.run("r0_again", a, 0)
    t.slots = [row for row in t.slots if row["slot"] != at(5)]
    t.slot(a, 5, run="r_gone")
    t.slots = [row for row in t.slots if row["slot"] != at(4)]
    t.slot(a, 4, run="r3")
    broken = t.check()
    iso = {second: at(second).isoformat() for second in range(6)}
    assert set(broken) == {
        (SLOT_STARTED_TWICE, f"a@{iso[0]}"),
        (RUN_WITHOUT_ITS_SLOT_RECORD, "r0_again"),
        (SLOT_RECORD_WITHOUT_ITS_RUN, f"a@{iso[5]}"),
        (SLOT_RECORD_WITHOUT_ITS_RUN, f"a@{iso[4]}"),
        (RUN_WITHOUT_ITS_SLOT_RECORD, "r4"),
        (RUN_WITHOUT_ITS_SLOT_RECORD, "r5"),
    }
    assert broken[SLOT_STARTED_TWICE, f"a@{iso[0]}"] == "2 runs: r0, r0_again"
    assert broken[SLOT_RECORD_WITHOUT_ITS_RUN, f"a@{iso[5]}"] == (
        "fired by w1 under fence 1, naming run r_gone, which does not exist"
    )
    assert broken[SLOT_RECORD_WITHOUT_ITS_RUN, f"a@{iso[4]}"] == (
        f"names run r3, which is of a@{iso[3]}"
    )
    assert broken[RUN_WITHOUT_ITS_SLOT_RECORD, "r4"] == (
        f"of a@{iso[4]}: its slot's record says fired, run r3"
    )


def test_the_lost_slot_rule_on_fabricated_records() -> None:
    """Slots 0-5 are due on each schedule (the cursor at 6). ``all``: a slot without a record is
    lost unless ``missed`` names it; ``latest``: unless ``missed`` says anything; a paused
    schedule's slots are not judged; a slot left buffered once every run ended never started."""
    t = Records()
    covered = {"first": at(2).isoformat(), "last": at(3).isoformat(), "count": 2}
    gaps = {
        "all_kept": ("all", None, [0, 1, 2, 3, 4, 5]),
        "all_gap_named": ("all", covered, [0, 1, 4, 5]),
        "all_gap_unnamed": ("all", covered, [0, 1, 5]),  # 4 is not in missed
        "latest_gap_said": ("latest", covered, [0, 5]),
        "latest_gap_unsaid": ("latest", None, [0, 5]),
    }
    for name, (catch_up, missed, fired) in gaps.items():
        schedule_id = t.schedule(name, catch_up=catch_up, missed=missed)
        for second in fired:
            t.fired(schedule_id, second, f"{name}.{second}")
    paused = t.schedule("paused")
    t.paused.add(paused)
    t.fired(paused, 0, "paused.0")
    ended = t.schedule("ended", next_fire_at=None, ends_at=at(3))
    t.fired(ended, 0, "ended.0")
    t.fired(ended, 1, "ended.1")
    t.slot(ended, 2, "buffered")
    broken = t.check()
    assert set(broken) == {
        (SLOT_LOST, "all_gap_unnamed"),
        (SLOT_LOST, "latest_gap_unsaid"),
        (BUFFERED_SLOT_NEVER_STARTED, f"ended@{at(2).isoformat()}"),
    }
    assert broken[SLOT_LOST, "all_gap_unnamed"].startswith(
        f"1 of its 6 slots up to its cursor have no record (the first {at(4).isoformat()}"
    )
    assert broken[SLOT_LOST, "latest_gap_unsaid"].startswith("4 of its 6 slots")
    assert broken[BUFFERED_SLOT_NEVER_STARTED, f"ended@{at(2).isoformat()}"].endswith(
        "every run of the schedule has ended and the schedule no longer holds it"
    )
    # all_gap_named's two and all_gap_unnamed's two named slots; latest_gap_said's four
    assert t.findings().slots_missed == 2 + 2 + 4


def test_the_fence_and_time_rules_on_fabricated_records() -> None:
    """Fences go up with the decisions: slot 3 was decided under fence 1 after fence 2 decided
    slot 2; slot 4 carries a fence no claim granted. Slot 5 was decided before it came, and
    its run claimed before it too. A backfill (decided late, under the current fence) and a
    buffered slot fired later under a higher fence keep the order."""
    t = Records()
    a = t.schedule("a", fence=3)
    t.fired(a, 0, "r0", fence=1)
    t.fired(a, 1, "r1", fence=2, decided=1.5)
    t.fired(a, 2, "r2", fence=2)
    t.fired(a, 3, "r3", fence=1, decided=3.2, by="stopped")
    t.fired(a, 5, "r5", fence=3, decided=4.5)
    t.fired(a, 4, "r4", fence=4, decided=4.6)
    t.events["r5"][0]["at"] = at(4.6)
    b = t.schedule("b", fence=5, next_fire_at=at(4))
    t.fired(b, 0, "b0", fence=1)
    t.fired(b, 1, "b1", fence=3, decided=4)  # buffered at 1, fired at 4 under fence 3
    t.fired(b, 2, "b2", fence=2, decided=2.01)
    t.run("b_old", b, 3)
    t.slot(b, 3, "backfilled", run="b_old", fence=5, decided=60)
    broken = t.check()
    iso = {second: at(second).isoformat() for second in range(6)}
    assert set(broken) == {
        (SLOT_BY_A_STALE_FENCE, "a"),
        (SLOT_BY_A_STALE_FENCE, f"a@{iso[4]}"),
        (SLOT_BEFORE_ITS_TIME, f"a@{iso[5]}"),
        (SLOT_BEFORE_ITS_TIME, "r5"),
    }
    assert broken[SLOT_BY_A_STALE_FENCE, "a"] == (
        f"{iso[3]} fired by stopped under fence 1 at {at(3.2).isoformat()}, after {iso[1]} was "
        f"decided by w1 under fence 2 at {at(1.5).isoformat()}"
    )
    assert broken[SLOT_BY_A_STALE_FENCE, f"a@{iso[4]}"].endswith(
        "above the schedule's 3: a fence no claim granted"
    )


def test_refused_fires_are_counted_from_the_schedulers_logs(tmp_path: Path) -> None:
    (tmp_path / "chaos-w1.g1.log").write_text(
        '{"event": "schedule lease lost before its fire", "schedule": "a"}\n'
        '{"event": "schedule fired", "schedule": "a"}\n'
        "not json: schedule lease lost before its fire\n"
    )
    (tmp_path / "chaos-w2.g1.log").write_text(
        '{"event": "schedule lease lost before its fire", "schedule": "b"}\n'
    )
    assert refused_fires(tmp_path) == 2


# -- the campaign's schedules ----------------------------------------------------------------------
async def test_the_campaign_s_schedules_meet_every_policy(pool: asyncpg.Pool) -> None:
    made = await create_schedules(pool, CAMPAIGN_SCHEDULES, 30)
    assert made == [schedule.name for schedule in CAMPAIGN_SCHEDULES]
    schedules = ScheduleStore(pool)
    rows = [await schedules.get(name) for name in made]
    assert {row.overlap for row in rows} == {"skip", "buffer_one", "allow_all", "cancel_running"}
    assert {row.catch_up for row in rows} == {"none", "latest", "all"}
    assert {row.agent for row in rows} == {TICK}
    for row in rows:  # each has a slot before its end
        assert row.next_fire_at is not None and row.ends_at is not None
        assert row.next_fire_at < row.ends_at
    assert any(row.cron == "* * * * *" for row in rows)


async def test_the_campaign_s_schedules_fired_by_a_worker_keep_every_rule(
    settings: Settings, pool: asyncpg.Pool
) -> None:
    """The every-second schedules for a few seconds, fired by an in-process worker's scheduler
    and run by ``chaos_tick``: every slot decided once, as its policy says, no rule broken."""
    every_second = [s for s in CAMPAIGN_SCHEDULES if s.cron is None]
    async with running_worker(settings, [tick_agent(1)], concurrency=8, **FAST):
        await create_schedules(pool, every_second, 4)
        with anyio.fail_after(60):
            while await pool.fetchval(PENDING) or await pool.fetchval(  # noqa: ASYNC110
                "SELECT count(*) FROM runs WHERE state NOT IN "
                "('succeeded', 'failed', 'cancelled', 'dead')"
            ):
                await anyio.sleep(0.1)
    found = await schedule_findings(pool)
    assert found.violations == [], found.violations
    assert found.schedules == len(every_second) and found.scheduled_runs >= len(every_second)
    states = {row["state"] for row in await pool.fetch("SELECT state FROM runs")}
    assert states <= {"succeeded", "cancelled"}


# -- a campaign (every campaign has the schedules; tests/test_chaos.py's keeps every rule) --
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_campaign_catches_a_stale_scheduler_starting_slots_again(tmp_path: Path) -> None:
    """The schedules' fire without its fence check and nothing keeping a slot to one run: a
    worker stopped while it holds a schedule's lease fires, once continued, the slots the others
    fired meanwhile, and the checker reports each slot started twice."""
    config = CampaignConfig(
        seed=5,
        duration=20,
        runs=10,
        fault_rate=0.3,
        kinds=("sigstop_worker",),
        agents=("chaos_steps",),
        after_migrate=SLOTS_NOT_UNIQUE,
        work_dir=tmp_path / "campaign",
    )
    report = anyio.run(run_campaign, config)
    caught = [r for r in report.faults if "holding the lease of schedules" in r.detail]
    assert caught, [r.as_json() for r in report.faults]
    assert SLOT_STARTED_TWICE in rules(report.findings), report.findings.violations
    assert not report.passed
