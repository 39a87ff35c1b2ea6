"""``orchestrator queue``: queue depth per agent."""

from __future__ import annotations

import click

from orchestrator.cli.presentation import queue_table
from orchestrator.cli.support import async_command, json_option, print_found
from orchestrator.client.stores import open_stores
from orchestrator.settings import Settings


@click.group()
def queue() -> None:
    """Queue depth per agent."""


@queue.command("stats")
@json_option("Print one JSON object per agent.")
@async_command
async def queue_stats(settings: Settings, as_json: bool) -> None:
    """Per agent: runs queued, due now, running, waiting, and the oldest due run's age."""
    async with open_stores(settings) as stores:
        rows = await stores.runs.queue_stats()
    print_found(rows, as_json, queue_table, "no queued, running or waiting runs")
