"""The campaign's HTTP vendor: it honours ``Idempotency-Key`` like ``LocalVendor``, keeps every
raw request per key with its time, and misbehaves on a queue of faults it proves it took."""

from __future__ import annotations

import collections
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import anyio

from orchestrator.testing.loopback import LoopbackVendorServer

OnAccept = Callable[[str], Awaitable[bool]]
"""Called with the key of a delivery the vendor will not answer; whether the fault took."""
VENDOR_FAULTS = ("vendor_accept_timeout", "vendor_5xx", "vendor_slow", "kill_on_accept")


@dataclass(frozen=True)
class Delivery:
    key: str
    payload: Any
    at: float
    """Wall-clock time (``time.time()``) the vendor accepted it: the database's clock too."""


class ChaosVendor(LoopbackVendorServer):
    """``POST /send`` delivers once per key; ``GET /requests/{key}`` looks a delivery up.

    ``posts`` counts every raw POST per key, ``resent`` those that came for a key already
    delivered (the idempotency key saved the customer, the orchestrator still sent twice).
    ``queue(fault)`` makes the next POST of a new key meet the fault; ``fired`` counts those
    taken. ``kill_on_accept`` delivers, then awaits its ``on_accept(key)`` (the campaign kills the
    dispatcher holding the effect) and does not answer.
    """

    def __init__(self, *, hang_seconds: float = 30.0) -> None:
        super().__init__()
        self.hang_seconds = hang_seconds
        self.slow_seconds = 2.0
        self.deliveries: dict[str, Delivery] = {}
        self.posts: collections.Counter[str] = collections.Counter()
        self.resent: collections.Counter[str] = collections.Counter()
        self.fired: collections.Counter[str] = collections.Counter()
        self._queued: collections.deque[tuple[str, OnAccept | None]] = collections.deque()

    def queue(self, fault: str, on_accept: OnAccept | None = None) -> None:
        """The next POST of a new key meets ``fault``; ``kill_on_accept`` calls ``on_accept``."""
        if fault not in VENDOR_FAULTS:
            raise ValueError(f"vendor fault must be one of {VENDOR_FAULTS}")
        self._queued.append((fault, on_accept))

    def clear(self) -> list[str]:
        """Drop the faults not yet taken; returns them."""
        left = [fault for fault, _ in self._queued]
        self._queued.clear()
        return left

    async def respond(
        self, method: str, path: str, headers: dict[str, str], body: bytes
    ) -> tuple[int, Any]:
        if method == "GET" and path.startswith("/requests/"):
            found = self.deliveries.get(path.removeprefix("/requests/"))
            if found is None:
                return 404, {"error": "no such request"}
            return 200, {"id": f"op_{found.key[-12:]}", "payload": found.payload}
        if method != "POST" or path != "/send":
            return 404, {"error": f"no route {method} {path}"}
        key = headers.get("idempotency-key")
        if not key:
            return 400, {"error": "Idempotency-Key header required"}
        return await self.deliver(key, json.loads(body or b"null"))

    async def deliver(self, key: str, payload: Any) -> tuple[int, Any]:
        """One request for ``key`` (an HTTP POST, or an MCP tool call): delivered once per key,
        unless the next queued fault says otherwise. Returns (HTTP status, answer)."""
        self.posts[key] += 1
        if key in self.deliveries:
            self.resent[key] += 1
            return 200, {"id": f"op_{key[-12:]}", "payload": self.deliveries[key].payload}
        fault, on_accept = self._queued.popleft() if self._queued else (None, None)
        if fault == "vendor_5xx":
            self.fired[fault] += 1
            return 500, {"error": "internal error"}
        if fault == "vendor_slow":
            self.fired[fault] += 1
            await anyio.sleep(self.slow_seconds)
        self.deliveries[key] = Delivery(key, payload, time.time())
        if fault == "vendor_accept_timeout":
            self.fired[fault] += 1
            await anyio.sleep(self.hang_seconds)
        if fault == "kill_on_accept":
            if on_accept is not None and await on_accept(key):
                self.fired[fault] += 1
            await anyio.sleep(self.hang_seconds)
        return 200, {"id": f"op_{key[-12:]}", "payload": payload}
