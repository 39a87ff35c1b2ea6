"""Rate limits shared by every worker and dispatcher (docs/flow-control.md, migration 0022).

A rate limit allows ``requests`` requests and ``tokens`` tokens (either optional) per
``per_seconds``, as a token bucket in PostgreSQL that every process charges atomically: a burst
of one interval, then the steady rate. It is named for what it limits: ``model:NAME`` is charged
by model calls to NAME, ``effect:KIND`` by the dispatcher's sends of that kind, any other name by
the steps that take it themselves. A provider's 429 with ``Retry-After`` pauses the name for every
process.
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any, NamedTuple, TypedDict

from orchestrator.access import Actor
from orchestrator.db.audit import decided
from orchestrator.db.deadlines import DATABASE_ERRORS
from orchestrator.db.limits import whole_number
from orchestrator.db.queries import query
from orchestrator.errors import InvalidInput
from orchestrator.models import JsonFields, from_row

if TYPE_CHECKING:
    from orchestrator.db.executor import Executor

RATE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:/@+-]{0,199}$")
MAX_REQUESTS = 1_000_000_000
MAX_TOKENS = 1_000_000_000_000
PER_SECONDS_RANGE = (0.001, 604_800.0)
MAX_PAUSE_SECONDS = 3600.0
NAMES_FRESH_SECONDS = 1.0
"""How long a process trusts its list of the rate limits there are: a new limit (or a pause)
holds everywhere within this."""


def model_limit(model: str) -> str | None:
    """The rate limit a call to ``model`` is charged against (None: no limit can have its name)."""
    name = f"model:{model}"
    return name if RATE_NAME.fullmatch(name) else None


def effect_limit(kind: str) -> str:
    """The rate limit the dispatcher's sends of effect ``kind`` are charged against."""
    return f"effect:{kind}"


def check_rate_name(name: Any) -> str:
    if not isinstance(name, str) or not RATE_NAME.fullmatch(name):
        raise InvalidInput(
            f"a rate limit's name is 1-200 letters, digits and _.:/@+- starting with a letter or "
            f"digit (model:NAME, effect:KIND), not {name!r}"
        )
    return name


def _whole(value: Any, what: str, most: int) -> int | None:
    return None if value is None else whole_number(value, what, 1, most)


def check_rate(
    requests: Any, tokens: Any, per_seconds: Any
) -> tuple[int | None, int | None, float]:
    """A rate limit's numbers as the database takes them, or one line saying what is wrong."""
    requests = _whole(requests, "requests", MAX_REQUESTS)
    tokens = _whole(tokens, "tokens", MAX_TOKENS)
    if requests is None and tokens is None:
        raise InvalidInput("a rate limit needs requests, tokens or both (e.g. --requests 500)")
    low, high = PER_SECONDS_RANGE
    if (
        isinstance(per_seconds, bool)
        or not isinstance(per_seconds, int | float)
        or not math.isfinite(per_seconds)
        or not low <= per_seconds <= high
    ):
        raise InvalidInput(f"the interval must be {low} to {high:g} seconds, not {per_seconds!r}")
    return requests, tokens, float(per_seconds)


@dataclass(frozen=True)
class RateLimit(JsonFields):
    name: str
    requests: int | None
    tokens: int | None
    per_seconds: float
    set_by: str
    set_at: datetime
    paused_until: datetime | None
    """Set while a provider's 429 pauses every process's calls."""
    paused_by: str | None
    requests_left: float | None
    tokens_left: float | None
    waiting: int
    """Runs waiting for it now."""


class Taken(NamedTuple):
    """How many requests a charge was granted, and when not all: how long until the next."""

    granted: int
    wait_seconds: float


class RateNumbers(TypedDict, total=False):
    """What a rate limit allows: ``requests`` and ``tokens`` (either may be left out: not
    limited) per ``per_seconds`` (60 when left out)."""

    requests: int | None
    tokens: int | None
    per_seconds: float


class RateLimitStore:
    """List, set and clear rate limits (each change audited); take, settle and pause them."""

    def __init__(self, db: Executor) -> None:
        self.db = db
        self._names: frozenset[str] = frozenset()
        self._names_read = -math.inf

    async def list(self, name: str | None = None) -> list[RateLimit]:
        if name is not None:
            check_rate_name(name)
        return [
            from_row(RateLimit, r) for r in await self.db.fetch(query("list_rate_limits"), name)
        ]

    async def set(
        self,
        name: str,
        *,
        requests: int | None = None,
        tokens: int | None = None,
        per_seconds: float = 60.0,
        actor: Actor | None = None,
    ) -> None:
        check_rate_name(name)
        requests, tokens, per_seconds = check_rate(requests, tokens, per_seconds)
        await decided(
            self.db, "rate_limit_set", actor, "set_rate_limit", name, requests, tokens, per_seconds
        )

    async def clear(self, name: str, *, actor: Actor | None = None) -> None:
        check_rate_name(name)
        row = await decided(self.db, "rate_limit_cleared", actor, "clear_rate_limit", name)
        if row is None or row["cleared"] is None:
            raise InvalidInput(
                f"no rate limit named {name!r}: `orchestrator rates list` shows the ones there are"
            )

    async def limited(self, name: str) -> bool:
        """Whether a rate limit (or a pause) named ``name`` may exist: read at most once every
        ``NAMES_FRESH_SECONDS``, so that calls and sends under no limit cost no statement."""
        if time.monotonic() - self._names_read >= NAMES_FRESH_SECONDS:
            try:
                rows = await self.db.fetch(query("rate_limit_names"))
            except DATABASE_ERRORS:
                # A blip must not fail a call under no limit: the names read last still
                # hold, and the next call reads them again.
                return name in self._names
            self._names = frozenset(row["name"] for row in rows)
            self._names_read = time.monotonic()
        return name in self._names

    async def take(
        self,
        name: str,
        requests: int = 1,
        tokens: int = 0,
        *,
        run_id: str | None = None,
        fence: int | None = None,
    ) -> Taken:
        """Take up to ``requests`` requests (and ``tokens`` with the first): how many were granted
        and, for the rest, how long to wait. A run waiting says so in its timeline and listing."""
        row = await self.db.fetchrow(
            query("take_rate"), name, requests, max(0, int(tokens)), run_id, fence
        )
        assert row is not None
        return Taken(int(row["granted"]), float(row["wait_seconds"]))

    async def settle(self, name: str, tokens: int) -> None:
        """Count ``tokens`` more (fewer, when negative) than were taken for a call."""
        if tokens:
            await self.db.execute(query("settle_rate"), name, int(tokens))

    async def pause(self, name: str, seconds: float, by: str) -> None:
        """Nobody takes ``name`` for ``seconds`` (a provider's Retry-After, at most an hour)."""
        seconds = min(max(0.0, seconds), MAX_PAUSE_SECONDS)
        await self.db.execute(query("pause_rate"), name, seconds, by[:200] or "unknown")
        self._names = self._names | {name}
