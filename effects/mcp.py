"""The ``mcp`` adapter: the dispatcher calls an effectful MCP tool, once per idempotency key.

A payload is ``{"server": NAME, "tool": TOOL, "arguments": {...}}`` (what an MCP effect tool of
a ``ToolAgent`` records). The adapter keeps one connection to its server open (reopened after a
failure), calls only the tools its configuration lists, and passes the effect's idempotency key
in the request's ``_meta`` as ``orchestrator/idempotency_key``.

Outcomes: a result -> ``Confirmed`` (its structured content, else its content blocks); a result
with ``isError`` -> ``Failed``; no connection could be opened -> ``Retry`` (nothing was sent);
a timeout, a connection lost after the request was written, or a stdio server that died ->
``Uncertain``. Reconciliation calls the configured read-only ``lookup_tool`` with the key:
``{"found": true, ...}`` -> ``Confirmed``, ``{"found": false}`` -> ``NotSent`` (sent again,
same key); without a lookup tool the effect is parked for a person. Never resent blindly.

Config (one kind of ``ORCHESTRATOR_EFFECTS_CONFIG``)::

    "tickets": {"adapter": "mcp", "url": "http://127.0.0.1:8000/mcp",
                "tools": ["open_ticket", "refund"], "lookup_tool": "find_ticket"}

or ``"command": "python", "args": ["server.py"]`` for a stdio server.
"""

from __future__ import annotations

from typing import Any

from orchestrator.agent.mcp.client import (
    DEFAULT_CALL_SECONDS,
    IDEMPOTENCY_META_KEY,
    McpConnection,
    McpConnectionLost,
    McpServerSpec,
    McpUnreachable,
    result_json,
    result_text,
)
from orchestrator.effect_model import EffectRecord
from orchestrator.effects.adapters import (
    Confirmed,
    Failed,
    NotSent,
    Park,
    ReconcileOutcome,
    Retry,
    SendOutcome,
    Uncertain,
)
from orchestrator.errors import InvalidInput

_REFUSED_UNSENT = frozenset((-32700, -32600, -32601, -32602))
"""JSON-RPC errors that say the call was never run: parse error, invalid request, method not
found, invalid params."""


class McpAdapter:
    """Calls effectful tools of one MCP server (see the module docstring)."""

    def __init__(
        self,
        kind: str,
        *,
        tools: list[str],
        lookup_tool: str | None = None,
        lookup_argument: str = "idempotency_key",
        timeout_seconds: float = DEFAULT_CALL_SECONDS,
        **server: Any,
    ) -> None:
        if not (isinstance(tools, list) and tools and all(isinstance(t, str) for t in tools)):
            raise ValueError(f"{kind}: tools must list the MCP tools this kind may call")
        if not timeout_seconds > 0:
            raise ValueError(f"{kind}: timeout_seconds must be above 0")
        self.kind = kind
        self.tools = frozenset(tools)
        self.lookup_tool = lookup_tool
        self.lookup_argument = lookup_argument
        self.timeout = float(timeout_seconds)
        try:
            spec = McpServerSpec.from_config(kind, server)
        except InvalidInput as error:
            raise ValueError(str(error)) from None
        self.connection = McpConnection(spec)

    async def connect(self) -> None:
        """Open the server's connection (``McpUnreachable`` if it cannot be): nothing is sent."""
        await self.connection.client()

    async def send(self, effect: EffectRecord) -> SendOutcome:
        payload = effect.payload if isinstance(effect.payload, dict) else {}
        tool, arguments = payload.get("tool"), payload.get("arguments", {})
        if tool not in self.tools:
            return Failed(f"{self.kind} does not call MCP tool {tool!r}: not in its tools list")
        if not isinstance(arguments, dict):
            return Failed("the payload's arguments are not a JSON object")
        from mcp import MCPError

        try:
            result = await self.connection.call_tool(
                str(tool),
                arguments,
                meta={IDEMPOTENCY_META_KEY: effect.idempotency_key},
                seconds=self.timeout,
            )
        except McpUnreachable as error:
            return Retry(str(error))
        except (McpConnectionLost, TimeoutError) as error:
            return Uncertain(str(error))
        except MCPError as error:
            if error.code in _REFUSED_UNSENT:
                return Failed(f"MCP error {error.code}: {error.message}")
            return Uncertain(f"MCP error {error.code}: {error.message}")
        if result.is_error:
            return Failed(result_text(result) or f"{tool} answered with an error")
        body = result_json(result)
        external = body.get("id") if isinstance(body, dict) else None
        return Confirmed(str(external) if external is not None else None, body)

    async def reconcile(self, effect: EffectRecord) -> ReconcileOutcome:
        if self.lookup_tool is None:
            return Park(
                f"{self.kind} has no lookup_tool and the last call may have reached the server"
            )
        from mcp import MCPError

        try:
            result = await self.connection.call_tool(
                self.lookup_tool,
                {self.lookup_argument: effect.idempotency_key},
                meta=None,
                seconds=self.timeout,
            )
        except (McpUnreachable, McpConnectionLost, TimeoutError, MCPError) as error:
            return Uncertain(f"lookup failed: {error}")
        if result.is_error:
            return Uncertain(f"lookup failed: {result_text(result)}")
        body = result_json(result)
        found = body.get("found") if isinstance(body, dict) else None
        if found is False:
            return NotSent()
        if found is True:
            assert isinstance(body, dict)
            external = body.get("id")
            answer = body.get("result", body)
            return Confirmed(str(external) if external is not None else None, answer)
        return Park(f'{self.lookup_tool} answered without "found": true or false')

    async def aclose(self) -> None:
        await self.connection.aclose()
