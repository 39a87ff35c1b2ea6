"""Waiting for a shared rate limit's capacity from inside a step (docs/flow-control.md).

The worker sets the step's ``RateScope`` (its run, fence and the worker's rate store); model calls
(``llm.chat``, ``llm.complete`` and so ToolAgent, the Pydantic AI integration) take the limit
named ``model:MODEL`` through it, and a step may take any limit itself::

    await take_rate("api:crm", requests=1)

A call asks the database every time (a pause another process recorded a moment ago holds), and
waits while its run keeps its lease (the heartbeat renews it), asking again at least every
``RECHECK_SECONDS`` so that a raised limit or a lifted pause is seen; a lost lease cancels the
wait with the step. Outside a worker (a script calling ``llm.chat``), nothing is
charged.
"""

from __future__ import annotations

import math
import os
import time
from contextvars import ContextVar, Token
from dataclasses import dataclass

import anyio

from orchestrator.db.rates import RateLimitStore, check_rate_name, model_limit
from orchestrator.errors import InvalidInput, OrchestratorError
from orchestrator.telemetry import flow_metrics

RECHECK_SECONDS = 5.0
DEFAULT_MAX_WAIT_SECONDS = 600.0
MAX_WAIT_VARIABLE = "ORCHESTRATOR_RATE_WAIT_SECONDS"


class RateLimitWait(OrchestratorError):
    """A rate limit had no capacity within the time the caller could wait: the step fails this
    attempt and is retried like any error."""


@dataclass(frozen=True, slots=True)
class RateScope:
    """The rate limits a step's calls are charged against, on behalf of its run."""

    store: RateLimitStore
    run_id: str | None = None
    fence: int | None = None
    who: str = "unknown"
    """Who pauses a limit on a 429 (the worker), in ``rates list``."""

    async def take(
        self, name: str, *, requests: int = 1, tokens: int = 0, within: float | None = None
    ) -> float:
        """Wait until ``requests`` requests (and ``tokens`` tokens, with the first) of ``name``
        are granted; returns the seconds waited. ``RateLimitWait`` past ``within`` seconds (by
        default ``ORCHESTRATOR_RATE_WAIT_SECONDS``, 600): the step fails that attempt."""
        # Asked every time (one short statement beside a model call of a second or more): a
        # pause another process just recorded holds for this call too.
        limit = max_wait_seconds() if within is None else within
        began = time.monotonic()
        left, counted = requests, False
        while True:
            taken = await self.store.take(
                name, left, tokens if left == requests else 0, run_id=self.run_id, fence=self.fence
            )
            left -= taken.granted
            waited = time.monotonic() - began
            if left <= 0:
                if not counted:
                    return 0.0
                flow_metrics().rate_wait_seconds.record(waited, {"limit": name})
                return waited
            if waited + taken.wait_seconds > limit:
                raise RateLimitWait(
                    f"rate limit {name!r} has no capacity for {taken.wait_seconds:.1f}s more, past "
                    f"the {limit:g}s this call may wait (`orchestrator rates list` shows it)"
                )
            if not counted:
                counted = True
                flow_metrics().rate_waits.add(1, {"limit": name})
            await anyio.sleep(min(taken.wait_seconds, RECHECK_SECONDS))

    async def settle(self, name: str, tokens: int) -> None:
        """What a call cost beyond (negative: below) the tokens taken for it."""
        if tokens and await self.store.limited(name):
            await self.store.settle(name, tokens)

    async def pause(self, name: str, seconds: float) -> None:
        """A provider said 429 with Retry-After: nobody calls ``name`` for ``seconds``."""
        await self.store.pause(name, seconds, self.who)


_SCOPE: ContextVar[RateScope | None] = ContextVar("orchestrator_rate_scope", default=None)


def current_rates() -> RateScope | None:
    """The running step's rate scope (``None`` outside a worker's step)."""
    return _SCOPE.get()


class rate_scope:  # a class, not @contextmanager: entered once per run, a third of the cost
    """Charge the calls made inside against ``scope``."""

    __slots__ = ("_scope", "_token")

    def __init__(self, scope: RateScope | None) -> None:
        self._scope = scope
        self._token: Token[RateScope | None] | None = None

    def __enter__(self) -> None:
        self._token = _SCOPE.set(self._scope)

    def __exit__(self, *exc_info: object) -> None:
        if self._token is not None:
            _SCOPE.reset(self._token)
            self._token = None


async def take_rate(
    name: str, *, requests: int = 1, tokens: int = 0, within: float | None = None
) -> float:
    """Wait for ``requests`` of rate limit ``name`` from inside a step (see ``RateScope.take``);
    outside a worker's step, nothing is charged."""
    check_rate_name(name)
    if (
        isinstance(requests, bool)
        or not isinstance(requests, int)
        or not 1 <= requests <= 1_000_000
    ):
        raise InvalidInput(f"requests must be a whole number from 1 to 1,000,000, not {requests!r}")
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
        raise InvalidInput(f"tokens must be a whole number of 0 or more, not {tokens!r}")
    scope = current_rates()
    return (
        0.0
        if scope is None
        else await scope.take(name, requests=requests, tokens=tokens, within=within)
    )


def max_wait_seconds() -> float:
    raw = os.environ.get(MAX_WAIT_VARIABLE, "").strip()
    if not raw:
        return DEFAULT_MAX_WAIT_SECONDS
    try:
        seconds = float(raw)
    except ValueError:
        seconds = math.nan
    if not (math.isfinite(seconds) and seconds >= 0):
        raise InvalidInput(
            f"{MAX_WAIT_VARIABLE}={raw!r} is not a number of seconds of 0 or more; set it to e.g. "
            f"{DEFAULT_MAX_WAIT_SECONDS:g} or unset it"
        )
    return seconds


def estimated_tokens(request_bytes: int, max_output_tokens: int | None) -> int:
    """What a model call is charged before its answer says what it cost: its request's size in
    bytes over 4 (a common rule of thumb for English text), and the output it may produce."""
    return request_bytes // 4 + (max_output_tokens if max_output_tokens is not None else 1024)


class ModelCallRates:
    """One model call's charge: taken before each attempt, settled by the answer's usage, and a
    429's Retry-After shared with every process."""

    __slots__ = ("estimate", "name", "scope")

    def __init__(self, model: str, request_bytes: int, max_output_tokens: int | None) -> None:
        self.scope = current_rates()
        self.name = model_limit(model) if self.scope is not None else None
        self.estimate = estimated_tokens(request_bytes, max_output_tokens)

    async def before_attempt(self, within: float | None = None) -> None:
        if self.scope is not None and self.name is not None:
            await self.scope.take(self.name, tokens=self.estimate, within=within)

    async def answered(self, input_tokens: int | None, output_tokens: int | None) -> None:
        """Settle the estimate against what the answer says it cost (if it says)."""
        if self.scope is not None and self.name is not None and input_tokens is not None:
            used = input_tokens + (output_tokens or 0)
            await self.scope.settle(self.name, used - self.estimate)

    async def refused_for_rate(self, retry_after: float | None) -> bool:
        """A 429: give back the estimate (nothing was produced) and, with a Retry-After, pause
        the model for every process; whether it paused (the next attempt then waits in
        ``before_attempt`` instead of sleeping on its own)."""
        if self.scope is None or self.name is None:
            return False
        await self.scope.settle(self.name, -self.estimate)
        if retry_after is None:
            return False
        await self.scope.pause(self.name, retry_after)
        return True
