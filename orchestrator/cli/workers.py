"""``orchestrator workers``: the workers registered with the database."""

from __future__ import annotations

import click

from orchestrator.cli.presentation import workers_table
from orchestrator.cli.support import async_command, json_option, print_found
from orchestrator.client.stores import open_stores
from orchestrator.settings import Settings


@click.group()
def workers() -> None:
    """Workers registered with the database: alive or dead, and the runs they hold."""


@workers.command("list")
@json_option("Print workers as a JSON array.")
@async_command
async def workers_list(settings: Settings, as_json: bool) -> None:
    """Registered workers: alive (their database session holds its liveness lock) or dead,
    the runs each holds, and when it last renewed or committed one."""
    async with open_stores(settings) as stores:
        found = await stores.workers.list_workers(stores.pool)
        now = await stores.runs.database_now()
    print_found(found, as_json, lambda rows: workers_table(rows, now), "no workers registered")
