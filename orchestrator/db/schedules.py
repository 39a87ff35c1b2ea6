"""Schedules: create, list, pause, resume, delete and backfill them (each an audited decision),
and the claim and fenced fire a scheduler makes (docs/schedules.md).

The calendar is worked out here, in Python (croniter and zoneinfo, ``orchestrator.scheduling``);
the database decides, under the schedule's lease and fence, which slots start runs, and keys each
slot's record and run by the schedule and the slot's instant, so a slot starts one run at most.
"""

from __future__ import annotations

import builtins
import os
import re
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, Literal, TypedDict

import asyncpg

from orchestrator.access import Actor
from orchestrator.db.audit import decided
from orchestrator.db.limits import check_concurrency_key, check_priority, whole_number
from orchestrator.db.queries import query
from orchestrator.db.store import MAX_ATTEMPTS_LIMIT, encode_input
from orchestrator.errors import InvalidInput
from orchestrator.ids import new_run_id, validate_agent_name
from orchestrator.models import JSON, JsonFields, Row
from orchestrator.scheduling.calendar import Calendar
from orchestrator.scheduling.calendar import jitter as slot_jitter
from orchestrator.scheduling.plan import (
    CATCH_UP_POLICIES,
    DEFAULT_CATCH_UP_WINDOW,
    CatchUpPolicy,
    Plan,
    slots_between,
)
from orchestrator.settings import DEFAULT_MAX_INPUT_BYTES

if TYPE_CHECKING:
    from orchestrator.db.executor import Executor

Overlap = Literal["skip", "buffer_one", "allow_all", "cancel_running"]
OVERLAPS: tuple[Overlap, ...] = ("skip", "buffer_one", "allow_all", "cancel_running")
MAX_BACKFILL_SLOTS = 10_000
MAX_JITTER = timedelta(days=1)
MAX_CATCH_UP_WINDOW = timedelta(days=366)
MAX_CATCH_UP_LIMIT = 1000
NAME_PATTERN = re.compile(r"[A-Za-z][A-Za-z0-9_.-]{0,99}")
HISTORY = 20
"""Slots ``show`` lists by default."""


def check_schedule_name(name: str) -> str:
    if not isinstance(name, str) or NAME_PATTERN.fullmatch(name) is None:
        raise InvalidInput(
            "a schedule's name starts with a letter and holds letters, digits and _ . - "
            f"(at most 100), not {name!r}"
        )
    return name


def _aware(value: datetime | None, what: str) -> datetime | None:
    if value is not None and (not isinstance(value, datetime) or value.utcoffset() is None):
        raise InvalidInput(f"{what} must be a timezone-aware time (e.g. 2026-12-24T09:00Z)")
    return value


class ScheduleOptions(TypedDict, total=False):
    """A schedule's policies and its runs' options (``ScheduleSpec`` says what each means)."""

    input: JSON
    overlap: Overlap
    catch_up: CatchUpPolicy
    catch_up_window: timedelta
    catch_up_limit: int
    jitter: timedelta
    starts_at: datetime | None
    ends_at: datetime | None
    concurrency_key: str | None
    priority: int
    max_attempts: int


class ScheduleArguments(ScheduleOptions, total=False):
    """A schedule's calendar (``Calendar``'s fields) and its options, as the client takes them."""

    cron: str | None
    every: timedelta | None
    timezone: str


@dataclass(frozen=True)
class ScheduleSpec:
    """What a schedule starts and when: its calendar, its agent and input, and its policies."""

    name: str
    agent: str
    calendar: Calendar
    input: JSON = field(default_factory=dict)
    overlap: Overlap = "skip"
    """When a slot comes while a run the schedule started is unfinished: skip the slot,
    ``buffer_one`` (start it when that run ends; one at most), ``allow_all``, or
    ``cancel_running`` (cancel the unfinished runs, then start)."""
    catch_up: CatchUpPolicy = "latest"
    """Slots missed (older than ``catch_up_window`` when a scheduler reaches them): start
    ``none``, the ``latest`` one, or ``all`` (the newest ``catch_up_limit``)."""
    catch_up_window: timedelta = DEFAULT_CATCH_UP_WINDOW
    catch_up_limit: int = 100
    jitter: timedelta = timedelta(0)
    """Each slot's run starts up to this much later (the same delay for a slot every time)."""
    starts_at: datetime | None = None
    """No slot before this (default: now)."""
    ends_at: datetime | None = None
    """No slot at or after this."""
    concurrency_key: str | None = None
    priority: int = 0
    max_attempts: int = 5

    def check(self, max_input_bytes: int = DEFAULT_MAX_INPUT_BYTES) -> None:
        """One line saying what is wrong, before anything is written."""
        check_schedule_name(self.name)
        validate_agent_name(self.agent)
        if not isinstance(self.calendar, Calendar):
            raise InvalidInput("a schedule's calendar must be a Calendar(cron=...) or (every=...)")
        encode_input(self.input, max_bytes=max_input_bytes)
        if self.overlap not in OVERLAPS:
            raise InvalidInput(
                f"an overlap policy is one of {', '.join(OVERLAPS)}, not {self.overlap!r}"
            )
        if self.catch_up not in CATCH_UP_POLICIES:
            raise InvalidInput(
                f"a catch-up policy is one of {', '.join(CATCH_UP_POLICIES)}, not {self.catch_up!r}"
            )
        _duration(self.catch_up_window, "a catch-up window", MAX_CATCH_UP_WINDOW)
        whole_number(self.catch_up_limit, "a catch-up limit", 1, MAX_CATCH_UP_LIMIT)
        _duration(self.jitter, "a jitter", MAX_JITTER)
        _aware(self.starts_at, "a schedule's start")
        _aware(self.ends_at, "a schedule's end")
        if self.starts_at and self.ends_at and self.ends_at <= self.starts_at:
            raise InvalidInput(
                f"a schedule's end ({self.ends_at.isoformat()}) must come after its start "
                f"({self.starts_at.isoformat()})"
            )
        check_concurrency_key(self.concurrency_key)
        check_priority(self.priority)
        whole_number(self.max_attempts, "max attempts", 1, MAX_ATTEMPTS_LIMIT)


def _duration(value: timedelta, what: str, most: timedelta) -> None:
    if not isinstance(value, timedelta) or not timedelta(0) <= value <= most:
        raise InvalidInput(f"{what} must be from 0 to {most.days} days, not {value!r}")
    if value.microseconds:
        raise InvalidInput(f"{what} is a whole number of seconds, not {value!r}")


@dataclass(frozen=True)
class Schedule(JsonFields):
    """A schedule as stored, with its unfinished runs and the last slot that started one."""

    schedule_id: str
    name: str
    agent: str
    cron: str | None
    every_seconds: int | None
    timezone: str
    overlap: Overlap
    catch_up: CatchUpPolicy
    catch_up_seconds: int
    catch_up_limit: int
    jitter_seconds: int
    starts_at: datetime
    ends_at: datetime | None
    input: JSON
    concurrency_key: str | None
    priority: int
    max_attempts: int
    paused: bool
    next_fire_at: datetime | None
    """The next slot to decide (``None``: the schedule has ended)."""
    buffered_slot: datetime | None
    missed: dict[str, Any] | None
    """The last slots the catch-up policy skipped: first, last, count."""
    fence: int
    lease_owner: str | None
    created_by: str
    created_at: datetime
    unfinished: int
    last_fired: datetime | None

    @classmethod
    def from_record(cls, record: Row) -> Schedule:
        names = cls.__dataclass_fields__
        return cls(**{name: record[name] for name in names})

    @property
    def calendar(self) -> Calendar:
        if self.cron is not None:
            return Calendar(cron=self.cron, timezone=self.timezone)
        return Calendar(every=timedelta(seconds=self.every_seconds or 0), timezone=self.timezone)

    @property
    def when(self) -> str:
        return self.calendar.describe()


@dataclass(frozen=True)
class SlotRecord(JsonFields):
    """One decided slot: fired, skipped, buffered or backfilled, with its run."""

    slot: datetime
    outcome: str
    run_id: str | None
    run_state: str | None
    fence: int
    decided_by: str
    decided_at: datetime


@dataclass(frozen=True)
class Fired:
    slot: datetime
    outcome: str
    run_id: str | None


class ScheduleStore:
    """Schedules for operators (each change audited) and for the schedulers in ``serve``."""

    def __init__(self, db: Executor, *, max_input_bytes: int = DEFAULT_MAX_INPUT_BYTES) -> None:
        self.db = db
        self.max_input_bytes = max_input_bytes

    # -- operators ------------------------------------------------------------------------------
    async def create(self, spec: ScheduleSpec, *, actor: Actor | None = None) -> Schedule:
        spec.check(self.max_input_bytes)
        if await self.db.fetchrow(query("list_schedules"), spec.name) is not None:
            raise InvalidInput(
                f"a schedule named {spec.name!r} exists: delete it first or pick another name"
            )
        now = await self._now()
        start = spec.starts_at or now
        first = spec.calendar.first_at_or_after(max(start, now))
        if first is None:
            raise InvalidInput(f"{spec.calendar.describe()} never fires: no date matches it")
        if spec.ends_at is not None and first >= spec.ends_at:
            raise InvalidInput(
                f"{spec.calendar.describe()} has no slot before the schedule's end "
                f"({spec.ends_at.isoformat()})"
            )
        try:
            await self._create(spec, start, first, actor)
        except asyncpg.InvalidParameterValueError as error:  # a create of the name won a race
            raise InvalidInput(str(error)) from None
        return await self.get(spec.name)

    async def _create(
        self, spec: ScheduleSpec, start: datetime, first: datetime, actor: Actor | None
    ) -> None:
        calendar = spec.calendar
        await decided(
            self.db,
            "schedule_create",
            actor,
            "create_schedule",
            "sch_" + os.urandom(10).hex(),
            spec.name,
            spec.agent,
            calendar.cron,
            None if calendar.every is None else int(calendar.every.total_seconds()),
            calendar.timezone,
            spec.overlap,
            spec.catch_up,
            int(spec.catch_up_window.total_seconds()),
            spec.catch_up_limit,
            int(spec.jitter.total_seconds()),
            start,
            spec.ends_at,
            spec.input,
            spec.concurrency_key,
            spec.priority,
            spec.max_attempts,
            first,
        )

    async def list(self) -> builtins.list[Schedule]:
        return [Schedule.from_record(r) for r in await self.db.fetch(query("list_schedules"), None)]

    async def get(self, name: str) -> Schedule:
        check_schedule_name(name)
        row = await self.db.fetchrow(query("list_schedules"), name)
        if row is None:
            raise InvalidInput(
                f"no schedule named {name!r}: `orchestrator schedules list` shows the schedules"
            )
        return Schedule.from_record(row)

    async def slots(self, name: str, *, newest: int = HISTORY) -> builtins.list[SlotRecord]:
        schedule = await self.get(name)
        newest = whole_number(newest, "the number of slots", 1, 10_000)
        rows = await self.db.fetch(query("schedule_slots"), schedule.schedule_id, newest)
        return [SlotRecord(**dict(r)) for r in rows]

    async def pause(self, name: str, *, actor: Actor | None = None) -> Schedule:
        await self._change(name, "pause", None, actor)
        return await self.get(name)

    async def resume(self, name: str, *, actor: Actor | None = None) -> Schedule:
        """Fire again from the next slot; the slots of the pause are not fired (backfill them)."""
        schedule = await self.get(name)
        if not schedule.paused:
            raise InvalidInput(f"schedule {name!r} is not paused")
        now = await self._now()
        upcoming = schedule.calendar.first_at_or_after(max(now, schedule.starts_at))
        if upcoming is not None and schedule.ends_at is not None and upcoming >= schedule.ends_at:
            upcoming = None
        await self._change(name, "resume", upcoming, actor)
        return await self.get(name)

    async def delete(self, name: str, *, actor: Actor | None = None) -> None:
        """Remove the schedule and its slot records; the runs it started are kept."""
        await self._change(name, "delete", None, actor)

    async def backfill(
        self, name: str, start: datetime, end: datetime, *, actor: Actor | None = None
    ) -> builtins.list[str]:
        """Start each slot from ``start`` to ``end`` (excluded) that has no run yet; returns
        the runs started. Twice over one window starts nothing the second time."""
        _aware(start, "a backfill's start")
        _aware(end, "a backfill's end")
        if end <= start:
            raise InvalidInput(
                f"a backfill's end ({end.isoformat()}) must come after its start "
                f"({start.isoformat()})"
            )
        schedule = await self.get(name)
        now = await self._now()
        if end > now:
            raise InvalidInput(
                f"a backfill covers the past: its end ({end.isoformat()}) is after the "
                f"database's now ({now.isoformat()}); slots to come fire by themselves"
            )
        try:
            slots = slots_between(schedule.calendar, start, end, MAX_BACKFILL_SLOTS)
        except ValueError:
            raise InvalidInput(
                f"{start.isoformat()} to {end.isoformat()} holds more than "
                f"{MAX_BACKFILL_SLOTS:,} slots of {schedule.when}: backfill it in parts"
            ) from None
        row = await decided(
            self.db,
            "schedule_backfill",
            actor,
            "backfill_schedule",
            name,
            slots,
            [new_run_id() for _ in slots],
        )
        if row is None:
            raise InvalidInput(f"no schedule named {name!r} (deleted meanwhile)")
        return list(row["started_runs"])

    async def _change(
        self, name: str, change: str, upcoming: datetime | None, actor: Actor | None
    ) -> None:
        check_schedule_name(name)
        row = await decided(
            self.db, f"schedule_{change}", actor, "change_schedule", name, change, upcoming
        )
        if row is None:
            await self.get(name)  # says there is no such schedule
            raise InvalidInput(f"schedule {name!r} is not paused")

    async def _now(self) -> datetime:
        now: datetime = await self.db.fetchval(query("database_now"))
        return now

    # -- schedulers -----------------------------------------------------------------------------
    async def claim(
        self, worker_id: str, lease_seconds: float, limit: int
    ) -> builtins.list[tuple[Schedule, datetime]]:
        """Due schedules, leased to ``worker_id`` under a raised fence, with the database's now."""
        rows = await self.db.fetch(query("claim_schedules"), worker_id, lease_seconds, limit)
        return [
            (Schedule.from_record({**dict(r), "unfinished": 0, "last_fired": None}), r["now"])
            for r in rows
        ]

    async def fire(
        self, schedule: Schedule, worker_id: str, plan: Plan
    ) -> builtins.list[Fired] | None:
        """Decide ``plan``'s slots under the lease ``claim`` took; ``None`` when that lease is
        gone (a newer claim decides, and nothing was changed)."""
        jitter = timedelta(seconds=schedule.jitter_seconds)
        starts = [slot + slot_jitter(schedule.schedule_id, slot, jitter) for slot in plan.fire]
        rows = await self.db.fetch(
            query("fire_schedule"),
            schedule.schedule_id,
            worker_id,
            schedule.fence,
            plan.fire,
            starts,
            [new_run_id() for _ in range(len(plan.fire) + 1)],
            plan.next,
            None if plan.missed is None else plan.missed.as_json(),
        )
        if rows and rows[0]["decision"] == "not_held":
            return None
        return [Fired(r["decided_slot"], r["decision"], r["started_run"]) for r in rows]

    async def seconds_to_next(self) -> float | None:
        seconds = await self.db.fetchval(query("next_schedule_due"))
        return None if seconds is None else float(seconds)
