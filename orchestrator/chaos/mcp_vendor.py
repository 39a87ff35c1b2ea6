"""The campaign's MCP server: an effectful tool whose calls are deliveries of the campaign's
vendor (one per idempotency key, read from ``_meta``; its faults apply), and the lookup tool the
``mcp`` adapter reconciles through. Served over streamable HTTP on loopback, in the campaign's
process; imported (by the campaign) only when the ``mcp`` extra is installed."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any

import anyio
import uvicorn
from mcp import MCPError
from mcp.server.mcpserver import Context, MCPServer

from orchestrator.agent.mcp.client import IDEMPOTENCY_META_KEY
from orchestrator.chaos.agents import MCP_SERVER as SERVER
from orchestrator.chaos.vendor import ChaosVendor


def dispatcher_kind(url: str) -> dict[str, Any]:
    return {
        "adapter": "mcp",
        "url": url,
        "tools": ["open_case"],
        "lookup_tool": "find_case",
        "timeout_seconds": 5,
    }


def _server(vendor: ChaosVendor) -> MCPServer:
    server = MCPServer(SERVER)

    async def open_case(customer: str, summary: str, ctx: Context) -> dict[str, Any]:
        """Open a support case for the customer (once per idempotency key)."""
        key = (ctx.request_context.meta or {}).get(IDEMPOTENCY_META_KEY)
        if not key:
            raise MCPError(-32602, f"_meta must carry {IDEMPOTENCY_META_KEY}")
        payload = {
            "server": SERVER,
            "tool": "open_case",
            "arguments": {"customer": customer, "summary": summary},
        }
        status, answer = await vendor.deliver(str(key), payload)
        if status >= 500:
            raise MCPError(-32603, "internal error")  # like a 5xx: it may be retried
        return {"id": answer["id"]}

    async def find_case(idempotency_key: str) -> dict[str, Any]:
        """The case opened with an idempotency key, if any."""
        found = vendor.deliveries.get(idempotency_key)
        if found is None:
            return {"found": False}
        return {"found": True, "id": f"op_{found.key[-12:]}"}

    server.add_tool(open_case)
    server.add_tool(find_case)
    return server


class _QuietServer(uvicorn.Server):
    @contextmanager
    def capture_signals(self) -> Iterator[None]:
        # The campaign handles SIGINT itself; uvicorn's handler would take it over.
        yield


@asynccontextmanager
async def serving(vendor: ChaosVendor) -> AsyncIterator[str]:
    """The MCP server on loopback until the block ends; yields its URL."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = int(probe.getsockname()[1])
    config = uvicorn.Config(
        _server(vendor).streamable_http_app(), host="127.0.0.1", port=port, log_level="warning"
    )
    server = _QuietServer(config)
    async with anyio.create_task_group() as group:
        group.start_soon(server.serve)
        with anyio.fail_after(30):
            while not server.started:  # noqa: ASYNC110 - uvicorn offers no event
                await anyio.sleep(0.02)
        try:
            yield f"http://127.0.0.1:{port}/mcp"
        finally:
            server.should_exit = True
