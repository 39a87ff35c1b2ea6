"""``orchestrator queue``: queue depth per agent."""

from __future__ import annotations

import click

from orchestrator.cli.support import run_async, settings_of, stderr, stdout
from orchestrator.db.bootstrap import open_store
from orchestrator.db.queries import query
from orchestrator.presentation import dump_json, queue_table


@click.group()
def queue() -> None:
    """Queue depth per agent."""


@queue.command("stats")
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
