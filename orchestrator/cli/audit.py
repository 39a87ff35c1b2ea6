"""``orchestrator audit``: the hash-chained record of every human and service decision."""

from __future__ import annotations

import sys
from collections.abc import Sequence

import click
from rich.table import Table

from orchestrator.cli.consoles import stderr, stdout
from orchestrator.cli.presentation import dump_json, grid
from orchestrator.cli.support import (
    async_command,
    json_option,
    limit_option,
    print_found,
    run_option,
)
from orchestrator.client.stores import open_stores
from orchestrator.db.audit import AuditEntry
from orchestrator.jsontext import compact
from orchestrator.settings import Settings


@click.group()
def audit() -> None:
    """The audit trail: list its rows, verify its hash chain."""


@audit.command("list")
@click.option("--after", type=click.IntRange(0), default=0, help="Only rows after this seq.")
@limit_option()
@run_option("rows")
@click.option("--principal", help="Only what this principal did.")
@click.option("--action", help="Only this action (approve, cancel, token_created, ...).")
@json_option("Print the rows as a JSON array, with their hashes.")
@async_command
async def audit_list(
    settings: Settings,
    after: int,
    limit: int,
    run_id: str | None,
    principal: str | None,
    action: str | None,
    as_json: bool,
) -> None:
    """List audit rows, oldest first: who (principal, how authenticated, database role) did
    what, when."""
    async with open_stores(settings) as stores:
        found = await stores.audit.entries(
            after=after, limit=limit, run_id=run_id, principal=principal, action=action
        )
    print_found(found, as_json, audit_table, "no audit rows", AuditEntry.as_json)


@audit.command("verify")
@click.option(
    "--expect-head",
    help="The head sha256 an earlier verify printed (kept elsewhere): also catches rows "
    "removed from the end.",
)
@json_option()
@async_command
async def audit_verify(settings: Settings, expect_head: str | None, as_json: bool) -> None:
    """Rebuild every row's hash and link; exit 1 if a row was edited, deleted or inserted."""
    async with open_stores(settings) as stores:
        verification = await stores.audit.verify(
            expect_head=expect_head,
            progress=lambda rows: stderr.print(f"checked {rows} rows …"),
        )
    if as_json:
        stdout.print_json(
            dump_json(
                {
                    "intact": verification.intact,
                    "rows": verification.rows,
                    "head_seq": verification.head_seq,
                    "head_sha256": verification.head_sha256,
                    "problems": verification.problems,
                }
            )
        )
    else:
        for problem in verification.problems:
            stderr.print(f"problem: {problem}", markup=False)
        state = "intact" if verification.intact else "BROKEN"
        stdout.print(
            f"{state}: {verification.rows} rows, head seq {verification.head_seq} "
            f"sha256 {verification.head_sha256}",
            markup=False,
        )
    if not verification.intact:
        sys.exit(1)


def audit_table(entries: Sequence[AuditEntry]) -> Table:
    return grid(
        ("seq", "at", "principal", "via", "db role", "action", "run", "effect", "detail"),
        (
            (
                str(entry.seq),
                entry.at.isoformat(timespec="seconds"),
                entry.principal,
                entry.via,
                entry.db_user,
                entry.action,
                entry.run_id or "",
                entry.effect_key or "",
                compact(entry.detail) if entry.detail else "",
            )
            for entry in entries
        ),
    )
