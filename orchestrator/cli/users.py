"""``orchestrator users``: the people and services who may use the console and the action proxy,
and their tokens. Each change is audited under the database role the command connects as."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

import click
from rich.table import Table

from orchestrator.access import PrincipalKind, Role, TokenScope
from orchestrator.cli.consoles import stderr, stdout
from orchestrator.cli.presentation import dump_json, grid
from orchestrator.cli.support import async_command, json_option, print_done, print_found
from orchestrator.client.stores import open_stores
from orchestrator.db.access import PrincipalEntry, TokenEntry
from orchestrator.db.retention import parse_age
from orchestrator.errors import InvalidInput
from orchestrator.settings import Settings

DEFAULT_TOKEN_LIFETIME = "90d"
ROLE_CHOICE = click.Choice([role.value for role in Role])
ROLE_HELP = (
    "viewer (reads, sizes only), approver (decides approvals), operator (cancel, retry, resolve, "
    "signal, top up, purge), admin (people and tokens)."
)


@click.group()
def users() -> None:
    """People and services: add, list, disable, and their tokens."""


@users.command("add")
@click.argument("name")
@click.option("--role", type=ROLE_CHOICE, required=True, help=ROLE_HELP)
@click.option("--service", is_flag=True, help="A service (an action proxy client), not a person.")
@json_option()
@async_command
async def users_add(settings: Settings, name: str, role: str, service: bool, as_json: bool) -> None:
    """Add NAME with --role, or change an existing NAME's role."""
    kind = PrincipalKind.SERVICE if service else PrincipalKind.PERSON
    async with open_stores(settings) as stores:
        entry = await stores.access.set_principal(name, kind=kind, role=Role(role))
    line = f"{entry.principal.kind.value} {name} is {entry.principal.role.value}"
    print_done(entry.as_json(), as_json, line)


@users.command("list")
@json_option("Print them as a JSON array.")
@async_command
async def users_list(settings: Settings, as_json: bool) -> None:
    """List people and services with their roles and how many working tokens each holds."""
    async with open_stores(settings) as stores:
        found = await stores.access.principals()
    nothing = "nobody yet: `orchestrator users add NAME`"
    print_found(found, as_json, principals_table, nothing, PrincipalEntry.as_json)


@users.command("disable")
@click.argument("name")
@json_option()
@async_command
async def users_disable(settings: Settings, name: str, as_json: bool) -> None:
    """Disable NAME: every token of theirs stops working at once."""
    async with open_stores(settings) as stores:
        entry = await stores.access.disable(name)
    print_done(entry.as_json(), as_json, f"disabled {name}")


@users.group("token")
def token() -> None:
    """Tokens: create (printed once), list, revoke."""


@token.command("create")
@click.argument("name")
@click.option(
    "--role",
    type=ROLE_CHOICE,
    help="Add NAME with this role first if it does not exist yet. " + ROLE_HELP,
)
@click.option("--service", is_flag=True, help="With --role: NAME is a service, not a person.")
@click.option(
    "--expires",
    default=DEFAULT_TOKEN_LIFETIME,
    show_default=True,
    help="Lifetime such as 30d, 12h or 2w; `never` for a token that does not expire.",
)
@click.option("--description", help="What the token is for (listed; never secret).")
@click.option(
    "--agent", "agents", multiple=True, help="Action proxy scope: only this agent (repeatable)."
)
@click.option(
    "--kind", "kinds", multiple=True, help="Action proxy scope: only this effect kind (repeatable)."
)
@click.option("--amount-field", help="Action proxy scope: the payload field --max-amount bounds.")
@click.option("--max-amount", help="Action proxy scope: the largest number at --amount-field.")
@json_option("Print the token and its record as JSON.")
@async_command
async def token_create(
    settings: Settings,
    name: str,
    role: str | None,
    service: bool,
    expires: str,
    description: str | None,
    agents: tuple[str, ...],
    kinds: tuple[str, ...],
    amount_field: str | None,
    max_amount: str | None,
    as_json: bool,
) -> None:
    """Create a token for NAME and print it once: the database keeps only its hash."""
    if service and role is None:
        raise InvalidInput("--service says what to add NAME as: give it with --role")
    expires_in = _lifetime(expires)
    scope = TokenScope.of(
        agents=agents or None,
        kinds=kinds or None,
        amount_field=amount_field,
        max_amount=max_amount,
    )
    kind = PrincipalKind.SERVICE if service else PrincipalKind.PERSON
    async with open_stores(settings) as stores:
        existing = await stores.access.principal(name)
        if existing is not None and role is not None and existing.role.value != role:
            raise InvalidInput(
                f"{name} is {existing.role.value}, not {role}: change the role with "
                f"`orchestrator users add {name} --role {role}` first"
            )
        person = existing.kind is PrincipalKind.PERSON if existing else not service
        if person and not scope.unlimited:
            raise InvalidInput(
                f"{name} is a person: --agent, --kind and --max-amount limit what a service "
                "asks the action proxy for (add it with --service)"
            )
        issued = await stores.access.create_token(
            name,
            expires_in=expires_in,
            scope=scope,
            description=description,
            add_as=None if role is None else (kind, Role(role)),
        )
    if as_json:
        stdout.print_json(dump_json({"token": issued.secret, **issued.entry.as_json()}))
    else:
        stdout.print(issued.secret)
    expiry = issued.entry.expires_at
    stderr.print(
        f"token {issued.entry.token_id} for {name}"
        + (", never expires" if expiry is None else f", expires {expiry.isoformat()}")
        + ": store it now, it is not shown again"
    )


@token.command("list")
@click.option("--principal", help="Only this principal's tokens.")
@json_option("Print them as a JSON array (never the secrets, which are not stored).")
@async_command
async def token_list(settings: Settings, principal: str | None, as_json: bool) -> None:
    """List tokens: id, owner, scope, expiry and whether revoked; never a secret."""
    async with open_stores(settings) as stores:
        found = await stores.access.tokens(principal)
    print_found(found, as_json, tokens_table, "no tokens", TokenEntry.as_json)


@token.command("revoke")
@click.argument("token_id")
@json_option()
@async_command
async def token_revoke(settings: Settings, token_id: str, as_json: bool) -> None:
    """Revoke TOKEN_ID (its id from `users token list`, not the secret)."""
    if token_id.startswith("orc_"):
        raise InvalidInput(
            "give the token's id (from `orchestrator users token list`), not the token itself"
        )
    async with open_stores(settings) as stores:
        entry = await stores.access.revoke_token(token_id)
    print_done(entry.as_json(), as_json, f"revoked {token_id} of {entry.principal}")


def _lifetime(text: str) -> float | None:
    """Seconds for ``--expires``; None for ``never``."""
    if text.strip().lower() == "never":
        return None
    return parse_age(text, "--expires").total_seconds()


def principals_table(entries: Sequence[PrincipalEntry]) -> Table:
    return grid(
        ("name", "kind", "role", "tokens", "created", "by", "disabled"),
        (
            (
                entry.principal.name,
                entry.principal.kind.value,
                entry.principal.role.value,
                "" if entry.live_tokens is None else str(entry.live_tokens),
                _when(entry.created_at),
                entry.created_by,
                "" if entry.disabled_at is None else _when(entry.disabled_at),
            )
            for entry in entries
        ),
    )


def tokens_table(entries: Sequence[TokenEntry]) -> Table:
    return grid(
        ("id", "principal", "scope", "expires", "revoked", "last used", "description"),
        (
            (
                entry.token_id,
                entry.principal,
                _scope_text(entry.scope.as_json()),
                "never" if entry.expires_at is None else _when(entry.expires_at),
                ""
                if entry.revoked_at is None
                else f"{_when(entry.revoked_at)} by {entry.revoked_by}",
                "" if entry.last_used_at is None else _when(entry.last_used_at),
                entry.description or "",
            )
            for entry in entries
        ),
    )


def _when(moment: datetime) -> str:
    return moment.isoformat(timespec="seconds")


def _scope_text(scope: dict[str, Any] | None) -> str:
    if scope is None:
        return "any"
    parts = []
    if scope["agents"]:
        parts.append("agents " + ",".join(scope["agents"]))
    if scope["kinds"]:
        parts.append("kinds " + ",".join(scope["kinds"]))
    if scope["amount_field"]:
        parts.append(f"{scope['amount_field']} <= {scope['max_amount']}")
    return "; ".join(parts)
