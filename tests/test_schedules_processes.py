"""Schedules shared by several `serve` processes under real faults (docs/schedules.md): SIGKILL,
SIGSTOP of whoever holds the schedules' leases, a PostgreSQL restart. Each slot starts one run,
no slot within the catch-up window is lost, and slots missed during an outage follow the
catch-up policy; through a failover too. Every check reads the database, never the test's
clock."""

from __future__ import annotations

import itertools
import random
import signal
from collections import Counter
from datetime import datetime, timedelta

import anyio
import asyncpg
import pytest

from orchestrator.db.bootstrap import ensure_schema
from orchestrator.db.connections import create_pool
from orchestrator.db.embedded import EmbeddedPostgres
from orchestrator.db.schedules import ScheduleSpec, ScheduleStore
from orchestrator.scheduling.calendar import Calendar
from orchestrator.settings import Settings
from orchestrator.testing import ReplicatedPostgres
from support import ServeProcess, serving, started_and_migrated

pytestmark = pytest.mark.slow

EVERY_SECOND = Calendar(every=timedelta(seconds=1))
SERVE = [
    *serving("orchestrator.agents.noop"),
    "--lease-seconds",
    "1.5",
    "--heartbeat-seconds",
    "0.5",
]


async def slots_started(pool: asyncpg.Pool, name: str) -> list[datetime]:
    """Each run the schedule started, by its slot (a slot twice appears twice)."""
    rows = await pool.fetch(
        "SELECT r.schedule_slot FROM runs AS r JOIN schedules AS s USING (schedule_id) "
        "WHERE s.name = $1 ORDER BY r.schedule_slot",
        name,
    )
    return [row["schedule_slot"] for row in rows]


def gaps(started: list[datetime], step: timedelta) -> list[tuple[datetime, datetime]]:
    return [(x, y) for x, y in itertools.pairwise(started) if y - x != step]


async def stop_a_lease_holder(
    pool: asyncpg.Pool, processes: list[ServeProcess]
) -> ServeProcess | None:
    """SIGSTOP whichever of ``processes`` holds a schedule's lease, between its claim and its
    fire (a round fires its claims one by one, so the window is a round long)."""
    by_name = {process.name: process for process in processes}
    with anyio.move_on_after(10):
        while True:
            owner = await pool.fetchval(
                "SELECT lease_owner FROM schedules WHERE lease_owner IS NOT NULL LIMIT 1"
            )
            if owner in by_name:
                by_name[owner].signal(signal.SIGSTOP)
                return by_name[owner]
            await anyio.sleep(0.001)
    return None


async def wait_for_slots(pool: asyncpg.Pool, name: str, count: int, within: float) -> None:
    with anyio.fail_after(within):
        while True:
            try:  # through a restart or a failover
                if len(await slots_started(pool, name)) >= count:
                    return
            except (asyncpg.PostgresError, asyncpg.InterfaceError, OSError):
                pass
            await anyio.sleep(0.2)


async def test_three_serves_under_sigkill_and_sigstop_start_each_slot_once(
    settings: Settings,
) -> None:
    """Sixty every-second schedules shared by three processes: one is SIGSTOPped (its
    schedules' leases run out and the others take them over, and what it fires after SIGCONT is
    refused), one is SIGKILLed and replaced. Every slot from each schedule's first to its last
    started exactly one run."""
    pool = await create_pool(settings, max_size=4)
    try:
        store = ScheduleStore(pool)
        names = [f"sweep-{i}" for i in range(60)]
        for name in names:
            await store.create(ScheduleSpec(name, "noop", EVERY_SECOND, overlap="allow_all"))
        dsn = str(settings.database_url)
        chooser = random.Random(7)
        with (
            ServeProcess(dsn, *SERVE, name="A") as a,
            ServeProcess(dsn, *SERVE, name="B") as b,
            ServeProcess(dsn, *SERVE, name="C") as c,
        ):
            await wait_for_slots(pool, names[0], 3, within=60)
            for _ in range(4):
                stopped = await stop_a_lease_holder(pool, [a, b]) or chooser.choice([a, b])
                await anyio.sleep(2.5)  # longer than a schedule's lease (1.5 s)
                stopped.signal(signal.SIGCONT)
                await anyio.sleep(0.5)
            c.kill()
            with ServeProcess(dsn, *SERVE, name="D"):
                await wait_for_slots(
                    pool, names[0], len(await slots_started(pool, names[0])) + 3, within=60
                )
                a.stop()
                b.stop()
            refused = [
                line
                for process in (a, b)
                for line in process.events("schedule lease lost before its fire")
            ]
        for name in names:
            started = await slots_started(pool, name)
            assert started, name
            assert [s for s, n in Counter(started).items() if n > 1] == [], name
            assert gaps(started, timedelta(seconds=1)) == [], name
        records = await pool.fetchval(
            "SELECT count(*) FROM schedule_slots WHERE outcome <> 'fired'"
        )
        assert records == 0
        # Whatever a stopped process had claimed and fired late was refused, and counted
        # nowhere: the slots above are whole without it.
        assert refused, "no stopped process held a schedule's lease"
    finally:
        await pool.close()


async def test_slots_missed_during_a_postgres_outage_follow_the_catch_up_policy(
    own_server: EmbeddedPostgres,
) -> None:
    settings = await started_and_migrated(own_server)
    pool = await create_pool(settings, max_size=4)
    try:
        store = ScheduleStore(pool)
        window = timedelta(seconds=2)
        for policy in ("none", "latest", "all"):
            await store.create(
                ScheduleSpec(
                    f"catch-{policy}",
                    "noop",
                    EVERY_SECOND,
                    overlap="allow_all",
                    catch_up=policy,
                    catch_up_window=window,
                )
            )
    finally:
        await pool.close()
    dsn = str(settings.database_url)
    with ServeProcess(dsn, *SERVE, name="A") as a, ServeProcess(dsn, *SERVE, name="B") as b:
        await a.wait_for_log("serving")
        await b.wait_for_log("serving")
        pool = await create_pool(settings, max_size=4)
        try:
            await wait_for_slots(pool, "catch-all", 2, within=60)
        finally:
            await pool.close()
        await anyio.to_thread.run_sync(lambda: own_server.restart(down_seconds=8))
        pool = await create_pool(settings, max_size=4)
        try:
            for policy in ("none", "latest", "all"):
                await wait_for_slots(
                    pool,
                    f"catch-{policy}",
                    len(await slots_started(pool, f"catch-{policy}")) + 3,
                    within=90,
                )
            outcome = {}
            for policy in ("none", "latest", "all"):
                started = await slots_started(pool, f"catch-{policy}")
                missed = (await store_of(pool).get(f"catch-{policy}")).missed
                outcome[policy] = (started, missed)
        finally:
            await pool.close()
    one = timedelta(seconds=1)
    every, every_missed = outcome["all"]
    assert [s for s, n in Counter(every).items() if n > 1] == []
    assert gaps(every, one) == [], "catch-up all starts every slot of the outage"
    assert every_missed is None
    for policy in ("none", "latest"):
        started, missed = outcome[policy]
        assert [s for s, n in Counter(started).items() if n > 1] == []
        holes = gaps(started, one)
        assert holes, f"{policy}: the outage left no hole"
        # Every slot of the outage's holes was skipped, and said so; "latest" starts the newest
        # missed slot only when no slot is on time, which after an outage one always is.
        assert missed is not None
        assert sum(int((y - x) / one) - 1 for x, y in holes) == missed["count"], policy


def store_of(pool: asyncpg.Pool) -> ScheduleStore:
    return ScheduleStore(pool)


@pytest.mark.parametrize("synchronous", [True, False])
async def test_through_a_failover_each_slot_starts_one_run(synchronous: bool) -> None:
    """Two `serve` processes on a primary + standby; the primary is killed and the standby
    promoted while every-second schedules fire. On the promoted server every slot from the
    first to the last started exactly one run: a fire the standby never received was lost
    with its run, and the promoted server's cursor, as far back, fires that slot again."""
    pair = ReplicatedPostgres(synchronous=synchronous)
    await anyio.to_thread.run_sync(pair.start)
    try:
        settings = Settings(database_url=pair.dsn())
        await ensure_schema(settings, pair.dsn(), auto_migrate=True)
        pool = await create_pool(settings, max_size=4)
        try:
            for i in range(5):
                await ScheduleStore(pool).create(
                    ScheduleSpec(
                        f"ha-{i}", "noop", EVERY_SECOND, overlap="allow_all", catch_up="all"
                    )
                )
        finally:
            await pool.close()
        dsn = pair.dsn()
        with ServeProcess(dsn, *SERVE, name="A"), ServeProcess(dsn, *SERVE, name="B"):
            pool = await create_pool(settings, max_size=4)
            try:
                await wait_for_slots(pool, "ha-0", 3, within=60)
            finally:
                await pool.close()
            failover = await anyio.to_thread.run_sync(pair.failover)
            assert failover.new_timeline == failover.old_timeline + 1
            pool = await create_pool(settings, max_size=4)
            try:
                await wait_for_slots(pool, "ha-0", 1, within=120)  # the promoted server answers
                before = len(await slots_started(pool, "ha-0"))
                await wait_for_slots(pool, "ha-0", before + 3, within=120)
                started = {f"ha-{i}": await slots_started(pool, f"ha-{i}") for i in range(5)}
            finally:
                await pool.close()
    finally:
        await anyio.to_thread.run_sync(pair.close)
    for name, slots in started.items():
        assert [s for s, n in Counter(slots).items() if n > 1] == [], name
        assert gaps(slots, timedelta(seconds=1)) == [], name
