"""Servers on loopback that stand in for the world: vendors, a model, SMTP, a faulty network.

Shared by ``orchestrator demo`` and by tests (``orchestrator.testing`` re-exports them). Each
listens on 127.0.0.1 only, for the life of an ``async with`` (``SmtpSink``: a ``with``):

- ``LocalVendor``: an HTTP vendor that honours ``Idempotency-Key`` and misbehaves on demand;
- ``SmtpSink``: a real SMTP server that keeps what it receives;
- ``LocalModelServer``: an OpenAI-compatible chat-completions server answering text;
- ``ScriptedModelServer``: one answering from a script, with tool calls, streaming and faults;
- ``FaultProxy``: a TCP proxy in front of PostgreSQL that partitions on demand.
"""

from __future__ import annotations

import collections
import contextlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import anyio
import anyio.abc
import anyio.streams.buffered


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
      their answers are lost);
    - ``latency``: pass both ways, each chunk ``latency_seconds`` late.
    Traffic only ever goes to the loopback target it was given. ``held``, ``dropped`` and
    ``delayed`` count the chunks each fault touched, so a caller can tell that it took effect.
    """

    MODES = ("forward", "blackhole", "drop_replies", "latency")

    def __init__(self, target_host: str, target_port: int) -> None:
        if target_host not in ("127.0.0.1", "::1", "localhost"):
            raise ValueError("FaultProxy only forwards to loopback")
        super().__init__()
        self.target = (target_host, target_port)
        self._mode = "forward"
        self._flowing = anyio.Event()
        self._flowing.set()
        self.latency_seconds = 0.2
        self.held = 0
        self.dropped = 0
        self.delayed = 0

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
        try:
            server = await anyio.connect_tcp(*self.target)
        except OSError:  # the server is down (restarting): the client sees a closed connection
            await client.aclose()
            return
        async with client, server, anyio.create_task_group() as pipes:
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
                if not self._flowing.is_set():
                    self.held += 1
                    await self._flowing.wait()
                if self.mode == "drop_replies" and direction == "to_client":
                    self.dropped += 1
                    continue
                if self.mode == "latency":
                    self.delayed += 1
                    await anyio.sleep(self.latency_seconds)
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

    retry_after: float | None = None
    """Sent as ``Retry-After`` with every 429 this server answers (``None``: no such header)."""

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
                    method, path, headers, body = await _read_request(buffered)
                    status, payload = await self.respond(method, path, headers, body)
                    extra = None
                    if status == 429 and self.retry_after is not None:
                        extra = {"Retry-After": f"{self.retry_after:g}"}
                    await _send_json(stream, status, payload, extra)


class LoopbackVendorServer(LoopbackHttpServer):
    """An HTTP vendor's two routes, ``POST /send`` and ``GET /requests/{key}``, as the URLs a
    vendor config names; subclasses decide how each answers."""

    @property
    def send_url(self) -> str:
        return f"{self.url}/send"

    @property
    def lookup_url(self) -> str:
        return f"{self.url}/requests/{{idempotency_key}}"


class LocalModelServer(LoopbackHttpServer):
    """A tiny OpenAI-compatible chat-completions server on 127.0.0.1, for tests and demos.

    It answers ``POST .../chat/completions`` with ``reply(messages)`` (by default a summary made
    of the last message's first words), after ``delay`` seconds; ``requests`` records every
    request body and ``arrivals`` when each came (``time.monotonic()``). The next
    ``busy_for`` requests are answered 429 (with ``retry_after``, if set). Point a worker at it
    with ``ORCHESTRATOR_MODEL_BASE_URL=server.base_url``.
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
        self.arrivals: list[float] = []
        self.busy_for = 0

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
        self.arrivals.append(time.monotonic())
        if self.busy_for > 0:
            self.busy_for -= 1
            return 429, {"error": {"message": "rate limited", "type": "rate_limit_exceeded"}}
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


class LocalVendor(LoopbackVendorServer):
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
        self.arrivals: list[float] = []
        """When each ``POST /send`` came (``time.monotonic()``)."""
        self.busy_for = 0
        """The next this many sends are answered 429 (with ``retry_after``, if set)."""

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
        self.arrivals.append(time.monotonic())
        key = headers.get("idempotency-key")
        if not key:
            return 400, {"error": "Idempotency-Key header required"}
        self.requests_by_key[key] += 1
        if key in self.deliveries:
            return 200, self.deliveries[key]
        if self.busy_for > 0:
            self.busy_for -= 1
            return 429, {"error": "slow down"}
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


# -- a scripted OpenAI-compatible model ------------------------------------------------------
@dataclass(frozen=True)
class ScriptedCall:
    """A tool call the scripted model makes. ``arguments`` as text is sent as it is (to send
    malformed JSON); ``id`` defaults to one that differs on every replay of the turn."""

    name: str
    arguments: dict[str, Any] | str = field(default_factory=dict)
    id: str | None = None


@dataclass(frozen=True)
class ScriptedTurn:
    """What the model answers on one turn: text, tool calls, or both."""

    content: str | None = None
    calls: tuple[ScriptedCall, ...] = ()


@dataclass(frozen=True)
class ScriptRequest:
    """What a script sees of a request. ``conversation`` identifies the run (its first user
    message); ``turn`` counts the assistant messages already in the request; ``replay`` counts
    the earlier answers the server gave for this same turn (a replayed turn sees 1, 2, ...)."""

    conversation: str
    turn: int
    replay: int
    messages: list[dict[str, Any]]
    tools: list[str]


@dataclass(frozen=True)
class RateLimited:
    """Answer 429 with ``Retry-After``."""

    retry_after: float = 1.0


@dataclass(frozen=True)
class ServerError:
    """Answer a 5xx (or any error status: a 4xx is a refused request)."""

    status: int = 500


@dataclass(frozen=True)
class Slow:
    """Answer only after ``seconds`` (a call that outlasts a lease); a client that gives up
    meanwhile is counted in ``disconnects``."""

    seconds: float


@dataclass(frozen=True)
class Garbled:
    """Answer 200 with a body that is not UTF-8 (a broken server): the answer the script gives,
    with a byte 0xFF in its text."""


@dataclass(frozen=True)
class CutOff:
    """Answer 200 and drop the connection midway (a server that died mid-answer): a streamed
    answer after ``pieces`` pieces of its text (at the end of a shorter text, before its end),
    an answer that is not streamed after half its body. The client sees a response that ends
    before its declared length."""

    pieces: int = 2


Fault = RateLimited | ServerError | Slow | Garbled | CutOff


@dataclass(frozen=True)
class RawRequest:
    """One request as a server received it: headers lower-cased, the body's bytes."""

    method: str
    path: str
    headers: dict[str, str]
    body: bytes


Script = Callable[[ScriptRequest], ScriptedTurn]


def turns(*scripted: ScriptedTurn, replays: dict[int, ScriptedTurn] | None = None) -> Script:
    """A script answering turn N with ``scripted[N]`` (the last one once they run out), and a
    replayed turn N with ``replays[N]`` when given (different arguments on a replay)."""

    def script(request: ScriptRequest) -> ScriptedTurn:
        if replays and request.replay > 0 and request.turn in replays:
            return replays[request.turn]
        return scripted[min(request.turn, len(scripted) - 1)]

    return script


class ScriptedModelServer(LoopbackService):
    """An OpenAI-compatible ``/v1/chat/completions`` on 127.0.0.1 that answers from a script:
    tool calls, usage, and SSE streaming (``stream=True``), deterministic per conversation, with
    faults on demand (``fail_next``). ``requests`` records every request (conversation, turn,
    replay, stream, what was answered); ``disconnects`` counts clients that gave up on a slow
    answer; with ``keep_raw``, ``raw`` keeps every request's headers and body bytes as they
    arrived. Point a worker at it with ``OPENAI_BASE_URL=server.base_url``."""

    def __init__(
        self,
        script: Script,
        *,
        latency: float = 0.0,
        keep_raw: bool = False,
        token_seconds: float = 0.0,
        token_chars: int = 8,
    ) -> None:
        super().__init__()
        self.script = script
        self.latency = latency
        self.token_seconds = token_seconds
        """A streamed answer's pause before each piece of its text (a model writing slowly)."""
        self.token_chars = token_chars
        """The characters of text in each streamed piece."""
        self.hold: anyio.Event | None = None
        """When set to an event: a streamed answer waits for it before its last piece of text (or
        before it is cut off), so that a test can see what was streamed so far, then let it end."""
        self.streamed: list[tuple[float, str]] = []
        """Each streamed text piece with the ``time.monotonic()`` it was sent at (benchmarks)."""
        self.requests: list[dict[str, Any]] = []
        self.keep_raw = keep_raw
        self.raw: list[RawRequest] = []
        self.disconnects = 0
        self._answered: collections.Counter[tuple[str, int]] = collections.Counter()
        self._faults: list[tuple[Fault, int | None, str | None]] = []
        self.faults_taken: collections.Counter[str] = collections.Counter()
        """Faults requests met, by class name (``RateLimited``, ``ServerError``, ``Slow``)."""

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def fail_next(
        self,
        fault: Fault,
        *,
        times: int = 1,
        turn: int | None = None,
        conversation: str | None = None,
    ) -> None:
        """The next ``times`` requests (of ``turn``, of a conversation containing
        ``conversation``, when given) meet ``fault``."""
        self._faults.extend([(fault, turn, conversation)] * times)

    def clear_faults(self) -> int:
        """Drop the faults no request met yet; returns how many."""
        left = len(self._faults)
        self._faults.clear()
        return left

    def answered(self, conversation: str, turn: int) -> int:
        """How many answers the server gave for this turn of this conversation."""
        return self._answered[(conversation, turn)]

    @staticmethod
    def conversation_of(messages: list[dict[str, Any]]) -> str:
        for message in messages:
            if message.get("role") == "user":
                return str(message.get("content", ""))
        return ""

    def _take_fault(self, conversation: str, turn: int) -> Fault | None:
        for index, (fault, for_turn, for_conversation) in enumerate(self._faults):
            if (for_turn is None or for_turn == turn) and (
                for_conversation is None or for_conversation in conversation
            ):
                del self._faults[index]
                self.faults_taken[type(fault).__name__] += 1
                return fault
        return None

    async def handle(self, stream: anyio.abc.SocketStream) -> None:
        buffered = anyio.streams.buffered.BufferedByteReceiveStream(stream)
        with contextlib.suppress(
            anyio.EndOfStream,
            anyio.BrokenResourceError,
            anyio.IncompleteRead,
            anyio.ClosedResourceError,
        ):
            async with stream:
                while True:
                    method, path, headers, body = await _read_request(buffered)
                    if self.keep_raw:
                        self.raw.append(RawRequest(method, path, headers, body))
                    if not await self._respond(stream, buffered, method, path, body):
                        return

    async def _respond(
        self,
        stream: anyio.abc.SocketStream,
        buffered: anyio.streams.buffered.BufferedByteReceiveStream,
        method: str,
        path: str,
        body: bytes,
    ) -> bool:
        """Answer one request; whether the connection stays open."""
        if method != "POST" or not path.endswith("/chat/completions"):
            await _send_json(stream, 404, {"error": {"message": f"no route {method} {path}"}})
            return True
        request = json.loads(body or b"{}")
        messages = list(request.get("messages", []))
        conversation = self.conversation_of(messages)
        turn = sum(1 for m in messages if m.get("role") == "assistant")
        record: dict[str, Any] = {
            "conversation": conversation,
            "turn": turn,
            "stream": bool(request.get("stream")),
            "model": request.get("model"),
            "tools": [t.get("function", {}).get("name") for t in request.get("tools", [])],
            "messages": len(messages),
        }
        self.requests.append(record)
        fault = self._take_fault(conversation, turn)
        if self.latency:
            await anyio.sleep(self.latency)
        if isinstance(fault, RateLimited):
            record["answer"] = "429"
            await _send_json(
                stream,
                429,
                {"error": {"message": "rate limited", "type": "rate_limit_exceeded"}},
                {"retry-after": f"{fault.retry_after:g}"},
            )
            return True
        if isinstance(fault, ServerError):
            record["answer"] = str(fault.status)
            await _send_json(stream, fault.status, {"error": {"message": "scripted failure"}})
            return True
        if isinstance(fault, Garbled):
            record["answer"] = "garbled"
            await _send_garbled(stream, events=bool(request.get("stream")))
            return not request.get("stream")
        if isinstance(fault, Slow):
            gone = await _client_leaves_within(buffered, fault.seconds)
            if gone:
                self.disconnects += 1
                record["answer"] = "client gave up"
                return False
        replay = self._answered[(conversation, turn)]
        scripted = self.script(ScriptRequest(conversation, turn, replay, messages, record["tools"]))
        self._answered[(conversation, turn)] += 1
        calls = [
            {
                "id": call.id or f"call_{turn}_{replay}_{index}",
                "type": "function",
                "function": {
                    "name": call.name,
                    "arguments": call.arguments
                    if isinstance(call.arguments, str)
                    else json.dumps(call.arguments),
                },
            }
            for index, call in enumerate(scripted.calls)
        ]
        record["answer"] = "tool_calls" if calls else "text"
        record["calls"] = calls
        usage = {
            "prompt_tokens": max(1, len(body) // 4),
            "completion_tokens": max(1, len(json.dumps(calls) + (scripted.content or "")) // 4),
        }
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        model = request.get("model", "scripted")
        finish = "tool_calls" if calls else "stop"
        if isinstance(fault, CutOff):
            record["answer"] = "cut off"
        if not request.get("stream"):
            message: dict[str, Any] = {"role": "assistant", "content": scripted.content}
            if calls:
                message["tool_calls"] = calls
            await _send_json(
                stream,
                200,
                {
                    "id": f"chatcmpl-{len(self.requests)}",
                    "object": "chat.completion",
                    "created": 0,
                    "model": model,
                    "choices": [{"index": 0, "message": message, "finish_reason": finish}],
                    "usage": usage,
                },
                cut_off=isinstance(fault, CutOff),
            )
            return not isinstance(fault, CutOff)
        cut_after = fault.pieces if isinstance(fault, CutOff) else None
        await _send_stream(
            stream, model, scripted.content, calls, finish, usage, request, self, cut_after
        )
        return False


async def _read_request(
    buffered: anyio.streams.buffered.BufferedByteReceiveStream,
) -> tuple[str, str, dict[str, str], bytes]:
    """One HTTP/1.1 request (method, path, lower-cased headers, body): the servers here read
    only Content-Length bodies, which is all their clients send."""
    head = await buffered.receive_until(b"\r\n\r\n", 65536)
    request_line, *header_lines = head.decode("latin-1").split("\r\n")
    headers = {
        name.strip().lower(): value.strip()
        for name, _, value in (line.partition(":") for line in header_lines)
    }
    length = int(headers.get("content-length", "0"))
    body = await buffered.receive_exactly(length) if length else b""
    method, path, _ = request_line.split(" ", 2)
    return method, path, headers, body


async def _send_garbled(stream: anyio.abc.SocketStream, *, events: bool) -> None:
    """A chat completion (``events``: one streamed chunk of it) whose text is not UTF-8."""
    choice: dict[str, Any] = {"index": 0, "finish_reason": "stop"}
    choice["delta" if events else "message"] = {"role": "assistant", "content": "GARBLED"}
    answer = {"id": "chatcmpl-garbled", "created": 0, "model": "scripted", "choices": [choice]}
    answer["object"] = "chat.completion.chunk" if events else "chat.completion"
    data = json.dumps(answer).encode().replace(b"GARBLED", b"caf\xc3 \xff")
    if events:
        await stream.send(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n"
            + b"data: "
            + data
            + b"\n\ndata: [DONE]\n\n"
        )
        return
    await stream.send(
        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
        + f"content-length: {len(data)}\r\n\r\n".encode()
        + data
    )


async def _send_json(
    stream: anyio.abc.SocketStream,
    status: int,
    payload: Any,
    headers: dict[str, str] | None = None,
    *,
    cut_off: bool = False,
) -> None:
    """A JSON response (``cut_off``: half of its body, then the caller drops the connection)."""
    data = json.dumps(payload).encode()
    extra = "".join(f"{name}: {value}\r\n" for name, value in (headers or {}).items())
    await stream.send(
        f"HTTP/1.1 {status} X\r\ncontent-type: application/json\r\n{extra}"
        f"content-length: {len(data)}\r\n\r\n".encode()
        + (data[: len(data) // 2] if cut_off else data)
    )


async def _send_stream(
    stream: anyio.abc.SocketStream,
    model: str,
    content: str | None,
    calls: list[dict[str, Any]],
    finish: str,
    usage: dict[str, int],
    request: dict[str, Any],
    server: ScriptedModelServer,
    cut_after: int | None = None,
) -> None:
    """Server-sent events as the chat completions API streams them, then the connection ends
    (``cut_after``: after that many pieces of text, before the length it declared)."""
    await stream.send(
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\n"
        + (b"content-length: 1048576\r\n" if cut_after is not None else b"")
        + b"connection: close\r\n\r\n"
    )

    async def event(choices: list[dict[str, Any]], extra: dict[str, Any] | None = None) -> None:
        chunk = {
            "id": "chatcmpl-stream",
            "object": "chat.completion.chunk",
            "created": 0,
            "model": model,
            "choices": choices,
            **(extra or {}),
        }
        await stream.send(f"data: {json.dumps(chunk)}\n\n".encode())

    await event([{"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}])
    text = content or ""
    size = max(1, server.token_chars)
    starts = range(0, len(text), size)
    for number, start in enumerate(starts):
        if server.hold is not None and number in (cut_after, len(starts) - 1):
            await server.hold.wait()
        if number == cut_after:
            return  # the caller drops the connection: the response is shorter than declared
        piece = text[start : start + size]
        if server.token_seconds:
            await anyio.sleep(server.token_seconds)
        server.streamed.append((time.monotonic(), piece))
        await event([{"index": 0, "delta": {"content": piece}, "finish_reason": None}])
    if cut_after is not None:
        return  # a shorter text than that: cut before its end
    for index, call in enumerate(calls):
        opening = {
            "index": index,
            "id": call["id"],
            "type": "function",
            "function": {"name": call["function"]["name"], "arguments": ""},
        }
        await event([{"index": 0, "delta": {"tool_calls": [opening]}, "finish_reason": None}])
        arguments = call["function"]["arguments"]
        for start in range(0, len(arguments), 16):
            part = {"index": index, "function": {"arguments": arguments[start : start + 16]}}
            await event([{"index": 0, "delta": {"tool_calls": [part]}, "finish_reason": None}])
    await event([{"index": 0, "delta": {}, "finish_reason": finish}])
    if (request.get("stream_options") or {}).get("include_usage"):
        await event([], {"usage": usage})
    await stream.send(b"data: [DONE]\n\n")


async def _client_leaves_within(
    buffered: anyio.streams.buffered.BufferedByteReceiveStream, seconds: float
) -> bool:
    """Wait ``seconds``; whether the client closed the connection meanwhile."""
    with anyio.move_on_after(seconds):
        try:
            await buffered.receive(1)
        except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError):
            return True
    return False
