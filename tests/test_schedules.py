"""Schedules (docs/schedules.md): each slot starts one run at most, whoever fires it; a stale
lease holder changes nothing; overlap and catch-up policies; backfill; DST by the calendar."""

from __future__ import annotations

import itertools
import json
from dataclasses import replace
from datetime import UTC, datetime, timedelta

import anyio
import asyncpg
import pytest
import structlog

from orchestrator.client import SyncClient
from orchestrator.db.outages import DatabaseOutage
from orchestrator.db.schedules import ScheduleSpec, ScheduleStore
from orchestrator.db.store import RunStore
from orchestrator.errors import InvalidInput
from orchestrator.scheduling.calendar import Calendar, jitter
from orchestrator.scheduling.plan import plan_fires
from orchestrator.settings import Settings
from orchestrator.worker.scheduler import Scheduler, plan_for
from support import cli
from test_db_roles import Logins, refused
from test_db_roles import logins as logins  # the fixture

EVERY_MINUTE = Calendar(every=timedelta(minutes=1))


def utc(year: int, month: int, day: int, hour: int = 0, minute: int = 0) -> datetime:
    return datetime(year, month, day, hour, minute, tzinfo=UTC)


def slots(calendar: Calendar, after: datetime, count: int) -> list[str]:
    return [s.isoformat() for s in itertools.islice(calendar.forward(after), count)]


# -- the calendar: daylight saving time -----------------------------------------------------------
def test_a_skipped_local_time_fires_once_at_the_first_instant_after_the_jump() -> None:
    berlin = Calendar(cron="30 2 * * *", timezone="Europe/Berlin")
    # 2026-03-29: 02:00 CET jumps to 03:00 CEST (01:00 UTC); 02:30 does not exist.
    assert slots(berlin, utc(2026, 3, 27), 4) == [
        "2026-03-27T01:30:00+00:00",
        "2026-03-28T01:30:00+00:00",
        "2026-03-29T01:00:00+00:00",
        "2026-03-30T00:30:00+00:00",
    ]
    quarter = Calendar(cron="*/15 * * * *", timezone="America/New_York")
    # 2026-03-08: 02:00 EST jumps to 03:00 EDT (07:00 UTC): 02:00-02:45 and 03:00 are one slot.
    assert slots(quarter, utc(2026, 3, 8, 6, 40), 4) == [
        "2026-03-08T06:45:00+00:00",
        "2026-03-08T07:00:00+00:00",
        "2026-03-08T07:15:00+00:00",
        "2026-03-08T07:30:00+00:00",
    ]


def test_a_repeated_local_time_fires_once_at_its_first_occurrence() -> None:
    berlin = Calendar(cron="30 2 * * *", timezone="Europe/Berlin")
    # 2026-10-25: 03:00 CEST goes back to 02:00 CET; 02:30 happens at 00:30 and 01:30 UTC.
    assert slots(berlin, utc(2026, 10, 24), 3) == [
        "2026-10-24T00:30:00+00:00",
        "2026-10-25T00:30:00+00:00",
        "2026-10-26T01:30:00+00:00",
    ]
    hourly = Calendar(cron="0 * * * *", timezone="America/New_York")
    # 2026-11-01: 01:00 EDT (05:00 UTC) happens again at 06:00 UTC as EST: fired once.
    assert slots(hourly, utc(2026, 11, 1, 4, 30), 3) == [
        "2026-11-01T05:00:00+00:00",
        "2026-11-01T07:00:00+00:00",
        "2026-11-01T08:00:00+00:00",
    ]
    # Walking back from inside the repeated hour finds the slots of its first pass.
    quarter = Calendar(cron="*/15 * * * *", timezone="Europe/Berlin")
    back = list(itertools.islice(quarter.backward(utc(2026, 10, 25, 1, 20)), 2))
    assert [s.isoformat() for s in back] == [
        "2026-10-25T00:45:00+00:00",
        "2026-10-25T00:30:00+00:00",
    ]


def test_half_hour_zones_and_a_half_hour_jump() -> None:
    adelaide = Calendar(cron="0 9 * * *", timezone="Australia/Adelaide")
    # +10:30 in January, +09:30 in July.
    assert slots(adelaide, utc(2026, 1, 10), 1) == ["2026-01-10T22:30:00+00:00"]
    assert slots(adelaide, utc(2026, 7, 10), 1) == ["2026-07-10T23:30:00+00:00"]
    lord_howe = Calendar(cron="15 2 * * *", timezone="Australia/Lord_Howe")
    # 2026-10-04: 02:00 (+10:30, 15:30 UTC the day before) jumps to 02:30 (+11); 02:15 does
    # not exist and fires at the jump.
    assert slots(lord_howe, utc(2026, 10, 3, 12), 2) == [
        "2026-10-03T15:30:00+00:00",
        "2026-10-04T15:15:00+00:00",
    ]


def test_intervals_are_counted_from_the_epoch_in_utc() -> None:
    quarter = Calendar(every=timedelta(minutes=15), timezone="Europe/Berlin")
    assert slots(quarter, utc(2026, 10, 25, 0, 50), 3) == [
        "2026-10-25T01:00:00+00:00",
        "2026-10-25T01:15:00+00:00",
        "2026-10-25T01:30:00+00:00",
    ]


@pytest.mark.parametrize(
    ("options", "says"),
    [
        ({"cron": "61 * * * *"}, "invalid cron expression '61 * * * *'"),
        ({"cron": "* * * *"}, "give five fields"),
        ({"cron": "0 0 * * * *"}, "for seconds use an interval"),
        ({"cron": "\x00"}, "invalid cron expression"),
        ({"cron": "0 9 * * *", "timezone": "Europe/Atlantis"}, "unknown time zone"),
        ({"cron": "0 9 * * *", "timezone": "../../etc/passwd"}, "unknown time zone"),
        ({"every": timedelta(0)}, "an interval must be from 1 second"),
        ({"every": timedelta(seconds=-5)}, "an interval must be from 1 second"),
        ({"every": timedelta(days=9999)}, "an interval must be from 1 second"),
        ({"every": timedelta(seconds=1.5)}, "whole number of seconds"),
        ({}, "a cron expression or an interval"),
        ({"cron": "0 9 * * *", "every": timedelta(hours=1)}, "a cron expression or an interval"),
    ],
)
def test_a_bad_calendar_is_one_line(options: dict[str, object], says: str) -> None:
    with pytest.raises(InvalidInput) as raised:
        Calendar(**options)  # type: ignore[arg-type]
    assert says in str(raised.value) and "\n" not in str(raised.value)


# -- the store and the fence --------------------------------------------------------------------
async def make_due(pool: asyncpg.Pool, name: str, ago: timedelta) -> None:
    """Move the schedule's cursor back (as if its slots had come while nothing ran)."""
    await pool.execute(
        "UPDATE schedules SET next_fire_at = date_trunc('minute', clock_timestamp() - $2::interval)"
        " WHERE name = $1",
        name,
        ago,
    )


def scheduler(pool: asyncpg.Pool, worker: str, lease: float = 30.0) -> Scheduler:
    return Scheduler(
        pool, worker, lease, 10.0, structlog.get_logger(), DatabaseOutage(structlog.get_logger())
    )


async def scheduled_runs(pool: asyncpg.Pool, name: str) -> list[asyncpg.Record]:
    return await pool.fetch(
        "SELECT r.run_id, r.schedule_slot, r.state, r.available_at FROM runs AS r "
        "JOIN schedules AS s USING (schedule_id) WHERE s.name = $1 ORDER BY r.schedule_slot",
        name,
    )


async def test_a_new_schedule_starts_at_its_next_slot_not_in_the_past(pool: asyncpg.Pool) -> None:
    store = ScheduleStore(pool)
    made = await store.create(
        ScheduleSpec(
            "nightly",
            "a",
            Calendar(cron="0 3 * * *", timezone="Europe/Berlin"),
            starts_at=utc(2020, 1, 1),
        )
    )
    now = await RunStore(pool).database_now()
    assert made.next_fire_at is not None and now < made.next_fire_at <= now + timedelta(days=1)
    assert (
        made.next_fire_at.astimezone(Calendar(cron="0 3 * * *", timezone="Europe/Berlin").zone).hour
        == 3
    )
    assert await scheduler(pool, "w1").round() == 0
    assert await scheduled_runs(pool, "nightly") == []


async def test_two_schedulers_racing_start_each_slot_once(pool: asyncpg.Pool) -> None:
    store = ScheduleStore(pool)
    await store.create(
        ScheduleSpec("sweep", "a", EVERY_MINUTE, overlap="allow_all", catch_up="all")
    )
    await make_due(pool, "sweep", timedelta(minutes=30))
    a, b = scheduler(pool, "a"), scheduler(pool, "b")
    async with anyio.create_task_group() as group:
        for _ in range(5):
            group.start_soon(a.round)
            group.start_soon(b.round)
    runs = await scheduled_runs(pool, "sweep")
    slots_started = [r["schedule_slot"] for r in runs]
    assert len(slots_started) == len(set(slots_started)) == a.fired + b.fired
    # Thirty missed minutes and the current one: every slot once (catch-up "all").
    assert 30 <= len(slots_started) <= 32
    assert all(y - x == timedelta(minutes=1) for x, y in itertools.pairwise(slots_started))


async def test_a_stale_lease_holder_changes_nothing(pool: asyncpg.Pool) -> None:
    store = ScheduleStore(pool)
    await store.create(ScheduleSpec("report", "a", EVERY_MINUTE, overlap="cancel_running"))
    await make_due(pool, "report", timedelta(minutes=2))
    [(stale, stale_now)] = await store.claim("paused-worker", 1.0, 10)
    await pool.execute("UPDATE schedules SET lease_until = clock_timestamp() - interval '1 s'")
    [(fresh, fresh_now)] = await store.claim("other-worker", 30.0, 10)
    assert fresh.fence == stale.fence + 1
    fired = await store.fire(fresh, "other-worker", plan_for(fresh, fresh_now))
    assert fired and fired[-1].outcome == "fired"
    before = await pool.fetchrow("SELECT * FROM schedules WHERE name = 'report'")
    runs_before = await scheduled_runs(pool, "report")
    # The paused worker wakes and fires what it planned: refused, nothing changed (its
    # cancel_running would have cancelled the slot's run the newer claim started).
    assert await store.fire(stale, "paused-worker", plan_for(stale, stale_now)) is None
    assert await pool.fetchrow("SELECT * FROM schedules WHERE name = 'report'") == before
    assert await scheduled_runs(pool, "report") == runs_before
    assert all(r["state"] == "queued" for r in runs_before)


# -- overlap and catch-up -----------------------------------------------------------------------
async def outcomes(pool: asyncpg.Pool, name: str) -> list[str]:
    rows = await pool.fetch(
        "SELECT x.outcome FROM schedule_slots AS x JOIN schedules AS s USING (schedule_id) "
        "WHERE s.name = $1 ORDER BY x.slot",
        name,
    )
    return [row["outcome"] for row in rows]


async def states(pool: asyncpg.Pool, name: str) -> list[str]:
    return [row["state"] for row in await scheduled_runs(pool, name)]


@pytest.mark.parametrize(
    ("overlap", "decided", "run_states"),
    [
        ("skip", ["fired", "skipped", "skipped", "skipped"], ["queued"]),
        ("buffer_one", ["fired", "buffered", "skipped", "skipped"], ["queued"]),
        ("allow_all", ["fired"] * 4, ["queued"] * 4),
        ("cancel_running", ["fired"] * 4, ["cancelled"] * 3 + ["queued"]),
    ],
)
async def test_overlap_policies_with_a_run_still_going(
    pool: asyncpg.Pool, overlap: str, decided: list[str], run_states: list[str]
) -> None:
    store = ScheduleStore(pool)
    await store.create(
        ScheduleSpec("o", "a", EVERY_MINUTE, overlap=overlap, catch_up="all")  # type: ignore[arg-type]
    )
    await make_due(pool, "o", timedelta(minutes=3))
    # Three missed slots and the current one, decided in slot order in one fire: the first
    # run is still unfinished (queued) when the next slots are decided.
    [(claimed, now)] = await store.claim("w", 30.0, 10)
    plan = plan_for(claimed, now)
    await store.fire(claimed, "w", replace(plan, fire=plan.fire[-4:]))
    assert await outcomes(pool, "o") == decided
    assert await states(pool, "o") == run_states


async def test_a_buffered_slot_starts_when_the_running_run_ends(pool: asyncpg.Pool) -> None:
    store = ScheduleStore(pool)
    runs = RunStore(pool)
    await store.create(ScheduleSpec("b", "a", EVERY_MINUTE, overlap="buffer_one", catch_up="all"))
    await make_due(pool, "b", timedelta(minutes=2))
    await scheduler(pool, "w").round()
    [first] = await scheduled_runs(pool, "b")
    assert (await store.get("b")).buffered_slot is not None
    assert await scheduler(pool, "w").round() == 0  # still running: nothing to claim
    await runs.cancel(first["run_id"], reason="done with it")
    assert await scheduler(pool, "w").round() == 1
    started = await scheduled_runs(pool, "b")
    assert len(started) == 2 and started[1]["state"] == "queued"
    assert (await store.get("b")).buffered_slot is None
    assert "buffered" not in await outcomes(pool, "b")


@pytest.mark.parametrize(
    ("catch_up", "started"),
    [("none", 0), ("latest", 1), ("all", 5)],
)
async def test_slots_missed_while_nothing_ran_follow_the_catch_up_policy(
    pool: asyncpg.Pool, catch_up: str, started: int
) -> None:
    store = ScheduleStore(pool)
    await store.create(
        ScheduleSpec(
            "c",
            "a",
            Calendar(every=timedelta(hours=1)),
            catch_up=catch_up,  # type: ignore[arg-type]
            catch_up_limit=5,
            overlap="allow_all",
        )
    )
    # Thirty hourly slots came while nothing ran; none is within the one-minute window.
    await pool.execute(
        "UPDATE schedules SET next_fire_at = "
        "date_trunc('hour', clock_timestamp()) - interval '29 h'"
    )
    await scheduler(pool, "w").round()
    runs = await scheduled_runs(pool, "c")
    assert len(runs) == started
    if started:  # the newest missed slots
        now = await RunStore(pool).database_now()
        assert max(r["schedule_slot"] for r in runs) > now - timedelta(hours=1)
    after = await store.get("c")
    assert after.missed is not None and after.missed["count"] == 30 - started
    assert (
        after.next_fire_at is not None and after.next_fire_at > await RunStore(pool).database_now()
    )


# -- backfill -----------------------------------------------------------------------------------
async def test_backfilling_a_window_twice_starts_each_slot_once(pool: asyncpg.Pool) -> None:
    store = ScheduleStore(pool)
    await store.create(
        ScheduleSpec("daily", "a", Calendar(cron="30 2 * * *", timezone="Europe/Berlin"))
    )
    # The week Berlin springs forward: 02:30 on the 29th does not exist and fires at 03:00.
    first = await store.backfill("daily", utc(2026, 3, 26), utc(2026, 4, 1))
    assert await store.backfill("daily", utc(2026, 3, 26), utc(2026, 4, 1)) == []
    wider = await store.backfill("daily", utc(2026, 3, 25), utc(2026, 4, 2))
    runs = await scheduled_runs(pool, "daily")
    assert len(first) == 6 and len(wider) == 2 and len(runs) == 8
    assert [r["schedule_slot"].isoformat() for r in runs[1:7]] == [
        "2026-03-26T01:30:00+00:00",
        "2026-03-27T01:30:00+00:00",
        "2026-03-28T01:30:00+00:00",
        "2026-03-29T01:00:00+00:00",
        "2026-03-30T00:30:00+00:00",
        "2026-03-31T00:30:00+00:00",
    ]
    assert set(await outcomes(pool, "daily")) == {"backfilled"}


async def test_backfilling_the_repeated_hour_starts_each_quarter_once(pool: asyncpg.Pool) -> None:
    store = ScheduleStore(pool)
    await store.create(
        ScheduleSpec("q", "a", Calendar(cron="*/15 * * * *", timezone="America/New_York"))
    )
    # 2026-11-01 01:00-01:59 EDT happens again as EST: four slots, not eight.
    started = await store.backfill("q", utc(2026, 11, 1, 5), utc(2026, 11, 1, 7))
    slots_started = [r["schedule_slot"] for r in await scheduled_runs(pool, "q")]
    assert len(started) == 4
    assert slots_started[-1] == utc(2026, 11, 1, 5, 45)


async def changes_nothing(pool: asyncpg.Pool) -> tuple[int, int, int]:
    row = await pool.fetchrow(
        "SELECT (SELECT count(*) FROM schedules) AS s, (SELECT count(*) FROM runs) AS r, "
        "(SELECT count(*) FROM audit_log) AS a"
    )
    assert row is not None
    return row["s"], row["r"], row["a"]


@pytest.mark.parametrize(
    ("start", "end", "says"),
    [
        (utc(2026, 1, 2), utc(2026, 1, 1), "must come after its start"),
        (utc(2000, 1, 1), utc(2026, 1, 1), "holds more than 10,000 slots"),
        (utc(2026, 1, 1), utc(9999, 1, 1), "a backfill covers the past"),
        (datetime(2026, 1, 1), utc(2026, 1, 2), "timezone-aware"),
    ],
)
async def test_an_absurd_backfill_is_one_line_and_changes_nothing(
    pool: asyncpg.Pool, start: datetime, end: datetime, says: str
) -> None:
    store = ScheduleStore(pool)
    await store.create(ScheduleSpec("m", "a", EVERY_MINUTE))
    before = await changes_nothing(pool)
    with pytest.raises(InvalidInput) as raised:
        await store.backfill("m", start, end)
    assert says in str(raised.value) and "\n" not in str(raised.value)
    assert await changes_nothing(pool) == before


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ({"name": "bad name"}, "a schedule's name"),
        ({"name": "x" * 101}, "a schedule's name"),
        ({"agent": "no spaces"}, "agent"),
        ({"starts_at": utc(2027, 1, 1), "ends_at": utc(2026, 1, 1)}, "must come after its start"),
        ({"ends_at": utc(2000, 1, 1)}, "no slot before the schedule's end"),
        ({"calendar": Calendar(cron="0 0 30 2 *")}, "never fires"),
        ({"overlap": "sometimes"}, "an overlap policy is one of"),
        ({"catch_up": "maybe"}, "a catch-up policy is one of"),
        ({"catch_up_limit": 0}, "a catch-up limit must be"),
        ({"catch_up_limit": float("nan")}, "a catch-up limit must be"),
        ({"catch_up_window": timedelta(seconds=-1)}, "a catch-up window must be"),
        ({"jitter": timedelta(days=2)}, "a jitter must be"),
        ({"input": ["not", "an", "object"]}, "input must be a JSON object"),
        ({"input": {"text": "nul \x00"}}, "NUL"),
        ({"concurrency_key": "k" * 201}, "a concurrency key"),
        ({"priority": 10**9}, "a priority"),
        ({"max_attempts": 0}, "max attempts"),
    ],
)
async def test_a_bad_schedule_is_one_line_and_changes_nothing(
    pool: asyncpg.Pool, spec: dict[str, object], says: str
) -> None:
    fields: dict[str, object] = {"name": "ok", "agent": "a", "calendar": EVERY_MINUTE}
    before = await changes_nothing(pool)
    with pytest.raises(InvalidInput) as raised:
        await ScheduleStore(pool).create(ScheduleSpec(**{**fields, **spec}))  # type: ignore[arg-type]
    assert says in str(raised.value) and "\n" not in str(raised.value)
    assert await changes_nothing(pool) == before


async def test_every_change_is_audited_and_a_second_name_is_refused(pool: asyncpg.Pool) -> None:
    store = ScheduleStore(pool)
    await store.create(ScheduleSpec("audited", "a", EVERY_MINUTE))
    with pytest.raises(InvalidInput, match="a schedule named 'audited' exists"):
        await store.create(ScheduleSpec("audited", "a", EVERY_MINUTE))
    await store.pause("audited")
    assert (await store.get("audited")).paused
    await store.resume("audited")
    with pytest.raises(InvalidInput, match="is not paused"):
        await store.resume("audited")
    await store.delete("audited")
    with pytest.raises(InvalidInput, match="no schedule named 'audited'"):
        await store.delete("audited")
    actions = [
        row["action"]
        for row in await pool.fetch(
            "SELECT action FROM audit_log WHERE action LIKE 'schedule%' ORDER BY seq"
        )
    ]
    assert actions == ["schedule_create", "schedule_pause", "schedule_resume", "schedule_delete"]


async def test_a_paused_schedule_fires_nothing_and_resumes_at_its_next_slot(
    pool: asyncpg.Pool,
) -> None:
    store = ScheduleStore(pool)
    await store.create(ScheduleSpec("p", "a", EVERY_MINUTE, catch_up="all"))
    await make_due(pool, "p", timedelta(minutes=5))
    await store.pause("p")
    assert await scheduler(pool, "w").round() == 0
    resumed = await store.resume("p")
    now = await RunStore(pool).database_now()
    assert resumed.next_fire_at is not None and resumed.next_fire_at > now
    assert await scheduled_runs(pool, "p") == []


async def test_jitter_delays_a_slot_s_run_by_the_same_amount_every_time(pool: asyncpg.Pool) -> None:
    store = ScheduleStore(pool)
    await store.create(ScheduleSpec("j", "a", EVERY_MINUTE, jitter=timedelta(seconds=50)))
    await make_due(pool, "j", timedelta(0))
    await scheduler(pool, "w").round()
    [run] = await scheduled_runs(pool, "j")
    schedule = await store.get("j")
    delay = jitter(schedule.schedule_id, run["schedule_slot"], timedelta(seconds=50))
    assert delay == jitter(schedule.schedule_id, run["schedule_slot"], timedelta(seconds=50))
    assert timedelta(0) <= delay < timedelta(seconds=50)
    submitted = await pool.fetchval(
        "SELECT at FROM run_events WHERE run_id = $1 AND kind = 'submitted'", run["run_id"]
    )
    # Due at the slot plus its delay, or at once if that had passed when it was fired.
    assert run["available_at"] == max(run["schedule_slot"] + delay, submitted) or (
        run["schedule_slot"] + delay <= run["available_at"] <= submitted + timedelta(seconds=1)
    )


# -- roles ----------------------------------------------------------------------------------------
async def test_each_role_does_what_its_grants_say(logins: Logins) -> None:
    """Clients and the console change schedules (audited as their login); only workers claim
    and fire them; the dispatcher and the proxy do neither."""
    client = ScheduleStore(await logins.pool("client"))
    worker_pool = await logins.pool("worker")
    await client.create(ScheduleSpec("roles", "roles", EVERY_MINUTE, catch_up="all"))
    assert [s.name for s in await ScheduleStore(await logins.pool("console")).list()] == ["roles"]
    await refused(lambda: ScheduleStore(worker_pool).create(ScheduleSpec("w", "a", EVERY_MINUTE)))
    await refused(lambda: ScheduleStore(worker_pool).pause("roles"))
    for kind in ("client", "console", "dispatcher", "proxy"):
        pool = await logins.pool(kind)
        await refused(lambda pool=pool: ScheduleStore(pool).claim("w", 30, 10))  # type: ignore[misc]
    admin = await asyncpg.connect(logins.admin_dsn)
    try:
        await admin.execute(
            "UPDATE orchestrator.schedules SET next_fire_at = clock_timestamp() - interval '90 s'"
        )
        creator = await admin.fetchval(
            "SELECT principal FROM orchestrator.audit_log WHERE action = 'schedule_create'"
        )
    finally:
        await admin.close()
    assert creator == logins.logins["client"]
    assert await scheduler(worker_pool, "w1").round() == 1
    assert len(await client.slots("roles")) >= 1


# -- the command line -----------------------------------------------------------------------------
@pytest.mark.slow
async def test_the_command_line_creates_shows_backfills_and_refuses_in_one_line(
    database_url: str, pool: asyncpg.Pool
) -> None:
    made = await anyio.to_thread.run_sync(
        lambda: cli(
            database_url,
            "schedules",
            "create",
            "daily",
            "--agent",
            "a",
            "--cron",
            "30 2 * * *",
            "--timezone",
            "Europe/Berlin",
            "--overlap",
            "buffer-one",
            "--input",
            '{"to": "ops"}',
            "--json",
        )
    )
    assert made.returncode == 0, made.stderr
    assert json.loads(made.stdout)["overlap"] == "buffer_one"
    for args, says in (
        (("--cron", "61 * * * *"), "invalid cron expression"),
        (("--cron", "0 9 * * *", "--timezone", "Mars/Olympus"), "unknown time zone"),
        (("--every", "-5m"), "--every takes an age"),
        (
            ("--every", "1m", "--start", "2027-01-01T00:00Z", "--end", "2026-01-01T00:00Z"),
            "must come after its start",
        ),
        (("--cron", "0 9 * * *", "--every", "1m"), "give --cron or --every"),
    ):
        refused = await anyio.to_thread.run_sync(
            lambda args=args: cli(database_url, "schedules", "create", "x", "--agent", "a", *args)  # type: ignore[misc]
        )
        assert refused.returncode in (1, 2), (args, refused.stderr)
        assert says in refused.stderr, (args, refused.stderr)
        assert refused.stderr.strip().count("\n") == 0 or refused.returncode == 2, refused.stderr
    assert [s.name for s in await ScheduleStore(pool).list()] == ["daily"]
    filled = await anyio.to_thread.run_sync(
        lambda: cli(
            database_url,
            "schedules",
            "backfill",
            "daily",
            "2026-03-28T00:00Z",
            "2026-03-30T00:00Z",
            "--json",
        )
    )
    assert filled.returncode == 0, filled.stderr
    [first, second] = json.loads(filled.stdout)["started"]
    shown = await anyio.to_thread.run_sync(
        lambda: cli(database_url, "schedules", "show", "daily", "--json")
    )
    document = json.loads(shown.stdout)
    assert [slot["run_id"] for slot in document["slots"]] == [second, first]
    assert document["slots"][0]["slot"].startswith("2026-03-29T01:00:00")
    run = await anyio.to_thread.run_sync(lambda: cli(database_url, "runs", "show", second))
    assert "slot 2026-03-29" in run.stdout, run.stdout


async def test_a_schedule_keeps_the_records_of_its_newest_slots(pool: asyncpg.Pool) -> None:
    """Every thousandth claim trims the slot records to the newest 10,000: an every-second
    schedule would otherwise add 86,400 a day."""
    store = ScheduleStore(pool)
    made = await store.create(ScheduleSpec("trim", "a", EVERY_MINUTE, overlap="allow_all"))
    await pool.execute(
        "INSERT INTO schedule_slots (schedule_id, slot, outcome, fence, decided_by) "
        "SELECT $1, timestamptz '2020-01-01' + make_interval(mins => n), 'skipped', 1, 'w' "
        "FROM generate_series(1, 10500) AS n",
        made.schedule_id,
    )
    await pool.execute("UPDATE schedules SET fence = 998")
    await make_due(pool, "trim", timedelta(0))
    await scheduler(pool, "w").round()  # fence 999: nothing trimmed
    assert await pool.fetchval("SELECT count(*) FROM schedule_slots") == 10_501
    await make_due(pool, "trim", timedelta(0))
    await pool.execute("UPDATE schedules SET next_fire_at = next_fire_at - interval '1 minute'")
    await scheduler(pool, "w").round()  # fence 1000
    assert await pool.fetchval("SELECT count(*) FROM schedule_slots") == 10_001
    newest = await pool.fetchval("SELECT max(slot) FROM schedule_slots WHERE run_id IS NOT NULL")
    assert newest is not None and newest > datetime(2026, 1, 1, tzinfo=UTC)


async def test_schedules_a_stopped_process_holds_do_not_stop_others_claiming(
    pool: asyncpg.Pool,
) -> None:
    """A process that claimed the oldest due schedules and stopped leaves the rest to others:
    its claims are left out before the claim's limit is counted."""
    store = ScheduleStore(pool)
    for i in range(150):
        await store.create(ScheduleSpec(f"s{i}", "a", EVERY_MINUTE))
    await pool.execute(
        "UPDATE schedules SET next_fire_at = date_trunc('minute', clock_timestamp())"
        " - make_interval(secs => substr(name, 2)::int / 100.0)"
    )
    assert len(await store.claim("stopped-process", 45, 100)) == 100
    assert await scheduler(pool, "w").round() == 50


async def test_a_buffered_slot_is_recorded_as_decided_by_the_process_that_started_it(
    pool: asyncpg.Pool,
) -> None:
    store = ScheduleStore(pool)
    await store.create(ScheduleSpec("b", "a", EVERY_MINUTE, overlap="buffer_one", catch_up="all"))
    await make_due(pool, "b", timedelta(minutes=1))
    await scheduler(pool, "A").round()
    [first, *_] = await scheduled_runs(pool, "b")
    await RunStore(pool).cancel(first["run_id"], reason="done")
    assert await scheduler(pool, "B").round() == 1
    rows = await pool.fetch("SELECT outcome, fence, decided_by FROM schedule_slots ORDER BY slot")
    assert [(r["outcome"], r["decided_by"]) for r in rows] == [("fired", "A"), ("fired", "B")]


def test_more_due_slots_than_a_fire_looks_at_are_counted_as_missed_before_the_oldest_fired() -> (
    None
):
    every_second = Calendar(every=timedelta(seconds=1))
    now = utc(2026, 1, 1, 12)
    plan = plan_fires(
        every_second,
        cursor=now - timedelta(seconds=1500),
        now=now,
        policy="all",
        window=timedelta(hours=1),
        limit=1000,
        ends_at=None,
    )
    assert len(plan.fire) == 1000 and plan.missed is not None
    assert plan.missed.last == min(plan.fire) - timedelta(seconds=1)
    assert plan.missed.first == now - timedelta(seconds=1500) and plan.missed.count is None


async def test_two_people_creating_one_name_at_once_get_one_schedule_and_one_clear_refusal(
    pool: asyncpg.Pool,
) -> None:
    store = ScheduleStore(pool)
    outcomes: list[str] = []

    async def create(agent: str) -> None:
        try:
            await store.create(ScheduleSpec("race", agent, EVERY_MINUTE))
            outcomes.append("created")
        except InvalidInput as error:
            outcomes.append(str(error))

    async with anyio.create_task_group() as group:
        for agent in ("a", "b", "c"):
            group.start_soon(create, agent)
    assert outcomes.count("created") == 1
    assert all("a schedule named 'race' exists" in o for o in outcomes if o != "created")
    assert len(await store.list()) == 1


def test_the_client_creates_and_backfills_with_keywords_and_refuses_in_one_line(
    settings: Settings,
) -> None:
    with SyncClient(settings) as client:
        made = client.schedules.create(
            "nightly",
            "a",
            cron="30 2 * * *",
            timezone="Europe/Berlin",
            overlap="allow_all",
            input={"to": "ops"},
        )
        assert (made.cron, made.timezone, made.overlap, made.input) == (
            "30 2 * * *",
            "Europe/Berlin",
            "allow_all",
            {"to": "ops"},
        )
        every = client.schedules.create("sweep", "a", every=timedelta(minutes=15))
        assert every.every_seconds == 900 and every.timezone == "UTC"
        started = client.schedules.backfill("nightly", utc(2026, 3, 28), utc(2026, 3, 30))
        assert len(started) == 2
        assert [s.run_id for s in client.schedules.slots("nightly")] == started[::-1]
        with pytest.raises(InvalidInput) as refused:
            client.schedules.create("bad", "a", cron="0 9 * * *", timezone="Nowhere/Atlantis")
        assert "unknown time zone" in str(refused.value) and "\n" not in str(refused.value)
        client.schedules.pause("sweep")
        client.schedules.delete("sweep")
        assert [s.name for s in client.schedules.list()] == ["nightly"]
