"""``orchestrator runs``: list, show, page, cancel, retry and watch runs; the group gathers
``signal``, ``budget`` and ``purge`` from their own modules."""

from __future__ import annotations

import dataclasses

import click

from orchestrator.cli.consoles import stderr, stdout
from orchestrator.cli.group import LazyCommands
from orchestrator.cli.run_filters import check_target, filter_options
from orchestrator.cli.support import (
    after_option,
    async_command,
    json_option,
    limit_option,
    print_found,
)
from orchestrator.client.detail import DEFAULT_EVENTS, MAX_EVENTS
from orchestrator.client.selection import RunSelection
from orchestrator.errors import InvalidInput
from orchestrator.models import Run, RunState
from orchestrator.settings import Settings

# Each command imports the stores and the tables when it runs: `runs list --help` needs neither.


@click.group(
    cls=LazyCommands,
    lazy={
        "budget": "orchestrator.cli.waits:runs_budget",
        "purge": "orchestrator.cli.purge:runs_purge",
        "signal": "orchestrator.cli.waits:runs_signal",
    },
    summaries={
        "budget": "Show RUN_ID's budget (spent / reserved / limit); with --add-..., top it up "
        "and wake the run if it waits for budget.",
        "purge": "Delete finished runs (succeeded, failed, cancelled, dead) older than "
        "--older-than, with their events, transcripts, effects, signals and budgets.",
        "signal": "Send RUN_ID the signal NAME; its next step reads it, and its commit consumes "
        "it.",
    },
)
def runs() -> None:
    """List, inspect, cancel, retry and signal runs; show and top up their budgets."""


@runs.command("list")
@click.option(
    "--state",
    "states",
    multiple=True,
    type=click.Choice([state.value for state in RunState]),
    help="Only runs in this state (repeatable).",
)
@click.option("--agent", help="Only runs of this agent.")
@click.option("--since", help="Submitted at or after: an ISO 8601 time, or an age (2h, 7d).")
@click.option("--until", help="Submitted before: an ISO 8601 time, or an age (2h, 7d).")
@click.option("--parent", metavar="RUN_ID", help="Only the child runs of RUN_ID.")
@limit_option()
@json_option("Print runs as a JSON array.")
@async_command
async def runs_list(
    settings: Settings,
    states: tuple[str, ...],
    agent: str | None,
    since: str | None,
    until: str | None,
    parent: str | None,
    limit: int,
    as_json: bool,
) -> None:
    """List runs, newest first."""
    from orchestrator.cli.presentation import runs_table
    from orchestrator.client.selection import select_runs
    from orchestrator.client.stores import open_stores

    async with open_stores(settings) as stores:
        selection = RunSelection(states, agent, since, until, parent)
        found = await select_runs(stores.runs, selection, limit)
        now = await stores.runs.database_now()
    print_found(found, as_json, lambda rows: runs_table(rows, now), "no runs match")


@runs.command("show")
@click.argument("run_id")
@json_option("Print the run, its timeline and transcript as JSON.")
@click.option(
    "--events",
    "events_shown",
    type=click.IntRange(1, MAX_EVENTS),
    default=DEFAULT_EVENTS,
    show_default=True,
    help="Show the newest N timeline events (`runs events` pages through all of them).",
)
@async_command
async def runs_show(settings: Settings, run_id: str, as_json: bool, events_shown: int) -> None:
    """Show a run: state, fence, owner, lease expiry, checkpoint, attempts, the newest timeline
    events and the conversation."""
    from orchestrator.cli.presentation import (
        budget_table,
        conversation_table,
        dump_json,
        jsonable,
        print_run,
        signals_table,
    )
    from orchestrator.client.detail import load_run_detail, more_events_hint
    from orchestrator.client.stores import open_stores

    async with open_stores(settings) as stores:
        detail = await load_run_detail(stores, run_id, events=events_shown)
    if as_json:
        click.echo(  # up to 10,000 events: no highlighting pass
            dump_json(
                {
                    "run": detail.run,
                    "events": detail.events,
                    "events_total": detail.events_total,
                    "events_more": more_events_hint(detail),
                    "claims": detail.claims,
                    "attempts": [attempt.as_json() for attempt in detail.attempts],
                    "messages": detail.messages,
                    "effects": detail.effects,
                    "signals": [
                        {**jsonable(signal), "consumed_at": at, "consumed_fence": fence}
                        for signal, at, fence in detail.signals
                    ],
                    "budget": None if detail.budget is None else detail.budget.as_json(),
                    "database_now": detail.now,
                }
            )
        )
        return
    print_run(stdout, detail)
    hint = more_events_hint(detail)
    if hint is not None:
        stderr.print(hint, markup=False)
    if detail.budget is not None:
        stdout.print(budget_table(detail.budget))
    if detail.signals:
        stdout.print(signals_table(detail.signals))
    if detail.messages:
        stdout.print(conversation_table(detail.messages, detail.effects))


@runs.command("events")
@click.argument("run_id")
@after_option("Start after this event id (the last one of the previous page).")
@click.option(
    "--limit",
    type=click.IntRange(1, MAX_EVENTS),
    default=1000,
    show_default=True,
    help="At most this many events.",
)
@json_option("Print the page as a JSON array.")
@async_command
async def runs_events(
    settings: Settings, run_id: str, after: int, limit: int, as_json: bool
) -> None:
    """Page through a run's timeline, oldest first: a page of --limit events after --after.
    The last line on stderr says how to ask for the next page."""
    from orchestrator.cli.presentation import dump_json, event_line
    from orchestrator.client.stores import open_stores

    async with open_stores(settings) as stores:
        events = await stores.events_of(run_id, after=after, limit=limit)
    if as_json:
        click.echo(dump_json(events))  # a page can be megabytes: no highlighting pass
    else:
        for event in events:
            click.echo(event_line(event))  # one line each, whatever the terminal's width
    if len(events) == limit:
        stderr.print(
            f"next page: orchestrator runs events {run_id} --after {events[-1].event_id}"
            f" --limit {limit}",
            markup=False,
        )


@runs.command("fork")
@click.argument("run_id")
@click.option("--version", type=click.IntRange(0), help="From this kept checkpoint (0: the start).")
@click.option("--step", "step_name", help="From the latest checkpoint from which STEP ran next.")
@json_option("Print the fork as JSON.")
@async_command
async def runs_fork(
    settings: Settings, run_id: str, version: int | None, step_name: str | None, as_json: bool
) -> None:
    """Start a new run from a kept checkpoint of RUN_ID (its agent keeps them with
    Agent(keep_checkpoints=True)); the effects RUN_ID had confirmed before that point are
    carried into the fork as receipts, never sent again (docs/child-runs.md). Refused while an
    effect before that point is not settled. Audited; needs the operate permission."""
    from orchestrator.cli.presentation import dump_json
    from orchestrator.client.stores import open_stores

    async with open_stores(settings) as stores:
        done = await stores.forks.fork(run_id, version=version, step=step_name)
    if as_json:
        click.echo(dump_json(done))
        return
    click.echo(
        f"forked {done.forked_from} at checkpoint version {done.version} into {done.run_id}; "
        f"{done.receipts} confirmed effect{'' if done.receipts == 1 else 's'} carried as receipts"
    )


@runs.command("cancel")
@click.argument("run_id", required=False)
@filter_options
@click.option("--reason", help="Recorded in the run's timeline.")
@click.option("--dry-run", is_flag=True, help="With filters: list the runs, cancel nothing.")
@json_option()
@async_command
async def runs_cancel(
    settings: Settings,
    run_id: str | None,
    selection: RunSelection,
    limit: int,
    every: bool,
    reason: str | None,
    dry_run: bool,
    as_json: bool,
) -> None:
    """Cancel a run (or, with filters instead of RUN_ID, every matching unfinished run) and raise
    its fence, so its current owner can no longer act."""
    from orchestrator.cli.run_filters import bulk
    from orchestrator.client.stores import open_stores

    check_target(run_id, selection, every, dry_run)
    async with open_stores(settings) as stores:
        store = stores.runs
        if run_id is not None:
            run = await store.cancel(run_id, reason=reason)
            print_acted_on(run, as_json, f"cancelled {run.run_id} (fence now {run.fence})")
            return
        wanted = selection.states or ("queued", "running", "waiting")
        unfinished = tuple(state for state in wanted if not RunState(state).terminal)
        if not unfinished:
            raise InvalidInput("only queued, running or waiting runs can be cancelled")
        await bulk(
            store,
            dataclasses.replace(selection, states=unfinished),
            limit,
            dry_run=dry_run,
            as_json=as_json,
            verb="cancel",
            act=lambda target: store.cancel(target, reason=reason),
        )


@runs.command("retry")
@click.argument("run_id", required=False)
@filter_options
@click.option("--dry-run", is_flag=True, help="With filters: list the runs, requeue nothing.")
@json_option()
@async_command
async def runs_retry(
    settings: Settings,
    run_id: str | None,
    selection: RunSelection,
    limit: int,
    every: bool,
    dry_run: bool,
    as_json: bool,
) -> None:
    """Requeue a dead-lettered run (or, with filters instead of RUN_ID, every matching dead run)
    with a fresh set of attempts."""
    from orchestrator.cli.run_filters import bulk
    from orchestrator.client.stores import open_stores

    check_target(run_id, selection, every, dry_run)
    async with open_stores(settings) as stores:
        store = stores.runs
        if run_id is not None:
            run = await store.retry(run_id)
            print_acted_on(run, as_json, f"requeued {run.run_id}")
            return
        if selection.states and set(selection.states) != {"dead"}:
            raise InvalidInput("only dead runs can be retried: drop --state or use dead")
        await bulk(
            store,
            dataclasses.replace(selection, states=("dead",)),
            limit,
            dry_run=dry_run,
            as_json=as_json,
            verb="requeue",
            act=store.retry,
        )


@runs.command("watch")
@click.argument("run_id")
@click.option(
    "--timeout",
    "give_up_after",
    type=click.FloatRange(0.1),
    help="Give up after this many seconds.",
)
@click.option(
    "--output",
    "live_output",
    is_flag=True,
    help="Follow the run's live output (model tokens, progress, retractions) instead of its "
    "timeline (docs/streaming.md).",
)
@after_option("With --output: start after this position (the last one seen, to resume).")
@json_option("One JSON object per event (JSON lines).")
@async_command
async def runs_watch(
    settings: Settings,
    run_id: str,
    give_up_after: float | None,
    live_output: bool,
    after: int,
    as_json: bool,
) -> None:
    """Print a run's timeline (or with --output its live output) as it happens; end when the
    run ends (exit 0), or at --timeout (exit 1)."""
    from orchestrator.cli.run_watch import watch, watch_output
    from orchestrator.client.stores import open_stores
    from orchestrator.client.streaming import OutputFollower

    if after and not live_output:
        raise InvalidInput("--after is a position in the live output: give --output too")
    async with open_stores(settings) as stores:
        if not live_output:
            await watch(stores.runs, run_id, give_up_after=give_up_after, as_json=as_json)
            return
        follower = OutputFollower(stores.runs, stores.outputs)
        try:
            await watch_output(
                follower, run_id, after=after, give_up_after=give_up_after, as_json=as_json
            )
        finally:
            await follower.close()


def print_acted_on(run: Run, as_json: bool, done: str) -> None:
    """What a single-run action left: the run as JSON, or one line saying what was done."""
    from orchestrator.cli.presentation import dump_json

    if as_json:
        stdout.print_json(dump_json(run))
    else:
        stdout.print(done, markup=False)
