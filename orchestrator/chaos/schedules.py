"""The campaign's schedules (docs/schedules.md): a few every-second schedules and one cron
schedule, one for each overlap policy and with each catch-up policy, created once the cluster is
up and ending with the fault window, so that every ``serve`` process's scheduler fires them
while the faults act on it and on PostgreSQL. Their runs are ``chaos_tick`` runs: a leaf's steps
(work a while, then email the customer and note the CRM) under a name of their own, outside the
workload's limits and trees.

A schedule whose runs work longer than its interval overlaps itself, so its overlap policy is
met on most slots: skipped, buffered, or the running run cancelled. The checker's rules are in
``schedule_checks.py``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta

import asyncpg

from orchestrator.chaos.agents import TICK
from orchestrator.db.schedules import Overlap, ScheduleSpec, ScheduleStore
from orchestrator.scheduling.calendar import Calendar
from orchestrator.scheduling.plan import CatchUpPolicy

PENDING = (
    "SELECT count(*) FROM orchestrator.schedules "
    "WHERE NOT paused AND (next_fire_at IS NOT NULL OR buffered_slot IS NOT NULL)"
)
"""Schedules with slots still to decide, or a buffered slot still to start: quiescence waits
for none to be left, so that no run starts after it."""


@dataclass(frozen=True)
class CampaignSchedule:
    """One of the campaign's schedules: its calendar, its policies, and how long its runs work."""

    name: str
    overlap: Overlap
    catch_up: CatchUpPolicy
    catch_up_seconds: int
    work_seconds: float
    every_seconds: int | None = 1
    cron: str | None = None

    @property
    def calendar(self) -> Calendar:
        if self.cron is not None:
            return Calendar(cron=self.cron)
        return Calendar(every=timedelta(seconds=self.every_seconds or 1))


LONG_WINDOW = 3600
"""A catch-up window longer than any campaign's outage: with ``all``, every slot fires."""
CAMPAIGN_SCHEDULES = (
    CampaignSchedule("chaos-every-allow", "allow_all", "all", LONG_WINDOW, 0.2),
    CampaignSchedule("chaos-every-skip", "skip", "latest", 2, 1.5),
    CampaignSchedule("chaos-every-buffer", "buffer_one", "none", 2, 1.5),
    CampaignSchedule("chaos-every-cancel", "cancel_running", "all", LONG_WINDOW, 1.5),
    CampaignSchedule(
        "chaos-cron-minute", "allow_all", "latest", 60, 0.2, every_seconds=None, cron="* * * * *"
    ),
)
"""Every overlap policy and every catch-up policy, each at least once; the first keeps every
slot (allow_all, catch-up all, a long window), so any slot missing from it was lost."""


async def create_schedules(
    pool: asyncpg.Pool, schedules: Sequence[CampaignSchedule], window: float
) -> list[str]:
    """Create ``schedules``, each ending ``window`` seconds from now (a cron one after its first
    slot at the earliest, so that it has one); returns their names."""
    store = ScheduleStore(pool)
    now = await store._now()
    made = []
    for planned in schedules:
        calendar = planned.calendar
        first = calendar.first_at_or_after(now)
        ends = now + timedelta(seconds=window)
        if first is not None and first >= ends:
            ends = first + timedelta(seconds=1)
        await store.create(
            ScheduleSpec(
                planned.name,
                TICK,
                calendar,
                input={"customer": planned.name, "work_seconds": planned.work_seconds},
                overlap=planned.overlap,
                catch_up=planned.catch_up,
                catch_up_window=timedelta(seconds=planned.catch_up_seconds),
                ends_at=ends,
                max_attempts=100,
            )
        )
        made.append(planned.name)
    return made
