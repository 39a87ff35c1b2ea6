"""``client.schedules``: cron and interval schedules that start runs once per slot
(docs/schedules.md). Each change is an audited decision of the connected login."""

from __future__ import annotations

import builtins
from datetime import datetime, timedelta
from typing import Unpack

from orchestrator.client.features import StoresHandle
from orchestrator.db.error_projection import project_errors
from orchestrator.db.schedules import HISTORY, Schedule, ScheduleOptions, ScheduleSpec, SlotRecord
from orchestrator.scheduling.calendar import Calendar


class SchedulesHandle(StoresHandle):
    """Create, list, pause, resume, delete and backfill schedules."""

    @project_errors
    async def create(
        self,
        name: str,
        agent: str,
        *,
        cron: str | None = None,
        every: timedelta | None = None,
        timezone: str = "UTC",
        **options: Unpack[ScheduleOptions],
    ) -> Schedule:
        """Schedule ``agent``: a run at each slot of ``cron`` (read in ``timezone``) or of
        ``every``; ``options``: ``input``, ``overlap``, ``catch_up``, ``jitter``, ``starts_at``,
        ``ends_at`` and the runs' ``concurrency_key``, ``priority``, ``max_attempts``."""
        calendar = Calendar(cron=cron, every=every, timezone=timezone)
        return await self._stores.schedules.create(ScheduleSpec(name, agent, calendar, **options))

    @project_errors
    async def list(self) -> builtins.list[Schedule]:
        return await self._stores.schedules.list()

    @project_errors
    async def get(self, name: str) -> Schedule:
        return await self._stores.schedules.get(name)

    @project_errors
    async def slots(self, name: str, *, newest: int = HISTORY) -> builtins.list[SlotRecord]:
        """The latest decided slots, newest first: fired (with the run), skipped, buffered."""
        return await self._stores.schedules.slots(name, newest=newest)

    @project_errors
    async def pause(self, name: str) -> Schedule:
        return await self._stores.schedules.pause(name)

    @project_errors
    async def resume(self, name: str) -> Schedule:
        """Fire from the next slot on; the paused slots are not fired (``backfill`` them)."""
        return await self._stores.schedules.resume(name)

    @project_errors
    async def delete(self, name: str) -> None:
        await self._stores.schedules.delete(name)

    @project_errors
    async def backfill(self, name: str, start: datetime, end: datetime) -> builtins.list[str]:
        """Start each slot from ``start`` to ``end`` (excluded) that has no run; returns the
        runs started."""
        return await self._stores.schedules.backfill(name, start, end)
