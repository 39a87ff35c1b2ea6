"""Failover on a real primary + streaming standby (``orchestrator.testing.ReplicatedPostgres``):
no fence is granted twice and no vendor sees a key twice, whatever the promoted server lost.

(a) Asynchronous replication, dispatchers that send while the standby is away
    (``--without-standby send``): the lost primary granted fences, accepted and sent effects
    that the standby never saw; the worker reaches the promoted server through the multi-host
    URL, re-runs the runs under fences of the new epoch, and reconciles before sending. (With
    the default, ``hold``, nothing is sent that the standby lacks: tests/test_standby_wait.py.)
(b) Synchronous replication: a claim whose wait for the standby is cancelled reports no
    success, and a claim whose client gives up leaves the wait in place (no cancel request).
(c) ``--require-sync-standby``, or the default standby wait: an SMTP email (no lookup) goes out
    once through a failover; with neither (``--standby-wait off``) the same email is parked for
    a person rather than sent blind.
(d) The action proxy with a fence store refuses a fence the promoted server forgot.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import asyncpg
import httpx
import pytest

from orchestrator.agent.steps import Agent, Fail, Finish, Next, Outcome, Step, StepContext
from orchestrator.db.bootstrap import ensure_schema
from orchestrator.db.connections import create_pool
from orchestrator.db.store import RunStore
from orchestrator.effect_model import Effect, EffectStatus
from orchestrator.effects.adapters import Adapter
from orchestrator.effects.dispatcher import Dispatcher
from orchestrator.effects.fence_store import FenceStore
from orchestrator.effects.proxy import create_app
from orchestrator.effects.store import EffectStore
from orchestrator.effects.vendors import adapter_from_config
from orchestrator.errors import DatabaseError, OutcomeUnknown
from orchestrator.fences import EPOCH_BITS, epoch_of
from orchestrator.models import JSON, ClaimedRun, RunState
from orchestrator.settings import Settings, StandbyPolicy, StandbyWait, WithoutStandby
from orchestrator.testing import LocalVendor, ReplicatedPostgres, SmtpSink, running_worker
from orchestrator.testing.loopback import ScriptedCall, ScriptedModelServer, ScriptedTurn, turns
from orchestrator.worker.worker import Worker
from support import crm_kind
from support.tool_agents_for_tests import orders

pytestmark = pytest.mark.slow

GRANTS: list[tuple[str, int, str]] = []
"""Every (run, fence) a step of this module ran under, on whichever timeline: the evidence a
failover cannot take back (the lost primary's own records of its claims are gone)."""

WORKER = {"lease_seconds": 3.0, "heartbeat_seconds": 1.0, "poll_seconds": 0.1}
SENDS_ALONE = StandbyPolicy(without=WithoutStandby.SEND)
"""Dispatchers that go on sending while the standby is away: what the lost timeline sent is
looked up on the promoted server."""


class Request(Step):
    async def run(self, ctx: StepContext) -> Outcome:
        GRANTS.append((ctx.run_id, ctx.fence, "request"))
        await anyio.sleep(float(ctx.input.get("think_seconds", 0)))
        kind = str(ctx.input["kind"])
        return Next(
            Settle,
            checkpoint={"requested_by": ctx.fence},
            effects=[Effect("notice", kind, {"to": "ops@example.test", "subject": "hi"})],
        )


class Settle(Step):
    async def run(self, ctx: StepContext) -> Outcome:
        GRANTS.append((ctx.run_id, ctx.fence, "settle"))
        assert ctx.effects is not None
        outcome = await ctx.effects.wait("notice", within=120)
        if outcome.status is not EffectStatus.CONFIRMED:
            return Fail("the notice did not go through", details={"status": outcome.status.value})
        return Finish(result={"external_id": outcome.external_id})


notice = Agent("failover_notice", first=Request, steps=[Settle])


SAME_CALLS_ON_A_REPLAY = turns(
    ScriptedTurn(calls=(ScriptedCall("lookup_order", {"order_id": "o-17"}),)),
    ScriptedTurn(calls=(ScriptedCall("notify", {"note": "shipped today", "order_id": "o-17"}),)),
    ScriptedTurn(content="Order o-17 has shipped; the CRM is noted."),
)
"""The orders conversation, answered alike on every replay (but for the call ids)."""


def granted_twice() -> list[tuple[str, int, str]]:
    """(run, fence, step) seen more than once: a step never runs twice under one claim (a
    failed or parked step goes on under a new claim), so a repeat means two claims were granted
    the same fence."""
    return sorted(grant for grant, count in Counter(GRANTS).items() if count > 1)


def looked_up_crm(vendor: LocalVendor) -> Adapter:
    """The CRM vendor as an HTTP adapter that looks a key up before sending it again."""
    return adapter_from_config("crm", crm_kind(vendor, timeout_seconds=2))


def notice_worker(
    settings: Settings, adapters: dict[str, Adapter], **options: Any
) -> AbstractAsyncContextManager[Worker]:
    """A worker for ``notice`` that keeps trying to reach a server being promoted."""
    return running_worker(
        settings, [notice], effect_adapters=adapters, start_retry_seconds=60, **WORKER, **options
    )


async def submit_notices(store: RunStore, count: int, input: JSON) -> list[str]:
    return [(await store.submit("failover_notice", input)).run.run_id for _ in range(count)]


@asynccontextmanager
async def replicated(*, synchronous: bool) -> AsyncIterator[ReplicatedPostgres]:
    pair = ReplicatedPostgres(synchronous=synchronous)
    try:
        await anyio.to_thread.run_sync(pair.start)
        yield pair
    finally:
        await anyio.to_thread.run_sync(pair.close)


@asynccontextmanager
async def async_pair_and_crm() -> AsyncIterator[
    tuple[ReplicatedPostgres, Settings, LocalVendor, Adapter]
]:
    """An asynchronous pair, migrated, with the settings that follow its primary (and send
    while the standby is away), and a CRM vendor on loopback with the adapter that looks keys
    up there."""
    async with replicated(synchronous=False) as pair, LocalVendor() as vendor:
        settings = Settings(database_url=pair.dsn(), standby=SENDS_ALONE)
        await ensure_schema(settings, pair.dsn(), auto_migrate=True)
        yield pair, settings, vendor, looked_up_crm(vendor)


@asynccontextmanager
async def opened(settings: Settings) -> AsyncIterator[tuple[asyncpg.Pool, RunStore]]:
    pool = await create_pool(settings, application_name="failover-test", max_size=4)
    try:
        yield pool, RunStore(pool)
    finally:
        await pool.close()


async def finished(store: RunStore, run_ids: list[str], *, within: float) -> dict[str, RunState]:
    """Each run's state once all are terminal, read through reconnects (the failover)."""
    with anyio.fail_after(within):
        while True:
            try:
                states = {run_id: (await store.get(run_id)).state for run_id in run_ids}
            except DatabaseError:
                await anyio.sleep(0.2)
                continue
            if all(state.terminal for state in states.values()):
                return states
            await anyio.sleep(0.2)


async def test_a_async_failover_grants_no_fence_twice_and_looks_up_before_sending() -> None:
    GRANTS.clear()
    async with async_pair_and_crm() as (pair, settings, vendor, crm):
        async with opened(settings) as (_, store):
            run_ids = await submit_notices(store, 12, {"kind": "crm"})
        await anyio.to_thread.run_sync(pair.wait_replayed)
        await anyio.to_thread.run_sync(pair.stop_standby)
        async with notice_worker(settings, {"crm": crm}, dispatch_lease_seconds=5):
            async with opened(settings) as (_, store):
                # On the primary alone: every run claimed, its notice sent and confirmed.
                lost_states = await finished(store, run_ids, within=90)
            assert set(lost_states.values()) == {RunState.SUCCEEDED}
            assert len(vendor.deliveries) == 12
            lost_grants = set(GRANTS)
            failover = await anyio.to_thread.run_sync(pair.failover)
            assert failover.new_timeline == failover.old_timeline + 1
            # The worker finds the promoted server through the multi-host URL, on its own.
            async with opened(settings) as (pool, store):
                states = await finished(store, run_ids, within=120)
                fences = {
                    row["run_id"]: row["fence"]
                    for row in await pool.fetch("SELECT run_id, fence FROM runs")
                }
                effects = await EffectStore(pool).list_effects()
    assert set(states.values()) == {RunState.SUCCEEDED}, states
    # The promoted server lost every claim above; it granted fences of a new epoch instead.
    assert all(epoch_of(fence) == 1 for fence in fences.values()), fences
    assert {(run, fence) for run, fence, _ in GRANTS if epoch_of(fence) == 0} == {
        (run, fence) for run, fence, _ in lost_grants
    }
    assert granted_twice() == []
    # Each key reached the vendor once: the second timeline looked it up and found it sent.
    assert set(vendor.requests_by_key.values()) == {1}, vendor.requests_by_key
    assert len(vendor.requests_by_key) == 12
    assert {e.status for e in effects} == {EffectStatus.CONFIRMED}


async def test_a_an_effect_replicated_then_sent_on_the_lost_timeline_is_not_sent_again() -> None:
    """The effects' acceptance reached the standby; their dispatch (claim, send, confirmation)
    happened on the lost primary alone. The promoted server reads them as never dispatched, yet
    looks each up first: the vendor sees every key once."""
    async with async_pair_and_crm() as (pair, settings, vendor, crm):
        async with opened(settings) as (pool, store):
            run_ids = await submit_notices(store, 6, {"kind": "crm"})
            effects = EffectStore(pool)
            # A worker without a vendor for "crm": the runs ask for their notices and wait.
            async with running_worker(settings, [notice], grace_seconds=0.5, **WORKER):
                with anyio.fail_after(60):
                    while len(await effects.list_effects()) < len(run_ids):  # noqa: ASYNC110
                        await anyio.sleep(0.05)
            await anyio.to_thread.run_sync(pair.wait_replayed)
            await anyio.to_thread.run_sync(pair.stop_standby)
            dispatcher = Dispatcher(
                pool, {"crm": crm}, lease_seconds=5, poll_seconds=0.05, standby=SENDS_ALONE
            )
            async with anyio.create_task_group() as group:
                group.start_soon(dispatcher.run)
                with anyio.fail_after(60):
                    while len(vendor.deliveries) < len(run_ids):  # noqa: ASYNC110
                        await anyio.sleep(0.05)
                group.cancel_scope.cancel()
        await anyio.to_thread.run_sync(pair.failover)
        async with (
            notice_worker(settings, {"crm": crm}),
            opened(settings) as (pool, store),
        ):
            states = await finished(store, run_ids, within=120)
            records = await EffectStore(pool).list_effects()
    assert set(states.values()) == {RunState.SUCCEEDED}, states
    assert {e.status for e in records} == {EffectStatus.CONFIRMED}
    assert len(vendor.requests_by_key) == len(run_ids)
    assert set(vendor.requests_by_key.values()) == {1}, vendor.requests_by_key


async def test_a_a_tool_agent_turn_the_failover_took_back_does_not_send_its_call_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A tool agent's turns ran, and its CRM note was sent, on the lost primary alone. The
    promoted server replays the turns and the model answers the same calls under new call ids:
    the note is keyed by its tool and arguments, looked up first, and not sent again."""
    async with (
        async_pair_and_crm() as (pair, settings, vendor, crm),
        ScriptedModelServer(SAME_CALLS_ON_A_REPLAY) as model,
    ):
        monkeypatch.setenv("OPENAI_BASE_URL", model.base_url)
        monkeypatch.delenv("OPENAI_API_KEY", raising=False)
        async with opened(settings) as (_, store):
            run_id = (await store.submit("orders", {"prompt": "Where is o-17?"})).run.run_id
            await anyio.to_thread.run_sync(pair.wait_replayed)
            await anyio.to_thread.run_sync(pair.stop_standby)
            async with running_worker(settings, [orders], effect_adapters={"crm": crm}, **WORKER):
                lost = await finished(store, [run_id], within=60)
        assert lost == {run_id: RunState.SUCCEEDED} and len(vendor.deliveries) == 1
        await anyio.to_thread.run_sync(pair.failover)
        async with (
            running_worker(
                settings, [orders], effect_adapters={"crm": crm}, start_retry_seconds=60, **WORKER
            ),
            opened(settings) as (pool, store),
        ):
            states = await finished(store, [run_id], within=120)
            records = await EffectStore(pool).list_effects(run_id=run_id)
    assert states == {run_id: RunState.SUCCEEDED}
    assert model.answered("Where is o-17?", 1) >= 2  # turn 1 was asked again, new call ids
    assert [(r.status, r.payload["note"]) for r in records] == [
        (EffectStatus.CONFIRMED, "shipped today")
    ]
    assert list(vendor.requests_by_key.values()) == [1], vendor.requests_by_key


async def claim_once_expired(store: RunStore, worker_id: str) -> ClaimedRun:
    """``worker_id``'s claim of the one run, once the lease before it ran out."""
    for _ in range(150):
        claimed = (await store.claim(worker_id, ["agent"], lease_seconds=600)).claimed
        if claimed:
            return claimed[0]
        await anyio.sleep(0.2)
    raise AssertionError(f"{worker_id} could not claim the run within 30 s")


async def proxy_post(client: httpx.AsyncClient, run_id: str, fence: int) -> httpx.Response:
    """One effect request through the proxy, retried while the database is unreachable (503:
    the pool reconnecting to the promoted server through the multi-host URL)."""
    request = {"run_id": run_id, "effect_key": "note", "fence": fence, "kind": "crm", "payload": {}}
    with anyio.fail_after(60):
        while True:
            answer = await client.post(
                "/v1/effects", json=request, headers={"Authorization": "Bearer t"}
            )
            if answer.status_code != 503:
                return answer
            await anyio.sleep(0.2)


async def test_a_the_proxy_refuses_a_fence_the_promoted_server_forgot(tmp_path: Path) -> None:
    """Worker B's claim (a higher fence) and its request through the proxy happened on the lost
    primary alone. The promoted server has the run back at replaced worker A's fence and would
    take A's request; the proxy, which remembers B's fence in its own store, refuses it loudly.
    A claim on the promoted server (the new epoch) is above both and goes through."""
    async with replicated(synchronous=False) as pair:
        settings = Settings(database_url=pair.dsn())
        await ensure_schema(settings, pair.dsn(), auto_migrate=True)
        fences = FenceStore.open(tmp_path / "fences.sqlite3")
        async with (
            opened(settings) as (pool, store),
            httpx.AsyncClient(
                transport=httpx.ASGITransport(app=create_app(pool, ["t"], fences=fences)),
                base_url="http://proxy",
            ) as proxy,
        ):
            await store.submit("agent", {})
            [a] = (await store.claim("A", ["agent"], lease_seconds=0.5)).claimed
            await anyio.to_thread.run_sync(pair.wait_replayed)
            await anyio.to_thread.run_sync(pair.stop_standby)
            b = await claim_once_expired(store, "B")
            assert (await proxy_post(proxy, a.run_id, b.fence)).status_code == 201
            await anyio.to_thread.run_sync(pair.failover)

            refused = await proxy_post(proxy, a.run_id, a.fence)
            assert refused.status_code == 409, refused.text
            assert refused.json()["error"] == "fence_regression"
            assert (refused.json()["remembered_fence"], refused.json()["presented_fence"]) == (
                b.fence,
                a.fence,
            )
            assert (await store.get(a.run_id)).fence == a.fence  # what the database forgot
            assert await pool.fetchval("SELECT count(*) FROM effects") == 0
            c = await claim_once_expired(store, "C")
            assert epoch_of(c.fence) == 1 and c.fence > b.fence
            assert (await proxy_post(proxy, a.run_id, c.fence)).status_code == 201
        fences.close()


async def test_b_a_cancelled_sync_wait_is_no_success_and_its_fence_is_not_reused() -> None:
    async with replicated(synchronous=True) as pair:
        settings = Settings(database_url=pair.dsn())
        async with opened(settings) as (_, store):
            await ensure_schema(settings, pair.dsn(), auto_migrate=True)
            cancelled_run = (await store.submit("failover_notice", {"kind": "crm"})).run.run_id
            abandoned_run = (await store.submit("failover_notice", {"kind": "crm"})).run.run_id
            await anyio.to_thread.run_sync(pair.wait_replayed)
            await anyio.to_thread.run_sync(pair.stop_standby)

            # A claim whose client gives up: the connection is aborted, no cancel request is
            # sent, so its commit keeps waiting for the standby, invisible to everyone.
            with anyio.move_on_after(1.0) as gave_up:
                await store.claim_run("gives-up", abandoned_run, lease_seconds=30)
            assert gave_up.cancelled_caught
            await anyio.sleep(0.5)
            assert await anyio.to_thread.run_sync(pair.sync_waiters) == 1
            primary = pair.primary_dsn()
            async with opened(Settings(database_url=primary)) as (_, old):
                assert (await old.get(abandoned_run)).fence == 0

            # A claim whose wait an administrator cancels: committed locally, and the client
            # is told so by a warning. That is no success.
            async with anyio.create_task_group() as group:

                async def cancel_when_waiting() -> None:
                    with anyio.fail_after(30):
                        while await anyio.to_thread.run_sync(pair.sync_waiters) < 2:  # noqa: ASYNC110
                            await anyio.sleep(0.05)
                    assert await anyio.to_thread.run_sync(pair.cancel_sync_waiters) >= 1

                group.start_soon(cancel_when_waiting)
                with pytest.raises(OutcomeUnknown):
                    await store.claim_run("cancelled", cancelled_run, lease_seconds=30)
            async with opened(Settings(database_url=primary)) as (_, old):
                unreplicated = (await old.get(cancelled_run)).fence
            assert unreplicated == 1  # the lost primary did grant it

            await anyio.to_thread.run_sync(pair.failover)
            with anyio.fail_after(60):
                while True:
                    try:
                        claimed = await store.claim_run("after", cancelled_run, lease_seconds=30)
                        break
                    except DatabaseError:
                        await anyio.sleep(0.2)
            assert claimed is not None
            assert claimed.lease.fence > unreplicated and epoch_of(claimed.lease.fence) >= 1
            assert claimed.lease.fence >= 1 << EPOCH_BITS


async def _email_through_a_failover(
    *,
    require_sync_standby: bool = False,
    standby: StandbyPolicy | None = None,
    synchronous: bool = True,
) -> tuple[list[str], list[str]]:
    """Three runs each sending one email; the primary dies while their first steps run (their
    claims replicated, nothing sent yet). Returns the messages' ids and the effects' statuses
    once the runs are over or the emails parked."""
    GRANTS.clear()
    async with replicated(synchronous=synchronous) as pair:
        with SmtpSink() as sink:
            settings = Settings(
                database_url=pair.dsn(),
                require_sync_standby=require_sync_standby,
                standby=standby or StandbyPolicy(StandbyWait.OFF),
            )
            email = adapter_from_config(
                "email",
                {"adapter": "smtp", "host": "127.0.0.1", "port": sink.port, "sender": "a@b.c"},
            )
            async with notice_worker(settings, {"email": email}, dispatch_lease_seconds=5):
                async with opened(settings) as (_, store):
                    run_ids = await submit_notices(store, 3, {"kind": "email", "think_seconds": 2})
                with anyio.fail_after(60):
                    while len(GRANTS) < 3:  # noqa: ASYNC110
                        await anyio.sleep(0.05)
                await anyio.to_thread.run_sync(pair.failover)
                async with opened(settings) as (pool, store):
                    with anyio.fail_after(120):
                        while True:
                            try:
                                effects = await EffectStore(pool).list_effects()
                                states = [(await store.get(r)).state for r in run_ids]
                            except DatabaseError:
                                await anyio.sleep(0.2)
                                continue
                            settled = [
                                e
                                for e in effects
                                if e.status in (EffectStatus.CONFIRMED, EffectStatus.PARKED)
                            ]
                            if len(settled) == 3 and (
                                settled[0].status is EffectStatus.PARKED
                                or all(s.terminal for s in states)
                            ):
                                break
                            await anyio.sleep(0.2)
            return sink.message_ids(), [e.status.value for e in effects]


async def test_c_with_a_required_sync_standby_an_email_goes_out_once_through_a_failover() -> None:
    message_ids, statuses = await _email_through_a_failover(require_sync_standby=True)
    assert statuses == ["confirmed"] * 3
    assert len(message_ids) == 3 and len(set(message_ids)) == 3
    assert granted_twice() == []


async def test_c_with_the_standby_wait_an_email_goes_out_once_through_an_async_failover() -> None:
    """No send waited for on the lost timeline was left unreplicated, so the promoted server
    sends what it has as never claimed, without a lookup an email cannot have."""
    message_ids, statuses = await _email_through_a_failover(
        standby=StandbyPolicy(), synchronous=False
    )
    assert statuses == ["confirmed"] * 3
    assert len(message_ids) == 3 and len(set(message_ids)) == 3
    assert granted_twice() == []


async def test_c_with_neither_the_email_is_parked_for_a_person_not_sent_blind() -> None:
    message_ids, statuses = await _email_through_a_failover()
    assert statuses == ["parked"] * 3
    assert message_ids == []


async def test_require_sync_standby_refuses_to_start_without_one() -> None:
    async with replicated(synchronous=False) as pair:
        settings = Settings(database_url=pair.dsn(), require_sync_standby=True)
        from orchestrator.db.sync_standby import SyncStandbyMissing

        with pytest.raises(BaseExceptionGroup) as refused:
            async with running_worker(settings, [notice], **WORKER):
                pass
        assert refused.group_contains(SyncStandbyMissing, match="synchronous_standby_names")
