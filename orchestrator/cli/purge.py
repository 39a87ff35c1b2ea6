"""``orchestrator runs purge``: delete finished runs older than an age."""

from __future__ import annotations

import time

import click

from orchestrator.cli.consoles import stderr, stdout
from orchestrator.cli.presentation import dump_json
from orchestrator.cli.support import async_command, json_option
from orchestrator.client.stores import open_stores
from orchestrator.db.purges import Purged, purge
from orchestrator.db.retention import PURGE_BATCH, PURGE_PAUSE_RATIO, parse_age
from orchestrator.settings import Settings


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
@json_option("Print what was (or would be) deleted.")
@async_command
async def runs_purge(
    settings: Settings,
    older_than: str,
    dry_run: bool,
    batch: int,
    pause_ratio: float,
    as_json: bool,
) -> None:
    """Delete finished runs (succeeded, failed, cancelled, dead) older than --older-than, with
    their events, transcripts, effects, signals and budgets. Runs with an effect not yet settled
    are kept. Safe while workers run: batches skip rows others hold."""
    age = parse_age(older_than)
    async with open_stores(settings) as stores:
        cutoff = await stores.purge_cutoff(age)
        if dry_run:
            count = await stores.purges.count(cutoff)
            result: dict[str, object] = {"dry_run": True, "cutoff": cutoff, "runs": count}
        else:
            shown = [time.monotonic()]

            def show(total: Purged) -> None:  # at most once a second
                if time.monotonic() - shown[0] >= 1:
                    shown[0] = time.monotonic()
                    stderr.print(f"purged {total.runs:,} runs so far")

            purged = await purge(
                stores.pool, cutoff, batch=batch, pause_ratio=pause_ratio, progress=show
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
