"""``orchestrator limits``: how many runs of an agent may hold a lease at once."""

from __future__ import annotations

from collections.abc import Sequence

import click
from rich.table import Table

from orchestrator.cli.consoles import stdout
from orchestrator.cli.presentation import dump_json, grid
from orchestrator.cli.support import async_command, json_option, print_found
from orchestrator.client.stores import open_stores
from orchestrator.db.limits import MAX_RUNNING, Limit, Per
from orchestrator.settings import Settings

NO_LIMITS = "no limits: every due run is claimed at once"


@click.group()
def limits() -> None:
    """How many runs of an agent may hold a lease at once: list, set, clear."""


def _scope(function: click.decorators.FC) -> click.decorators.FC:
    """``--keys PATTERN`` and ``--per-key``: which runs a limit counts, and how."""
    function = click.option(
        "--per-key",
        is_flag=True,
        help="Count each key apart (at most N runs of every key), not all together.",
    )(function)
    return click.option(
        "--keys",
        "key_pattern",
        default="*",
        show_default=True,
        help="The keys it counts, a glob ('tenant-*'); '*' together counts runs without a key.",
    )(function)


@limits.command("list")
@click.option("--agent", "agents", multiple=True, help="Only this agent's limits (repeatable).")
@json_option("Print the limits as a JSON array.")
@async_command
async def limits_list(settings: Settings, agents: tuple[str, ...], as_json: bool) -> None:
    """Every limit, with the runs it counts now and the due runs it covers."""
    async with open_stores(settings) as stores:
        found = [
            limit
            for agent in dict.fromkeys(agents or (None,))
            for limit in await stores.limits.list(agent)
        ]
    print_found(found, as_json, limits_table, NO_LIMITS)


@limits.command("set")
@click.argument("agent")
@click.option(
    "--max-running",
    type=click.IntRange(0, MAX_RUNNING),
    required=True,
    help="At most this many runs hold a lease at once (0 holds every new claim back).",
)
@_scope
@json_option("Print the limit as JSON.")
@async_command
async def limits_set(
    settings: Settings,
    agent: str,
    max_running: int,
    key_pattern: str,
    per_key: bool,
    as_json: bool,
) -> None:
    """Set AGENT's limit (raise or lower it): it holds from the next claim on; lowering it never
    stops a running run."""
    per: Per = "key" if per_key else "all"
    async with open_stores(settings) as stores:
        previous = await stores.limits.set(agent, max_running, key_pattern=key_pattern, per=per)
        found = [lim for lim in await stores.limits.list(agent) if _same(lim, key_pattern, per)]
    if as_json:
        stdout.print_json(dump_json({"limit": found[0] if found else None, "previous": previous}))
        return
    was = "" if previous is None else f" (was {previous})"
    scope = f"each key matching {key_pattern!r}" if per == "key" else f"keys {key_pattern!r}"
    stdout.print(f"{agent}: at most {max_running} running, {scope}{was}", markup=False)


@limits.command("clear")
@click.argument("agent")
@_scope
@async_command
async def limits_clear(settings: Settings, agent: str, key_pattern: str, per_key: bool) -> None:
    """Remove one of AGENT's limits (the one --keys and --per-key name)."""
    per: Per = "key" if per_key else "all"
    async with open_stores(settings) as stores:
        cleared = await stores.limits.clear(agent, key_pattern=key_pattern, per=per)
    stdout.print(f"{agent}: limit of {cleared} for keys {key_pattern!r} ({per}) cleared")


def _same(limit: Limit, key_pattern: str, per: str) -> bool:
    return limit.key_pattern == key_pattern and limit.per == per


def limits_table(found: Sequence[Limit]) -> Table:
    return grid(
        ("agent", "keys", "per", "max running", "running", "backlog", "set by", "set at"),
        (
            (
                limit.agent,
                limit.key_pattern,
                limit.per,
                str(limit.max_running),
                str(limit.running),
                str(limit.backlog),
                f"{limit.set_by} (code)" if limit.declared else limit.set_by,
                limit.set_at.isoformat(timespec="seconds"),
            )
            for limit in found
        ),
    )
