"""``orchestrator schedules``: cron and interval schedules that start runs, once per slot."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import click
from rich.table import Table

from orchestrator.cli.consoles import stdout
from orchestrator.cli.presentation import dump_json, grid, section
from orchestrator.cli.support import (
    async_command,
    input_option,
    json_option,
    print_done,
    print_found,
    read_input,
)
from orchestrator.client.selection import parse_time
from orchestrator.client.stores import open_stores
from orchestrator.db.retention import parse_age
from orchestrator.db.schedules import HISTORY, OVERLAPS, Schedule, ScheduleSpec, SlotRecord
from orchestrator.scheduling.calendar import Calendar
from orchestrator.scheduling.plan import CATCH_UP_POLICIES
from orchestrator.settings import Settings

NO_SCHEDULES = "no schedules: `orchestrator schedules create NAME --agent A --cron '0 9 * * *'`"


def parse_duration(text: str, what: str) -> timedelta:
    """``0``, or an age such as ``30s``, ``15m``, ``1h``."""
    if text.strip() in ("0", "0s"):
        return timedelta(0)
    return parse_age(text, what)


@click.group()
def schedules() -> None:
    """Cron and interval schedules: each slot starts one run, whichever serve process fires it."""


@schedules.command("create")
@click.argument("name")
@click.option("--agent", required=True, help="The agent each slot starts a run of.")
@click.option("--cron", help="A cron expression: five fields ('0 9 * * 1-5') or @daily, @hourly.")
@click.option("--every", help="An interval instead of --cron (15m, 1h, 30s), from 1970 in UTC.")
@click.option(
    "--timezone",
    default="UTC",
    show_default=True,
    help="The IANA time zone --cron is read in (Europe/Berlin).",
)
@click.option(
    "--overlap",
    type=click.Choice([o.replace("_", "-") for o in OVERLAPS]),
    default="skip",
    show_default=True,
    help="When a slot comes while the schedule's last run is unfinished.",
)
@click.option(
    "--catch-up",
    type=click.Choice(CATCH_UP_POLICIES),
    default="latest",
    show_default=True,
    help="Slots missed while nothing ran: start none, the latest, or all (up to --catch-up-limit).",
)
@click.option(
    "--catch-up-window",
    default="60s",
    show_default=True,
    help="A slot older than this when a scheduler reaches it was missed.",
)
@click.option("--catch-up-limit", type=int, default=100, show_default=True)
@click.option("--jitter", default="0", show_default=True, help="Start each run up to this late.")
@click.option("--start", help="No slot before this (ISO 8601 with a zone; default now).")
@click.option("--end", help="No slot at or after this (ISO 8601 with a zone).")
@input_option("Each run's input: a JSON object, @file.json, or @- for standard input.")
@click.option("--concurrency-key", help="Each run's concurrency key (docs/flow-control.md).")
@click.option("--priority", type=int, default=0, show_default=True)
@click.option("--max-attempts", type=int, default=5, show_default=True)
@json_option("Print the schedule as JSON.")
@async_command
async def schedules_create(
    settings: Settings,
    name: str,
    agent: str,
    cron: str | None,
    every: str | None,
    timezone: str,
    overlap: str,
    catch_up: str,
    catch_up_window: str,
    catch_up_limit: int,
    jitter: str,
    start: str | None,
    end: str | None,
    input_: str,
    concurrency_key: str | None,
    priority: int,
    max_attempts: int,
    as_json: bool,
) -> None:
    """Create schedule NAME: each slot of --cron (or --every) starts a run of --agent."""
    if (cron is None) == (every is None):
        raise click.UsageError("give --cron or --every (one of them)")
    spec = ScheduleSpec(
        name=name,
        agent=agent,
        calendar=Calendar(
            cron=cron,
            every=None if every is None else parse_age(every, "--every"),
            timezone=timezone,
        ),
        input=read_input(input_),
        overlap=overlap.replace("-", "_"),  # type: ignore[arg-type]
        catch_up=catch_up,  # type: ignore[arg-type]
        catch_up_window=parse_duration(catch_up_window, "--catch-up-window"),
        catch_up_limit=catch_up_limit,
        jitter=parse_duration(jitter, "--jitter"),
        starts_at=None if start is None else parse_time(start, "--start"),
        ends_at=None if end is None else parse_time(end, "--end"),
        concurrency_key=concurrency_key,
        priority=priority,
        max_attempts=max_attempts,
    )
    async with open_stores(settings) as stores:
        made = await stores.schedules.create(spec)
    print_done(made, as_json, f"{made.name}: {made.when}, next slot {_time(made.next_fire_at)}")


@schedules.command("list")
@json_option("Print the schedules as a JSON array.")
@click.option("--agent", "agents", multiple=True, help="Only this agent's schedules (repeatable).")
@async_command
async def schedules_list(settings: Settings, as_json: bool, agents: tuple[str, ...]) -> None:
    """Every schedule: its calendar, next slot, unfinished runs and last fired slot."""
    async with open_stores(settings) as stores:
        every = await stores.schedules.list()
    found = [schedule for schedule in every if not agents or schedule.agent in agents]
    print_found(found, as_json, schedules_table, NO_SCHEDULES)


@schedules.command("show")
@click.argument("name")
@click.option(
    "--slots",
    "newest",
    type=click.IntRange(1, 10_000),
    default=HISTORY,
    show_default=True,
    help="How many of the latest decided slots to list.",
)
@json_option("Print the schedule and its slots as JSON.")
@async_command
async def schedules_show(settings: Settings, name: str, newest: int, as_json: bool) -> None:
    """Schedule NAME and its latest slots: fired (with the run), skipped, buffered, backfilled."""
    async with open_stores(settings) as stores:
        schedule = await stores.schedules.get(name)
        decided = await stores.schedules.slots(name, newest=newest)
    if as_json:
        stdout.print_json(dump_json({"schedule": schedule, "slots": decided}))
        return
    stdout.print(schedules_table([schedule]))
    if schedule.missed:
        missed = schedule.missed
        count = "more than 1000" if missed.get("count") is None else missed["count"]
        stdout.print(
            f"missed (catch-up {schedule.catch_up}): {count} slots from "
            f"{missed['first']} to {missed['last']}",
            markup=False,
        )
    stdout.print(slots_table(decided))


CHANGES = {
    "pause": "Stop firing NAME's slots until it is resumed (its unfinished runs go on).",
    "resume": "Fire NAME again from its next slot (the paused slots are not fired: backfill them).",
    "delete": "Delete NAME and its slot records (the runs it started stay).",
}


def _change_command(change: str) -> None:
    """``schedules pause|resume|delete NAME``: one decision each, the same shape."""

    @schedules.command(change, help=CHANGES[change])
    @click.argument("name")
    @json_option("Print the schedule as JSON (null once deleted).")
    @async_command
    async def command(settings: Settings, name: str, as_json: bool) -> None:
        async with open_stores(settings) as stores:
            changed = await getattr(stores.schedules, change)(name)
        upcoming = "" if changed is None else f", next slot {_time(changed.next_fire_at)}"
        done = {"pause": "paused", "resume": "resumed", "delete": "deleted"}[change]
        print_done(changed, as_json, f"{name}: {done}{upcoming if change == 'resume' else ''}")


for _change in CHANGES:
    _change_command(_change)


@schedules.command("backfill")
@click.argument("name")
@click.argument("start")
@click.argument("end")
@json_option("Print the runs started as JSON.")
@async_command
async def schedules_backfill(
    settings: Settings, name: str, start: str, end: str, as_json: bool
) -> None:
    """Start each of NAME's slots from START to END (ISO 8601; END excluded) that has no run.
    A second backfill of the same window starts nothing."""
    async with open_stores(settings) as stores:
        started = await stores.schedules.backfill(
            name, parse_time(start, "START"), parse_time(end, "END")
        )
    print_done(
        {"started": started},
        as_json,
        f"{name}: {len(started)} slot(s) started" + ("" if started else " (all had runs)"),
    )


def _time(moment: Any) -> str:
    return "-" if moment is None else moment.isoformat(timespec="seconds")


def _schedule_row(s: Schedule) -> tuple[str, ...]:
    state = "paused" if s.paused else ("ended" if s.next_fire_at is None else "active")
    return (
        s.name,
        s.agent,
        s.when,
        s.overlap,
        s.catch_up,
        _time(s.next_fire_at),
        str(s.unfinished),
        _time(s.last_fired),
        state,
    )


def schedules_table(found: Sequence[Schedule]) -> Table:
    columns = (
        "name",
        "agent",
        "when",
        "overlap",
        "catch-up",
        "next slot",
        "unfinished",
        "last fired",
        "state",
    )
    return grid(columns, map(_schedule_row, found))


def _slot_row(s: SlotRecord) -> tuple[str, ...]:
    return (
        _time(s.slot),
        s.outcome,
        s.run_id or "-",
        s.run_state or "-",
        s.decided_by,
        str(s.fence),
    )


def slots_table(found: Sequence[SlotRecord]) -> Table:
    columns = ("slot", "outcome", "run", "run state", "decided by", "fence")
    return section("slots (newest first)", columns, map(_slot_row, found))
