"""The ``orchestrator`` command line.

Exit codes: 0 ok, 1 a user error (one line on stderr saying what was wrong and what to do),
2 usage (click's own), 130 interrupted. Data goes to stdout, messages and logs to stderr.
"""

from __future__ import annotations

import asyncio
import getpass
import os
import signal
import sys
from contextlib import AsyncExitStack
from pathlib import Path
from typing import TYPE_CHECKING

import anyio
import click
import structlog

from orchestrator import __version__
from orchestrator.cli.chaos import chaos
from orchestrator.cli.console import console
from orchestrator.cli.ops import (
    bulk,
    check_target,
    db_status,
    filter_options,
    queue_stats,
    runs_purge,
    select_runs,
    watch,
    workers_list,
)
from orchestrator.cli.support import (
    OneLineErrors,
    parse_time,
    print_error,
    read_input,
    run_async,
    settings_of,
    stderr,
    stdout,
)
from orchestrator.cli.waits import approvals, runs_budget, runs_signal
from orchestrator.client import start_time
from orchestrator.db.bootstrap import open_store
from orchestrator.db.connections import connect, redact_dsn, resolve_dsn
from orchestrator.db.deadlines import enter_when_reachable
from orchestrator.db.embedded import EmbeddedPostgres
from orchestrator.db.migrations import latest_version, migrate
from orchestrator.db.store import WorkerRegistry
from orchestrator.db.sync_standby import SyncStandbyRequirement
from orchestrator.effects.model import EffectStatus
from orchestrator.effects.store import EffectStore
from orchestrator.errors import InvalidInput, OrchestratorError
from orchestrator.metrics_endpoint import MetricsEndpoint, sample_gauges, serving_metrics
from orchestrator.models import RunState
from orchestrator.presentation import (
    budget_table,
    conversation_table,
    dump_json,
    effects_table,
    event_line,
    jsonable,
    print_run,
    runs_table,
    signals_table,
)
from orchestrator.retention import DEFAULT_RETENTION, parse_age, parse_retention
from orchestrator.run_detail import DEFAULT_EVENTS, MAX_EVENTS, load_run_detail, more_events_hint
from orchestrator.settings import Settings

if TYPE_CHECKING:
    from orchestrator.worker.worker import Worker


@click.group(cls=OneLineErrors, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "--version", prog_name="orchestrator")
@click.option(
    "--database-url",
    envvar="ORCHESTRATOR_DATABASE_URL",
    help="PostgreSQL DSN. Unset: the embedded server under --home.",
)
@click.option(
    "--home",
    envvar="ORCHESTRATOR_HOME",
    type=click.Path(file_okay=False, path_type=Path),
    help="Directory for the embedded server's data (default ./.orchestrator).",
)
@click.pass_context
def main(ctx: click.Context, database_url: str | None, home: Path | None) -> None:
    """Long-running AI agent runs with run leases and fencing tokens on PostgreSQL."""
    try:
        settings = Settings.from_env().with_overrides(database_url=database_url or None, home=home)
    except OrchestratorError as error:
        print_error(error)
        sys.exit(1)
    ctx.obj = settings


# -- db ---------------------------------------------------------------------------------------
@main.group()
def db() -> None:
    """Database: migrate, show the DSN in use, stop the embedded server."""


@db.command("migrate")
@click.pass_context
def db_migrate(ctx: click.Context) -> None:
    """Apply pending schema migrations (safe to run from several processes at once)."""
    settings = settings_of(ctx)

    async def body() -> None:
        dsn = resolve_dsn(settings)
        stderr.print(f"migrating {redact_dsn(dsn)}")
        connection = await connect(settings, dsn=dsn, application_name="orchestrator-migrate")
        try:
            applied = await migrate(connection)
        finally:
            await connection.close()
        for migration in applied:
            stderr.print(f"  applied {migration.version:04d}_{migration.name}")
        stdout.print(f"schema at version {latest_version()}" + ("" if applied else " (no change)"))

    run_async(body)


@db.command("url")
@click.option("--show-password", is_flag=True, help="Print the password instead of ***.")
@click.pass_context
def db_url(ctx: click.Context, show_password: bool) -> None:
    """Print the DSN in use (starting the embedded server if it is the default)."""
    settings = settings_of(ctx)

    async def body() -> None:
        dsn = resolve_dsn(settings)
        stdout.print(dsn if show_password else redact_dsn(dsn), markup=False)

    run_async(body)


@db.command("stop")
@click.option(
    "--force", is_flag=True, help="Stop it even while other processes are connected to it."
)
@click.pass_context
def db_stop(ctx: click.Context, force: bool) -> None:
    """Stop the embedded PostgreSQL server (no effect with ORCHESTRATOR_DATABASE_URL set).

    Refused while other processes (workers, consoles, psql) are connected, unless --force."""
    settings = settings_of(ctx)

    async def body() -> None:
        if settings.database_url:
            raise InvalidInput("ORCHESTRATOR_DATABASE_URL is set: there is no embedded server")
        server = EmbeddedPostgres(settings.home)
        running = server.running()
        if running is not None and not force:
            _refuse_while_connected(await _other_sessions(settings, running.dsn("postgres")))
        stopped = server.stop()
        stderr.print(
            "embedded PostgreSQL stopped" if stopped else "embedded PostgreSQL not running"
        )

    run_async(body)


async def _other_sessions(settings: Settings, dsn: str) -> dict[str, int]:
    """Client sessions of other processes on the server, by application_name."""
    connection = await connect(settings, dsn=dsn, application_name="orchestrator-db-stop")
    try:
        rows = await connection.fetch(
            "SELECT coalesce(nullif(application_name, ''), 'unnamed') AS name, count(*) AS n "
            "FROM pg_stat_activity WHERE backend_type = 'client backend' "
            "AND pid <> pg_backend_pid() GROUP BY 1 ORDER BY 2 DESC, 1"
        )
    finally:
        await connection.close()
    return {row["name"]: row["n"] for row in rows}


def _refuse_while_connected(sessions: dict[str, int]) -> None:
    """Stopping the server under running workers and consoles leaves them failing every
    second: say who is connected and let the operator decide."""
    if not sessions:
        return
    total = sum(sessions.values())
    shown = [f"{count} {name!r}" for name, count in list(sessions.items())[:5]]
    if len(sessions) > 5:
        shown.append(f"{len(sessions) - 5} more application names")
    raise InvalidInput(
        f"{total} session{'s' if total != 1 else ''} of other processes "
        f"{'are' if total != 1 else 'is'} connected to the embedded PostgreSQL "
        f"({', '.join(shown)}): stop them first, or pass --force to stop it under them"
    )


# -- submit -----------------------------------------------------------------------------------
@main.command()
@click.argument("agent")
@click.option(
    "--input",
    "input_",
    default="{}",
    show_default=True,
    help="JSON object, @file.json, or @- for standard input.",
)
@click.option("--run-id", help="Use this run id instead of a generated one.")
@click.option("--idempotency-key", help="Submitting the same key again returns the same run.")
@click.option("--max-attempts", type=click.IntRange(1, 1000), default=5, show_default=True)
@click.option(
    "--at",
    "at",
    help="Start at this time (ISO 8601 with a zone, e.g. 2026-12-24T09:00Z; within ten years; "
    "a past time warns and starts now).",
)
@click.option("--delay", type=float, help="Start this many seconds from now (at most ten years).")
@click.option("--json", "as_json", is_flag=True, help="Print the run as JSON.")
@click.pass_context
def submit(
    ctx: click.Context,
    agent: str,
    input_: str,
    run_id: str | None,
    idempotency_key: str | None,
    max_attempts: int,
    at: str | None,
    delay: float | None,
    as_json: bool,
) -> None:
    """Queue a run of AGENT (now, --at a time or after --delay) and print its run id."""
    settings = settings_of(ctx)
    if at is not None and delay is not None:
        raise click.UsageError("give --at or --delay, not both")

    async def body() -> None:
        payload = read_input(input_)
        moment = parse_time(at, "--at") if at is not None else None
        async with open_store(settings) as store:
            start = None
            if moment is not None or delay is not None:
                now = await store.database_now()
                start = start_time(now, moment, delay)
                if start is not None and start < now:
                    stderr.print(
                        f"warning: --at {at} is in the past (the database's clock says "
                        f"{now.isoformat(timespec='seconds')}); the run is due now",
                        markup=False,
                    )
            submission = await store.submit(
                agent,
                payload,
                run_id=run_id,
                idempotency_key=idempotency_key,
                max_attempts=max_attempts,
                not_before=start,
            )
            served = await WorkerRegistry().served_agents(store.pool)
        if agent not in served:
            # Not an error: runs may be queued before any worker starts. But a typo would wait
            # forever, so say what the live workers serve.
            stderr.print(
                f"warning: no live worker serves agent {agent!r} yet "
                f"(live workers serve: {', '.join(served) or 'none'}); the run waits until one does"
            )
        if not submission.created:
            stderr.print(f"idempotency key matched run {submission.run.run_id}; nothing new queued")
        if as_json:
            stdout.print_json(dump_json({"created": submission.created, "run": submission.run}))
        else:
            stdout.print(submission.run.run_id, markup=False)

    run_async(body)


# -- runs -------------------------------------------------------------------------------------
@main.group()
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
@click.option("--limit", type=click.IntRange(1, 10_000), default=100, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print runs as a JSON array.")
@click.pass_context
def runs_list(
    ctx: click.Context,
    states: tuple[str, ...],
    agent: str | None,
    since: str | None,
    until: str | None,
    limit: int,
    as_json: bool,
) -> None:
    """List runs, newest first."""
    settings = settings_of(ctx)

    async def body() -> None:
        async with open_store(settings) as store:
            found = await select_runs(store, states, agent, since, until, limit)
            now = await store.database_now()
        if as_json:
            stdout.print_json(dump_json(found))
        elif found:
            stdout.print(runs_table(found, now))
        else:
            stderr.print("no runs match")

    run_async(body)


@runs.command("show")
@click.argument("run_id")
@click.option(
    "--json", "as_json", is_flag=True, help="Print the run, its timeline and transcript as JSON."
)
@click.option(
    "--events",
    "events_shown",
    type=click.IntRange(1, MAX_EVENTS),
    default=DEFAULT_EVENTS,
    show_default=True,
    help="Show the newest N timeline events (`runs events` pages through all of them).",
)
@click.pass_context
def runs_show(ctx: click.Context, run_id: str, as_json: bool, events_shown: int) -> None:
    """Show a run: state, fence, owner, lease expiry, checkpoint, attempts, the newest timeline
    events and the conversation."""
    settings = settings_of(ctx)

    async def body() -> None:
        async with open_store(settings) as store:
            detail = await load_run_detail(store, run_id, events=events_shown)
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

    run_async(body)


@runs.command("events")
@click.argument("run_id")
@click.option(
    "--after",
    type=click.IntRange(0),
    default=0,
    show_default=True,
    help="Start after this event id (the last one of the previous page).",
)
@click.option(
    "--limit",
    type=click.IntRange(1, MAX_EVENTS),
    default=1000,
    show_default=True,
    help="At most this many events.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the page as a JSON array.")
@click.pass_context
def runs_events(ctx: click.Context, run_id: str, after: int, limit: int, as_json: bool) -> None:
    """Page through a run's timeline, oldest first: a page of --limit events after --after.
    The last line on stderr says how to ask for the next page."""
    settings = settings_of(ctx)

    async def body() -> None:
        async with open_store(settings) as store:
            await store.get(run_id)  # RunNotFound for an unknown run, not an empty page
            events = await store.events(run_id, after=after, limit=limit)
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

    run_async(body)


@runs.command("cancel")
@click.argument("run_id", required=False)
@filter_options
@click.option("--reason", help="Recorded in the run's timeline.")
@click.option("--dry-run", is_flag=True, help="With filters: list the runs, cancel nothing.")
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def runs_cancel(
    ctx: click.Context,
    run_id: str | None,
    states: tuple[str, ...],
    agent: str | None,
    since: str | None,
    until: str | None,
    limit: int,
    every: bool,
    reason: str | None,
    dry_run: bool,
    as_json: bool,
) -> None:
    """Cancel a run (or, with filters instead of RUN_ID, every matching unfinished run) and raise
    its fence, so its current owner can no longer act."""
    settings = settings_of(ctx)

    async def body() -> None:
        async with open_store(settings) as store:
            check_target(run_id, states, agent, since, until, every, dry_run)
            if run_id is not None:
                run = await store.cancel(run_id, reason=reason)
                if as_json:
                    stdout.print_json(dump_json(run))
                else:
                    stdout.print(f"cancelled {run.run_id} (fence now {run.fence})", markup=False)
                return
            wanted = states or ("queued", "running", "waiting")
            unfinished = [state for state in wanted if not RunState(state).terminal]
            if not unfinished:
                raise InvalidInput("only queued, running or waiting runs can be cancelled")
            await bulk(
                store,
                tuple(unfinished),
                agent,
                since,
                until,
                limit,
                dry_run=dry_run,
                as_json=as_json,
                verb="cancel",
                act=lambda target: store.cancel(target, reason=reason),
            )

    run_async(body)


@runs.command("retry")
@click.argument("run_id", required=False)
@filter_options
@click.option("--dry-run", is_flag=True, help="With filters: list the runs, requeue nothing.")
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def runs_retry(
    ctx: click.Context,
    run_id: str | None,
    states: tuple[str, ...],
    agent: str | None,
    since: str | None,
    until: str | None,
    limit: int,
    every: bool,
    dry_run: bool,
    as_json: bool,
) -> None:
    """Requeue a dead-lettered run (or, with filters instead of RUN_ID, every matching dead run)
    with a fresh set of attempts."""
    settings = settings_of(ctx)

    async def body() -> None:
        async with open_store(settings) as store:
            check_target(run_id, states, agent, since, until, every, dry_run)
            if run_id is not None:
                run = await store.retry(run_id)
                if as_json:
                    stdout.print_json(dump_json(run))
                else:
                    stdout.print(f"requeued {run.run_id}", markup=False)
                return
            if states and set(states) != {"dead"}:
                raise InvalidInput("only dead runs can be retried: drop --state or use dead")
            await bulk(
                store,
                ("dead",),
                agent,
                since,
                until,
                limit,
                dry_run=dry_run,
                as_json=as_json,
                verb="requeue",
                act=store.retry,
            )

    run_async(body)


@runs.command("watch")
@click.argument("run_id")
@click.option("--timeout", type=click.FloatRange(0.1), help="Give up after this many seconds.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per event (JSON lines).")
@click.pass_context
def runs_watch(ctx: click.Context, run_id: str, timeout: float | None, as_json: bool) -> None:
    """Print a run's timeline as it happens; end when the run ends (exit 0), or at --timeout
    (exit 1)."""
    settings = settings_of(ctx)

    async def body() -> None:
        async with open_store(settings) as store:
            await watch(store, run_id, give_up_after=timeout, as_json=as_json)

    run_async(body)


runs.add_command(runs_signal)
runs.add_command(runs_budget)
runs.add_command(runs_purge)
db.add_command(db_status)


@main.group()
def workers() -> None:
    """Workers registered with the database: alive or dead, and the runs they hold."""


workers.add_command(workers_list)


@main.group()
def queue() -> None:
    """Queue depth per agent."""


queue.add_command(queue_stats)
main.add_command(approvals)
main.add_command(chaos)
main.add_command(console)


metrics_listen_option = click.option(
    "--metrics-listen",
    help="Serve Prometheus metrics on http://HOST:PORT/metrics and readiness on /ready.",
)
require_sync_standby_option = click.option(
    "--require-sync-standby",
    is_flag=True,
    default=None,
    help="Refuse to start, report not ready and send no effect while the primary has no "
    "synchronous standby or synchronous_commit is below on (ORCHESTRATOR_REQUIRE_SYNC_STANDBY=1). "
    "See docs/high-availability.md.",
)
start_retry_option = click.option(
    "--start-retry-seconds",
    type=click.FloatRange(0, 3600),
    default=30.0,
    show_default=True,
    help="How long to keep trying to reach PostgreSQL at start (0: fail at once).",
)


# -- serve ------------------------------------------------------------------------------------
def _split_modules(values: tuple[str, ...]) -> list[str]:
    return [part for value in values for part in value.replace(",", " ").split() if part]


@main.command()
@click.option(
    "--agents",
    "agent_modules",
    multiple=True,
    envvar="ORCHESTRATOR_AGENTS",
    help="Module(s) defining Agent objects, e.g. orchestrator.agents.sleepy (repeatable; "
    "ORCHESTRATOR_AGENTS takes a space- or comma-separated list).",
)
@click.option("--worker-id", help="Default: host:pid:random.")
@click.option("--concurrency", type=click.IntRange(1, 100_000), default=10, show_default=True)
@click.option("--lease-seconds", type=click.FloatRange(0.5), default=45.0, show_default=True)
@click.option(
    "--heartbeat-seconds", type=click.FloatRange(0.1), help="Default: a third of the lease."
)
@click.option("--poll-seconds", type=click.FloatRange(0.05), default=2.0, show_default=True)
@click.option("--claim-batch", type=click.IntRange(1, 1000), default=50, show_default=True)
@click.option("--grace-seconds", type=click.FloatRange(0), default=30.0, show_default=True)
@click.option("--status-seconds", type=click.FloatRange(0.5), default=10.0, show_default=True)
@click.option(
    "--takeover/--no-takeover",
    default=True,
    show_default=True,
    help="Claim runs of workers whose database session is gone before their lease ends.",
)
@click.option(
    "--reap-seconds",
    type=click.FloatRange(0.05),
    default=1.0,
    show_default=True,
    help="How often this worker looks for workers whose session is gone (with --takeover): "
    "a killed worker's runs are claimed elsewhere within about this long.",
)
@click.option(
    "--effects-config",
    envvar="ORCHESTRATOR_EFFECTS_CONFIG",
    type=click.Path(dir_okay=False),
    help="Vendors per effect kind (JSON); with it, serve also dispatches effects.",
)
@click.option(
    "--dispatch/--no-dispatch",
    default=True,
    show_default=True,
    help="Run the effect dispatcher inside serve (needs --effects-config).",
)
@click.option(
    "--dispatch-lease-seconds",
    type=click.FloatRange(1),
    default=60.0,
    show_default=True,
    help="How long the built-in dispatcher holds an effect it sends. Shorter: an effect in "
    "flight when its worker dies is reconciled sooner. It must outlast the slowest vendor "
    "call: a call still unanswered at 80% of it is given up as uncertain.",
)
@metrics_listen_option
@start_retry_option
@require_sync_standby_option
@click.option(
    "--retention",
    default=DEFAULT_RETENTION,
    show_default=True,
    help="Delete finished runs older than this in the background (30d, 12h, ...; off: keep).",
)
@click.option("--log-json/--log-console", default=None, help="Default: JSON unless a terminal.")
@click.pass_context
def serve(
    ctx: click.Context,
    agent_modules: tuple[str, ...],
    worker_id: str | None,
    concurrency: int,
    lease_seconds: float,
    heartbeat_seconds: float | None,
    poll_seconds: float,
    claim_batch: int,
    grace_seconds: float,
    status_seconds: float,
    takeover: bool,
    reap_seconds: float,
    effects_config: str | None,
    dispatch: bool,
    dispatch_lease_seconds: float,
    metrics_listen: str | None,
    start_retry_seconds: float,
    require_sync_standby: bool | None,
    retention: str,
    log_json: bool | None,
) -> None:
    """Claim and run agent runs until SIGTERM/SIGINT (a second signal exits at once)."""
    from orchestrator.effects.dispatcher import load_adapters
    from orchestrator.steps import AgentRegistry
    from orchestrator.telemetry import (
        QueueGauges,
        configure_logging,
        install_sdk_from_env,
        shutdown_sdk,
    )
    from orchestrator.worker.gc_tuning import tune_for_worker
    from orchestrator.worker.worker import Worker, WorkerConfig, default_worker_id

    settings = settings_of(ctx).with_overrides(require_sync_standby=require_sync_standby)
    configure_logging(json_logs=log_json)
    modules = _split_modules(agent_modules)
    if not modules:
        raise click.UsageError(
            "no agents to serve: pass --agents MODULE (e.g. --agents orchestrator.agents.sleepy)"
        )

    _import_from_working_directory()

    async def body() -> None:
        registry = AgentRegistry.from_modules(modules)
        adapters = load_adapters(effects_config) if dispatch and effects_config else {}
        config = WorkerConfig(
            agents=registry,
            worker_id=worker_id or default_worker_id(),
            concurrency=concurrency,
            lease_seconds=lease_seconds,
            heartbeat_seconds=heartbeat_seconds or lease_seconds / 3,
            poll_seconds=poll_seconds,
            claim_batch=claim_batch,
            grace_seconds=grace_seconds,
            status_seconds=status_seconds,
            dead_session_takeover=takeover,
            reap_seconds=reap_seconds,
            effect_adapters=adapters,
            dispatch_lease_seconds=dispatch_lease_seconds,
            retention=parse_retention(retention),
            start_retry_seconds=start_retry_seconds,
            gauges=QueueGauges() if metrics_listen else None,
        )
        try:
            worker = Worker(settings, config)
        except ValueError as error:
            raise InvalidInput(str(error)) from None
        install_sdk_from_env(prometheus=metrics_listen is not None)
        endpoint = (
            None
            if metrics_listen is None
            else MetricsEndpoint(metrics_listen, worker.readiness, asyncio.get_running_loop())
        )
        tune_for_worker()  # start-up is done: see orchestrator/gc_tuning.py
        try:
            async with anyio.create_task_group() as group:
                group.start_soon(_watch_signals, worker)
                await worker.run()
                group.cancel_scope.cancel()
        finally:
            if endpoint is not None:
                endpoint.close()
            shutdown_sdk()

    run_async(body)


def _import_from_working_directory() -> None:
    """Put the working directory first on the import path, as ``python -m`` does: the
    ``orchestrator`` script's own path is its bin directory, so ``--agents myagent`` in the folder
    holding ``myagent.py`` would not be found."""
    here = os.getcwd()
    if not any(os.path.abspath(entry or os.curdir) == here for entry in sys.path):
        sys.path.insert(0, here)


async def _watch_signals(worker: Worker) -> None:
    """First SIGTERM/SIGINT: drain gracefully. Second: exit at once."""
    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for received in signals:
            if worker.stop_requested:
                stderr.print(f"second {signal.Signals(received).name}: exiting now")
                os._exit(130)
            stderr.print(f"{signal.Signals(received).name}: draining (send again to exit at once)")
            worker.request_stop()


# -- effects ----------------------------------------------------------------------------------
@main.group()
def effects() -> None:
    """Effect records at the fenced boundary: list, inspect, resolve parked ones, dispatch."""


@effects.command("list")
@click.option("--run", "run_id", help="Only this run's effects.")
@click.option("--status", type=click.Choice([status.value for status in EffectStatus]))
@click.option("--limit", type=click.IntRange(1, 10_000), default=100, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print effects as a JSON array.")
@click.pass_context
def effects_list(
    ctx: click.Context, run_id: str | None, status: str | None, limit: int, as_json: bool
) -> None:
    """List effect records, newest first."""
    settings = settings_of(ctx)

    async def body() -> None:
        async with open_store(settings) as store:
            found = await EffectStore(store.pool).list_effects(
                run_id=run_id, status=EffectStatus(status) if status else None, limit=limit
            )
        if as_json:
            stdout.print_json(dump_json(found))
        elif found:
            stdout.print(effects_table(found))
        else:
            stderr.print("no effects match")

    run_async(body)


@effects.command("show")
@click.argument("run_id")
@click.argument("effect_key")
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def effects_show(ctx: click.Context, run_id: str, effect_key: str, as_json: bool) -> None:
    """Show one effect record."""
    settings = settings_of(ctx)

    async def body() -> None:
        async with open_store(settings) as store:
            effect = await EffectStore(store.pool).get(run_id, effect_key)
        if as_json:
            stdout.print_json(dump_json(effect))
        else:
            stdout.print(effects_table([effect], wide=True))

    run_async(body)


@effects.command("resolve")
@click.argument("run_id")
@click.argument("effect_key")
@click.option("--sent", "decision", flag_value="sent", help="It reached the vendor: confirm it.")
@click.option("--not-sent", "decision", flag_value="not-sent", help="It did not: send it again.")
@click.option("--external-id", help="The vendor's id for it, when --sent.")
@click.option(
    "--by",
    default=getpass.getuser,
    show_default="the OS user",
    help="Who decides (recorded in the timeline).",
)
@click.pass_context
def effects_resolve(
    ctx: click.Context,
    run_id: str,
    effect_key: str,
    decision: str | None,
    external_id: str | None,
    by: str,
) -> None:
    """Decide a parked effect after checking with the vendor by hand."""
    if decision is None:
        raise click.UsageError("say what you found: --sent or --not-sent")
    settings = settings_of(ctx)

    async def body() -> None:
        async with open_store(settings) as store:
            effect = await EffectStore(store.pool).resolve(
                run_id, effect_key, sent=decision == "sent", by=by, external_id=external_id
            )
        stdout.print(f"{run_id} {effect_key}: {effect.status.value} (by {by})", markup=False)

    run_async(body)


@effects.command("serve")
@click.option("--listen", default="127.0.0.1:8787", show_default=True, help="HOST:PORT")
@click.option(
    "--tokens",
    envvar="ORCHESTRATOR_PROXY_TOKENS",
    help="Comma-separated bearer tokens callers must present. On the command line they are "
    "visible to every user of the machine (ps): prefer ORCHESTRATOR_PROXY_TOKENS or "
    "--tokens-file.",
)
@click.option(
    "--tokens-file",
    envvar="ORCHESTRATOR_PROXY_TOKENS_FILE",
    type=click.Path(dir_okay=False, path_type=Path),
    help="A file of bearer tokens, one a line or comma-separated (ORCHESTRATOR_PROXY_TOKENS_FILE).",
)
@click.option("--max-body-bytes", type=click.IntRange(1024), default=256 * 1024, show_default=True)
@click.option(
    "--fence-store",
    type=click.Path(path_type=Path),
    help="Remember the highest fence accepted per run in this SQLite file on a local disk, and "
    "refuse a lower one with 409 fence_regression even if the database forgot it in a failover "
    "(ORCHESTRATOR_PROXY_FENCE_STORE; default: none, the database's check alone). "
    "See docs/high-availability.md.",
)
@click.option(
    "--fence-store-retention",
    envvar="ORCHESTRATOR_PROXY_FENCE_RETENTION",
    default="7d",
    show_default=True,
    help="With --fence-store: forget a run's fence after this long without a request "
    "(at least 1h).",
)
@metrics_listen_option
@require_sync_standby_option
@click.option("--log-json/--log-console", default=None, help="Default: JSON unless a terminal.")
@click.pass_context
def effects_serve(
    ctx: click.Context,
    listen: str,
    tokens: str | None,
    tokens_file: Path | None,
    max_body_bytes: int,
    fence_store: Path | None,
    fence_store_retention: str,
    metrics_listen: str | None,
    require_sync_standby: bool | None,
    log_json: bool | None,
) -> None:
    """Serve the effect boundary over HTTP (the action proxy) until SIGTERM/SIGINT."""
    import uvicorn

    from orchestrator.effects.fence_store import FenceStore, check_retention
    from orchestrator.effects.proxy import create_app
    from orchestrator.telemetry import configure_logging

    settings = settings_of(ctx).with_overrides(
        proxy_fence_store=fence_store, require_sync_standby=require_sync_standby
    )
    requirement = SyncStandbyRequirement(settings.require_sync_standby)
    configure_logging(json_logs=log_json)
    host, _, port = listen.rpartition(":")
    if not host or not port.isdigit():
        raise click.UsageError(f"--listen must be HOST:PORT, not {listen!r}")
    if not tokens and tokens_file is None:
        raise click.UsageError(
            "no bearer tokens: set ORCHESTRATOR_PROXY_TOKENS or pass --tokens-file"
        )

    async def body() -> None:
        token_list = _proxy_tokens(tokens, tokens_file)
        retention = check_retention(parse_age(fence_store_retention, "--fence-store-retention"))
        async with AsyncExitStack() as stack:
            # Before the database: a bad path is a one-line error at once, not after a wait.
            fences = None
            if settings.proxy_fence_store is not None:
                fences = FenceStore.open(settings.proxy_fence_store, retention=retention)
                stack.callback(fences.close)
            store = await stack.enter_async_context(
                open_store(settings, application_name="orchestrator-proxy", max_size=10)
            )
            await requirement.require_at_start(store.pool)
            app = create_app(store.pool, token_list, fences=fences, max_body_bytes=max_body_bytes)
            # log_config=None: uvicorn's records go through configure_logging's handler.
            config = uvicorn.Config(
                app, host=host.strip("[]"), port=int(port), log_level="warning", log_config=None
            )
            server = uvicorn.Server(config)
            if fences is None:
                remembering = "no fence store (the database's fence check alone)"
            else:
                remembering = (
                    f"fence store {fences.path.resolve()} ({await fences.count()} runs remembered)"
                )
            stderr.print(f"action proxy listening on http://{listen}; {remembering}", markup=False)
            with serving_metrics(
                metrics_listen, store.pool, gauges=False, sync_standby=requirement
            ):
                await server.serve()

    run_async(body)


def _proxy_tokens(tokens: str | None, tokens_file: Path | None) -> list[str]:
    """The tokens of ``--tokens`` (or its variable) and of ``--tokens-file``, together."""
    raw = tokens or ""
    if tokens_file is not None:
        try:
            raw += "," + tokens_file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as error:
            reason = getattr(error, "strerror", None) or str(error)
            raise InvalidInput(
                f"cannot read --tokens-file {str(tokens_file)!r}: {reason}"
            ) from None
    found = raw.replace(",", " ").split()
    if not found:
        raise InvalidInput("no bearer tokens given: put at least one in --tokens-file, one a line")
    return found


@effects.command("dispatch")
@click.option(
    "--effects-config",
    envvar="ORCHESTRATOR_EFFECTS_CONFIG",
    required=True,
    type=click.Path(dir_okay=False),
    help="Vendors per effect kind (JSON).",
)
@click.option("--lease-seconds", type=click.FloatRange(1), default=60.0, show_default=True)
@click.option("--poll-seconds", type=click.FloatRange(0.05), default=1.0, show_default=True)
@click.option(
    "--concurrency",
    type=click.IntRange(1, 1000),
    default=20,
    show_default=True,
    help="Vendor calls in flight at once.",
)
@click.option(
    "--batch",
    type=click.IntRange(1, 1000),
    default=20,
    show_default=True,
    help="Effects claimed per statement.",
)
@click.option("--dispatcher-id", help="Default: dispatch:host:pid:random.")
@metrics_listen_option
@start_retry_option
@require_sync_standby_option
@click.option("--log-json/--log-console", default=None)
@click.pass_context
def effects_dispatch(
    ctx: click.Context,
    effects_config: str,
    lease_seconds: float,
    poll_seconds: float,
    concurrency: int,
    batch: int,
    dispatcher_id: str | None,
    metrics_listen: str | None,
    start_retry_seconds: float,
    require_sync_standby: bool | None,
    log_json: bool | None,
) -> None:
    """Run only the effect dispatcher (outbox relay) until SIGTERM/SIGINT."""
    from orchestrator.effects.dispatcher import Dispatcher, load_adapters
    from orchestrator.telemetry import configure_logging

    settings = settings_of(ctx).with_overrides(require_sync_standby=require_sync_standby)
    requirement = SyncStandbyRequirement(settings.require_sync_standby)
    configure_logging(json_logs=log_json)

    async def body() -> None:
        adapters = load_adapters(effects_config)
        if not adapters:
            raise InvalidInput(f"{effects_config} configures no effect kinds")
        async with AsyncExitStack() as stack:
            store = await enter_when_reachable(
                stack,
                lambda: open_store(
                    settings, application_name="orchestrator-dispatch", max_size=concurrency + 3
                ),
                within=start_retry_seconds,
                log=structlog.get_logger("orchestrator.dispatch"),
            )
            await requirement.require_at_start(store.pool)
            dispatcher = Dispatcher(
                store.pool,
                adapters,
                dispatcher_id=dispatcher_id,
                lease_seconds=lease_seconds,
                poll_seconds=poll_seconds,
                concurrency=concurrency,
                batch=batch,
                sync_standby=requirement,
            )
            with (
                serving_metrics(metrics_listen, store.pool, sync_standby=requirement) as gauges,
                anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals,
            ):
                async with anyio.create_task_group() as group:
                    group.start_soon(dispatcher.run)
                    if gauges is not None:
                        group.start_soon(sample_gauges, store.pool, gauges, dispatcher.log)
                    async for _ in signals:
                        group.cancel_scope.cancel()
                        break
        stderr.print(f"dispatcher stopped: {dispatcher.outcomes}")

    run_async(body)


# -- demo -------------------------------------------------------------------------------------
@main.command()
@click.option("--lease-seconds", type=click.FloatRange(1, 60), default=2.0, show_default=True)
@click.option("--runs", type=click.IntRange(1, 200), default=6, show_default=True)
@click.pass_context
def demo(ctx: click.Context, lease_seconds: float, runs: int) -> None:
    """Two workers, a paused one, real vendors: each effect still happens exactly once."""
    from orchestrator.demo import run_demo

    settings = settings_of(ctx)
    # Leave nothing running: stop the embedded server afterwards if the demo started it.
    embedded = None if settings.database_url else EmbeddedPostgres(settings.home)
    started_here = embedded is not None and embedded.running() is None
    try:
        ok = run_async(
            lambda: run_demo(
                settings, lease_seconds=lease_seconds, runs=runs, console=stderr, out=stdout
            )
        )
    finally:
        if embedded is not None and started_here:
            embedded.stop()
    sys.exit(0 if ok else 1)
