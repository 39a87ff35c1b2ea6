"""The dispatcher against real vendors on loopback: an HTTP API and an SMTP server."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import anyio
import asyncpg
import pytest

from orchestrator.agent.turns import default_result
from orchestrator.backoff import Backoff
from orchestrator.db.store import RunStore
from orchestrator.effect_model import Effect, EffectRecord, EffectStatus
from orchestrator.effects.adapters import Adapter, answers_within
from orchestrator.effects.dispatcher import Dispatcher
from orchestrator.effects.http import HttpAdapter
from orchestrator.effects.smtp import SmtpAdapter
from orchestrator.effects.store import EffectStore
from orchestrator.testing import LocalVendor, SmtpSink

CRM = Effect("crm-note", "crm", {"note": "contract reviewed"})
MAIL = Effect("summary-email", "email", {"to": "legal@acme.test", "subject": "S", "body": "B"})


async def requested(store: RunStore, pool: asyncpg.Pool, effect: Effect) -> str:
    """A run whose owner's step commit requested ``effect``; returns the run id."""
    await store.submit("agent", {})
    run = (await store.claim("W", ["agent"], limit=1, lease_seconds=60)).claimed[0]

    async def record(db: object, _: object) -> None:
        answer = await EffectStore(pool).accept(db, run.run_id, run.fence, effect, worker_id="W")  # type: ignore[arg-type]
        assert answer.outcome == "accepted"

    assert await store.commit_step(
        run.lease, expected_version=0, next_step="wait", checkpoint={}, in_transaction=record
    )
    return run.run_id


async def dispatch_until(
    pool: asyncpg.Pool,
    adapters: Mapping[str, Adapter],
    run_id: str,
    key: str,
    statuses: set[EffectStatus],
    *,
    within: float = 20,
    lease_seconds: float = 5,
) -> EffectRecord:
    dispatcher = Dispatcher(
        pool,
        adapters,
        lease_seconds=lease_seconds,
        poll_seconds=0.05,
        backoff=Backoff(base_seconds=0.2),
    )
    effects = EffectStore(pool)
    async with anyio.create_task_group() as group:
        group.start_soon(dispatcher.run)
        with anyio.fail_after(within):
            while (record := await effects.get(run_id, key)).status not in statuses:  # noqa: ASYNC110
                await anyio.sleep(0.05)
        group.cancel_scope.cancel()
    return record


def http(
    vendor: LocalVendor, reconcile: str = "lookup", timeout: float = 2.0
) -> dict[str, Adapter]:
    return {
        "crm": HttpAdapter(
            "crm",
            url=vendor.send_url,
            reconcile=reconcile,
            lookup_url=vendor.lookup_url if reconcile == "lookup" else None,
            timeout_seconds=timeout,
        )
    }


def smtp(sink: SmtpSink, **options: Any) -> dict[str, Adapter]:
    return {
        "email": SmtpAdapter(
            "email", host="127.0.0.1", port=sink.port, sender="a@orch.test", **options
        )
    }


async def confirmed_after_a_bad_spell(
    pool: asyncpg.Pool,
    vendor: LocalVendor,
    adapters: Mapping[str, Adapter],
    run_id: str,
    *,
    mode: str,
    failed_requests: int,
) -> None:
    """Dispatch while ``vendor`` misbehaves (``mode``) for ``failed_requests`` requests, then
    let it recover; return once the effect is confirmed."""
    vendor.mode = mode
    async with anyio.create_task_group() as group:
        group.start_soon(dispatch_until, pool, adapters, run_id, CRM.key, {EffectStatus.CONFIRMED})
        with anyio.fail_after(60):
            while vendor.requests < failed_requests:  # noqa: ASYNC110 - vendor state, polled
                await anyio.sleep(0.02)
        vendor.mode = "ok"


@pytest.mark.parametrize(
    ("mode", "send_timeout", "first_outcome"),
    [
        ("ok", 2.0, "effect_accepted"),
        # A timeout after the vendor accepted: reconciled by a lookup, not sent again.
        ("accept_then_hang", 0.5, "effect_uncertain"),
    ],
    ids=["answered", "timeout-after-the-vendor-accepted"],
)
async def test_confirmed_once_with_the_stable_key(
    store: RunStore, pool: asyncpg.Pool, mode: str, send_timeout: float, first_outcome: str
) -> None:
    run_id = await requested(store, pool, CRM)
    async with LocalVendor() as vendor:
        vendor.mode = mode
        record = await dispatch_until(
            pool, http(vendor, timeout=send_timeout), run_id, CRM.key, {EffectStatus.CONFIRMED}
        )
    assert record.external_id == "op_1"
    assert list(vendor.deliveries) == [record.idempotency_key]
    assert vendor.requests == 1  # the lookup, when there was one, found it: no second POST
    kinds = [e.kind for e in await store.events(run_id)]
    assert kinds[-2:] == [first_outcome, "effect_confirmed"]


async def test_replay_reconciliation_resends_with_the_same_key(
    store: RunStore, pool: asyncpg.Pool
) -> None:
    run_id = await requested(store, pool, CRM)
    async with LocalVendor() as vendor:
        adapters = http(vendor, reconcile="replay")
        await confirmed_after_a_bad_spell(
            pool, vendor, adapters, run_id, mode="fail_5xx", failed_requests=1
        )
    record = await EffectStore(pool).get(run_id, CRM.key)
    assert record.status is EffectStatus.CONFIRMED
    assert len(vendor.deliveries) == 1 and vendor.requests >= 2


async def test_an_adapter_that_cannot_reconcile_parks_then_a_person_resolves(
    store: RunStore, pool: asyncpg.Pool
) -> None:
    run_id = await requested(store, pool, CRM)
    async with LocalVendor() as vendor:
        vendor.mode = "fail_5xx"
        record = await dispatch_until(
            pool, http(vendor, reconcile="none"), run_id, CRM.key, {EffectStatus.PARKED}
        )
    assert vendor.requests == 1
    assert record.error is not None and "cannot be looked up" in record.error["message"]
    resolved = await EffectStore(pool).resolve(
        run_id, CRM.key, sent=True, by="ana", external_id="manual-7"
    )
    assert (resolved.status, resolved.external_id) == (EffectStatus.CONFIRMED, "manual-7")
    # The model reads the outcome only: not the park's error, nor who resolved it (the
    # timeline and the audit trail say that).
    assert default_result(resolved) == {
        "status": "confirmed",
        "external_id": "manual-7",
        "result": None,
        "error": None,
    }
    (event,) = [e for e in await store.events(run_id) if e.kind == "effect_resolved"]
    role = await pool.fetchval("SELECT session_user")
    assert event.details == {
        "effect_key": CRM.key,
        "decision": "confirmed",
        "by": role,  # the principal the database proved, not the typed name
        "via": "database-role",
        "typed_by": "ana",
    }
    from orchestrator.errors import InvalidTransition

    with pytest.raises(InvalidTransition, match="not parked"):
        await EffectStore(pool).resolve(run_id, CRM.key, sent=False, by="ana")


async def test_busy_vendor_is_retried_and_a_rejection_fails(
    store: RunStore, pool: asyncpg.Pool
) -> None:
    busy_run = await requested(store, pool, CRM)
    async with LocalVendor() as vendor:
        await confirmed_after_a_bad_spell(
            pool, vendor, http(vendor), busy_run, mode="busy", failed_requests=2
        )
        assert len(vendor.deliveries) == 1
        rejected_run = await requested(store, pool, Effect("crm-2", "crm", {"bad": True}))
        vendor.mode = "reject"
        record = await dispatch_until(
            pool, http(vendor), rejected_run, "crm-2", {EffectStatus.FAILED}
        )
    assert record.error is not None and "HTTP 422" in record.error["message"]


async def slow_dispatch_once(dispatcher: Dispatcher) -> None:
    """Claim and handle one batch as ``Dispatcher.run`` does, then return."""
    deadline = anyio.current_time() + dispatcher.lease_seconds - dispatcher.margin
    claimed = await dispatcher._claim()
    assert claimed
    for effect in claimed:
        dispatcher._in_flight += 1
        await dispatcher._handle(effect, deadline)


async def test_the_run_is_rechecked_right_before_the_vendor_call(
    store: RunStore, pool: asyncpg.Pool
) -> None:
    run_id = await requested(store, pool, CRM)
    effects = EffectStore(pool)
    async with LocalVendor() as vendor:
        dispatcher = Dispatcher(pool, http(vendor), dispatcher_id="d1", lease_seconds=30)
        async with pool.acquire() as db:
            (claimed,) = await effects.claim(db, "d1", ["crm"], limit=1, lease_seconds=30)
        await store.cancel(run_id)  # after the claim, before the send
        deadline = anyio.current_time() + 29
        outcome = await dispatcher._dispatch(claimed, dispatcher.adapters["crm"], deadline)
    assert outcome == "rejected"
    assert vendor.requests == 0
    assert (await effects.get(run_id, CRM.key)).status is EffectStatus.REJECTED


async def test_a_late_answer_to_the_recheck_sends_nothing_once_the_lease_may_have_ended(
    store: RunStore, pool: asyncpg.Pool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by the chaos campaign: a dispatcher whose re-check answer came back 14 s late (its
    replies held by a partition) sent after its 4 s lease, after the run's cancel had withdrawn
    the effect. An answer says what was true when the database computed it: past the lease the
    dispatcher sends nothing, and the next dispatcher decides."""
    run_id = await requested(store, pool, CRM)
    effects = EffectStore(pool)
    checked = effects.may_dispatch

    async def late(*args: Any, **kwargs: Any) -> tuple[bool, bool]:
        answer = await checked(*args, **kwargs)  # computed now, while the lease holds
        await anyio.sleep(1.5)  # the answer arrives after the 1 s lease
        return answer

    async with LocalVendor() as vendor:
        slow = Dispatcher(pool, http(vendor), dispatcher_id="slow", lease_seconds=1)
        monkeypatch.setattr(slow.store, "may_dispatch", late)
        with anyio.fail_after(60):
            await slow_dispatch_once(slow)
        assert vendor.requests == 0
        record = await dispatch_until(pool, http(vendor), run_id, CRM.key, {EffectStatus.CONFIRMED})
    assert vendor.requests == 1 and len(vendor.deliveries) == 1
    assert record.attempts == 2


async def test_smtp_sends_once_with_a_message_id_from_the_key(
    store: RunStore, pool: asyncpg.Pool
) -> None:
    run_id = await requested(store, pool, MAIL)
    with SmtpSink() as sink:
        record = await dispatch_until(pool, smtp(sink), run_id, MAIL.key, {EffectStatus.CONFIRMED})
    assert sink.message_ids() == [f"<{record.idempotency_key}@orchestrator>"]
    assert sink.messages[0]["To"] == "legal@acme.test"


async def test_an_uncertain_smtp_send_is_parked_never_resent(
    store: RunStore, pool: asyncpg.Pool
) -> None:
    run_id = await requested(store, pool, MAIL)
    with SmtpSink() as sink:
        sink.mode = "hang_after_data"
        sink.hang_seconds = 3
        record = await dispatch_until(
            pool, smtp(sink, timeout_seconds=0.5), run_id, MAIL.key, {EffectStatus.PARKED}
        )
        await anyio.sleep(1.0)
        assert len(sink.messages) == 1
    assert record.status is EffectStatus.PARKED
    kinds = [e.kind for e in await store.events(run_id)]
    assert kinds[-2:] == ["effect_uncertain", "effect_parked"]


async def test_a_vendor_slower_than_the_lease_allows_is_cut_off_by_the_dispatcher(
    store: RunStore, pool: asyncpg.Pool
) -> None:
    """An adapter that bounds its own calls (``answers_within``) is trusted only when that bound
    fits in the lease: here 30 s does not fit a 2 s lease, so the dispatcher's own timer ends
    the send as uncertain, and the lookup finds the delivery (one POST)."""
    run_id = await requested(store, pool, CRM)
    async with LocalVendor() as vendor:
        vendor.mode = "accept_then_hang"
        slow = Dispatcher(pool, http(vendor, timeout=30), dispatcher_id="short", lease_seconds=2)
        try:
            with anyio.fail_after(20):
                await slow_dispatch_once(slow)
        finally:
            await slow.adapters["crm"].aclose()
        record = await EffectStore(pool).get(run_id, CRM.key)
        assert record.status is EffectStatus.UNCERTAIN
        assert record.error is not None and "no answer from crm within" in record.error["message"]
        vendor.mode = "ok"
        record = await dispatch_until(pool, http(vendor), run_id, CRM.key, {EffectStatus.CONFIRMED})
    assert vendor.requests == 1 and list(vendor.deliveries) == [record.idempotency_key]


async def test_a_dispatcher_cancelled_mid_send_stops_its_sends_and_the_next_one_reconciles(
    store: RunStore, pool: asyncpg.Pool
) -> None:
    """Cancelling the dispatcher reaches the sends of every batch in flight: it returns at once,
    the effect stays 'dispatching' (the vendor may have it), and whoever claims it after the
    lease looks it up instead of posting again."""
    run_ids = [await requested(store, pool, CRM) for _ in range(3)]
    async with LocalVendor() as vendor:
        vendor.mode = "accept_then_hang"
        hung = Dispatcher(pool, http(vendor, timeout=30), lease_seconds=3, poll_seconds=0.05)
        with anyio.fail_after(20):
            async with anyio.create_task_group() as group:
                group.start_soon(hung.run)
                while vendor.requests < len(run_ids):  # noqa: ASYNC110 - vendor state, polled
                    await anyio.sleep(0.02)
                group.cancel_scope.cancel()
        assert hung._in_flight == 0
        await anyio.sleep(0.5)  # a send that outlived the cancel would record its outcome now
        effects = EffectStore(pool)
        for run_id in run_ids:
            assert (await effects.get(run_id, CRM.key)).status is EffectStatus.DISPATCHING
        vendor.mode = "ok"
        for run_id in run_ids:
            await dispatch_until(pool, http(vendor), run_id, CRM.key, {EffectStatus.CONFIRMED})
    assert vendor.requests == len(run_ids) and len(vendor.deliveries) == len(run_ids)


class _Bounded:
    def __init__(self, bound: object) -> None:
        self.answers_within = bound


@pytest.mark.parametrize(
    ("adapter", "trusted"),
    [
        (HttpAdapter("crm", url="http://127.0.0.1:9/send", timeout_seconds=7), 7.0),
        (_Bounded(2), 2.0),
        (_Bounded(0), None),
        (_Bounded(-1.0), None),
        (_Bounded(float("nan")), None),
        (_Bounded(True), None),
        (_Bounded("5"), None),
        (_Bounded(None), None),
        (object(), None),
    ],
    ids=["http", "two", "zero", "negative", "nan", "bool", "text", "null", "unsaid"],
)
def test_only_a_positive_number_of_seconds_is_taken_as_an_adapters_own_bound(
    adapter: object, trusted: float | None
) -> None:
    assert answers_within(adapter) == (float("inf") if trusted is None else trusted)  # type: ignore[arg-type]
