"""One kept-open connection to an MCP server (the official ``mcp`` SDK, an optional extra).

Used by the dispatcher's ``McpAdapter`` (effectful calls) and by the worker's MCP tool source
(listing tools, read-only calls). A server is reached over streamable HTTP (``url``) or stdio
(``command`` and ``args``: the server runs as a child process).

The SDK's ``Client`` is an async context manager whose transport tasks live in the task that
enters it; a transport failure (a cut HTTP stream) cancels that task. So each connection is
owned by a task of its own, and calls from any task go through it: a failure ends the owner,
never the caller, and the next call opens a new connection.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from typing import Any, TextIO

import anyio
import structlog

from orchestrator.errors import InvalidInput
from orchestrator.lazy import install_hint
from orchestrator.models import JSON

log = structlog.get_logger("orchestrator.mcp")

IDEMPOTENCY_META_KEY = "orchestrator/idempotency_key"
"""The ``_meta`` key that carries an effect's idempotency key on ``tools/call``."""

DEFAULT_CALL_SECONDS = 30.0
DEFAULT_CONNECT_SECONDS = 10.0


def require_sdk() -> None:
    """``InvalidInput`` with the fix when the ``mcp`` extra is not installed."""
    try:
        import mcp  # noqa: F401
    except ImportError:
        raise InvalidInput(f"MCP needs the mcp extra: {install_hint('mcp')}") from None


class McpUnreachable(Exception):
    """No connection could be opened: nothing was sent."""


class McpConnectionLost(Exception):
    """The connection ended while a request was in flight: the server may have acted."""


@dataclass(frozen=True)
class McpServerSpec:
    """Where an MCP server is: ``url`` (streamable HTTP) or ``command`` + ``args`` (stdio)."""

    name: str
    url: str | None = None
    command: str | None = None
    args: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    cwd: str | None = None
    headers: dict[str, str] = field(default_factory=dict)
    connect_seconds: float = DEFAULT_CONNECT_SECONDS

    @classmethod
    def from_config(cls, name: str, options: dict[str, Any]) -> McpServerSpec:
        """From a config entry: ``url`` (and ``token_env``: a bearer token from that variable),
        or ``command``, ``args``, ``env``, ``cwd``. Bad entries raise ``InvalidInput``."""
        require_sdk()
        unknown = set(options) - {
            "url",
            "command",
            "args",
            "env",
            "cwd",
            "token_env",
            "connect_seconds",
        }
        if unknown:
            raise InvalidInput(
                f"MCP server {name!r}: unknown option(s) {', '.join(sorted(unknown))}"
            )
        url, command = options.get("url"), options.get("command")
        if (url is None) == (command is None):
            raise InvalidInput(f"MCP server {name!r}: give exactly one of url or command")
        if url is not None and not (
            isinstance(url, str) and url.startswith(("http://", "https://"))
        ):
            raise InvalidInput(f"MCP server {name!r}: url must be an http(s) URL, not {url!r}")
        if command is not None and not (isinstance(command, str) and command):
            raise InvalidInput(f"MCP server {name!r}: command must be a program name or path")
        args = options.get("args", [])
        env = options.get("env", {})
        if not (isinstance(args, list) and all(isinstance(a, str) for a in args)):
            raise InvalidInput(f"MCP server {name!r}: args must be a list of strings")
        if not (isinstance(env, dict) and all(isinstance(v, str) for v in env.values())):
            raise InvalidInput(f"MCP server {name!r}: env must map names to strings")
        headers: dict[str, str] = {}
        token_env = options.get("token_env")
        if token_env is not None:
            token = os.environ.get(str(token_env))
            if token is None:
                raise InvalidInput(
                    f"MCP server {name!r}: environment variable {token_env} (its token) is not set"
                )
            headers["Authorization"] = f"Bearer {token}"
        connect = options.get("connect_seconds", DEFAULT_CONNECT_SECONDS)
        if not (isinstance(connect, int | float) and connect > 0):
            raise InvalidInput(f"MCP server {name!r}: connect_seconds must be above 0")
        cwd = options.get("cwd")
        return cls(
            name=name,
            url=url,
            command=command,
            args=tuple(args),
            env=dict(env),
            cwd=str(cwd) if cwd is not None else None,
            headers=headers,
            connect_seconds=float(connect),
        )

    def describe(self) -> str:
        return self.url or " ".join((self.command or "", *self.args))


def _errlog() -> TextIO:
    """A stdio server's stderr: ours when it is a real file, else discarded (under a test
    runner's capture)."""
    try:
        sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):
        return open(os.devnull, "w")
    return sys.stderr


class _Live:
    """One open ``Client`` and the task that owns it."""

    def __init__(self, connect_by: float) -> None:
        self.connect_by = connect_by  # on time.monotonic(): not open by then is unreachable
        self.client: Any = None
        self.ready = anyio.Event()
        self.closed = anyio.Event()
        self.stop = anyio.Event()
        self.error: BaseException | None = None
        self.task: asyncio.Task[None] | None = None


class McpConnection:
    """A connection to one MCP server, opened on first use and reopened after a failure."""

    def __init__(self, spec: McpServerSpec) -> None:
        self.spec = spec
        self._live: _Live | None = None
        self._opening = anyio.Lock()

    def _transport(self, stack: AsyncExitStack) -> Any:
        from mcp import StdioServerParameters
        from mcp.client.stdio import stdio_client
        from mcp.client.streamable_http import streamable_http_client

        if self.spec.url is not None:
            if not self.spec.headers:
                return streamable_http_client(self.spec.url)
            import httpx2  # the SDK's HTTP client; the same timeouts as its own default

            http = httpx2.AsyncClient(
                headers=self.spec.headers, timeout=httpx2.Timeout(30.0, read=300.0)
            )
            stack.push_async_callback(http.aclose)  # a client passed in is ours to close
            return streamable_http_client(self.spec.url, http_client=http)
        assert self.spec.command is not None
        params = StdioServerParameters(
            command=self.spec.command,
            args=list(self.spec.args),
            env=self.spec.env or None,
            cwd=self.spec.cwd,
        )
        return stdio_client(params, errlog=_errlog())

    async def _own(self, live: _Live) -> None:
        from mcp import Client

        try:
            async with (
                AsyncExitStack() as stack,
                Client(self._transport(stack), cache=None) as client,
            ):
                live.client = client
                live.ready.set()
                await live.stop.wait()
        except BaseException as error:  # the owner ends; callers see the connection gone
            live.error = error
            if not isinstance(error, Exception):
                raise
        finally:
            live.closed.set()
            live.ready.set()

    async def client(self) -> Any:
        """The open ``mcp.Client``; ``McpUnreachable`` when none can be opened."""
        return (await self._connected()).client

    async def _connected(self) -> _Live:
        async with self._opening:
            live = self._live
            if live is None or live.closed.is_set():
                live = self._live = _Live(time.monotonic() + self.spec.connect_seconds)
                live.task = asyncio.get_running_loop().create_task(self._own(live))
            # A caller cancelled while the connection was opening leaves it opening: the next
            # one waits for the same connection, within what is left of its connect time.
            with anyio.move_on_after(max(0.0, live.connect_by - time.monotonic())):
                await live.ready.wait()
            if live.client is None or live.closed.is_set():
                await self._end(live)
                self._live = None
                why = _first_error(live.error) if live.error else "timed out"
                raise McpUnreachable(f"cannot connect to MCP server {self.spec.name}: {why}")
            return live

    async def call_tool(
        self, name: str, arguments: dict[str, Any], *, meta: dict[str, Any] | None, seconds: float
    ) -> Any:
        """``tools/call``; raises ``McpUnreachable`` (nothing sent), ``McpConnectionLost`` or
        ``TimeoutError`` (the server may have acted), or the SDK's ``MCPError``."""
        from mcp import MCPError
        from mcp_types import CONNECTION_CLOSED, REQUEST_TIMEOUT

        live = await self._connected()
        client = live.client
        answer: list[Any] = []
        failure: list[BaseException] = []
        # A timeout or a caller's cancellation leaves the session usable (the SDK cancels the
        # request): other calls in flight on it go on. Only a lost connection ends it.
        async with anyio.create_task_group() as group:

            async def call() -> None:
                try:
                    answer.append(
                        await client.call_tool(
                            name, arguments, read_timeout_seconds=seconds, meta=meta
                        )
                    )
                except Exception as error:
                    failure.append(error)
                group.cancel_scope.cancel()

            async def watch() -> None:
                await live.closed.wait()
                group.cancel_scope.cancel()

            group.start_soon(call)
            group.start_soon(watch)
        if answer:
            return answer[0]
        if failure:
            error = failure[0]
            if isinstance(error, MCPError) and error.code == REQUEST_TIMEOUT:
                raise TimeoutError(f"no answer from MCP server {self.spec.name} in {seconds}s")
            if isinstance(error, MCPError) and error.code != CONNECTION_CLOSED:
                raise error
            await self._drop(live)
            raise McpConnectionLost(f"{type(error).__name__}: {error}") from error
        await self._drop(live)
        why = _first_error(live.error) if live.error else "closed"
        raise McpConnectionLost(f"the connection to MCP server {self.spec.name} ended: {why}")

    async def list_tools(self, *, seconds: float) -> list[Any]:
        """Every tool the server lists (all pages)."""
        live = await self._connected()
        client = live.client
        tools: list[Any] = []
        cursor: str | None = None
        try:
            with anyio.fail_after(seconds):
                for _ in range(100):
                    page = await client.list_tools(cursor=cursor)
                    tools += page.tools
                    cursor = page.next_cursor
                    if cursor is None:
                        break
        except BaseException:
            await self._drop(live)
            raise
        return tools

    async def _drop(self, live: _Live) -> None:
        if self._live is live:
            self._live = None
        await self._end(live)

    async def _end(self, live: _Live) -> None:
        live.stop.set()
        with anyio.move_on_after(5, shield=True):
            await live.closed.wait()
        if not live.closed.is_set() and live.task is not None:
            live.task.cancel()  # a server that will not close politely

    async def aclose(self) -> None:
        """Close the connection (a stdio server is stopped)."""
        if self._live is not None:
            await self._drop(self._live)


def _first_error(error: BaseException | None) -> str:
    while isinstance(error, BaseExceptionGroup) and error.exceptions:
        error = error.exceptions[0]
    return f"{type(error).__name__}: {error}" if error is not None else ""


def result_text(result: Any) -> str:
    """A ``CallToolResult``'s text blocks, joined (for an error message)."""
    return " ".join(
        str(block.text) for block in result.content if getattr(block, "type", "") == "text"
    )[:2000]


def result_json(result: Any) -> JSON:
    """A ``CallToolResult`` as JSON: its structured content, else its one text block parsed as
    JSON (or kept as text), else its content blocks."""
    if result.structured_content is not None:
        value: JSON = result.structured_content
        return value
    blocks = result.content
    if len(blocks) == 1 and getattr(blocks[0], "type", "") == "text":
        text = str(blocks[0].text)
        try:
            parsed: JSON = json.loads(text)
        except ValueError:
            return text
        return parsed
    return [block.model_dump(mode="json", by_alias=True, exclude_none=True) for block in blocks]
