"""Commands for what runs wait on: signals, approvals, budgets."""

from __future__ import annotations

import click

from orchestrator.budgets import BudgetStore
from orchestrator.cli.support import read_json_option, run_async, settings_of, stderr, stdout
from orchestrator.db.bootstrap import open_store
from orchestrator.effects.approvals import ApprovalStore, Decision
from orchestrator.effects.store import EffectStore
from orchestrator.errors import InvalidTransition
from orchestrator.presentation import (
    approvals_table,
    budget_table,
    dump_json,
    effects_table,
    ledger_table,
)
from orchestrator.signals import SignalStore


# -- runs signal / runs budget ------------------------------------------------------------------
@click.command("signal")
@click.argument("run_id")
@click.argument("name")
@click.option("--data", default="null", show_default=True, help="JSON, @file.json or @-.")
@click.option("--idempotency-key", help="Sending the same key again stores nothing new.")
@click.option("--json", "as_json", is_flag=True, help="Print the stored signal as JSON.")
@click.pass_context
def runs_signal(
    ctx: click.Context,
    run_id: str,
    name: str,
    data: str,
    idempotency_key: str | None,
    as_json: bool,
) -> None:
    """Send RUN_ID the signal NAME; its next step reads it, and its commit consumes it."""
    settings = settings_of(ctx)

    async def body() -> None:
        value = read_json_option(
            data, "--data", example='give JSON such as \'{"text": "yes"}\' or null, or @file.json'
        )
        async with open_store(settings) as store:
            sent = await SignalStore(store.pool).send(
                run_id, name, value, idempotency_key=idempotency_key
            )
        if not sent.created:
            stderr.print(
                f"idempotency key matched signal #{sent.signal.seq}; nothing new was stored"
            )
        if as_json:
            stdout.print_json(dump_json({"created": sent.created, "signal": sent.signal}))
        else:
            stdout.print(f"signal #{sent.signal.seq} {name} stored for {run_id}", markup=False)

    run_async(body)


@click.command("budget")
@click.argument("run_id")
@click.option("--add-usd", help="Raise the cost limit by this many US dollars (above 0).")
@click.option("--add-turns", type=int, help="Raise the turns limit by this many (above 0).")
@click.option("--add-tool-calls", type=int)
@click.option("--add-input-tokens", type=int)
@click.option("--add-output-tokens", type=int)
@click.option("--ledger", is_flag=True, help="Also print every reservation and settlement.")
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def runs_budget(
    ctx: click.Context,
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
    settings = settings_of(ctx)
    topping_up = any(
        value is not None
        for value in (add_usd, add_turns, add_tool_calls, add_input_tokens, add_output_tokens)
    )

    async def body() -> None:
        async with open_store(settings) as store:
            budgets = BudgetStore(store.pool)
            await store.get(run_id)  # a clear error for an unknown run
            if topping_up:
                state = await budgets.top_up(
                    run_id,
                    turns=add_turns,
                    tool_calls=add_tool_calls,
                    input_tokens=add_input_tokens,
                    output_tokens=add_output_tokens,
                    cost_usd=add_usd,
                )
            else:
                found = await budgets.get(run_id)
                if found is None:
                    raise InvalidTransition(
                        f"run {run_id} has no budget (its agent declares none, or it has not "
                        "made a model call yet)"
                    )
                state = found
            entries = await budgets.ledger(run_id) if ledger else []
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

    run_async(body)


# -- approvals --------------------------------------------------------------------------------
@click.group()
def approvals() -> None:
    """Effects waiting for a person's decision: list, show, approve, deny."""


@approvals.command("list")
@click.option("--run", "run_id", help="Only this run's approvals.")
@click.option("--limit", type=click.IntRange(1, 10_000), default=100, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print them as a JSON array.")
@click.pass_context
def approvals_list(ctx: click.Context, run_id: str | None, limit: int, as_json: bool) -> None:
    """List effects awaiting approval, oldest first."""
    settings = settings_of(ctx)

    async def body() -> None:
        async with open_store(settings) as store:
            found = await ApprovalStore(store.pool).pending(run_id=run_id, limit=limit)
        if as_json:
            stdout.print_json(dump_json(found))
        elif found:
            stdout.print(approvals_table(found))
        else:
            stderr.print("nothing awaits approval")

    run_async(body)


@approvals.command("show")
@click.argument("run_id")
@click.argument("effect_key")
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def approvals_show(ctx: click.Context, run_id: str, effect_key: str, as_json: bool) -> None:
    """Show what approving RUN_ID's EFFECT_KEY would send: its payload and the payload's hash."""
    settings = settings_of(ctx)

    async def body() -> None:
        async with open_store(settings) as store:
            effect = await EffectStore(store.pool).get(run_id, effect_key)
            run = await store.get(run_id)
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

    run_async(body)


def _decide(decision: Decision) -> click.Command:
    verb = "approve" if decision is Decision.APPROVED else "deny"

    @click.command(verb)
    @click.argument("run_id")
    @click.argument("effect_key")
    @click.option("--by", required=True, help="Who decides (recorded in the timeline).")
    @click.option("--note", help="Why (the model is told a denial's note).")
    @click.option(
        "--hash",
        "payload_sha256",
        required=decision is Decision.APPROVED,
        help="The payload sha256 you reviewed (from `approvals show`); refused if it changed"
        + (" (required: an approval names what was approved)." if verb == "approve" else "."),
    )
    @click.option("--fence", type=int, help="The run fence you saw; refused if it moved on.")
    @click.option("--json", "as_json", is_flag=True)
    @click.pass_context
    def command(
        ctx: click.Context,
        run_id: str,
        effect_key: str,
        by: str,
        note: str | None,
        payload_sha256: str | None,
        fence: int | None,
        as_json: bool,
    ) -> None:
        settings = settings_of(ctx)

        async def body() -> None:
            async with open_store(settings) as store:
                decided = await ApprovalStore(store.pool).decide(
                    run_id,
                    effect_key,
                    decision,
                    by=by,
                    note=note,
                    payload_sha256=payload_sha256,
                    run_fence=fence,
                )
            if as_json:
                stdout.print_json(dump_json(decided))
            else:
                stdout.print(
                    f"{decision.value} {run_id} {effect_key} (payload sha256 "
                    f"{decided.payload_sha256}) by {by}",
                    markup=False,
                )

        run_async(body)

    command.help = (
        f"{verb.capitalize()} RUN_ID's EFFECT_KEY, only if its payload is still the one whose "
        "sha256 --hash names (and, with --fence, the run's fence has not moved on)."
    )
    return command


approvals.add_command(_decide(Decision.APPROVED))
approvals.add_command(_decide(Decision.DENIED))

__all__ = ["approvals", "runs_budget", "runs_signal"]
