"""The ``http`` vendor: an HTTP API that takes an ``Idempotency-Key`` (``HttpAdapter``)."""

from __future__ import annotations

from typing import Any

import aiohttp

from orchestrator.backoff import retry_after_seconds
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
    secret_from,
)
from orchestrator.jsontext import compact, parse


class HttpAdapter:
    """An HTTP API vendor. ``POST url`` with the payload as JSON and an ``Idempotency-Key``.

    Reconciliation modes: ``replay`` (the vendor honours the key the way Stripe does: sending
    again returns the first outcome), ``lookup`` (``GET lookup_url`` with ``{idempotency_key}``
    filled in: 200 found, 404 never received), or ``none`` (an uncertain send is parked).
    Connections are kept alive and reused, at most ``max_connections`` at once.
    """

    def __init__(
        self,
        kind: str,
        *,
        url: str,
        reconcile: str = "none",
        lookup_url: str | None = None,
        token: str | None = None,
        token_env: str | None = None,
        timeout_seconds: float = 10.0,
        max_connections: int = 100,
    ) -> None:
        if reconcile not in ("replay", "lookup", "none"):
            raise ValueError(f"{kind}: reconcile must be replay, lookup or none, not {reconcile!r}")
        if reconcile == "lookup" and not lookup_url:
            raise ValueError(f"{kind}: reconcile=lookup needs lookup_url")
        if not isinstance(timeout_seconds, int | float) or not timeout_seconds > 0:
            raise ValueError(f"{kind}: timeout_seconds must be a positive number of seconds")
        if not isinstance(max_connections, int) or not 1 <= max_connections <= 10_000:
            raise ValueError(f"{kind}: max_connections must be a whole number from 1 to 10000")
        self.kind = kind
        self.url = url
        self.mode = reconcile
        self.lookup_url = lookup_url
        secret = secret_from(token, token_env)
        self._headers = {"Authorization": f"Bearer {secret}"} if secret else {}
        self._timeout = aiohttp.ClientTimeout(total=timeout_seconds)
        self.answers_within = float(timeout_seconds)
        """aiohttp's total timeout bounds each call, the answer's body included."""
        self._max_connections = max_connections
        self._http: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        # One session for the adapter's life, made on first use (it belongs to the running
        # event loop): it keeps connections alive, and a new one per request costs a TLS
        # context and a connection set-up on the event loop.
        if self._http is None or self._http.closed:
            self._http = aiohttp.ClientSession(
                timeout=self._timeout,
                headers=self._headers,
                connector=aiohttp.TCPConnector(limit=self._max_connections),
            )
        return self._http

    async def aclose(self) -> None:
        if self._http is not None:
            await self._http.close()
            self._http = None

    async def send(self, effect: EffectRecord) -> SendOutcome:
        headers = {"Idempotency-Key": effect.idempotency_key, "Content-Type": "application/json"}
        body = compact(effect.payload).encode()
        try:
            async with self._client().post(self.url, data=body, headers=headers) as response:
                return _outcome(
                    response.status, await response.read(), response.headers.get("Retry-After")
                )
        except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as error:
            return Retry(f"could not connect: {error}")  # nothing reached the vendor
        except (aiohttp.ClientError, TimeoutError) as error:
            return Uncertain(f"{type(error).__name__}: {error}")

    async def reconcile(self, effect: EffectRecord) -> ReconcileOutcome:
        if self.mode == "replay":
            return await self.send(effect)
        if self.mode == "none" or self.lookup_url is None:
            return Park(f"{self.kind} cannot be looked up and the last send may have arrived")
        url = self.lookup_url.format(idempotency_key=effect.idempotency_key)
        try:
            async with self._client().get(url) as response:
                status, body = response.status, await response.read()
        except (aiohttp.ClientError, TimeoutError) as error:
            return Uncertain(f"lookup failed: {type(error).__name__}: {error}")
        if status == 404:
            return NotSent()
        if 200 <= status < 300:
            return _confirmed(body)
        return Uncertain(f"lookup answered HTTP {status}")


def _outcome(status: int, body: bytes, retry_after: str | None = None) -> SendOutcome:
    if 200 <= status < 300:
        return _confirmed(body)
    if status in (429, 503):
        return Retry(f"HTTP {status}", retry_after_seconds(retry_after))
    if 400 <= status < 500:
        return Failed(f"HTTP {status}: {body[:500].decode(errors='replace')}")
    return Uncertain(f"HTTP {status}")


def _confirmed(body: bytes) -> Confirmed:
    """The vendor's answer as the result, its ``id`` as the external id (when it is JSON)."""
    value = _json_or_none(body)
    external = value.get("id") if isinstance(value, dict) else None
    return Confirmed(str(external) if external is not None else None, value)


def _json_or_none(body: bytes) -> Any:
    try:
        return parse(body.decode())
    except ValueError:  # not UTF-8, not JSON, or JSON that jsonb refuses (NaN)
        return None
