"""``orchestrator mcp``: MCP servers as tool sources (docs/mcp.md)."""

from __future__ import annotations

from typing import Any

import click
from rich.table import Table

from orchestrator.cli.consoles import stdout
from orchestrator.cli.presentation import dump_json
from orchestrator.cli.support import async_command, json_option
from orchestrator.errors import InvalidInput
from orchestrator.settings import Settings


@click.group()
def mcp() -> None:
    """MCP servers whose tools a tool agent offers its model."""


@mcp.command("import")
@click.argument("name")
@click.option("--url", help="The server's streamable HTTP endpoint.")
@click.option("--command", "command", help="The program that serves MCP over stdio.")
@click.option("--arg", "args", multiple=True, help="An argument of --command (repeatable).")
@click.option("--token-env", help="A variable holding a bearer token for --url.")
@json_option("Print the draft classification as a JSON document (to edit and save).")
@async_command
async def mcp_import(
    settings: Settings,
    name: str,
    url: str | None,
    command: str | None,
    args: tuple[str, ...],
    token_env: str | None,
    as_json: bool,
) -> None:
    """List server NAME's tools and print a DRAFT classification, pre-filled from the
    server's own hints (readOnlyHint, destructiveHint, idempotentHint). Hints are not to be
    trusted: review every tool, delete the ones the model must never call, then save it."""
    from orchestrator.agent.mcp.client import McpServerSpec, McpUnreachable
    from orchestrator.agent.mcp.tools import draft_classification

    options: dict[str, Any] = {"url": url} if url else {"command": command, "args": list(args)}
    if token_env:
        options["token_env"] = token_env
    spec = McpServerSpec.from_config(name, {k: v for k, v in options.items() if v is not None})
    try:
        draft = await draft_classification(spec)
    except McpUnreachable as error:
        raise InvalidInput(str(error)) from None
    if as_json:
        stdout.print_json(dump_json(draft))
        return
    table = Table(title=f"DRAFT classification of MCP server {name} (hints only: review it)")
    for column in ("tool", "class", "policy", "approve"):
        table.add_column(column)
    for tool, rule in draft["servers"][name]["tools"].items():
        table.add_row(
            tool,
            rule["class"],
            rule.get("policy", ""),
            "" if rule["class"] == "read_only" else str(rule["approve"]).lower(),
        )
    stdout.print(table)
    stdout.print("Save it with --json > mcp.json, edit it, and give it to ToolAgent.", markup=False)
