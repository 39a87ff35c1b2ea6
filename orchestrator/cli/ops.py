"""Operator commands: ``runs purge``, ``runs watch``, bulk ``runs cancel|retry``, ``workers
list``, ``queue stats``, ``db status``."""

from __future__ import annotations

import json
import time
from collections import deque
from collections.abc import Awaitable, Callable
from datetime import datetime
from typing import Any, TypeVar

import anyio
import click

from orchestrator.cli.support import parse_time, run_async, settings_of, stderr, stdout
from orchestrator.db.bootstrap import open_store
from orchestrator.db.connections import connect, redact_dsn, resolve_dsn
from orchestrator.db.deadlines import DATABASE_ERRORS
from orchestrator.db.migrations import available_migrations, current_version, latest_version
from orchestrator.db.queries import query
from orchestrator.db.store import RunStore, WorkerRegistry
from orchestrator.errors import InvalidInput, InvalidTransition, OrchestratorError
from orchestrator.models import Run, RunState
from orchestrator.presentation import dump_json, event_line, jsonable, queue_table, workers_table
from orchestrator.retention import (
    AGE_PATTERN,
    PURGE_BATCH,
    PURGE_PAUSE_RATIO,
    Purged,
    parse_age,
    purge,
    purgeable,
)


@click.command("purge")
@click.option(
    "--older-than",
    "older_than",
    required=True,
    help="Delete runs that finished longer ago than this (30d, 12h, 90m, 3600s).",
)
@click.option("--dry-run", is_flag=True, help="Count what would be deleted; delete nothing.")
@click.option(
    "--batch",
    type=click.IntRange(1, 10_000),
    default=PURGE_BATCH,
    show_default=True,
    help="Runs per delete statement (each one short transaction).",
)
@click.option(
    "--pause-ratio",
    type=click.FloatRange(0, 100),
    default=PURGE_PAUSE_RATIO,
    show_default=True,
    help="After each batch, pause this many times as long as it took (0: flat out, which can "
    "slow workers running beside the purge by a third).",
)
@click.option("--json", "as_json", is_flag=True, help="Print what was (or would be) deleted.")
@click.pass_context
def runs_purge(
    ctx: click.Context,
    older_than: str,
    dry_run: bool,
    batch: int,
    pause_ratio: float,
    as_json: bool,
) -> None:
    """Delete finished runs (succeeded, failed, cancelled, dead) older than --older-than, with
    their events, transcripts, effects, signals and budgets. Runs with an effect not yet settled
    are kept. Safe while workers run: batches skip rows others hold."""
    settings = settings_of(ctx)

    async def body() -> None:
        age = parse_age(older_than)
        async with open_store(settings) as store:
            cutoff = await store.database_now() - age
            if dry_run:
                count = await purgeable(store.pool, cutoff)
                result: dict[str, object] = {"dry_run": True, "cutoff": cutoff, "runs": count}
            else:
                shown = [time.monotonic()]

                def show(total: Purged) -> None:  # at most once a second
                    if time.monotonic() - shown[0] >= 1:
                        shown[0] = time.monotonic()
                        stderr.print(f"purged {total.runs:,} runs so far")

                purged = await purge(
                    store.pool, cutoff, batch=batch, pause_ratio=pause_ratio, progress=show
                )
                result = {
                    "dry_run": False,
                    "cutoff": cutoff,
                    "runs": purged.runs,
                    "other_rows": purged.other_rows,
                }
        if as_json:
            stdout.print_json(dump_json(result))
        elif dry_run:
            stdout.print(f"would purge {result['runs']:,} runs finished before {cutoff}")
        else:
            stdout.print(
                f"purged {result['runs']:,} runs finished before {cutoff} "
                f"({result['other_rows']:,} other rows)"
            )

    run_async(body)


# -- workers list / queue stats / db status --------------------------------------------------
@click.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print workers as a JSON array.")
@click.pass_context
def workers_list(ctx: click.Context, as_json: bool) -> None:
    """Registered workers: alive (their database session holds its liveness lock) or dead,
    the runs each holds, and when it last renewed or committed one."""
    settings = settings_of(ctx)

    async def body() -> None:
        async with open_store(settings) as store:
            found = await WorkerRegistry(settings.schema).list_workers(store.pool)
            now = await store.database_now()
        if as_json:
            stdout.print_json(dump_json(found))
        elif found:
            stdout.print(workers_table(found, now))
        else:
            stderr.print("no workers registered")

    run_async(body)


@click.command("stats")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object per agent.")
@click.pass_context
def queue_stats(ctx: click.Context, as_json: bool) -> None:
    """Per agent: runs queued, due now, running, waiting, and the oldest due run's age."""
    settings = settings_of(ctx)

    async def body() -> None:
        async with open_store(settings) as store:
            rows = [dict(row) for row in await store.pool.fetch(query("queue_stats"))]
        if as_json:
            stdout.print_json(dump_json(rows))
        elif rows:
            stdout.print(queue_table(rows))
        else:
            stderr.print("no queued, running or waiting runs")

    run_async(body)


@click.command("status")
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def db_status(ctx: click.Context, as_json: bool) -> None:
    """The database in use, its schema version, and the migrations not yet applied."""
    settings = settings_of(ctx)

    async def body() -> None:
        dsn = resolve_dsn(settings)
        connection = await connect(settings, dsn=dsn, application_name="orchestrator-status")
        try:
            version = await current_version(connection)
            server = await connection.fetchval("SHOW server_version")
        finally:
            await connection.close()
        pending = [m for m in available_migrations() if m.version > version]
        status = {
            "database": redact_dsn(dsn),
            "server_version": server,
            "schema": settings.schema,
            "schema_version": version,
            "known_version": latest_version(),
            "pending": [f"{m.version:04d}_{m.name}" for m in pending],
        }
        if as_json:
            stdout.print_json(dump_json(status))
            return
        stdout.print(f"database {status['database']} (PostgreSQL {server})", markup=False)
        stdout.print(f"schema {settings.schema} at version {version} of {latest_version()}")
        if version > latest_version():
            stdout.print("migrated by a newer release: upgrade orchestrator on this machine")
        for name in status["pending"]:
            stdout.print(f"  pending {name} (orchestrator db migrate)", markup=False)

    run_async(body)


# -- filters, bulk actions, watch -------------------------------------------------------------
F = TypeVar("F", bound=Callable[..., Any])


def filter_options(command: F) -> F:
    """``--state`` (repeatable), ``--agent``, ``--since``, ``--until``, ``--limit``."""
    for option in reversed(
        (
            click.option(
                "--state",
                "states",
                multiple=True,
                type=click.Choice([state.value for state in RunState]),
                help="Only runs in this state (repeatable).",
            ),
            click.option("--agent", help="Only runs of this agent."),
            click.option("--since", help="Submitted at or after: ISO 8601 time or age (2h)."),
            click.option("--until", help="Submitted before: ISO 8601 time or age (2h)."),
            click.option(
                "--limit", type=click.IntRange(1, 10_000), default=1000, show_default=True
            ),
            click.option(
                "--all",
                "every",
                is_flag=True,
                help="With no RUN_ID and no filter: act on every run the command applies to.",
            ),
        )
    ):
        command = option(command)
    return command


def parse_when(raw: str, option: str, now: datetime) -> datetime:
    """An ISO 8601 time with a zone, or an age back from the database's ``now`` (``2h``)."""
    if AGE_PATTERN.fullmatch(raw):
        return now - parse_age(raw, option)
    try:
        datetime.fromisoformat(raw.strip())
    except ValueError:  # neither form: say both
        raise InvalidInput(
            f"{option} takes an age such as 2h, 90m or 7d, or an ISO 8601 time such as "
            f"2026-12-24T09:00:00Z, not {raw!r}"
        ) from None
    return parse_time(raw, option)


def check_target(
    run_id: str | None,
    states: tuple[str, ...],
    agent: str | None,
    since: str | None,
    until: str | None,
    every: bool,
    dry: bool,
) -> None:
    """One run, or filters (or ``--all``), never both and never neither: a bulk action with an
    empty RUN_ID variable must not act on every run."""
    filtered = bool(states or agent or since or until)
    if run_id is None:
        if not (filtered or every):
            raise InvalidInput(
                "give a RUN_ID, or filters (--state, --agent, --since, --until), or --all"
            )
        return
    if filtered or every or dry:
        raise InvalidInput(
            "give a RUN_ID or filters (--state, --agent, --since, --until), not both"
        )


async def select_runs(
    store: RunStore,
    states: tuple[str, ...],
    agent: str | None,
    since: str | None,
    until: str | None,
    limit: int,
) -> list[Run]:
    now = await store.database_now()
    return await store.list_runs(
        state=[RunState(state) for state in states] or None,
        agent=agent,
        limit=limit,
        submitted_after=None if since is None else parse_when(since, "--since", now),
        submitted_before=None if until is None else parse_when(until, "--until", now),
    )


async def bulk(
    store: RunStore,
    states: tuple[str, ...],
    agent: str | None,
    since: str | None,
    until: str | None,
    limit: int,
    *,
    dry_run: bool,
    as_json: bool,
    verb: str,
    act: Callable[[str], Awaitable[Run]],
) -> None:
    """Apply ``act`` to every run the filters select (or, ``dry_run``, only list them). A run
    that moved on meanwhile (finished, already requeued) is reported and skipped."""
    targets = await select_runs(store, states, agent, since, until, limit)
    done: list[str] = []
    skipped: list[dict[str, str]] = []
    failed: str | None = None
    if not dry_run:
        for index, run in enumerate(targets, 1):
            try:
                await act(run.run_id)
                done.append(run.run_id)
            except OrchestratorError as error:  # moved on meanwhile: finished, gone
                skipped.append({"run_id": run.run_id, "reason": str(error)})
            except DATABASE_ERRORS as error:  # stop, but say what was done
                failed = (
                    f"the database failed at run {index:,}: {str(error) or type(error).__name__}"
                )
                break
            if index % 100 == 0:
                stderr.print(f"{verb}: {index:,} of {len(targets):,}")
    more = len(targets) == limit
    if as_json:
        stdout.print_json(
            dump_json(
                {
                    "dry_run": dry_run,
                    "matched": [run.run_id for run in targets],
                    "done": done,
                    "skipped": skipped,
                    "more_may_match": more,
                }
            )
        )
    elif dry_run:
        for run in targets:
            stdout.print(f"would {verb} {run.run_id} ({run.state.value})", markup=False)
        stdout.print(f"{len(targets):,} runs match; nothing changed (--dry-run)")
    else:
        stdout.print(f"{verb}: {len(done):,} done, {len(skipped):,} skipped")
    if more:
        stderr.print(f"--limit {limit:,} reached: more runs may match; run it again")
    if failed is not None:
        raise InvalidTransition(failed)


WATCH_PAGE = 1000
WATCH_LOOKBACK_SECONDS = 30.0
WATCH_ID_MARGIN = 10_000


async def watch(
    store: RunStore, run_id: str, *, give_up_after: float | None, as_json: bool
) -> None:
    """Poll the run's timeline (4 times a second) and print what is new until the run ends."""
    started = time.monotonic()
    # By id: a lower id may commit after a higher one, so each poll reads again from the highest
    # id seen a few seconds earlier (longer than any transaction the runtime lets run), in pages.
    seen: set[int] = set()
    floors: deque[tuple[float, int]] = deque([(started, 0)])
    while True:
        run = await store.get(run_id)
        now = time.monotonic()
        while len(floors) > 1 and floors[1][0] <= now - WATCH_LOOKBACK_SECONDS:
            floors.popleft()
        after = floors[0][1]
        seen = {event_id for event_id in seen if event_id > after}
        while True:
            page = await store.events(run_id, after=after, limit=WATCH_PAGE)
            for event in page:
                if event.event_id in seen:
                    continue
                seen.add(event.event_id)
                if as_json:
                    click.echo(json.dumps(jsonable(event), separators=(",", ":")))
                else:
                    stdout.print(event_line(event), markup=False)
            if len(page) < WATCH_PAGE:
                break
            after = page[-1].event_id
        newest = max(seen, default=floors[-1][1])
        if len(floors) == 1 and floors[0][1] == 0:
            # After the first full read, a late commit can only hold an id just below the
            # newest seen (ids are handed out as its transaction wrote): look back that far.
            floors[0] = (floors[0][0], max(0, newest - WATCH_ID_MARGIN))
        floors.append((now, newest))
        if run.state.terminal:
            if not as_json:
                stdout.print(f"run {run_id} {run.state.value}", markup=False)
            return
        if give_up_after is not None and time.monotonic() - started > give_up_after:
            raise WatchTimedOut(f"run {run_id} is still {run.state.value} after {give_up_after:g}s")
        await anyio.sleep(0.25)


class WatchTimedOut(OrchestratorError):
    """``runs watch --timeout`` passed before the run ended."""
