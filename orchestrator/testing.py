"""Test support for orchestrator and for agent authors' own tests: real PostgreSQL, fast.

- ``DatabaseFactory``: a freshly migrated database per test;
- ``running_worker`` / ``run_agent``: run a worker (or one input through an agent) in a test;
- ``FaultProxy``: a loopback TCP proxy that partitions a worker from PostgreSQL on demand;
- ``LocalModelServer``: an OpenAI-compatible model server on loopback;
- ``LocalVendor``: an HTTP vendor that honours idempotency keys and can misbehave on demand.

``DatabaseFactory`` migrates a template database once per test session and gives each test a
fresh copy through ``CREATE DATABASE ... TEMPLATE`` (a file copy: tens of milliseconds), so
tests are isolated without paying for migrations each time. With no server given it starts an
embedded PostgreSQL in a temporary directory, tuned for tests (no fsync).
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import json
import os
import shutil
import tempfile
from collections.abc import AsyncIterator, Iterable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import anyio
import anyio.abc
import anyio.streams.buffered
import asyncpg

from orchestrator.db.connections import connect, create_pool
from orchestrator.db.embedded import EmbeddedPostgres
from orchestrator.db.migrations import migrate
from orchestrator.db.store import RunStore
from orchestrator.models import JSON, TERMINAL_STATES, Run, RunEvent, RunState
from orchestrator.settings import Settings
from orchestrator.steps import Agent, AgentRegistry
from orchestrator.worker.worker import Supervisor, WorkerConfig

TEST_SERVER_SETTINGS = {
    # Durability is not under test and fsync dominates small transactions on CI disks.
    "fsync": "off",
    "synchronous_commit": "off",
    "full_page_writes": "off",
}


def with_database(dsn: str, database: str) -> str:
    parts = urlsplit(dsn)
    return urlunsplit(parts._replace(path="/" + database))


class DatabaseFactory:
    """Hands out freshly migrated databases on one server."""

    def __init__(self, server_dsn: str | None = None) -> None:
        self._home: Path | None = None
        self.embedded: EmbeddedPostgres | None = None
        if server_dsn is None:
            self._home = Path(tempfile.mkdtemp(prefix="orchestrator-test-"))
            self.embedded = EmbeddedPostgres(self._home, server_settings=TEST_SERVER_SETTINGS)
            server_dsn = self.embedded.ensure_running().dsn()
        self.server_dsn = server_dsn
        self.template = f"orchestrator_template_{os.getpid()}"
        self._counter = itertools.count(1)
        self._ready = False

    @property
    def settings(self) -> Settings:
        return Settings(database_url=self.server_dsn)

    async def _admin(self) -> asyncpg.Connection:
        return await connect(self.settings, application_name="orchestrator-tests")

    async def prepare(self) -> None:
        if self._ready:
            return
        admin = await self._admin()
        try:
            await admin.execute(f'DROP DATABASE IF EXISTS "{self.template}" WITH (FORCE)')
            await admin.execute(f'CREATE DATABASE "{self.template}"')
        finally:
            await admin.close()
        migrator = await connect(self.settings, dsn=with_database(self.server_dsn, self.template))
        try:
            await migrate(migrator)
        finally:
            await migrator.close()
        self._ready = True

    async def create(self) -> str:
        """A new, migrated, empty database; returns its DSN."""
        await self.prepare()
        name = f"orchestrator_test_{os.getpid()}_{next(self._counter)}"
        admin = await self._admin()
        try:
            await admin.execute(f'CREATE DATABASE "{name}" TEMPLATE "{self.template}"')
        finally:
            await admin.close()
        return with_database(self.server_dsn, name)

    async def drop(self, dsn: str) -> None:
        name = urlsplit(dsn).path.lstrip("/")
        admin = await self._admin()
        try:
            await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        finally:
            await admin.close()

    def close(self) -> None:
        """Stop the embedded server (if this factory started one) and delete its files."""
        if self.embedded is not None:
            self.embedded.stop(mode="immediate")
        if self._home is not None:
            shutil.rmtree(self._home, ignore_errors=True)


# -- running a worker inside a test ------------------------------------------------------------
@asynccontextmanager
async def running_worker(
    settings: Settings,
    agents: Sequence[Agent] | AgentRegistry,
    **options: Any,
) -> AsyncIterator[Supervisor]:
    """Run a worker for the body of an ``async with``, then drain it.

    Start it inside the test body, not across an async fixture's ``yield``: a task group (and
    its cancel scope) must begin and end in the same task.
    """
    registry = agents if isinstance(agents, AgentRegistry) else AgentRegistry(agents)
    options.setdefault("status_seconds", 3600.0)
    supervisor = Supervisor(settings, WorkerConfig(agents=registry, **options))
    async with anyio.create_task_group() as group:
        group.start_soon(supervisor.run)
        with anyio.fail_after(30):
            await supervisor.ready.wait()
        try:
            yield supervisor
        finally:
            supervisor.request_stop()


async def wait_for_run(
    store: RunStore,
    run_id: str,
    *,
    states: Iterable[RunState] = TERMINAL_STATES,
    within: float = 30,
) -> Run:
    """Poll until the run reaches one of ``states`` (terminal by default)."""
    wanted = set(states)
    with anyio.fail_after(within):
        while True:
            run = await store.get(run_id)
            if run.state in wanted:
                return run
            await anyio.sleep(0.05)


async def run_agent(
    settings: Settings, agent: Agent, input: JSON, *, within: float = 60, **options: Any
) -> tuple[Run, list[RunEvent]]:
    """The step harness for agent authors: run one input through ``agent`` on a real database
    and return the finished run and its timeline."""
    pool = await create_pool(settings, application_name="orchestrator-harness")
    try:
        store = RunStore(pool)
        async with running_worker(settings, [agent], **options):
            run_id = (await store.submit(agent.name, input)).run.run_id
            run = await wait_for_run(store, run_id, within=within)
        return run, await store.events(run_id)
    finally:
        await pool.close()


# -- loopback services for tests ---------------------------------------------------------------
class LoopbackService:
    """A TCP service on 127.0.0.1 for the life of an ``async with``; subclasses ``handle``."""

    def __init__(self) -> None:
        self.port = 0
        self._group: anyio.abc.TaskGroup | None = None
        self._listener: anyio.abc.Listener[anyio.abc.SocketStream] | None = None

    async def __aenter__(self) -> Any:
        listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)
        self.port = int(listener.extra(anyio.abc.SocketAttribute.local_port))
        self._listener = listener
        self._group = anyio.create_task_group()
        await self._group.__aenter__()
        self._group.start_soon(listener.serve, self.handle)
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        assert self._group is not None and self._listener is not None
        self._group.cancel_scope.cancel()
        await self._group.__aexit__(None, None, None)
        await self._listener.aclose()

    async def handle(self, stream: anyio.abc.SocketStream) -> None:
        raise NotImplementedError


# -- a loopback TCP proxy that injects network faults ------------------------------------------
class FaultProxy(LoopbackService):
    """A TCP proxy on 127.0.0.1 between a client and PostgreSQL, for partition tests.

    ``mode`` may be changed at any time:
    - ``forward``: pass bytes both ways;
    - ``blackhole``: pass nothing either way, keep every socket open (a partition: the server
      keeps the client's session, so its locks and leases stay held);
    - ``drop_replies``: pass client→server, discard server→client (requests are processed,
      their answers are lost).
    Traffic only ever goes to the loopback target it was given.
    """

    MODES = ("forward", "blackhole", "drop_replies")

    def __init__(self, target_host: str, target_port: int) -> None:
        if target_host not in ("127.0.0.1", "::1", "localhost"):
            raise ValueError("FaultProxy only forwards to loopback")
        super().__init__()
        self.target = (target_host, target_port)
        self._mode = "forward"
        self._flowing = anyio.Event()
        self._flowing.set()

    @property
    def mode(self) -> str:
        return self._mode

    @mode.setter
    def mode(self, mode: str) -> None:
        if mode not in self.MODES:
            raise ValueError(f"mode must be one of {self.MODES}")
        self._mode = mode
        if mode == "blackhole":
            self._flowing = anyio.Event()
        else:
            self._flowing.set()

    def dsn_for(self, dsn: str) -> str:
        parts = urlsplit(dsn)
        netloc = parts.netloc.rsplit("@", 1)
        userinfo = netloc[0] + "@" if len(netloc) == 2 else ""
        return urlunsplit(parts._replace(netloc=f"{userinfo}127.0.0.1:{self.port}"))

    async def handle(self, client: anyio.abc.SocketStream) -> None:
        async with (
            client,
            await anyio.connect_tcp(*self.target) as server,
            anyio.create_task_group() as pipes,
        ):
            pipes.start_soon(self._pipe, client, server, "to_server")
            pipes.start_soon(self._pipe, server, client, "to_client")

    async def _pipe(
        self, source: anyio.abc.SocketStream, sink: anyio.abc.SocketStream, direction: str
    ) -> None:
        with contextlib.suppress(
            anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError, OSError
        ):
            while True:
                data = await source.receive()
                await self._flowing.wait()
                if self.mode == "drop_replies" and direction == "to_client":
                    continue
                await sink.send(data)
        with contextlib.suppress(Exception):
            await sink.aclose()


# -- small loopback HTTP servers for tests ---------------------------------------------------
class LoopbackHttpServer(LoopbackService):
    """A minimal HTTP/1.1 JSON server on 127.0.0.1 (keep-alive, Content-Length bodies only).

    Subclasses implement ``respond``; tests use them as real vendors and model servers.
    """

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def respond(
        self, method: str, path: str, headers: dict[str, str], body: bytes
    ) -> tuple[int, Any]:
        raise NotImplementedError

    async def handle(self, stream: anyio.abc.SocketStream) -> None:
        buffered = anyio.streams.buffered.BufferedByteReceiveStream(stream)
        with contextlib.suppress(
            anyio.EndOfStream, anyio.BrokenResourceError, anyio.IncompleteRead
        ):
            async with stream:
                while True:
                    head = await buffered.receive_until(b"\r\n\r\n", 65536)
                    request_line, *header_lines = head.decode("latin-1").split("\r\n")
                    headers = {
                        name.strip().lower(): value.strip()
                        for name, _, value in (line.partition(":") for line in header_lines)
                    }
                    length = int(headers.get("content-length", "0"))
                    body = await buffered.receive_exactly(length) if length else b""
                    method, path, _ = request_line.split(" ", 2)
                    status, payload = await self.respond(method, path, headers, body)
                    data = json.dumps(payload).encode()
                    await stream.send(
                        f"HTTP/1.1 {status} X\r\ncontent-type: application/json\r\n"
                        f"content-length: {len(data)}\r\n\r\n".encode()
                        + data
                    )


class LocalModelServer(LoopbackHttpServer):
    """A tiny OpenAI-compatible chat-completions server on 127.0.0.1, for tests and demos.

    It answers ``POST .../chat/completions`` with ``reply(messages)`` (by default a summary made
    of the last message's first words), after ``delay`` seconds; ``requests`` records every
    request body. Point a worker at it with ``ORCHESTRATOR_MODEL_BASE_URL=server.base_url``.
    """

    def __init__(self, *, delay: float = 0.0, reply: Any = None) -> None:
        super().__init__()
        self.delay = delay
        self.reply = reply or (
            lambda messages: (
                "Summary: " + " ".join(str(messages[-1].get("content", "")).split()[:12])
            )
        )
        self.requests: list[dict[str, Any]] = []

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"

    async def respond(
        self, method: str, path: str, headers: dict[str, str], body: bytes
    ) -> tuple[int, Any]:
        if method != "POST" or not path.endswith("/chat/completions"):
            return 404, {"error": {"message": f"no route {method} {path}"}}
        request = json.loads(body or b"{}")
        self.requests.append(request)
        if self.delay:
            await anyio.sleep(self.delay)
        text = self.reply(request.get("messages", []))
        return 200, {
            "id": f"chatcmpl-{len(self.requests)}",
            "object": "chat.completion",
            "created": 0,
            "model": request.get("model", "local"),
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "finish_reason": "stop",
                }
            ],
            "usage": {
                "prompt_tokens": len(body) // 4,
                "completion_tokens": len(text) // 4,
                "total_tokens": (len(body) + len(text)) // 4,
            },
        }


class LocalVendor(LoopbackHttpServer):
    """An HTTP vendor that honours ``Idempotency-Key`` the way Stripe does, for tests and demos.

    ``POST /send`` delivers once per key (a repeat returns the first answer) and
    ``GET /requests/{key}`` looks a delivery up (404 if it never arrived). ``mode``:
    ``ok``; ``accept_then_hang`` (deliver, then never answer: the client times out after the
    vendor accepted); ``fail_5xx`` (answer 500 without delivering); ``busy`` (429);
    ``reject`` (422). ``delay`` slows every answer.
    """

    def __init__(self) -> None:
        super().__init__()
        self.mode = "ok"
        self.delay = 0.0
        self.deliveries: dict[str, dict[str, Any]] = {}
        self.requests = 0
        self.requests_by_key: collections.Counter[str] = collections.Counter()
        """Raw ``POST /send`` requests per idempotency key, repeats included."""

    @property
    def send_url(self) -> str:
        return f"{self.url}/send"

    @property
    def lookup_url(self) -> str:
        return f"{self.url}/requests/{{idempotency_key}}"

    async def respond(
        self, method: str, path: str, headers: dict[str, str], body: bytes
    ) -> tuple[int, Any]:
        if self.delay:
            await anyio.sleep(self.delay)
        if method == "GET" and path.startswith("/requests/"):
            found = self.deliveries.get(path.removeprefix("/requests/"))
            return (200, found) if found else (404, {"error": "no such request"})
        if method != "POST" or path != "/send":
            return 404, {"error": f"no route {method} {path}"}
        self.requests += 1
        key = headers.get("idempotency-key")
        if not key:
            return 400, {"error": "Idempotency-Key header required"}
        self.requests_by_key[key] += 1
        if key in self.deliveries:
            return 200, self.deliveries[key]
        if self.mode == "fail_5xx":
            return 500, {"error": "internal error"}
        if self.mode == "busy":
            return 429, {"error": "slow down"}
        if self.mode == "reject":
            return 422, {"error": "invalid payload"}
        self.deliveries[key] = {
            "id": f"op_{len(self.deliveries) + 1}",
            "payload": json.loads(body or b"null"),
        }
        if self.mode == "accept_then_hang":
            await anyio.sleep(3600)
        return 200, self.deliveries[key]


class SmtpSink:
    """A real SMTP server on 127.0.0.1 (aiosmtpd, a test extra) that keeps what it receives.

    ``messages`` holds every message accepted, as ``email.message.EmailMessage``. With
    ``mode = "hang_after_data"`` it stores the message and then does not answer the end of DATA
    for ``hang_seconds``: the client cannot know whether the email went out.
    """

    def __init__(self) -> None:
        self.messages: list[Any] = []
        self.mode = "ok"
        self.hang_seconds = 30.0
        self.port = 0
        self._controller: Any = None

    def __enter__(self) -> SmtpSink:
        import asyncio
        import email
        import email.policy
        import socket

        from aiosmtpd.controller import Controller

        sink = self

        class Handler:
            async def handle_DATA(self, server: Any, session: Any, envelope: Any) -> str:
                raw = envelope.original_content or envelope.content
                sink.messages.append(email.message_from_bytes(raw, policy=email.policy.default))
                if sink.mode == "hang_after_data":
                    await asyncio.sleep(sink.hang_seconds)
                return "250 OK"

        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self._controller = Controller(Handler(), hostname="127.0.0.1", port=self.port)
        self._controller.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._controller is not None:
            self._controller.stop()

    def message_ids(self) -> list[str]:
        return [str(message["Message-ID"]) for message in self.messages]


# -- capturing spans -------------------------------------------------------------------------
_SPAN_EXPORTER: Any = None


def capture_spans() -> Any:
    """An in-memory span exporter installed once as the global tracer provider's sink.

    OpenTelemetry allows one global provider per process: the first call installs an SDK
    provider with this exporter (unless the host already has one, which is then left alone and
    ``None`` is returned). Call ``exporter.clear()`` between tests.
    """
    global _SPAN_EXPORTER
    if _SPAN_EXPORTER is not None:
        return _SPAN_EXPORTER
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    if not isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider):
        return None
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    _SPAN_EXPORTER = exporter
    return exporter
