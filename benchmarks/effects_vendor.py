"""The vendor of ``effects.py``, in a process of its own: a lean HTTP/1.1 server on 127.0.0.1.

Not a benchmark itself. Standard library only (``asyncio.Protocol``, keep-alive, bodies with
``Content-Length``), so that one core serves many thousand requests per second and the
dispatcher, not the vendor, is what ``effects.py`` measures. Routes:

* ``POST /send`` with an ``Idempotency-Key`` header: the first request of a key is delivered
  (the answer ``{"id": "op_N", "key": KEY}`` is kept and the arrival time noted, this host's
  ``time.time()``); a repeat is counted and answered with the first answer, as Stripe does;
* ``GET /requests/{key}``: the kept answer (200), or 404 if the key never arrived;
* ``GET /stats``: ``{"posts": N, "lookups": N, "counts": {key: POSTs}, "arrivals": {key: t},
  "cpu_seconds": S}`` (its own CPU time, from ``resource.getrusage``);
* ``POST /reset``: forget every key (between measurements).

Started as ``python benchmarks/effects_vendor.py``; it prints ``@@ {"port": N}`` on stdout once
listening and serves until its stdin closes or it is terminated.
"""

from __future__ import annotations

import asyncio
import json
import resource
import signal
import sys
import threading
import time
from typing import Any

MARK = "@@ "
REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 411: "Length Required"}


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class Vendor:
    """What the vendor knows: answers by key, POSTs by key, first arrivals."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.answers: dict[str, bytes] = {}
        self.counts: dict[str, int] = {}
        self.arrivals: dict[str, float] = {}
        self.posts = 0
        self.lookups = 0

    def respond(self, method: str, target: str, key: str | None) -> tuple[int, bytes]:
        if method == "POST" and target == "/send":
            self.posts += 1
            if not key:
                return 400, b'{"error": "Idempotency-Key header required"}'
            self.counts[key] = self.counts.get(key, 0) + 1
            answer = self.answers.get(key)
            if answer is None:
                self.arrivals[key] = time.time()
                answer = json.dumps({"id": f"op_{len(self.answers) + 1}", "key": key}).encode()
                self.answers[key] = answer
            return 200, answer
        if method == "GET" and target.startswith("/requests/"):
            self.lookups += 1
            found = self.answers.get(target.removeprefix("/requests/"))
            return (200, found) if found is not None else (404, b'{"error": "no such request"}')
        if method == "GET" and target == "/stats":
            stats: dict[str, Any] = {
                "posts": self.posts,
                "lookups": self.lookups,
                "counts": self.counts,
                "arrivals": self.arrivals,
                "cpu_seconds": cpu_seconds(),
            }
            return 200, json.dumps(stats).encode()
        if method == "POST" and target == "/reset":
            self.reset()
            return 200, b"{}"
        return 404, json.dumps({"error": f"no route {method} {target}"}).encode()


class HttpProtocol(asyncio.Protocol):
    """One keep-alive connection: requests parsed from the buffer, answered in order."""

    def __init__(self, vendor: Vendor) -> None:
        self.vendor = vendor
        self.buffer = bytearray()
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while self.transport is not None:
            end = self.buffer.find(b"\r\n\r\n")
            if end < 0:
                return
            lines = bytes(self.buffer[:end]).decode("latin-1").split("\r\n")
            method, target, _ = ([*lines[0].split(" ", 2), "", ""])[:3]
            length, key, close, chunked = 0, None, False, False
            for line in lines[1:]:
                name, _, value = line.partition(":")
                name = name.strip().lower()
                if name == "content-length":
                    length = int(value)
                elif name == "idempotency-key":
                    key = value.strip()
                elif name == "connection":
                    close = value.strip().lower() == "close"
                elif name == "transfer-encoding":
                    chunked = True
            if chunked:
                self.answer(411, b'{"error": "Content-Length required"}', close=True)
                return
            total = end + 4 + length
            if len(self.buffer) < total:
                return
            del self.buffer[:total]  # the body is not read: the answer does not depend on it
            status, body = self.vendor.respond(method, target, key)
            self.answer(status, body, close=close)

    def answer(self, status: int, body: bytes, *, close: bool) -> None:
        assert self.transport is not None
        head = (
            f"HTTP/1.1 {status} {REASONS.get(status, 'Error')}\r\n"
            "Content-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n" + ("Connection: close\r\n" if close else "") + "\r\n"
        )
        self.transport.write(head.encode("latin-1") + body)
        if close:
            self.transport.close()
            self.transport = None

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None


async def serve() -> None:
    loop = asyncio.get_running_loop()
    vendor = Vendor()
    server = await loop.create_server(
        lambda: HttpProtocol(vendor), host="127.0.0.1", port=0, backlog=1024
    )
    port = server.sockets[0].getsockname()[1]
    print(MARK + json.dumps({"port": port}), flush=True)
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.set)

    def until_stdin_closes() -> None:
        sys.stdin.read()
        loop.call_soon_threadsafe(stop.set)

    threading.Thread(target=until_stdin_closes, daemon=True).start()
    async with server:
        await stop.wait()


if __name__ == "__main__":
    asyncio.run(serve())
