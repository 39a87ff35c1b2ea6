"""The dispatcher's side of shared rate limits (docs/flow-control.md): each batch's sends of an
effect kind are charged to the rate limit ``effect:KIND`` before they start, and those it has no
capacity for are handed back unsent, due again when it will have; a vendor's Retry-After pauses
the kind for every dispatcher."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from orchestrator.db.deadlines import DATABASE_ERRORS
from orchestrator.db.rates import RateLimitStore, Taken, effect_limit
from orchestrator.effects.store import ClaimedEffect
from orchestrator.errors import error_fields
from orchestrator.telemetry import flow_metrics


@dataclass(frozen=True)
class Unsent:
    """Why an effect of a claimed batch is given back unsent, and when it is due again
    (``None``: the dispatcher's backoff)."""

    reason: str
    retry_after: float | None = None


class SendRates:
    """Charges a dispatcher's sends to their kinds' rate limits."""

    def __init__(self, store: RateLimitStore, who: str, poll_seconds: float, log: Any) -> None:
        self.store = store
        self.who = who
        self.poll_seconds = poll_seconds
        self.log = log

    async def over(self, fresh: list[ClaimedEffect]) -> dict[int, Unsent]:
        """The effects their kind's rate limit has no capacity for now, by ``id()``, each due
        again when it will have; the others are charged to it."""
        by_kind: dict[str, list[ClaimedEffect]] = {}
        for claimed in fresh:
            by_kind.setdefault(claimed.record.kind, []).append(claimed)
        over: dict[int, Unsent] = {}
        for kind, effects in by_kind.items():
            name = effect_limit(kind)
            try:
                if not await self.store.limited(name):
                    continue
                taken = await self.store.take(name, len(effects))
            except DATABASE_ERRORS as error:
                self.log.warning("cannot take a rate limit", limit=name, **error_fields(error))
                taken = Taken(0, self.poll_seconds)  # nothing is sent uncharged
            if taken.granted >= len(effects):
                continue
            flow_metrics().rate_waits.add(len(effects) - taken.granted, {"limit": name})
            unsent = Unsent(
                f"not sent: rate limit {name} has no capacity for "
                f"{taken.wait_seconds:.1f}s (`orchestrator rates list`)",
                retry_after=taken.wait_seconds,
            )
            over.update((id(claimed), unsent) for claimed in effects[taken.granted :])
        return over

    async def pause(self, kind: str, seconds: float) -> None:
        """The vendor said when to come back: every dispatcher's sends of ``kind`` wait."""
        try:
            await self.store.pause(effect_limit(kind), seconds, self.who)
        except DATABASE_ERRORS as error:
            self.log.warning("cannot pause a rate limit", kind=kind, **error_fields(error))
