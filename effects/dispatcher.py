"""The dispatcher: an outbox relay from accepted effect records to vendors.

It claims effects with its own lease (SKIP LOCKED, so many dispatchers can run), re-checks right
before the vendor call that it still holds the effect and that the run was not cancelled, sends
with the stable idempotency key, and records the outcome. An effect whose send may have reached
the vendor (a timeout, a dropped connection, a dispatcher that died mid-call and whose lease ran
out) is reconciled through the adapter before anything is sent again; an adapter that cannot
reconcile parks it for a person.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import socket
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import anyio
import asyncpg
import structlog
from opentelemetry import trace
from opentelemetry.context import Context

from orchestrator.backoff import Backoff
from orchestrator.db.bootstrap import PoolOptions
from orchestrator.db.deadlines import DATABASE_ERRORS, pooled
from orchestrator.db.notifications import DUE_CHANNEL, Listener
from orchestrator.db.outages import DatabaseOutage
from orchestrator.db.rates import RateLimitStore
from orchestrator.db.standby_wait import StandbyGate
from orchestrator.db.sync_standby import SyncStandbyRequirement
from orchestrator.effect_model import EffectRecord, EffectStatus
from orchestrator.effects.adapters import (
    Adapter,
    Confirmed,
    Failed,
    NotSent,
    Park,
    ReconcileOutcome,
    Retry,
    SendOutcome,
    Uncertain,
    answers_within,
    connector,
)
from orchestrator.effects.send_rates import SendRates, Unsent
from orchestrator.effects.settling import GroupSettler
from orchestrator.effects.store import ClaimedEffect, EffectStore, SettleRequest
from orchestrator.errors import InvalidInput, error_fields
from orchestrator.settings import StandbyPolicy
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

log = structlog.get_logger("orchestrator.effects")

DISPATCH_POOL: PoolOptions = {"keep_session_state": True}
"""How a dispatcher process opens its pool: its statements leave no session state behind and
its listener unlistens before giving a connection back, so no reset query follows each use."""


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
        standby: StandbyGate | StandbyPolicy | None = None,
        outage: DatabaseOutage | None = None,
    ) -> None:
        _check_settings(
            lease_seconds=lease_seconds,
            batch=batch,
            concurrency=concurrency,
            poll_seconds=poll_seconds,
            statement_seconds=statement_seconds,
        )
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
        self._in_flight = 0
        self._wake = anyio.Event()
        self.stopping = False
        """Asked to stop: it claims nothing more, and returns once its sends in flight end."""
        self.stopped = anyio.Event()
        self._claim_at = max(1, min(batch, concurrency) // 2)
        """While effects are in flight, claim once this many slots are free (or none are busy):
        one statement per batch, not one per finished send."""
        self.settler = GroupSettler(pool, self.store, self.dispatcher_id, statement_seconds)
        self.outcomes: dict[str, int] = {}
        self.margin = min(1.0, lease_seconds * 0.1)
        """Kept from the end of each lease: a send starts at least this long before it ends."""
        self.metrics = EffectMetrics()
        self.log = log.bind(dispatcher=self.dispatcher_id)
        self.rates = SendRates(RateLimitStore(pool), self.dispatcher_id, poll_seconds, self.log)
        """The shared rate limits its sends are charged against (``effect:KIND``)."""
        self.outage = outage or DatabaseOutage(self.log)
        """Says once that the database is out of reach (a worker shares its own)."""
        self.sync_standby = sync_standby or SyncStandbyRequirement(False)
        """With ``--require-sync-standby``: nothing is claimed while it fails, and no effect
        needs a lookup for a failover's sake (no commit of a lost timeline was acted on)."""
        if not isinstance(standby, StandbyGate):
            standby = StandbyGate(standby or StandbyPolicy())
        self.standby = standby
        """Where the primary has streaming standbys, a claim is sent only once one holds it
        (``--standby-wait``): a promotion cannot take back what a vendor was sent for."""

    def wake(self) -> None:
        self._wake.set()

    def stop(self) -> None:
        """Claim nothing more; ``run`` returns once the sends in flight have ended (each within
        its lease). Cancelling them instead would leave an effect claimed and perhaps half
        sent, which its next dispatcher must reconcile (or a person, for email)."""
        self.stopping = True
        self.wake()

    async def finish(self) -> None:
        """Stop, and wait for the sends in flight to end (at most a lease: each ends within
        its own)."""
        self.stop()
        with anyio.move_on_after(self.lease_seconds):
            await self.stopped.wait()

    async def run(self) -> None:
        """Dispatch until cancelled or stopped."""
        try:
            if self.adapters:
                await self._claim_and_send()
        finally:
            self.stopped.set()

    async def _claim_and_send(self) -> None:
        self.metrics.start_at_zero(self.adapters)
        self.log.info("dispatching", kinds=sorted(self.adapters))
        listening = anyio.CancelScope()
        try:
            async with anyio.create_task_group() as group:
                group.start_soon(listen_for_due, self, listening)
                while not self.stopping:
                    self._wake = anyio.Event()
                    # The lease is judged from before the claim was sent: its answer may arrive
                    # late, and by then part of the lease is gone.
                    deadline = time.monotonic() + self.lease_seconds - self.margin
                    asked = self._claim_size()
                    claimed = await self._claim(asked) if asked else []
                    if claimed:
                        self._in_flight += len(claimed)
                        group.start_soon(self._dispatch_batch, claimed, deadline)
                    if claimed and len(claimed) == asked:
                        continue  # more may be due
                    with anyio.move_on_after(self.poll_seconds):
                        await self._wake.wait()
                listening.cancel()  # the batches in flight end by themselves
        finally:
            with anyio.move_on_after(5, shield=True):
                for adapter in self.adapters.values():
                    await adapter.aclose()

    def _claim_size(self) -> int:
        """How many effects to claim now: the free slots, up to a batch (0: not yet)."""
        # Effects in flight: claimed, their vendor calls not yet over (see _handle).
        free = self.concurrency - self._in_flight
        if free <= 0 or (self._in_flight and free < self._claim_at):
            return 0  # a batch's worth of slots frees up soon: claim then, in one statement
        return min(self.batch, free)

    async def _claim(self, limit: int | None = None) -> list[ClaimedEffect]:
        """Claim up to ``limit`` effects (default: ``_claim_size()``)."""
        asked = self._claim_size() if limit is None else limit
        if asked <= 0:
            return []
        claimed: list[ClaimedEffect] | None = None
        try:
            async with pooled(self.pool, within=self.statement_seconds) as db:
                if await self.sync_standby.satisfied(db) and await self.standby.may_claim(db):
                    claimed = await self.store.claim(
                        db,
                        self.dispatcher_id,
                        sorted(self.adapters),
                        limit=asked,
                        lease_seconds=self.lease_seconds,
                        trust_sync_replication=self.sync_standby.required or self.standby.trusted,
                        flush_commit=self.standby.waits,
                    )
        except DATABASE_ERRORS as error:
            self.outage.failed(error, otherwise="cannot claim effects")
        else:
            self.outage.reached()
            if claimed is not None:
                return claimed
        # Unreachable, or the standby it requires is missing: look again later.
        await anyio.sleep(self.poll_seconds)
        return []

    async def _dispatch_batch(self, claimed: list[ClaimedEffect], deadline: float) -> None:
        """Dispatch a claimed batch: the effects that may already have been sent are reconciled
        and re-checked one by one; the others are re-checked together, in one statement (a
        single one by itself), right before their sends start. Nothing is sent before a standby
        holds the claim (where one is waited for); if none does in time, they are handed back."""
        held = await self._held_by_standby(deadline, len(claimed))
        unready = await self._connect(claimed, deadline) if held else {}
        fresh = [c for c in claimed if not c.must_reconcile and c.record.kind not in unready]
        over_rate = await self.rates.over(fresh) if held else {}
        if over_rate:
            fresh = [c for c in fresh if id(c) not in over_rate]
        checks: dict[tuple[str, str], tuple[bool, bool]] | None = None
        if len(fresh) > 1 and held:  # one effect alone is re-checked by _dispatch, as it always was
            try:
                async with pooled(self.pool, within=self.statement_seconds) as db:
                    checks = await self.store.may_dispatch_many(
                        db, self.dispatcher_id, [c.record for c in fresh]
                    )
            except DATABASE_ERRORS as error:
                # Nothing is sent: the effects stay 'dispatching' until the lease runs out,
                # and whoever claims them next reconciles first.
                self.log.warning("cannot re-check effects", **error_fields(error))
                checks = {}
        # asyncio's own task group: a task per effect costs a fraction of anyio's, and a
        # cancelled batch still cancels (and waits for) every send in it.
        unheld = None
        if not held:
            problem = self.standby.problem or "no standby flushed its claim in time"
            reason = f"not sent: {problem} (docs/high-availability.md)"
            unheld = Unsent(reason, retry_after=self.poll_seconds)  # due again once one is back
        async with asyncio.TaskGroup() as group:
            for effect in claimed:
                record = effect.record
                check = None
                if checks is not None and not effect.must_reconcile:
                    check = checks.get((record.run_id, record.effect_key), (False, True))
                unsent = unheld or unready.get(record.kind) or over_rate.get(id(effect))
                group.create_task(self._handle(effect, deadline, check, unsent=unsent))

    async def _connect(self, claimed: list[ClaimedEffect], deadline: float) -> dict[str, Unsent]:
        """Open the connections of the batch's adapters that keep one, within half the lease
        left, before the re-check: the kinds whose connection is not open, each with why."""
        openers = {
            kind: connect
            for kind in {c.record.kind for c in claimed}
            if (connect := connector(self.adapters[kind])) is not None
        }
        unready: dict[str, Unsent] = {}
        within = max(0.0, (deadline - time.monotonic()) / 2)

        async def open_one(kind: str, connect: Callable[[], Awaitable[None]]) -> None:
            try:
                with anyio.fail_after(within):
                    await connect()
            except TimeoutError:
                unready[kind] = Unsent(f"not sent: no connection to {kind} within {within:.1f}s")
            except Exception as error:
                unready[kind] = Unsent(f"not sent: {error}")

        if openers:
            async with anyio.create_task_group() as group:
                for kind, connect in openers.items():
                    group.start_soon(open_one, kind, connect)
        return unready

    async def _held_by_standby(self, deadline: float, claimed: int) -> bool:
        """Whether a standby holds this dispatcher's last claim (and so the steps that asked
        for its effects) within half the lease left, leaving the other half for the sends."""
        began = time.monotonic()
        if not self.standby.waits:  # no connection taken: a lone primary's hot path
            held = self.standby.sends_unwaited()
        else:
            within = max(0.0, (deadline - began) / 2)
            try:
                async with pooled(self.pool, within=within + self.statement_seconds) as db:
                    held = await self.standby.held(db, within=within)
            except DATABASE_ERRORS as error:
                # Nothing is sent: the effects stay 'dispatching' until the lease runs out,
                # and whoever claims them next reconciles first.
                self.log.warning("cannot see the standbys", **error_fields(error))
                return False
        if held and self.standby.waits:
            self.metrics.standby_wait.record(time.monotonic() - began)
        elif held and self.standby.problem is not None:  # --without-standby send
            self.metrics.sent_without_standby.add(claimed)
        return held

    async def _handle(
        self,
        claimed: ClaimedEffect,
        deadline: float,
        checked: tuple[bool, bool] | None = None,
        *,
        unsent: Unsent | None = None,
    ) -> None:
        effect = claimed.record
        adapter = self.adapters[effect.kind]
        slot_held = True

        def vendor_done() -> None:
            """Its slot is free once the vendor calls are over, before the outcome is written:
            ``concurrency`` bounds the calls at vendors, and writes are batched meanwhile."""
            nonlocal slot_held
            if slot_held:
                slot_held = False
                self._in_flight -= 1
                if not self._in_flight or self.concurrency - self._in_flight >= self._claim_at:
                    self.wake()  # slots are free: claim more without waiting for a poll

        try:
            parent = await self._requesting_attempt(effect)
            with start_span(
                f"dispatch {effect.kind}",
                attributes=lambda: {
                    **_effect_ids(effect),
                    "orchestrator.effect.attempt": effect.attempts,
                    "orchestrator.dispatcher.id": self.dispatcher_id,
                },
                context=parent,
            ) as span:
                began = time.monotonic()
                try:
                    if unsent is None:
                        status = await self._dispatch(
                            claimed, adapter, deadline, checked, vendor_done
                        )
                    else:
                        status = await self._hand_back(claimed, unsent, vendor_done)
                except DATABASE_ERRORS as error:
                    # The record stays 'dispatching' until its lease runs out; whoever claims
                    # it next reconciles before sending. Nothing is sent blind.
                    self.log.warning(
                        "lost track of an effect",
                        error=str(error),
                        **{RUN_ID: effect.run_id},
                        effect_key=effect.effect_key,
                    )
                    status = "unknown"
                span.set_attribute(EFFECT_DISPOSITION, status)
        finally:
            vendor_done()
        self.outcomes[status] = self.outcomes.get(status, 0) + 1
        kind = {"kind": effect.kind}
        self.metrics.outcomes.add(1, {**kind, "outcome": status})
        self.metrics.send_seconds.record(time.monotonic() - began, kind)

    async def _hand_back(
        self, claimed: ClaimedEffect, unsent: Unsent, vendor_done: Callable[[], None] | None = None
    ) -> str:
        """Give back an effect that cannot be sent now, unsent: due again later, and reconciled
        first if it had to be (an uncertain one stays uncertain)."""
        reason = unsent.reason
        outcome: Retry | Uncertain = Uncertain(reason) if claimed.must_reconcile else Retry(reason)
        return await self._record(
            claimed.record, outcome, vendor_done=vendor_done, retry_after=unsent.retry_after
        )

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

    async def _dispatch(
        self,
        claimed: ClaimedEffect,
        adapter: Adapter,
        deadline: float,
        checked: tuple[bool, bool] | None = None,
        vendor_done: Callable[[], None] | None = None,
    ) -> str:
        """Reconcile if a send may have landed, re-check the claim, send within the lease.

        ``deadline`` is when this dispatcher's lease may end, on ``time.monotonic()`` (the
        event loop's clock): an answer that arrives late (a paused process, replies held by the
        network) says what was true when the database computed it, so past the deadline nothing
        is sent. ``checked``: the batch's re-check answer (holds, run live), made just now for
        an effect that needs no reconciliation; without it the effect is re-checked here.
        ``vendor_done`` is called once no more vendor calls will be made for it, before its
        outcome is written.
        """
        effect = claimed.record
        bound = max(1.0, self.lease_seconds * 0.8)
        if claimed.must_reconcile:
            with start_span(
                f"reconcile {effect.kind}", attributes=lambda: _effect_ids(effect)
            ) as span:
                try:
                    with anyio.fail_after(bound):
                        found: ReconcileOutcome = await adapter.reconcile(effect)
                except TimeoutError:
                    found = Uncertain("reconciliation timed out")
                span.set_attribute("orchestrator.effect.found", type(found).__name__)
            if not isinstance(found, NotSent):
                return await self._record(effect, found, vendor_done=vendor_done)
        if checked is None or claimed.must_reconcile:
            async with pooled(self.pool, within=self.statement_seconds) as db:
                checked = await self.store.may_dispatch(db, effect, self.dispatcher_id)
        holds, run_live = checked
        if not run_live:
            return await self._record(
                effect, Failed("the run was cancelled"), cancelled=True, vendor_done=vendor_done
            )
        remaining = deadline - time.monotonic()
        if not holds or remaining <= 0:
            return "lost_claim"
        limit = min(bound, remaining)
        with start_span(f"send {effect.kind}", attributes=lambda: _effect_ids(effect)) as span:
            sent: SendOutcome
            if answers_within(adapter) <= limit:
                sent = await adapter.send(effect)  # it answers in time by itself: no 2nd timer
            else:
                try:
                    with anyio.fail_after(limit):
                        sent = await adapter.send(effect)
                except TimeoutError:
                    sent = Uncertain(f"no answer from {effect.kind} within {limit:.1f}s")
            span.set_attribute("orchestrator.effect.answer", type(sent).__name__)
        if isinstance(sent, Retry) and sent.retry_after is not None:
            await self.rates.pause(effect.kind, sent.retry_after)
        return await self._record(
            effect,
            sent,
            vendor_done=vendor_done,
            retry_after=sent.retry_after if isinstance(sent, Retry) else None,
        )

    async def _record(
        self,
        effect: EffectRecord,
        outcome: ReconcileOutcome,
        *,
        cancelled: bool = False,
        vendor_done: Callable[[], None] | None = None,
        retry_after: float | None = None,
    ) -> str:
        if vendor_done is not None:
            vendor_done()
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
        elif isinstance(outcome, Retry | Uncertain):
            status = EffectStatus.ACCEPTED if isinstance(outcome, Retry) else EffectStatus.UNCERTAIN
            options = {
                "error": {"message": outcome.error},
                "retry_after": (
                    self.backoff.ceiling(effect.attempts) if retry_after is None else retry_after
                ),
            }
        else:
            assert isinstance(outcome, Park)
            status = EffectStatus.PARKED
            options = {"error": {"message": outcome.reason}}
        recorded = await self.settler.settle(SettleRequest(effect, status, **options))
        ids = {RUN_ID: effect.run_id, RUN_FENCE: effect.fence}
        if not recorded:
            # This dispatcher's hold ran out (a pause, a partition) and another one claimed the
            # effect and settles it itself: what this one saw is not the effect's outcome, and
            # saying "effect uncertain" would send an operator after one already settled.
            self.log.warning(
                "effect outcome not recorded: another dispatcher holds it now",
                **ids,
                effect_key=effect.effect_key,
                attempt=effect.attempts,
                outcome=status.value,
            )
            return "lost_claim"
        why = {"reason": options["error"]["message"]} if "error" in options else {}
        self.log.info(
            "effect " + status.value,
            **ids,
            effect_key=effect.effect_key,
            attempt=effect.attempts,
            **why,
        )
        return status.value


def _check_settings(
    *,
    lease_seconds: float,
    batch: int,
    concurrency: int,
    poll_seconds: float,
    statement_seconds: float,
) -> None:
    """Refuse settings with which a dispatcher would never send (or never stop trying)."""
    for name, count in (("batch", batch), ("concurrency", concurrency)):
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise InvalidInput(
                f"dispatcher {name} must be a whole number of 1 or more, not {count!r}"
            )
    for name, seconds in (
        ("lease_seconds", lease_seconds),
        ("poll_seconds", poll_seconds),
        ("statement_seconds", statement_seconds),
    ):
        if not isinstance(seconds, int | float) or not 0 < seconds < 86_400:
            raise InvalidInput(
                f"dispatcher {name} must be a number of seconds above 0 and below a day, "
                f"not {seconds!r}"
            )


def _effect_ids(effect: EffectRecord) -> dict[str, str | int]:
    return {
        RUN_ID: effect.run_id,
        RUN_FENCE: effect.fence,
        EFFECT_KEY: effect.effect_key,
        IDEMPOTENCY_KEY: effect.idempotency_key,
    }


async def listen_for_due(dispatcher: Dispatcher, scope: anyio.CancelScope) -> None:
    """Wake ``dispatcher`` when a step commits an effect (NOTIFY in the same transaction), until
    ``scope`` is cancelled.

    On one of the pool's connections, checked every five polls; the claim loop's own poll
    covers what is notified while it is lost.
    """
    with scope:
        await Listener(
            (DUE_CHANNEL,),
            lambda channel, kind: dispatcher.wake(),
            pool=dispatcher.pool,
            check_seconds=dispatcher.poll_seconds * 5,
            statement_seconds=dispatcher.statement_seconds,
            retry_seconds=dispatcher.poll_seconds,
        ).run()
