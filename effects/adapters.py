"""Vendor adapters: how the dispatcher sends an effect, and how it finds out what happened.

Adding a vendor is a small class with ``send`` and ``reconcile``. Credentials live in the
adapter's configuration (the dispatcher's environment), never in agent code, checkpoints,
payloads or traces. Every send carries the effect's stable idempotency key.

Outcomes are deliberately blunt about uncertainty: when a request may have reached the vendor
and no answer came back, the outcome is ``Uncertain``, and the dispatcher reconciles before it
ever sends again.
"""

from __future__ import annotations

import os
import smtplib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from email.message import EmailMessage
from typing import Any, Protocol

import aiohttp
import anyio

from orchestrator.effect_model import EffectRecord
from orchestrator.jsontext import compact, parse
from orchestrator.models import JSON


@dataclass(frozen=True)
class Confirmed:
    external_id: str | None
    result: JSON = None


@dataclass(frozen=True)
class Failed:
    """The vendor refused for good (e.g. a 4xx): sending again would not help."""

    error: str


@dataclass(frozen=True)
class Retry:
    """The vendor did not accept it (refused connection, 429/503, SMTP 4xx): safe to resend."""

    error: str


@dataclass(frozen=True)
class Uncertain:
    """It may have been accepted: reconcile before any resend."""

    error: str


@dataclass(frozen=True)
class NotSent:
    """Reconciliation found the vendor never accepted it: send it now, same key."""


@dataclass(frozen=True)
class Park:
    """Nobody can tell whether it was sent: a person must decide (`effects resolve`)."""

    reason: str


SendOutcome = Confirmed | Failed | Retry | Uncertain
ReconcileOutcome = Confirmed | Failed | NotSent | Uncertain | Retry | Park


class Adapter(Protocol):
    """A vendor. One may also set ``answers_within`` (seconds): the bound it puts on each of its
    own calls, timeouts answered as ``Uncertain``; a dispatcher whose lease leaves that much
    time then sends without a timer of its own (see ``answers_within``). One that keeps a
    connection may also have ``async def connect(self) -> None`` (see ``connector``)."""

    kind: str

    async def send(self, effect: EffectRecord) -> SendOutcome: ...

    async def reconcile(self, effect: EffectRecord) -> ReconcileOutcome: ...

    async def aclose(self) -> None:
        """Release connections when the dispatcher stops."""
        ...


def answers_within(adapter: Adapter) -> float:
    """The seconds within which ``adapter`` answers any send on its own (infinite: unsaid)."""
    bound = getattr(adapter, "answers_within", None)
    if isinstance(bound, int | float) and not isinstance(bound, bool) and bound > 0:
        return float(bound)
    return float("inf")


def connector(adapter: Adapter) -> Callable[[], Awaitable[None]] | None:
    """``adapter``'s ``connect``, if it has one: the dispatcher opens the connection before it
    re-checks and sends, so a slow start (a stdio server) is "not sent yet", never a send that
    timed out and may have landed. It raises when no connection can be opened."""
    connect = getattr(adapter, "connect", None)
    return connect if callable(connect) else None


def _secret(value: str | None, env: str | None) -> str | None:
    if env:
        found = os.environ.get(env)
        if found is None:
            raise ValueError(f"environment variable {env} (a vendor credential) is not set")
        return found
    return value


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
        secret = _secret(token, token_env)
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
                return _outcome(response.status, await response.read())
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


def _outcome(status: int, body: bytes) -> SendOutcome:
    if 200 <= status < 300:
        return _confirmed(body)
    if status in (429, 503):
        return Retry(f"HTTP {status}")
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


class SmtpAdapter:
    """Email through a real SMTP server. The Message-ID is derived from the idempotency key, so
    a receiving system can drop a duplicate; but SMTP offers no lookup, so an uncertain send is
    parked for a person, never resent. Payload: ``{"to", "subject", "body"}``."""

    def __init__(
        self,
        kind: str,
        *,
        host: str,
        port: int = 25,
        sender: str,
        username: str | None = None,
        password_env: str | None = None,
        starttls: bool = False,
        timeout_seconds: float = 10.0,
    ) -> None:
        self.kind = kind
        self.host = host
        self.port = port
        self.sender = sender
        self.username = username
        self.password = _secret(None, password_env)
        self.starttls = starttls
        self.timeout = timeout_seconds

    def message(self, effect: EffectRecord) -> EmailMessage:
        payload = effect.payload if isinstance(effect.payload, dict) else {}
        message = EmailMessage()
        message["From"] = self.sender
        message["To"] = str(payload.get("to", ""))
        message["Subject"] = str(payload.get("subject", ""))
        message["Message-ID"] = f"<{effect.idempotency_key}@orchestrator>"
        message.set_content(str(payload.get("body", "")))
        return message

    async def send(self, effect: EffectRecord) -> SendOutcome:
        message = self.message(effect)
        if not message["To"]:
            return Failed("payload has no 'to' address")
        return await anyio.to_thread.run_sync(self._send, message, abandon_on_cancel=True)

    def _send(self, message: EmailMessage) -> SendOutcome:
        try:
            client = smtplib.SMTP(self.host, self.port, timeout=self.timeout)
        except (OSError, smtplib.SMTPException) as error:
            return Retry(f"could not connect: {error}")
        with client:
            try:
                client.ehlo()
                if self.starttls:
                    client.starttls()
                if self.username and self.password:
                    client.login(self.username, self.password)
                code, reply = client.mail(self.sender)
                if code >= 400:
                    return _refused(code, reply)
                code, reply = client.rcpt(message["To"])
                if code >= 400:
                    return _refused(code, reply)
            except (OSError, smtplib.SMTPException) as error:
                return Retry(f"refused before any data was sent: {error}")
            try:
                # From here on the server may have the message: any failure is uncertain.
                code, reply = client.data(message.as_bytes())
            except smtplib.SMTPResponseException as error:
                if 400 <= error.smtp_code < 600:
                    return _refused(error.smtp_code, error.smtp_error)
                return Uncertain(str(error))
            except (OSError, smtplib.SMTPException) as error:
                return Uncertain(f"connection lost during DATA: {error}")
        return Confirmed(message["Message-ID"], {"smtp_reply": f"{code} {reply!r}"})

    async def reconcile(self, effect: EffectRecord) -> ReconcileOutcome:
        return Park("SMTP cannot be looked up: a person must check whether the email went out")

    async def aclose(self) -> None:
        """Each send uses its own SMTP session: nothing to release."""


def _refused(code: int, reply: bytes | str) -> SendOutcome:
    text = reply.decode(errors="replace") if isinstance(reply, bytes) else reply
    if 400 <= code < 500:
        return Retry(f"SMTP {code}: {text}")
    return Failed(f"SMTP {code}: {text}")
