"""Vendor adapters: how the dispatcher sends an effect, and how it finds out what happened.

Adding a vendor is a small class with ``send`` and ``reconcile``. Credentials live in the
adapter's configuration (the dispatcher's environment), never in agent code, checkpoints,
payloads or traces. Every send carries the effect's stable idempotency key.

Outcomes are deliberately blunt about uncertainty: when a request may have reached the vendor
and no answer came back, the outcome is ``Uncertain``, and the dispatcher reconciles before it
ever sends again.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from orchestrator.effect_model import EffectRecord
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
    retry_after: float | None = None
    """When the vendor said to come back (a 429's Retry-After): every dispatcher pauses the
    kind's rate limit until then, and this effect is due again then."""


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


def secret_from(value: str | None, env: str | None) -> str | None:
    """A vendor credential: from the environment variable ``env`` when named, else ``value``."""
    if env:
        found = os.environ.get(env)
        if found is None:
            raise ValueError(f"environment variable {env} (a vendor credential) is not set")
        return found
    return value


_VENDORS = {"HttpAdapter": "orchestrator.effects.http", "SmtpAdapter": "orchestrator.effects.smtp"}


def __getattr__(name: str) -> Any:
    """``HttpAdapter`` and ``SmtpAdapter`` by their earlier path. They live in modules of their
    own, imported on first use: a process that sends no HTTP (or no email) does not pay for
    aiohttp (or smtplib) at start."""
    module = _VENDORS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
