"""``client.schedules``: cron and interval schedules that start runs once per slot
(docs/schedules.md). Each change is an audited decision of the connected login."""

from __future__ import annotations

import builtins
from datetime import datetime
from typing import Unpack

from orchestrator.client.features import StoresHandle
from orchestrator.db.error_projection import project_errors
from orchestrator.db.schedules import (
    HISTORY,
    Schedule,
    ScheduleArguments,
    ScheduleSpec,
    SlotRecord,
)
from orchestrator.scheduling.calendar import Calendar


class SchedulesHandle(StoresHandle):
    """Create, list, pause, resume, delete and backfill schedules."""

    @project_errors
    async def create(self, name: str, agent: str, **given: Unpack[ScheduleArguments]) -> Schedule:
        """Schedule ``agent``: a run at each slot of ``cron=`` (read in ``timezone=``, UTC by
        default) or of ``every=`` (a timedelta); the other options are ``input``, ``overlap``,
        ``catch_up``, ``catch_up_window``, ``catch_up_limit``, ``jitter``, ``starts_at``,
        ``ends_at`` and the runs' ``concurrency_key``, ``priority``, ``max_attempts``."""
        options = dict(given)
        calendar = Calendar(
            cron=options.pop("cron", None),  # type: ignore[arg-type]
            every=options.pop("every", None),  # type: ignore[arg-type]
            timezone=options.pop("timezone", "UTC"),  # type: ignore[arg-type]
        )
        spec = ScheduleSpec(name, agent, calendar, **options)  # type: ignore[arg-type]
        return await self._stores.schedules.create(spec)

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
