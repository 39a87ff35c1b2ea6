"""``orchestrator approvals``: effects waiting for a person's decision."""

from __future__ import annotations

import click

from orchestrator.cli.consoles import stdout
from orchestrator.cli.presentation import approvals_table, dump_json, effects_table
from orchestrator.cli.support import (
    BY_NOTE_HELP,
    async_command,
    decided_as,
    effect_arguments,
    json_option,
    limit_option,
    print_found,
    run_option,
    wait_for_standby_option,
)
from orchestrator.client.stores import open_stores
from orchestrator.effects.approvals import Decision
from orchestrator.settings import Settings


@click.group()
def approvals() -> None:
    """Effects waiting for a person's decision: list, show, approve, deny."""


@approvals.command("list")
@run_option("approvals")
@limit_option()
@json_option("Print them as a JSON array.")
@async_command
async def approvals_list(settings: Settings, run_id: str | None, limit: int, as_json: bool) -> None:
    """List effects awaiting approval, oldest first."""
    async with open_stores(settings) as stores:
        found = await stores.approvals.pending(run_id=run_id, limit=limit)
    print_found(found, as_json, approvals_table, "nothing awaits approval")


@approvals.command("show")
@effect_arguments
@json_option()
@async_command
async def approvals_show(settings: Settings, run_id: str, effect_key: str, as_json: bool) -> None:
    """Show what approving RUN_ID's EFFECT_KEY would send: its payload and the payload's hash."""
    async with open_stores(settings) as stores:
        effect = await stores.effects.get(run_id, effect_key)
        run = await stores.runs.get(run_id)
    if as_json:
        stdout.print_json(dump_json({"effect": effect, "run_fence": run.fence}))
        return
    stdout.print(effects_table([effect], wide=True))
    stdout.print(f"payload sha256: {effect.payload_sha256}", markup=False)
    stdout.print(f"run fence:      {run.fence}", markup=False)
    if effect.decided_at is not None:
        stdout.print(
            f"decided by {effect.decided_by} at {effect.decided_at.isoformat()}", markup=False
        )


def _decide(decision: Decision) -> click.Command:
    verb = "approve" if decision is Decision.APPROVED else "deny"

    @click.command(verb)
    @effect_arguments
    @click.option("--by", help=BY_NOTE_HELP)
    @click.option("--note", help="Why (the model is told a denial's note).")
    @click.option(
        "--hash",
        "payload_sha256",
        required=decision is Decision.APPROVED,
        help="The payload sha256 you reviewed (from `approvals show`); refused if it changed"
        + (" (required: an approval names what was approved)." if verb == "approve" else "."),
    )
    @click.option("--fence", type=int, help="The run fence you saw; refused if it moved on.")
    @wait_for_standby_option("decision")
    @json_option()
    @async_command
    async def command(
        settings: Settings,
        run_id: str,
        effect_key: str,
        by: str | None,
        note: str | None,
        payload_sha256: str | None,
        fence: int | None,
        wait_for_standby: bool,
        as_json: bool,
    ) -> None:
        async with open_stores(settings) as stores:
            decided = await stores.approvals.decide(
                run_id,
                effect_key,
                decision,
                by=by,
                note=note,
                payload_sha256=payload_sha256,
                run_fence=fence,
            )
            if wait_for_standby:
                await stores.held_by_standby()
        if as_json:
            stdout.print_json(dump_json(decided))
        else:
            stdout.print(
                f"{decision.value} {run_id} {effect_key} (payload sha256 "
                f"{decided.payload_sha256}) by {decided_as(decided.decided_by, by)}",
                markup=False,
            )

    command.help = (
        f"{verb.capitalize()} RUN_ID's EFFECT_KEY, only if its payload is still the one whose "
        "sha256 --hash names (and, with --fence, the run's fence has not moved on)."
    )
    return command


approvals.add_command(_decide(Decision.APPROVED))
approvals.add_command(_decide(Decision.DENIED))
