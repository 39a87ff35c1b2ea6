"""``orchestrator rates``: rate limits shared by every worker and dispatcher."""

from __future__ import annotations

from collections.abc import Sequence

import click
from rich.table import Table

from orchestrator.cli.consoles import stdout
from orchestrator.cli.presentation import dump_json, grid
from orchestrator.cli.support import async_command, json_option, print_found
from orchestrator.client.stores import open_stores
from orchestrator.db.rates import RateLimit
from orchestrator.settings import Settings

NO_RATES = "no rate limits: model calls and sends are not held back"


@click.group()
def rates() -> None:
    """Requests and tokens per interval, shared by every process: list, set, clear."""


@rates.command("list")
@click.argument("name", required=False)
@json_option("Print the rate limits as a JSON array.")
@async_command
async def rates_list(settings: Settings, name: str | None, as_json: bool) -> None:
    """Every rate limit (or NAME alone): what is left of it now, a provider's pause, the runs
    waiting for it."""
    async with open_stores(settings) as stores:
        found = await stores.rates.list(name)
    print_found(found, as_json, rates_table, NO_RATES)


@rates.command("set")
@click.argument("name")
@click.option("--requests", type=int, help="At most this many requests per interval.")
@click.option("--tokens", type=int, help="At most this many tokens per interval (model calls).")
@click.option(
    "--per",
    "per_seconds",
    type=float,
    default=60.0,
    show_default=True,
    help="The interval, in seconds.",
)
@json_option("Print the rate limit as JSON.")
@async_command
async def rates_set(
    settings: Settings,
    name: str,
    requests: int | None,
    tokens: int | None,
    per_seconds: float,
    as_json: bool,
) -> None:
    """Set rate limit NAME: model:MODEL limits calls to MODEL, effect:KIND the sends of effect
    kind KIND, any other name the steps that take it. It holds everywhere within a second."""
    async with open_stores(settings) as stores:
        await stores.rates.set(name, requests=requests, tokens=tokens, per_seconds=per_seconds)
        found = await stores.rates.list(name)
    if as_json:
        stdout.print_json(dump_json(found[0] if found else None))
        return
    allowed = " and ".join(
        f"{amount:,} {what}"
        for amount, what in ((requests, "requests"), (tokens, "tokens"))
        if amount is not None
    )
    stdout.print(f"{name}: at most {allowed} per {per_seconds:g}s", markup=False)


@rates.command("clear")
@click.argument("name")
@async_command
async def rates_clear(settings: Settings, name: str) -> None:
    """Remove rate limit NAME (and any pause a provider's 429 left on it)."""
    async with open_stores(settings) as stores:
        await stores.rates.clear(name)
    stdout.print(f"{name}: rate limit cleared", markup=False)


def _amount(limit: int | None, left: float | None) -> str:
    return "-" if limit is None else f"{max(0.0, left or 0.0):,.0f} of {limit:,}"


def rates_table(found: Sequence[RateLimit]) -> Table:
    return grid(
        ("name", "requests left", "tokens left", "per", "paused until", "waiting", "set by"),
        (
            (
                rate.name,
                _amount(rate.requests, rate.requests_left),
                _amount(rate.tokens, rate.tokens_left),
                f"{rate.per_seconds:g}s",
                "-"
                if rate.paused_until is None
                else rate.paused_until.isoformat(timespec="seconds"),
                str(rate.waiting),
                rate.set_by,
            )
            for rate in found
        ),
    )
