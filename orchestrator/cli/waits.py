"""``orchestrator runs signal|budget``: what runs wait on besides approvals."""

from __future__ import annotations

import click

from orchestrator.cli.consoles import stderr, stdout
from orchestrator.cli.presentation import budget_table, dump_json, ledger_table
from orchestrator.cli.support import (
    async_command,
    json_option,
    read_json_option,
    wait_for_standby_option,
)
from orchestrator.client.stores import open_stores
from orchestrator.errors import InvalidTransition
from orchestrator.settings import Settings


@click.command("signal")
@click.argument("run_id")
@click.argument("name")
@click.option("--data", default="null", show_default=True, help="JSON, @file.json or @-.")
@click.option("--idempotency-key", help="Sending the same key again stores nothing new.")
@wait_for_standby_option("signal")
@json_option("Print the stored signal as JSON.")
@async_command
async def runs_signal(
    settings: Settings,
    run_id: str,
    name: str,
    data: str,
    idempotency_key: str | None,
    wait_for_standby: bool,
    as_json: bool,
) -> None:
    """Send RUN_ID the signal NAME; its next step reads it, and its commit consumes it."""
    value = read_json_option(
        data, "--data", example='give JSON such as \'{"text": "yes"}\' or null, or @file.json'
    )
    async with open_stores(settings) as stores:
        sent = await stores.signals.send(run_id, name, value, idempotency_key=idempotency_key)
        if wait_for_standby:
            await stores.held_by_standby()
    if not sent.created:
        stderr.print(f"idempotency key matched signal #{sent.signal.seq}; nothing new was stored")
    if as_json:
        stdout.print_json(dump_json({"created": sent.created, "signal": sent.signal}))
    else:
        stdout.print(f"signal #{sent.signal.seq} {name} stored for {run_id}", markup=False)


@click.command("budget")
@click.argument("run_id")
@click.option("--add-usd", help="Raise the cost limit by this many US dollars (above 0).")
@click.option("--add-turns", type=int, help="Raise the turns limit by this many (above 0).")
@click.option("--add-tool-calls", type=int)
@click.option("--add-input-tokens", type=int)
@click.option("--add-output-tokens", type=int)
@click.option("--ledger", is_flag=True, help="Also print every reservation and settlement.")
@json_option()
@async_command
async def runs_budget(
    settings: Settings,
    run_id: str,
    add_usd: str | None,
    add_turns: int | None,
    add_tool_calls: int | None,
    add_input_tokens: int | None,
    add_output_tokens: int | None,
    ledger: bool,
    as_json: bool,
) -> None:
    """Show RUN_ID's budget (spent / reserved / limit); with --add-..., top it up and wake the
    run if it waits for budget."""
    topping_up = any(
        value is not None
        for value in (add_usd, add_turns, add_tool_calls, add_input_tokens, add_output_tokens)
    )
    async with open_stores(settings) as stores:
        if topping_up:
            state = await stores.top_up(
                run_id,
                turns=add_turns,
                tool_calls=add_tool_calls,
                input_tokens=add_input_tokens,
                output_tokens=add_output_tokens,
                cost_usd=add_usd,
            )
        else:
            found = await stores.budget_of(run_id)
            if found is None:
                raise InvalidTransition(
                    f"run {run_id} has no budget (its agent declares none, or it has not "
                    "made a model call yet)"
                )
            state = found
        entries = await stores.ledger_of(run_id) if ledger else []
    if as_json:
        document = {"run_id": run_id, **state.as_json()}
        if ledger:
            document["ledger"] = [entry.as_json() for entry in entries]
        stdout.print_json(dump_json(document))
        return
    if topping_up:
        stderr.print(f"budget of {run_id} raised; a run waiting for budget is woken")
    stdout.print(budget_table(state))
    if ledger:
        stdout.print(ledger_table(entries))
