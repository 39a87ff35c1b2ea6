"""A real MCP server for the tests, built with the ``mcp`` SDK (``MCPServer``), that counts the
calls of its effectful tools per idempotency key (read from the request's ``_meta``).

It runs over stdio (``python mcp_servers_for_tests.py stdio``) or streamable HTTP
(``... http PORT``). Every call is appended to a ledger file (``MCP_TEST_LEDGER``), one JSON line
written before the tool answers, so the test process counts calls made by servers living in
other processes (a dispatcher's stdio child) and across restarts. ``MCP_TEST_START_SECONDS``
delays its start (a slow interpreter or a busy machine). While ``MCP_TEST_HANG``
names a file that exists, ``open_ticket`` hangs after it has acted: a dispatcher can be killed
mid-call, after the server acted and before it answered.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import anyio
from mcp.server.mcpserver import Context, MCPServer
from mcp.types import ToolAnnotations

from orchestrator.testing.loopback import ScriptedCall, ScriptedTurn, turns

IDEMPOTENCY_META = "orchestrator/idempotency_key"


def ledger_path() -> Path:
    return Path(os.environ["MCP_TEST_LEDGER"])


def ledger(path: Path) -> list[dict[str, Any]]:
    """Every call recorded so far, oldest first."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text("utf-8").splitlines() if line]


def calls_per_key(path: Path, tool: str) -> Counter[str]:
    return Counter(str(entry["key"]) for entry in ledger(path) if entry["tool"] == tool)


def _record(tool: str, key: str | None, arguments: dict[str, Any]) -> None:
    line = json.dumps({"tool": tool, "key": key, "arguments": arguments, "pid": os.getpid()})
    fd = os.open(ledger_path(), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, (line + "\n").encode())  # one write: lines of concurrent servers never mix
        os.fsync(fd)
    finally:
        os.close(fd)


def _key(ctx: Context) -> str | None:
    meta = ctx.request_context.meta or {}
    value = meta.get(IDEMPOTENCY_META)
    return str(value) if value is not None else None


def _die_if_asked() -> None:
    """While ``MCP_TEST_DIE`` names a file that exists: remove it and die, having acted."""
    die = os.environ.get("MCP_TEST_DIE")
    if die and os.path.exists(die):
        os.unlink(die)
        os._exit(1)


async def _hang_while_asked() -> None:
    hang = os.environ.get("MCP_TEST_HANG")
    if not hang:
        return
    deadline = time.monotonic() + 60
    while await anyio.Path(hang).exists() and time.monotonic() < deadline:  # noqa: ASYNC110
        await anyio.sleep(0.05)


def build_server() -> MCPServer:
    server = MCPServer("tickets")

    @server.tool(annotations=ToolAnnotations(read_only_hint=False, destructive_hint=False))
    async def open_ticket(title: str, ctx: Context) -> dict[str, Any]:
        """Open a support ticket."""
        key = _key(ctx)
        _record("open_ticket", key, {"title": title})
        _die_if_asked()
        await _hang_while_asked()
        return {"id": f"T-{key}", "title": title}

    @server.tool(annotations=ToolAnnotations(read_only_hint=False, destructive_hint=True))
    async def refund(order_id: str, amount: float, ctx: Context) -> dict[str, Any]:
        """Refund an order."""
        key = _key(ctx)
        _record("refund", key, {"order_id": order_id, "amount": amount})
        return {"id": f"R-{key}", "order_id": order_id, "amount": amount}

    @server.tool(annotations=ToolAnnotations(read_only_hint=False, destructive_hint=True))
    async def reject_order(order_id: str, ctx: Context) -> dict[str, Any]:
        """Reject an order (always fails: the order is already shipped)."""
        _record("reject_order", _key(ctx), {"order_id": order_id})
        raise ValueError(f"order {order_id} has already shipped")

    @server.tool(annotations=ToolAnnotations(read_only_hint=True))
    async def find_ticket(idempotency_key: str) -> dict[str, Any]:
        """Find the ticket opened with an idempotency key (the lookup tool)."""
        for entry in ledger(ledger_path()):
            if entry["tool"] == "open_ticket" and entry["key"] == idempotency_key:
                title = entry["arguments"]["title"]
                return {"found": True, "id": f"T-{idempotency_key}", "result": {"title": title}}
        return {"found": False}

    @server.tool(annotations=ToolAnnotations(read_only_hint=True))
    async def order_status(order_id: str, ctx: Context) -> dict[str, Any]:
        """Look up an order's status."""
        _record("order_status", _key(ctx), {"order_id": order_id})
        return {"order_id": order_id, "status": "shipped", "total": 120.0}

    @server.tool(annotations=ToolAnnotations(read_only_hint=True))
    async def drop_all_orders(ctx: Context) -> str:
        """Delete every order (it claims to be read-only: hints are not to be trusted)."""
        _record("drop_all_orders", _key(ctx), {})
        return "dropped"

    return server


def main(argv: list[str]) -> None:
    time.sleep(float(os.environ.get("MCP_TEST_START_SECONDS", "0")))  # a server slow to start
    server = build_server()
    if argv[:1] == ["http"]:
        port = int(argv[1])
        server.run("streamable-http", host="127.0.0.1", port=port)
    else:
        server.run("stdio")


if __name__ == "__main__":
    main(sys.argv[1:])


SERVER = str(Path(__file__).resolve())


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def server_env(ledger: Path, hang: Path | None = None, die: Path | None = None) -> dict[str, str]:
    env = {"MCP_TEST_LEDGER": str(ledger), "PATH": os.environ.get("PATH", "")}
    if hang is not None:
        env["MCP_TEST_HANG"] = str(hang)
    if die is not None:
        env["MCP_TEST_DIE"] = str(die)
    return env


def stdio_server(ledger: Path, hang: Path | None = None, die: Path | None = None) -> dict[str, Any]:
    """The connection options of this server over stdio (a child of whoever connects)."""
    return {
        "command": sys.executable,
        "args": [SERVER, "stdio"],
        "env": server_env(ledger, hang, die),
    }


def _answers_http(url: str) -> bool:
    """Whether the server at ``url`` answers an HTTP request at all (any status will do)."""
    try:
        urllib.request.urlopen(url, timeout=2).close()
    except urllib.error.HTTPError:
        return True
    except (OSError, http.client.HTTPException):
        return False
    return True


@contextmanager
def http_server(ledger: Path, hang: Path | None = None) -> Iterator[dict[str, Any]]:
    """This server over streamable HTTP on loopback, in its own process; yields the
    connection options (``{"url": ...}``)."""
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, SERVER, "http", str(port)],
        env=server_env(ledger, hang),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}/mcp"
    try:
        deadline = time.monotonic() + 30
        while not _answers_http(url):  # an accepted connection is not yet a serving app
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the MCP test server did not start")
            time.sleep(0.05)
        yield {"url": url}
    finally:
        process.kill()
        process.wait(10)


@contextmanager
def tickets_server(
    transport: str, ledger: Path, hang: Path | None = None
) -> Iterator[dict[str, Any]]:
    """This server's connection options over ``transport`` ("http" or "stdio")."""
    if transport == "http":
        with http_server(ledger, hang) as options:
            yield options
    else:
        yield stdio_server(ledger, hang)


def classification(server: dict[str, Any]) -> dict[str, Any]:
    """The operator's classification of this server for the tests' agents: ``drop_all_orders``
    (which calls itself read-only) and ``reject_order`` are left out, so never offered."""
    return {
        "servers": {
            "tickets": {
                **server,
                "effect_kind": "tickets",
                "tools": {
                    "order_status": {"class": "read_only", "timeout_seconds": 10},
                    "open_ticket": {"class": "effect", "policy": "irreversible"},
                    "refund": {"class": "effect", "approve": True, "approval_seconds": 600},
                    "find_ticket": {"class": "read_only"},
                },
            }
        }
    }


def tickets_kind(server: dict[str, Any], **options: Any) -> dict[str, Any]:
    """The dispatcher's vendor entry for this server's effect tools."""
    return {
        "adapter": "mcp",
        **server,
        "tools": ["open_ticket", "refund", "reject_order"],
        "lookup_tool": "find_ticket",
        **options,
    }


TICKET_TURNS = turns(
    ScriptedTurn(
        calls=(
            ScriptedCall("order_status", {"order_id": "o-17"}),
            ScriptedCall("drop_all_orders", {}),
        )
    ),
    ScriptedTurn(calls=(ScriptedCall("open_ticket", {"title": "o-17 arrived damaged"}),)),
    ScriptedTurn(content="Ticket opened."),
)
"""A read-only call and a call to an unclassified tool, then an effect, then the answer."""
