"""``orchestrator submit``: queue a run, now or at a time."""

from __future__ import annotations

import click

from orchestrator.cli.consoles import stderr, stdout
from orchestrator.cli.presentation import dump_json
from orchestrator.cli.support import (
    async_command,
    input_option,
    json_option,
    read_input,
    wait_for_standby_option,
)
from orchestrator.client.runs import start_time
from orchestrator.client.selection import parse_time
from orchestrator.client.stores import open_stores
from orchestrator.settings import Settings


@click.command()
@click.argument("agent")
@input_option("JSON object, @file.json, or @- for standard input.")
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
@click.option(
    "--concurrency-key",
    help="What the agent's limits count this run under (a tenant, a customer); claims are "
    "shared fairly across keys (docs/flow-control.md).",
)
@click.option(
    "--priority",
    type=int,
    default=0,
    show_default=True,
    help="Among due runs of its key, higher first (-1000 to 1000).",
)
@wait_for_standby_option("run")
@json_option("Print the run as JSON.")
@async_command
async def submit(
    settings: Settings,
    agent: str,
    input_: str,
    run_id: str | None,
    idempotency_key: str | None,
    max_attempts: int,
    at: str | None,
    delay: float | None,
    concurrency_key: str | None,
    priority: int,
    wait_for_standby: bool,
    as_json: bool,
) -> None:
    """Queue a run of AGENT (now, --at a time or after --delay) and print its run id."""
    if at is not None and delay is not None:
        raise click.UsageError("give --at or --delay, not both")
    payload = read_input(input_)
    moment = parse_time(at, "--at") if at is not None else None
    async with open_stores(settings) as stores:
        store = stores.runs
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
            concurrency_key=concurrency_key,
            priority=priority,
        )
        if wait_for_standby:
            await stores.held_by_standby()
        served = await stores.workers.served_agents(stores.pool)
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
