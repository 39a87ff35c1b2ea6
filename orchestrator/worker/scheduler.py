"""The scheduler every ``serve`` process runs: claim the schedules whose slot has come, fire
their slots under the claim's fence, sleep until the next slot (docs/schedules.md).

There is no single scheduler to run or to fail over: each process claims due schedules with
``SKIP LOCKED`` and a lease, so they share the work, and the database refuses the fire of a
process that lost its lease meanwhile (a pause, a partition), which changes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

import anyio
import asyncpg
from structlog.typing import FilteringBoundLogger

from orchestrator.db.deadlines import DATABASE_ERRORS, pooled
from orchestrator.db.outages import DatabaseOutage
from orchestrator.db.schedules import Schedule, ScheduleStore
from orchestrator.scheduling.plan import Plan, plan_fires

CLAIM_BATCH = 100
LONGEST_SLEEP = 0.5
"""A scheduler looks again at least this often (a new schedule, another process's change)."""
SHORTEST_SLEEP = 0.002
HELD_ELSEWHERE_SLEEP = 0.1
"""Sleep when a slot is due but none was claimed: another process holds it (or held it and
stopped, until its lease runs out), so there is nothing to hurry for."""


def plan_for(schedule: Schedule, now: datetime) -> Plan:
    """What a claim of ``schedule`` at ``now`` fires; only a buffered slot when none is due."""
    cursor = schedule.next_fire_at
    if cursor is None or cursor > now:
        return Plan(fire=[], missed=None, next=cursor)
    return plan_fires(
        schedule.calendar,
        cursor=cursor,
        now=now,
        policy=schedule.catch_up,
        window=timedelta(seconds=schedule.catch_up_seconds),
        limit=schedule.catch_up_limit,
        ends_at=schedule.ends_at,
    )


@dataclass
class Scheduler:
    pool: asyncpg.Pool
    worker_id: str
    lease_seconds: float
    statement_seconds: float
    log: FilteringBoundLogger
    outage: DatabaseOutage
    fired: int = 0
    skipped: int = 0

    async def run(self) -> None:
        while True:
            try:
                claimed = await self.round()
                if claimed >= CLAIM_BATCH:
                    continue
                async with pooled(self.pool, within=self.statement_seconds) as db:
                    wait = await ScheduleStore(db).seconds_to_next()
            except DATABASE_ERRORS as error:
                self.outage.failed(error, otherwise="cannot fire schedules")
                wait = LONGEST_SLEEP
            if wait is None:
                wait = LONGEST_SLEEP
            elif wait <= 0:
                wait = HELD_ELSEWHERE_SLEEP
            await anyio.sleep(min(max(wait, SHORTEST_SLEEP), LONGEST_SLEEP))

    async def round(self) -> int:
        """Claim the due schedules and fire each; returns how many were claimed."""
        async with pooled(self.pool, within=self.statement_seconds) as db:
            claimed = await ScheduleStore(db).claim(self.worker_id, self.lease_seconds, CLAIM_BATCH)
        for schedule, now in claimed:
            # Each fire has its own deadline: a slow one (or a pause of this process) leaves
            # the others to be fired, or refused if their lease ran out meanwhile.
            try:
                async with pooled(self.pool, within=self.statement_seconds) as db:
                    await self._fire(ScheduleStore(db), schedule, now)
            except DATABASE_ERRORS as error:
                self.outage.failed(error, otherwise="cannot fire a schedule")
        return len(claimed)

    async def _fire(self, store: ScheduleStore, schedule: Schedule, now: datetime) -> None:
        try:
            plan = plan_for(schedule, now)
        except Exception as error:  # a calendar that cannot answer must not stop the others
            self.log.error("cannot plan schedule", schedule=schedule.name, error=str(error))
            return
        decided = await store.fire(schedule, self.worker_id, plan)
        if decided is None:
            self.log.info(
                "schedule lease lost before its fire",
                schedule=schedule.name,
                fence=schedule.fence,
            )
            return
        for slot in decided:
            if slot.outcome == "fired":
                self.fired += 1
                self.log.info(
                    "schedule fired",
                    schedule=schedule.name,
                    slot=slot.slot.isoformat(),
                    run_id=slot.run_id,
                    fence=schedule.fence,
                )
            else:
                self.skipped += 1
                self.log.info(
                    "schedule slot " + slot.outcome,
                    schedule=schedule.name,
                    slot=slot.slot.isoformat(),
                    overlap=schedule.overlap,
                )
        if plan.missed is not None:
            self.log.warning(
                "schedule missed slots",
                schedule=schedule.name,
                catch_up=schedule.catch_up,
                **plan.missed.as_json(),
            )
