"""A tool agent whose tools live in an MCP server, with its effectful tool sent through the fence.

    pip install -e '.[mcp]'                              # from a checkout of this repository
    pip install 'fenced-orchestrator[mcp]'               # or from an index that has it
    python examples/mcp_tickets.py                       # embedded PostgreSQL, ./.orchestrator
    ORCHESTRATOR_DATABASE_URL=postgresql://... python examples/mcp_tickets.py

This one file is also the MCP server (``python examples/mcp_tickets.py server``: the ``mcp``
SDK's ``MCPServer`` over stdio). The operator's classification offers the model one read-only
tool (``order_status``, called by the worker in the turn) and one effect (``open_ticket``,
recorded in the turn's commit and called once by the dispatcher, with the run's idempotency key
in ``_meta``); the server's ``delete_orders`` is not classified, so it is never offered and a
call to it is refused. The model is the scripted model server, so nothing leaves the machine.

It prints one JSON line on standard output: the run's state, its answer and its error (none).
The MCP server (a child process) logs each ticket it opens on standard error, as
``{"opened": {"id": "T-1", "title": "o-17 arrived damaged"}}``: once, however often the
dispatcher asks. See docs/mcp.md.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import anyio
from mcp.server.mcpserver import Context, MCPServer

from orchestrator import Settings, ToolAgent
from orchestrator.agent.mcp.tools import load_classification
from orchestrator.effects.vendors import adapter_from_config
from orchestrator.testing import ScriptedCall, ScriptedModelServer, ScriptedTurn, run_agent, turns

OPENED: dict[str, dict[str, Any]] = {}
"""The server's tickets by idempotency key; in memory here, durable in a real server (a stdio
server restarted by a reconnecting dispatcher must still find what it did)."""


def serve_mcp() -> None:
    """The MCP server: it opens a ticket at most once per idempotency key, and can say whether
    it opened one (the lookup the dispatcher uses after a call whose answer was lost)."""
    server = MCPServer("tickets")

    @server.tool()
    def order_status(order_id: str) -> dict[str, Any]:
        """Look an order up."""
        return {"order_id": order_id, "status": "damaged in transit"}

    @server.tool()
    def open_ticket(title: str, ctx: Context) -> dict[str, Any]:
        """Open a support ticket."""
        key = str((ctx.request_context.meta or {}).get("orchestrator/idempotency_key"))
        ticket = OPENED.setdefault(key, {"id": f"T-{len(OPENED) + 1}", "title": title})
        print(json.dumps({"opened": ticket}), file=sys.stderr)
        return ticket

    @server.tool()
    def find_ticket(idempotency_key: str) -> dict[str, Any]:
        """The ticket opened with an idempotency key, if any."""
        found = OPENED.get(idempotency_key)
        return {"found": True, **found} if found else {"found": False}

    @server.tool()
    def delete_orders() -> str:
        """Delete every order."""
        return "deleted"

    server.run("stdio")


SERVER = {"command": sys.executable, "args": [os.path.abspath(__file__), "server"]}

CLASSIFICATION = {
    "servers": {
        "tickets": {
            **SERVER,
            "effect_kind": "tickets",
            "tools": {
                "order_status": {"class": "read_only", "timeout_seconds": 10},
                "open_ticket": {"class": "effect", "policy": "irreversible"},
            },
        }
    }
}
"""The operator's word, usually a file (``load_classification("mcp.json")``)."""

DISPATCHER_KIND = {
    "adapter": "mcp",
    **SERVER,
    "tools": ["open_ticket"],
    "lookup_tool": "find_ticket",
}
"""The dispatcher's vendor entry for the effect kind (``ORCHESTRATOR_EFFECTS_CONFIG``)."""

SCRIPT = turns(
    ScriptedTurn(
        calls=(
            ScriptedCall("order_status", {"order_id": "o-17"}),
            ScriptedCall("delete_orders", {}),
        )
    ),
    ScriptedTurn(calls=(ScriptedCall("open_ticket", {"title": "o-17 arrived damaged"}),)),
    ScriptedTurn(content="I opened ticket T-1 for your damaged order."),
)


async def main() -> None:
    sources = load_classification(CLASSIFICATION)
    agent = ToolAgent(
        "mcp_tickets_example",
        instructions="Check the order, then open a ticket for the customer.",
        tools=sources,
        max_turns=5,
    )
    adapter = adapter_from_config("tickets", DISPATCHER_KIND)
    try:
        async with ScriptedModelServer(SCRIPT) as model:
            os.environ["OPENAI_BASE_URL"] = model.base_url
            os.environ["OPENAI_API_KEY"] = ""  # never send a real key to a local server
            run, _timeline = await run_agent(
                Settings.from_env(),
                agent,
                {"prompt": "My order o-17 arrived damaged."},
                poll_seconds=0.1,
                effect_adapters={"tickets": adapter},
            )
    finally:
        for source in sources:
            await source.aclose()
    result = run.result or {}
    print(
        json.dumps({"state": run.state.value, "output": result.get("output"), "error": run.error})
    )


if __name__ == "__main__":
    if sys.argv[1:] == ["server"]:
        serve_mcp()
    else:
        anyio.run(main)
