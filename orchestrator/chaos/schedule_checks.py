"""The checker's rules for schedules (docs/schedules.md). Each slot of a schedule is decided once,
under the fence of the lease its scheduler holds, and a slot that starts a run is recorded with
that run in one transaction; so after a campaign:

- one run per slot: no two runs carry one (schedule, slot);
- every slot record that says fired or backfilled names a run of that schedule and slot, and
  every run a schedule started is the run its slot's record names;
- no slot is lost silently: every slot of the calendar from a schedule's first to its cursor has
  a record, unless the schedule's ``missed`` says its catch-up policy skipped it (with ``all``,
  the slot lies in the range ``missed`` names; with ``none`` or ``latest``, which only keep the
  latest summary, ``missed`` says something was skipped); and no slot is left buffered once
  every run has ended;
- fences: no record carries a fence above the schedule's, and a record decided later never
  carries a lower fence than one decided before it (the fire checks its lease and fence under
  the schedule's row lock, so decisions serialize in fence order: a lower fence after a higher
  one is a stale lease holder whose fire was not refused);
- no slot is decided, and no run of a slot claimed, before the slot's instant.

The calendar comes from the schedule's own row (``orchestrator.scheduling``), the records from
``schedule_slots``, the runs from ``runs`` and their timelines, never from the schedulers' logs;
the logs only give the report a count of the fires that were refused.
"""

from __future__ import annotations

import collections
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path

import asyncpg

from orchestrator.chaos.findings import (
    CLOCK_TOLERANCE_SECONDS,
    TERMINAL,
    Findings,
    Row,
    repeated,
)
from orchestrator.errors import InvalidInput
from orchestrator.scheduling.calendar import Calendar
from orchestrator.scheduling.plan import slots_between

SLOT_STARTED_TWICE = "slot started twice"
SLOT_RECORD_WITHOUT_ITS_RUN = "slot record without its run"
RUN_WITHOUT_ITS_SLOT_RECORD = "scheduled run without its slot record"
SLOT_LOST = "slot lost silently"
BUFFERED_SLOT_NEVER_STARTED = "buffered slot never started"
SLOT_BY_A_STALE_FENCE = "slot decided by a stale fence"
SLOT_BEFORE_ITS_TIME = "slot decided before its time"
RULES = (
    SLOT_STARTED_TWICE,
    SLOT_RECORD_WITHOUT_ITS_RUN,
    RUN_WITHOUT_ITS_SLOT_RECORD,
    SLOT_LOST,
    BUFFERED_SLOT_NEVER_STARTED,
    SLOT_BY_A_STALE_FENCE,
    SLOT_BEFORE_ITS_TIME,
)
WITH_A_RUN = ("fired", "backfilled")
MOST_SLOTS = 100_000
"""Slots of one schedule the lost-slot rule walks (a campaign's are far fewer)."""
REFUSED_FIRE = "schedule lease lost before its fire"
"""What a scheduler logs when the database refused its fire (``worker/scheduler.py``)."""


@dataclass(frozen=True)
class ScheduleRecords:
    """What the database holds of the schedules: their rows, every slot record, and the
    schedules an operator ever paused (the audit log), whose paused slots are never decided."""

    schedules: Sequence[Row] = ()
    slots: Sequence[Row] = ()
    paused: frozenset[str] = field(default_factory=frozenset)


async def read_schedule_records(pool: asyncpg.Pool) -> ScheduleRecords:
    paused = await pool.fetch(
        "SELECT DISTINCT detail->>'schedule_id' AS schedule_id FROM orchestrator.audit_log "
        "WHERE action = 'schedule_pause'"
    )
    return ScheduleRecords(
        schedules=await pool.fetch("SELECT * FROM orchestrator.schedules ORDER BY name"),
        slots=await pool.fetch(
            "SELECT * FROM orchestrator.schedule_slots ORDER BY schedule_id, slot"
        ),
        paused=frozenset(row["schedule_id"] for row in paused),
    )


def check_schedules(
    found: Findings,
    runs: Mapping[str, Row],
    events: Mapping[str, Sequence[Row]],
    records: ScheduleRecords,
) -> None:
    """``runs`` by id; ``events``: each run's timeline in order."""
    schedules = {row["schedule_id"]: row for row in records.schedules}
    scheduled = [run for run in runs.values() if run["schedule_id"] is not None]
    slots = {(row["schedule_id"], row["slot"]): row for row in records.slots}
    found.schedules = len(schedules)
    found.scheduled_runs = len(scheduled)
    found.scheduled_runs_by_state = dict(collections.Counter(run["state"] for run in scheduled))
    found.slots_by_outcome = dict(collections.Counter(row["outcome"] for row in records.slots))
    found.schedule_claims = sum(row["fence"] for row in records.schedules)
    _one_run_per_slot(found, scheduled, schedules)
    _records_and_runs(found, runs, scheduled, slots, schedules)
    for schedule_id, schedule in sorted(schedules.items()):
        mine = [row for row in records.slots if row["schedule_id"] == schedule_id]
        if schedule_id not in records.paused:
            _no_slot_lost(found, schedule, {row["slot"] for row in mine})
        _fences(found, schedule, mine)
        _buffered_left(found, schedule, mine, scheduled)
        _not_before_time(found, schedule, mine)
    _runs_not_before_their_slots(found, scheduled, events, schedules)


def _subject(schedules: Mapping[str, Row], schedule_id: str, slot: datetime | None = None) -> str:
    schedule = schedules.get(schedule_id)
    name = schedule["name"] if schedule is not None else schedule_id
    return name if slot is None else f"{name}@{slot.isoformat()}"


def _one_run_per_slot(
    found: Findings, scheduled: Sequence[Row], schedules: Mapping[str, Row]
) -> None:
    for (schedule_id, slot), started in repeated(
        scheduled, lambda run: (run["schedule_id"], run["schedule_slot"])
    ):
        found.add(
            SLOT_STARTED_TWICE,
            _subject(schedules, schedule_id, slot),
            f"{len(started)} runs: {', '.join(started)}",
        )


def _records_and_runs(
    found: Findings,
    runs: Mapping[str, Row],
    scheduled: Sequence[Row],
    slots: Mapping[tuple[str, datetime], Row],
    schedules: Mapping[str, Row],
) -> None:
    for (schedule_id, slot), record in sorted(slots.items()):
        subject = _subject(schedules, schedule_id, slot)
        run_id = record["run_id"]
        if record["outcome"] not in WITH_A_RUN:
            if run_id is not None:
                found.add(
                    SLOT_RECORD_WITHOUT_ITS_RUN, subject, f"{record['outcome']}, run {run_id}"
                )
            continue
        run = runs.get(run_id) if run_id is not None else None
        if run is None:
            found.add(
                SLOT_RECORD_WITHOUT_ITS_RUN,
                subject,
                f"{record['outcome']} by {record['decided_by']} under fence {record['fence']}, "
                f"naming run {run_id}, which does not exist",
            )
        elif (run["schedule_id"], run["schedule_slot"]) != (schedule_id, slot):
            found.add(
                SLOT_RECORD_WITHOUT_ITS_RUN,
                subject,
                f"names run {run_id}, which is of "
                f"{_subject(schedules, run['schedule_id'] or '-', run['schedule_slot'])}",
            )
    for run in scheduled:
        if run["schedule_id"] not in schedules:
            continue  # its schedule was deleted, and its slot records with it
        its = slots.get((run["schedule_id"], run["schedule_slot"]))
        if its is None or its["run_id"] != run["run_id"]:
            found.add(
                RUN_WITHOUT_ITS_SLOT_RECORD,
                run["run_id"],
                f"of {_subject(schedules, run['schedule_id'], run['schedule_slot'])}: "
                + (
                    "no record of its slot"
                    if its is None
                    else f"its slot's record says {its['outcome']}, run {its['run_id']}"
                ),
            )


def calendar_of(schedule: Row) -> Calendar:
    every = schedule["every_seconds"]
    return Calendar(
        cron=schedule["cron"],
        every=None if every is None else timedelta(seconds=every),
        timezone=schedule["timezone"],
    )


def expected_slots(schedule: Row) -> list[datetime] | None:
    """The slots from the schedule's first to its cursor (the first slot no fire has decided;
    its end, or past its last record, once it has ended); ``None`` when there are too many to
    walk or the calendar cannot be read."""
    first = max(schedule["starts_at"], schedule["created_at"])
    cursor = schedule["next_fire_at"] or schedule["ends_at"]
    if cursor is None:
        return None
    try:
        return slots_between(calendar_of(schedule), first, cursor, MOST_SLOTS)
    except (ValueError, InvalidInput):
        return None


def _no_slot_lost(found: Findings, schedule: Row, decided: set[datetime]) -> None:
    expected = expected_slots(schedule)
    if expected is None:
        return
    missing = [slot for slot in expected if slot not in decided]
    missed = schedule["missed"]
    summary = json.loads(missed) if isinstance(missed, str) else missed
    if schedule["catch_up"] == "all":
        silent = [slot for slot in missing if not _covers(summary, slot)]
    else:  # only the latest summary is kept: that there is one is all it can say
        silent = missing if summary is None else []
    found.slots_missed += len(missing) - len(silent)
    if silent:
        found.add(
            SLOT_LOST,
            schedule["name"],
            f"{len(silent)} of its {len(expected)} slots up to its cursor have no record "
            f"(the first {silent[0].isoformat()}, the last {silent[-1].isoformat()}); "
            f"catch-up {schedule['catch_up']}, missed {summary}",
        )


def _covers(summary: object, slot: datetime) -> bool:
    """Whether a ``missed`` summary (first, last, count) names ``slot`` as skipped."""
    if not isinstance(summary, dict):
        return False
    first, last = summary.get("first"), summary.get("last")
    if not isinstance(first, str) or not isinstance(last, str):
        return False
    return datetime.fromisoformat(first) <= slot <= datetime.fromisoformat(last)


def _fences(found: Findings, schedule: Row, records: Sequence[Row]) -> None:
    above = [row for row in records if row["fence"] > schedule["fence"]]
    for row in above:
        found.add(
            SLOT_BY_A_STALE_FENCE,
            f"{schedule['name']}@{row['slot'].isoformat()}",
            f"decided under fence {row['fence']}, above the schedule's {schedule['fence']}: "
            "a fence no claim granted",
        )
    highest: Row | None = None
    stale = []
    for row in sorted(records, key=lambda row: (row["decided_at"], row["slot"])):
        if highest is not None and row["fence"] < highest["fence"]:
            stale.append(
                f"{row['slot'].isoformat()} {row['outcome']} by {row['decided_by']} under fence "
                f"{row['fence']} at {row['decided_at'].isoformat()}, after "
                f"{highest['slot'].isoformat()} was decided by {highest['decided_by']} under "
                f"fence {highest['fence']} at {highest['decided_at'].isoformat()}"
            )
        if highest is None or row["fence"] > highest["fence"]:
            highest = row
    if stale:  # once per schedule: the first, and how many more
        more = f" (and {len(stale) - 1} more)" if len(stale) > 1 else ""
        found.add(SLOT_BY_A_STALE_FENCE, schedule["name"], stale[0] + more)


def _buffered_left(
    found: Findings, schedule: Row, records: Sequence[Row], scheduled: Iterable[Row]
) -> None:
    """Once every run of the schedule has ended, a buffered slot should have started."""
    if any(
        run["schedule_id"] == schedule["schedule_id"] and run["state"] not in TERMINAL
        for run in scheduled
    ):
        return
    for row in records:
        if row["outcome"] == "buffered":
            held = schedule["buffered_slot"] == row["slot"]
            found.add(
                BUFFERED_SLOT_NEVER_STARTED,
                f"{schedule['name']}@{row['slot'].isoformat()}",
                f"buffered by {row['decided_by']} at {row['decided_at'].isoformat()}; every run "
                "of the schedule has ended and the schedule "
                + ("still holds it" if held else "no longer holds it"),
            )


def _not_before_time(found: Findings, schedule: Row, records: Sequence[Row]) -> None:
    tolerance = timedelta(seconds=CLOCK_TOLERANCE_SECONDS)
    for row in records:
        if row["outcome"] != "backfilled" and row["decided_at"] + tolerance < row["slot"]:
            found.add(
                SLOT_BEFORE_ITS_TIME,
                f"{schedule['name']}@{row['slot'].isoformat()}",
                f"{row['outcome']} by {row['decided_by']} at {row['decided_at'].isoformat()}",
            )


def _runs_not_before_their_slots(
    found: Findings,
    scheduled: Sequence[Row],
    events: Mapping[str, Sequence[Row]],
    schedules: Mapping[str, Row],
) -> None:
    tolerance = timedelta(seconds=CLOCK_TOLERANCE_SECONDS)
    for run in scheduled:
        claims = [e for e in events.get(run["run_id"], ()) if e["kind"] == "claimed"]
        if claims and claims[0]["at"] + tolerance < run["schedule_slot"]:
            found.add(
                SLOT_BEFORE_ITS_TIME,
                run["run_id"],
                f"of {_subject(schedules, run['schedule_id'], run['schedule_slot'])}: claimed at "
                f"{claims[0]['at'].isoformat()}",
            )


def refused_fires(log_dir: Path) -> int:
    """The fires the database refused (a stale lease holder's), as the schedulers logged them:
    a count for the report, never evidence for a rule."""
    refused = 0
    for path in sorted(log_dir.glob("*.log")):
        for line in path.read_text(errors="replace").splitlines():
            if REFUSED_FIRE in line:
                try:
                    refused += json.loads(line).get("event") == REFUSED_FIRE
                except (json.JSONDecodeError, AttributeError):
                    continue
    return refused
