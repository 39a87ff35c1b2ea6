"""The dispatcher: an outbox relay from accepted effect records to vendors.

It claims effects with its own lease (SKIP LOCKED, so many dispatchers can run), re-checks right
before the vendor call that it still holds the effect and that the run was not cancelled, sends
with the stable idempotency key, and records the outcome. An effect whose send may have reached
the vendor (a timeout, a dropped connection, a dispatcher that died mid-call and whose lease ran
out) is reconciled through the adapter before anything is sent again; an adapter that cannot
reconcile parks it for a person.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import anyio
import asyncpg
import structlog
from opentelemetry import trace
from opentelemetry.context import Context

from orchestrator.backoff import Backoff
from orchestrator.db.deadlines import DATABASE_ERRORS, pooled
from orchestrator.db.notifications import DUE_CHANNEL, Listener
from orchestrator.db.sync_standby import SyncStandbyRequirement
from orchestrator.errors import InvalidInput, error_fields
from orchestrator.telemetry import (
    EFFECT_DISPOSITION,
    EFFECT_KEY,
    EXTERNAL_ID,
    IDEMPOTENCY_KEY,
    RUN_FENCE,
    RUN_ID,
    EffectMetrics,
    parent_from,
    start_span,
    tracing_enabled,
)

from .adapters import (
    Adapter,
    Confirmed,
    Failed,
    NotSent,
    Park,
    ReconcileOutcome,
    Retry,
    SendOutcome,
    Uncertain,
    adapter_from_config,
)
from .model import EffectRecord, EffectStatus
from .store import ClaimedEffect, EffectStore

log = structlog.get_logger("orchestrator.effects")


def load_adapters(path: str | Path | None = None) -> dict[str, Adapter]:
    """Vendors from a JSON file (``ORCHESTRATOR_EFFECTS_CONFIG``): ``{"kinds": {KIND: {...}}}``.

    Example: ``{"kinds": {"email": {"adapter": "smtp", "host": "127.0.0.1", "port": 2525,
    "sender": "agents@example.com"}, "crm": {"adapter": "http", "url": "https://…",
    "token_env": "CRM_TOKEN", "reconcile": "lookup", "lookup_url": "https://…/{idempotency_key}"}}}``
    """
    location = path or os.environ.get("ORCHESTRATOR_EFFECTS_CONFIG")
    if not location:
        return {}
    try:
        document = json.loads(Path(location).read_text("utf-8"))
    except OSError as error:
        raise InvalidInput(f"cannot read effects config {location}: {error.strerror}") from None
    except json.JSONDecodeError as error:
        raise InvalidInput(f"effects config {location} is not valid JSON: {error.msg}") from None
    kinds = document.get("kinds") if isinstance(document, dict) else None
    if not isinstance(kinds, dict):
        raise InvalidInput(f'effects config {location} must be {{"kinds": {{KIND: {{...}}}}}}')
    try:
        return {kind: adapter_from_config(kind, options) for kind, options in kinds.items()}
    except (TypeError, ValueError) as error:
        raise InvalidInput(f"effects config {location}: {error}") from None


def default_dispatcher_id() -> str:
    return f"dispatch:{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"


class Dispatcher:
    def __init__(
        self,
        pool: asyncpg.Pool,
        adapters: Mapping[str, Adapter],
        *,
        dispatcher_id: str | None = None,
        lease_seconds: float = 60.0,
        batch: int = 20,
        concurrency: int = 20,
        poll_seconds: float = 1.0,
        statement_seconds: float = 10.0,
        backoff: Backoff | None = None,
        sync_standby: SyncStandbyRequirement | None = None,
    ) -> None:
        self.store = EffectStore(pool)
        self.pool = pool
        self.adapters = dict(adapters)
        self.dispatcher_id = dispatcher_id or default_dispatcher_id()
        self.lease_seconds = lease_seconds
        self.batch = batch
        self.poll_seconds = poll_seconds
        self.statement_seconds = statement_seconds
        self.backoff = backoff or Backoff(base_seconds=1.0, max_seconds=300.0)
        self.concurrency = concurrency
        self._limiter = anyio.CapacityLimiter(concurrency)
        self._in_flight = 0
        self._wake = anyio.Event()
        self.outcomes: dict[str, int] = {}
        self.margin = min(1.0, lease_seconds * 0.1)
        """Kept from the end of each lease: a send starts at least this long before it ends."""
        self.metrics = EffectMetrics()
        self.log = log.bind(dispatcher=self.dispatcher_id)
        self.sync_standby = sync_standby or SyncStandbyRequirement(False)
        """With ``--require-sync-standby``: nothing is claimed while it fails, and no effect
        needs a lookup for a failover's sake (no commit of a lost timeline was acted on)."""

    def wake(self) -> None:
        self._wake.set()

    async def run(self) -> None:
        """Dispatch until cancelled."""
        if not self.adapters:
            return
        self.metrics.start_at_zero(self.adapters)
        self.log.info("dispatching", kinds=sorted(self.adapters))
        try:
            async with anyio.create_task_group() as group:
                group.start_soon(self._listen)
                while True:
                    self._wake = anyio.Event()
                    # The lease is judged from before the claim was sent: its answer may arrive
                    # late, and by then part of the lease is gone.
                    deadline = anyio.current_time() + self.lease_seconds - self.margin
                    claimed = await self._claim()
                    for effect in claimed:
                        self._in_flight += 1
                        group.start_soon(self._handle, effect, deadline)
                    if claimed and len(claimed) == self.batch:
                        continue
                    with anyio.move_on_after(self.poll_seconds):
                        await self._wake.wait()
        finally:
            with anyio.move_on_after(5, shield=True):
                for adapter in self.adapters.values():
                    await adapter.aclose()

    async def _claim(self) -> list[ClaimedEffect]:
        # Count effects in flight, not free limiter slots: handlers just started have not taken
        # theirs yet, and claiming against those would hold twice the concurrency.
        free = self.concurrency - self._in_flight
        if free <= 0:
            return []
        try:
            async with pooled(self.pool, within=self.statement_seconds) as db:
                if await self.sync_standby.satisfied(db):
                    return await self.store.claim(
                        db,
                        self.dispatcher_id,
                        sorted(self.adapters),
                        limit=min(self.batch, free),
                        lease_seconds=self.lease_seconds,
                        trust_sync_replication=self.sync_standby.required,
                    )
        except DATABASE_ERRORS as error:
            self.log.warning("cannot claim effects", **error_fields(error))
        # Unreachable, or the synchronous standby it requires is missing: look again later.
        await anyio.sleep(self.poll_seconds)
        return []

    async def _listen(self) -> None:
        """Wake when a step commits an effect (NOTIFY in the same transaction).

        On one of the pool's connections, checked every five polls; the claim loop's own poll
        covers what is notified while it is lost.
        """
        await Listener(
            (DUE_CHANNEL,),
            lambda channel, kind: self.wake(),
            pool=self.pool,
            check_seconds=self.poll_seconds * 5,
            statement_seconds=self.statement_seconds,
            retry_seconds=self.poll_seconds,
        ).run()

    async def _handle(self, claimed: ClaimedEffect, deadline: float) -> None:
        effect = claimed.record
        adapter = self.adapters[effect.kind]
        async with self._limiter:
            try:
                parent = await self._requesting_attempt(effect)
                with start_span(
                    f"dispatch {effect.kind}",
                    attributes={
                        **_effect_ids(effect),
                        "orchestrator.effect.attempt": effect.attempts,
                        "orchestrator.dispatcher.id": self.dispatcher_id,
                    },
                    context=parent,
                ) as span:
                    began = time.monotonic()
                    try:
                        status = await self._dispatch(claimed, adapter, deadline)
                    except DATABASE_ERRORS as error:
                        # The record stays 'dispatching' until its lease runs out; whoever
                        # claims it next reconciles before sending. Nothing is sent blind.
                        self.log.warning(
                            "lost track of an effect",
                            error=str(error),
                            **{RUN_ID: effect.run_id},
                            effect_key=effect.effect_key,
                        )
                        status = "unknown"
                    span.set_attribute(EFFECT_DISPOSITION, status)
            finally:
                self._in_flight -= 1
                self.wake()  # a slot is free: claim more without waiting for a poll
        self.outcomes[status] = self.outcomes.get(status, 0) + 1
        kind = {"kind": effect.kind}
        self.metrics.outcomes.add(1, {**kind, "outcome": status})
        self.metrics.send_seconds.record(time.monotonic() - began, kind)

    async def _requesting_attempt(self, effect: EffectRecord) -> Context | None:
        """With tracing on, the trace context of the attempt that requested ``effect``, so this
        dispatch joins that attempt's trace; ``None`` (a trace of its own) if it is not known."""
        if not tracing_enabled():
            return None
        try:
            async with pooled(self.pool, within=self.statement_seconds) as db:
                return parent_from(await self.store.requesting_trace(db, effect))
        except DATABASE_ERRORS:
            return None  # the dispatch itself will meet the outage and say so

    async def _dispatch(self, claimed: ClaimedEffect, adapter: Adapter, deadline: float) -> str:
        """Reconcile if a send may have landed, re-check the claim, send within the lease.

        ``deadline`` is when this dispatcher's lease may end, on its own monotonic clock: an
        answer that arrives late (a paused process, replies held by the network) says what was
        true when the database computed it, so past the deadline nothing is sent.
        """
        effect = claimed.record
        bound = max(1.0, self.lease_seconds * 0.8)
        if claimed.must_reconcile:
            with start_span(f"reconcile {effect.kind}", attributes=_effect_ids(effect)) as span:
                try:
                    with anyio.fail_after(bound):
                        found: ReconcileOutcome = await adapter.reconcile(effect)
                except TimeoutError:
                    found = Uncertain("reconciliation timed out")
                span.set_attribute("orchestrator.effect.found", type(found).__name__)
            if not isinstance(found, NotSent):
                return await self._record(effect, found)
        async with pooled(self.pool, within=self.statement_seconds) as db:
            holds, run_live = await self.store.may_dispatch(db, effect, self.dispatcher_id)
        if not run_live:
            return await self._record(effect, Failed("the run was cancelled"), cancelled=True)
        remaining = deadline - anyio.current_time()
        if not holds or remaining <= 0:
            return "lost_claim"
        limit = min(bound, remaining)
        with start_span(f"send {effect.kind}", attributes=_effect_ids(effect)) as span:
            try:
                with anyio.fail_after(limit):
                    sent: SendOutcome = await adapter.send(effect)
            except TimeoutError:
                sent = Uncertain(f"no answer from {effect.kind} within {limit:.1f}s")
            span.set_attribute("orchestrator.effect.answer", type(sent).__name__)
        return await self._record(effect, sent)

    async def _record(
        self, effect: EffectRecord, outcome: ReconcileOutcome, *, cancelled: bool = False
    ) -> str:
        status: EffectStatus
        options: dict[str, Any] = {}
        if isinstance(outcome, Confirmed):
            status = EffectStatus.CONFIRMED
            options = {"external_id": outcome.external_id, "result": outcome.result}
            if outcome.external_id is not None:
                trace.get_current_span().set_attribute(EXTERNAL_ID, outcome.external_id)
        elif isinstance(outcome, Failed):
            status = EffectStatus.REJECTED if cancelled else EffectStatus.FAILED
            options = {"error": {"message": outcome.error}}
        elif isinstance(outcome, Retry):
            status = EffectStatus.ACCEPTED
            options = {
                "error": {"message": outcome.error},
                "retry_after": self.backoff.ceiling(effect.attempts),
            }
        elif isinstance(outcome, Uncertain):
            status = EffectStatus.UNCERTAIN
            options = {
                "error": {"message": outcome.error},
                "retry_after": self.backoff.ceiling(effect.attempts),
            }
        else:
            assert isinstance(outcome, Park)
            status = EffectStatus.PARKED
            options = {"error": {"message": outcome.reason}}
        async with pooled(self.pool, within=self.statement_seconds) as db:
            await self.store.settle(db, effect, self.dispatcher_id, status, **options)
        self.log.info(
            "effect " + status.value,
            **{RUN_ID: effect.run_id, RUN_FENCE: effect.fence},
            effect_key=effect.effect_key,
            attempt=effect.attempts,
        )
        return status.value


def _effect_ids(effect: EffectRecord) -> dict[str, str | int]:
    return {
        RUN_ID: effect.run_id,
        RUN_FENCE: effect.fence,
        EFFECT_KEY: effect.effect_key,
        IDEMPOTENCY_KEY: effect.idempotency_key,
    }
