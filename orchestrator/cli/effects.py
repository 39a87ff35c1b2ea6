"""``orchestrator effects``: list, show and resolve effect records; the group gathers ``serve``
and ``dispatch`` from effects_processes.py."""

from __future__ import annotations

import click

from orchestrator.cli.consoles import stdout
from orchestrator.cli.effects_processes import effects_dispatch, effects_serve
from orchestrator.cli.presentation import dump_json, effects_table
from orchestrator.cli.support import (
    BY_NOTE_HELP,
    async_command,
    decided_as,
    effect_arguments,
    json_option,
    limit_option,
    print_found,
    run_option,
)
from orchestrator.client.stores import open_stores
from orchestrator.effect_model import EffectStatus
from orchestrator.settings import Settings


@click.group()
def effects() -> None:
    """Effect records at the fenced boundary: list, inspect, resolve parked ones, dispatch."""


@effects.command("list")
@run_option("effects")
@click.option("--status", type=click.Choice([status.value for status in EffectStatus]))
@limit_option()
@json_option("Print effects as a JSON array.")
@async_command
async def effects_list(
    settings: Settings, run_id: str | None, status: str | None, limit: int, as_json: bool
) -> None:
    """List effect records, newest first."""
    async with open_stores(settings) as stores:
        found = await stores.effects.list_effects(
            run_id=run_id, status=EffectStatus(status) if status else None, limit=limit
        )
    print_found(found, as_json, effects_table, "no effects match")


@effects.command("show")
@effect_arguments
@json_option()
@async_command
async def effects_show(settings: Settings, run_id: str, effect_key: str, as_json: bool) -> None:
    """Show one effect record."""
    async with open_stores(settings) as stores:
        effect = await stores.effects.get(run_id, effect_key)
    if as_json:
        stdout.print_json(dump_json(effect))
    else:
        stdout.print(effects_table([effect], wide=True))


@effects.command("resolve")
@effect_arguments
@click.option("--sent", "decision", flag_value="sent", help="It reached the vendor: confirm it.")
@click.option("--not-sent", "decision", flag_value="not-sent", help="It did not: send it again.")
@click.option("--external-id", help="The vendor's id for it, when --sent.")
@click.option("--by", help=BY_NOTE_HELP)
@async_command
async def effects_resolve(
    settings: Settings,
    run_id: str,
    effect_key: str,
    decision: str | None,
    external_id: str | None,
    by: str | None,
) -> None:
    """Decide a parked effect after checking with the vendor by hand."""
    if decision is None:
        raise click.UsageError("say what you found: --sent or --not-sent")
    async with open_stores(settings) as stores:
        effect = await stores.effects.resolve(
            run_id, effect_key, sent=decision == "sent", by=by, external_id=external_id
        )
    stdout.print(
        f"{run_id} {effect_key}: {effect.status.value} (by {decided_as(None, by)})",
        markup=False,
    )


effects.add_command(effects_serve)
effects.add_command(effects_dispatch)
