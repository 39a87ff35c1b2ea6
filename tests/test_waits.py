"""Waiting without a lease, in-process: signals, timers, effects, approvals, scheduled runs."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any, ClassVar

import anyio
import asyncpg
import pytest

from orchestrator import Agent, Effect, Finish, Next, Outcome, Step, StepContext, Wait
from orchestrator.client import Client
from orchestrator.db.audit import AuditStore
from orchestrator.db.signals import SignalStore
from orchestrator.db.store import RunStore
from orchestrator.effect_model import EffectStatus
from orchestrator.effects.approvals import ApprovalStore, Decision, DecisionRefused
from orchestrator.effects.http import HttpAdapter
from orchestrator.effects.store import EffectStore
from orchestrator.errors import IdempotencyConflict, InvalidInput, InvalidTransition, RunNotFound
from orchestrator.models import RunState, StoredWait
from orchestrator.settings import Settings
from orchestrator.testing import LocalVendor, running_worker, wait_for_run
from support import fenced_claims, run_to_the_end

FAST: dict[str, Any] = {"lease_seconds": 5.0, "heartbeat_seconds": 1.0, "poll_seconds": 0.1}


class AwaitReply(Step):
    """Waits for a ``reply`` signal (up to ``seconds`` from the input), then reports it."""

    runs: ClassVar[int] = 0

    async def run(self, ctx: StepContext) -> Outcome:
        type(self).runs += 1
        replies = [s for s in ctx.signals if s.name == "reply"]
        if replies:
            return Finish(
                {
                    "replies": [s.data for s in replies],
                    "others": [s.name for s in ctx.signals if s.name != "reply"],
                    "fence": ctx.fence,
                }
            )
        if ctx.wait is not None and ctx.wait.timed_out:
            return Finish({"timed_out": True, "fence": ctx.fence})
        seconds = ctx.input.get("seconds")
        until = None if seconds is None else ctx.database_now() + timedelta(seconds=seconds)
        return Wait(then=AwaitReply, signals=["reply"], until=until)


replies = Agent("replies", first=AwaitReply)


class Sleep(Step):
    async def run(self, ctx: StepContext) -> Outcome:
        if ctx.wait is None:
            until = ctx.database_now() + timedelta(seconds=ctx.input["seconds"])
            return Wait(then=Sleep, until=until, checkpoint={"until": until.isoformat()})
        return Finish({"woke_at": ctx.database_now().isoformat(), **ctx.checkpoint})


sleeper = Agent("sleeper", first=Sleep)


class Request(Step):
    async def run(self, ctx: StepContext) -> Outcome:
        effect = Effect(
            "refund",
            "crm",
            {"order": ctx.input["order"], "amount": ctx.input["amount"]},
            requires_approval=ctx.input.get("approval", False),
            approval_seconds=ctx.input.get("approval_seconds", 3600),
        )
        return Wait(then=Report, effects=[effect])


class Report(Step):
    async def run(self, ctx: StepContext) -> Outcome:
        record = await ctx.effects.get("refund")
        return Finish({"status": record.status.value, "error": record.error})


refunds = Agent("refunds", first=Request, steps=[Report])


class TwoEffects(Step):
    async def run(self, ctx: StepContext) -> Outcome:
        return Wait(
            then=BothSettled,
            effects=[Effect("first", "crm", {"n": 1}), Effect("second", "slow", {"n": 2})],
        )


class BothSettled(Step):
    runs: ClassVar[int] = 0

    async def run(self, ctx: StepContext) -> Outcome:
        type(self).runs += 1
        statuses = [(await ctx.effects.get(key)).status.value for key in ("first", "second")]
        return Finish({"statuses": statuses})


pair = Agent("pair", first=TwoEffects, steps=[BothSettled])


def crm(vendor: LocalVendor, kind: str = "crm") -> HttpAdapter:
    return HttpAdapter(kind, url=vendor.send_url, lookup_url=vendor.lookup_url, reconcile="lookup")


@asynccontextmanager
async def serving_refunds(settings: Settings) -> AsyncIterator[LocalVendor]:
    """A worker for ``refunds`` whose CRM is a vendor on loopback, which is yielded."""
    async with (
        LocalVendor() as vendor,
        running_worker(settings, [refunds], effect_adapters={"crm": crm(vendor)}, **FAST),
    ):
        yield vendor


async def parked(store: RunStore, run_id: str) -> None:
    run = await wait_for_run(store, run_id, states={RunState.WAITING}, within=60)
    assert run.wait is not None
    assert (run.lease_owner, run.lease_until) == (None, None)


# -- signals ----------------------------------------------------------------------------------
async def test_a_signal_wakes_a_waiting_run_and_is_consumed_once(
    settings: Settings, store: RunStore, pool: asyncpg.Pool
) -> None:
    async with running_worker(settings, [replies], **FAST) as worker:
        run_id = (await store.submit("replies", {})).run.run_id
        await parked(store, run_id)
        assert run_id not in worker.active  # the slot is free
        signals = SignalStore(pool)
        await signals.send(run_id, "note", {"text": "fyi"})  # not awaited: does not wake it
        await anyio.sleep(0.3)
        assert (await store.get(run_id)).state is RunState.WAITING
        sent = await signals.send(run_id, "reply", {"text": "yes"}, idempotency_key="mail-1")
        again = await signals.send(run_id, "reply", {"text": "yes"}, idempotency_key="mail-1")
        assert (again.created, again.signal.seq) == (False, sent.signal.seq)
        run = await wait_for_run(store, run_id)
    assert run.state is RunState.SUCCEEDED
    assert run.result == {"replies": [{"text": "yes"}], "others": ["note"], "fence": 2}
    # A retried send after the run finished is answered with the stored signal, not an error.
    late = await signals.send(run_id, "reply", {"text": "yes"}, idempotency_key="mail-1")
    assert (late.created, late.signal.seq) == (False, sent.signal.seq)
    with pytest.raises(InvalidTransition, match="is succeeded"):
        await signals.send(run_id, "reply", {"text": "yes"}, idempotency_key="mail-2")
    history = await signals.history(run_id)
    assert [(s.name, fence) for s, _, fence in history] == [("note", 2), ("reply", 2)]
    kinds = [e.kind for e in await store.events(run_id)]
    assert kinds.count("claimed") == 2
    assert "waiting" in kinds and "signals_consumed" in kinds
    assert (await store.get(run_id)).signals_pending == 0


async def test_signal_errors_are_clear_and_change_nothing(
    settings: Settings, store: RunStore, pool: asyncpg.Pool
) -> None:
    signals = SignalStore(pool)
    with pytest.raises(RunNotFound):
        await signals.send("r_missing", "reply", {})
    with pytest.raises(InvalidInput, match="malformed signal name"):
        await signals.send("r_missing", "no spaces", {})
    run_id = (await store.submit("replies", {})).run.run_id
    await signals.send(run_id, "reply", {"n": 1}, idempotency_key="k")
    with pytest.raises(IdempotencyConflict, match="already used for signal 'reply'"):
        await signals.send(run_id, "reply", {"n": 2}, idempotency_key="k")
    await store.cancel(run_id)
    with pytest.raises(InvalidTransition, match="is cancelled"):
        await signals.send(run_id, "reply", {"n": 3})
    assert [s.data for s, _, _ in await signals.history(run_id)] == [{"n": 1}]


async def test_a_signal_sent_before_the_wait_wakes_it_at_once(
    settings: Settings, store: RunStore, pool: asyncpg.Pool
) -> None:
    """Queued with a signal already stored: the first step reads it and never waits."""
    run_id = (await store.submit("replies", {})).run.run_id
    await SignalStore(pool).send(run_id, "reply", "early")
    async with running_worker(settings, [replies], **FAST):
        run = await wait_for_run(store, run_id)
    assert run.result == {"replies": ["early"], "others": [], "fence": 1}


async def test_a_wait_with_a_deadline_resumes_with_a_timeout_it_can_see(
    settings: Settings, store: RunStore
) -> None:
    run = await run_to_the_end(settings, store, replies, {"seconds": 0.5}, **FAST)
    assert run.result == {"timed_out": True, "fence": 2}


async def test_a_timer_fires_within_a_poll_interval_of_its_time(
    settings: Settings, store: RunStore
) -> None:
    run = await run_to_the_end(settings, store, sleeper, {"seconds": 1.0}, **FAST)
    woke = datetime.fromisoformat(run.result["woke_at"])
    due = datetime.fromisoformat(run.result["until"])
    assert timedelta(0) <= woke - due < timedelta(seconds=FAST["poll_seconds"] + 0.4)


async def test_a_scheduled_run_starts_at_its_time(settings: Settings, store: RunStore) -> None:
    async with await Client.connect(settings) as client:
        run = await client.submit("sleeper", {"seconds": 0.01}, delay_seconds=1.0)
        assert run.state is RunState.QUEUED and run.available_at > run.created_at
        async with running_worker(settings, [sleeper], **FAST):
            await anyio.sleep(0.5)
            assert (await client.get(run.run_id)).state is RunState.QUEUED
            done = await client.wait(run.run_id, within=60)
    claimed = next(e for e in await store.events(run.run_id) if e.kind == "claimed")
    assert claimed.at >= run.available_at
    assert done.state is RunState.SUCCEEDED


async def test_waiting_runs_do_not_hold_worker_slots(settings: Settings, store: RunStore) -> None:
    async with running_worker(settings, [replies, sleeper], concurrency=1, **FAST):
        waiting = [(await store.submit("replies", {})).run.run_id for _ in range(3)]
        for run_id in waiting:
            await parked(store, run_id)
        other = (await store.submit("sleeper", {"seconds": 0.01})).run.run_id
        assert (await wait_for_run(store, other, within=60)).state is RunState.SUCCEEDED


# -- effects and approvals ------------------------------------------------------------------
async def test_a_run_waits_for_its_effect_to_settle_without_a_lease(
    settings: Settings, store: RunStore
) -> None:
    async with serving_refunds(settings) as vendor:
        run_id = (await store.submit("refunds", {"order": 42, "amount": 10})).run.run_id
        run = await wait_for_run(store, run_id, within=60)
    assert run.result == {"status": "confirmed", "error": None}
    assert vendor.requests == 1


async def test_woken_by_one_of_two_effects_the_run_waits_on_without_running_its_step(
    settings: Settings, store: RunStore
) -> None:
    BothSettled.runs = 0
    async with LocalVendor() as fast, LocalVendor() as slow:
        slow.delay = 1.5
        adapters = {"crm": crm(fast), "slow": crm(slow, "slow")}
        async with running_worker(settings, [pair], effect_adapters=adapters, **FAST):
            run_id = (await store.submit("pair", {})).run.run_id
            run = await wait_for_run(store, run_id, within=60)
    assert run.result == {"statuses": ["confirmed", "confirmed"]}
    assert BothSettled.runs == 1
    kinds = [e.kind for e in await store.events(run_id)]
    assert kinds.count("waiting") == 2  # parked, woken by the first, parked again


async def test_an_approved_effect_is_sent_once_and_only_for_the_payload_shown(
    settings: Settings, store: RunStore, pool: asyncpg.Pool
) -> None:
    approvals = ApprovalStore(pool)
    async with serving_refunds(settings) as vendor:
        input = {"order": 42, "amount": 120, "approval": True}
        run_id = (await store.submit("refunds", input)).run.run_id
        await parked(store, run_id)
        [pending] = await approvals.pending(run_id=run_id)
        assert pending.status is EffectStatus.AWAITING_APPROVAL
        assert pending.payload == {"order": 42, "amount": 120}
        assert pending.payload_sha256 is not None
        await anyio.sleep(0.5)
        assert vendor.requests == 0  # the dispatcher never sends it unapproved
        with pytest.raises(DecisionRefused, match="is not the one you saw"):
            await approvals.decide(
                run_id, "refund", Decision.APPROVED, by="ana", payload_sha256="0" * 64
            )
        run = await store.get(run_id)
        with pytest.raises(DecisionRefused, match="moved on from fence"):
            await approvals.decide(
                run_id, "refund", Decision.APPROVED, by="ana", run_fence=run.fence - 1
            )
        never = run.fence + 6
        with pytest.raises(DecisionRefused, match=f"fence {never} was never granted") as refused:
            await approvals.decide(run_id, "refund", Decision.APPROVED, by="ana", run_fence=never)
        assert "moved on" not in str(refused.value)
        assert f"current fence is {run.fence}" in str(refused.value)
        approved = await approvals.decide(
            run_id,
            "refund",
            Decision.APPROVED,
            by="ana",
            note="ok",
            payload_sha256=pending.payload_sha256,
            run_fence=run.fence,
        )
        assert approved.approved_sha256 == pending.payload_sha256
        with pytest.raises(DecisionRefused, match="already decided by "):
            await approvals.decide(run_id, "refund", Decision.DENIED, by="bo")
        run = await wait_for_run(store, run_id, within=60)
    assert run.result == {"status": "confirmed", "error": None}
    assert vendor.requests == 1
    granted = [e for e in await store.events(run_id) if e.kind == "approval_granted"]
    role = await pool.fetchval("SELECT session_user")
    assert [(e.details["by"], e.details["typed_by"], e.details["note"]) for e in granted] == [
        (role, "ana", "ok")
    ]
    # One audit row: the approval, under the connected role; the refused attempts left none.
    audited = await AuditStore(pool).entries(run_id=run_id)
    assert [(e.action, e.principal, e.via, e.effect_key) for e in audited] == [
        ("approve", role, "database-role", "refund")
    ]
    assert audited[0].detail["payload_sha256"] == pending.payload_sha256
    assert audited[0].detail["note"] == "ana"  # the typed name, kept as a note
    assert (await AuditStore(pool).verify()).intact


async def test_a_denied_effect_is_never_sent_and_the_step_sees_why(
    settings: Settings, store: RunStore, pool: asyncpg.Pool
) -> None:
    async with serving_refunds(settings) as vendor:
        run_id = (await store.submit("refunds", {"order": 7, "amount": 5, "approval": True})).run
        await parked(store, run_id.run_id)
        await ApprovalStore(pool).decide(
            run_id.run_id, "refund", Decision.DENIED, by="ana", note="not eligible"
        )
        run = await wait_for_run(store, run_id.run_id, within=60)
    assert run.result["status"] == "rejected"
    assert run.result["error"]["message"] == "denied by reviewer: not eligible"
    assert vendor.requests == 0


async def test_an_approval_nobody_gives_expires_as_a_denial(
    settings: Settings, store: RunStore, pool: asyncpg.Pool
) -> None:
    async with serving_refunds(settings) as vendor:
        input = {"order": 1, "amount": 1, "approval": True, "approval_seconds": 0.5}
        run_id = (await store.submit("refunds", input)).run.run_id
        run = await wait_for_run(store, run_id, within=60)
        with pytest.raises(DecisionRefused, match="already decided by expiry"):
            await ApprovalStore(pool).decide(run_id, "refund", Decision.APPROVED, by="late")
    assert run.result["status"] == "rejected"
    assert run.result["error"]["type"] == "ApprovalExpired"
    assert vendor.requests == 0
    assert "approval_expired" in [e.kind for e in await store.events(run_id)]


async def test_cancel_withdraws_a_pending_approval(
    settings: Settings, store: RunStore, pool: asyncpg.Pool
) -> None:
    async with serving_refunds(settings) as vendor:
        input = {"order": 9, "amount": 99, "approval": True}
        run_id = (await store.submit("refunds", input)).run.run_id
        await parked(store, run_id)
        await store.cancel(run_id, reason="customer withdrew")
        with pytest.raises(DecisionRefused, match="withdrawn"):
            await ApprovalStore(pool).decide(run_id, "refund", Decision.APPROVED, by="ana")
        assert await ApprovalStore(pool).pending(run_id=run_id) == []
        await anyio.sleep(0.5)
    assert vendor.requests == 0
    effect = await EffectStore(pool).get(run_id, "refund")
    assert effect.status is EffectStatus.REJECTED
    assert "approval_withdrawn" in [e.kind for e in await store.events(run_id)]


async def test_a_newer_fence_replacing_the_payload_never_consumes_the_old_approval(
    store: RunStore, pool: asyncpg.Pool
) -> None:
    """A replaceable effect approved for one payload and replaced (a replayed step asked
    for another) needs a new approval: the first one is not carried over."""
    from orchestrator.effect_model import EffectPolicy

    effects = EffectStore(pool)
    run_id = (await store.submit("agent", {})).run.run_id
    first = (await store.claim("A", ["agent"], lease_seconds=0.2)).claimed[0]

    async def request(fence: int, amount: int) -> None:
        effect = Effect(
            "refund",
            "crm",
            {"amount": amount},
            EffectPolicy.REPLACEABLE,
            requires_approval=True,
        )
        async with pool.acquire() as db:
            answer = await effects.accept(db, run_id, fence, effect, worker_id="w")
        assert not answer.outcome.refused, answer

    await request(first.fence, 100)
    approved = await ApprovalStore(pool).decide(run_id, "refund", Decision.APPROVED, by="ana")
    assert approved.status is EffectStatus.ACCEPTED
    await anyio.sleep(0.3)
    second = (await store.claim("B", ["agent"], lease_seconds=30)).claimed[0]
    assert second.fence == first.fence + 1
    await request(second.fence, 120)
    record = await effects.get(run_id, "refund")
    assert record.status is EffectStatus.AWAITING_APPROVAL
    assert (record.payload, record.approved_sha256) == ({"amount": 120}, None)
    assert record.payload_sha256 != approved.payload_sha256


def test_a_wait_needs_something_to_wake_it() -> None:
    with pytest.raises(InvalidInput, match="something to wake it"):
        Wait(then=AwaitReply)
    with pytest.raises(InvalidInput, match="timezone-aware"):
        Wait(then=AwaitReply, until=datetime(2030, 1, 1))
    with pytest.raises(InvalidInput, match="lists"):
        Wait(then=AwaitReply, signals="reply")


class BadWait(Step):
    async def run(self, ctx: StepContext) -> Outcome:
        return Wait(then="nowhere", signals=["x"])


async def test_a_wait_naming_a_missing_step_fails_the_attempt(
    settings: Settings, store: RunStore
) -> None:
    agent = Agent("bad_wait", first=BadWait)
    run = await run_to_the_end(settings, store, agent, {}, max_attempts=1, **FAST)
    assert run.state is RunState.DEAD
    assert "Wait names step 'nowhere'" in run.error["message"]


BUSY_STARTED: set[str] = set()
"""Runs whose ``Busy`` step has started."""


class Busy(Step):
    async def run(self, ctx: StepContext) -> Outcome:
        BUSY_STARTED.add(ctx.run_id)
        await anyio.sleep(float(ctx.input["seconds"]))
        return Next(Collect, checkpoint={"busy_saw": [s.name for s in ctx.signals]})


class Collect(Step):
    async def run(self, ctx: StepContext) -> Outcome:
        return Finish({**ctx.checkpoint, "collect_saw": [s.data for s in ctx.signals]})


collector = Agent("collector", first=Busy, steps=[Collect])


async def test_a_signal_sent_while_a_step_runs_reaches_the_next_step(
    settings: Settings, store: RunStore, pool: asyncpg.Pool
) -> None:
    async with running_worker(settings, [collector], **FAST):
        run_id = (await store.submit("collector", {"seconds": 1.0})).run.run_id
        with anyio.fail_after(60):
            while run_id not in BUSY_STARTED:  # noqa: ASYNC110
                await anyio.sleep(0.01)
        await SignalStore(pool).send(run_id, "note", {"n": 1})
        run = await wait_for_run(store, run_id, within=60)
    assert run.result == {"busy_saw": [], "collect_saw": [{"n": 1}]}
    assert [fence for _, _, fence in await SignalStore(pool).history(run_id)] == [1]


# -- races the review found: each would fail on the code before its fix ---------------------------
async def blocked_on_a_lock(pool: asyncpg.Pool, within: float = 60) -> None:
    """Wait until a session of this database waits for a lock: the race a test sets up has
    begun, however slowly a loaded machine got the other task there (a fixed sleep may not)."""
    with anyio.fail_after(within):
        while not await pool.fetchval(  # noqa: ASYNC110 - PostgreSQL offers no event for it
            "SELECT count(*) FROM pg_stat_activity"
            " WHERE datname = current_database() AND wait_event_type = 'Lock'"
        ):
            await anyio.sleep(0.02)


async def park(store: RunStore, claimed: Any, wait: dict[str, Any]) -> None:
    """A step commit that parks the run, as the group committer writes it (one transaction)."""
    from orchestrator.db.store import Park, StepCommit

    async with store.pool.acquire() as db, db.transaction():
        commit = StepCommit(claimed.lease, claimed.checkpoint_version, "turn", {"k": 1})
        assert await store.commit_steps(claimed.lease.worker_id, [commit], db=db)
        until = None
        assert await store.park_many(
            claimed.lease.worker_id, [(claimed.lease, Park(wait, until))], db=db
        )


async def test_a_top_up_between_the_refused_reservation_and_the_park_wakes_the_run(
    store: RunStore, pool: asyncpg.Pool
) -> None:
    from orchestrator.agent.budgets import Budget, BudgetExhausted, Prices, RunBudget
    from orchestrator.db.budgets import BudgetStore

    run_id = (await store.submit("budgeted", {})).run.run_id
    claimed = (await store.claim("W", ["budgeted"], lease_seconds=30)).claimed[0]
    budget = RunBudget(Budget(turns=0), claimed.lease, pool, Prices())
    with pytest.raises(BudgetExhausted):
        await budget.reserve(turns=1)
    await BudgetStore(pool).top_up(run_id, turns=5)  # the run is still running: nothing to wake
    await park(store, claimed, {"step": "turn", "reason": "budget"})
    run = await store.get(run_id)
    assert run.state is RunState.WAITING
    assert run.available_at <= await store.database_now()  # due at once, not at 'infinity'


async def test_what_a_woken_run_waited_for_survives_a_crash_before_its_next_commit(
    store: RunStore, pool: asyncpg.Pool
) -> None:
    run_id = (await store.submit("replies", {})).run.run_id
    first = (await store.claim("A", ["replies"], lease_seconds=30)).claimed[0]
    wait = {"step": "turn", "signals": ["reply"], "effects": [], "until": None, "reason": None}
    await park(store, first, wait)
    await SignalStore(pool).send(run_id, "reply", {"n": 1})
    woken = (await store.claim("B", ["replies"], lease_seconds=0.2)).claimed[0]
    assert woken.wait == wait and [s["name"] for s in woken.signals] == ["reply"]
    await anyio.sleep(0.4)  # B dies: its lease expires before it commits anything
    again = (await store.claim("C", ["replies"], lease_seconds=30)).claimed[0]
    assert again.fence == woken.fence + 1
    assert again.wait == wait and [s["name"] for s in again.signals] == ["reply"]


async def test_a_top_up_and_a_step_commit_settling_the_budget_do_not_deadlock(
    store: RunStore, pool: asyncpg.Pool
) -> None:
    """The commit locks the run, then its budget; the top-up must take them in that order too."""
    from orchestrator.agent.budgets import Budget, Prices, RunBudget
    from orchestrator.db.budgets import BudgetStore, Spend

    run_id = (await store.submit("budgeted", {})).run.run_id
    claimed = (await store.claim("W", ["budgeted"], lease_seconds=30)).claimed[0]
    await RunBudget(Budget(turns=10), claimed.lease, pool, Prices()).reserve(turns=1)
    from orchestrator.db.store import StepCommit

    async with pool.acquire() as db:
        transaction = db.transaction()
        await transaction.start()
        commit = StepCommit(claimed.lease, 0, "turn", {})
        assert await store.commit_steps("W", [commit], db=db)  # the run's row is locked
        async with anyio.create_task_group() as group:
            group.start_soon(lambda: BudgetStore(pool).top_up(run_id, turns=1))
            await blocked_on_a_lock(pool)  # the top-up is now waiting for the run's row
            spend = Spend(claimed.fence, 1, 0, 0, 0, Decimal(0))
            await BudgetStore(db).settle([(run_id, spend)])  # deadlocked before the fix
            await transaction.commit()
    state = await BudgetStore(pool).get(run_id)
    assert state is not None
    assert (state.spent["turns"], state.limit["turns"]) == (1, 11)


async def test_a_denial_and_a_cancel_racing_do_not_deadlock(
    store: RunStore, pool: asyncpg.Pool
) -> None:
    """Cancel locks the run, then its effects; a decision must take them in that order too."""
    from orchestrator.effect_model import Effect

    run_id = (await store.submit("refunds", {})).run.run_id
    claimed = (await store.claim("W", ["refunds"], lease_seconds=30)).claimed[0]
    effect = Effect("refund", "crm", {"amount": 1}, requires_approval=True)
    async with pool.acquire() as db:
        assert not (
            await EffectStore(pool).accept(db, run_id, claimed.fence, effect, worker_id="W")
        ).outcome.refused
    async with pool.acquire() as db:
        transaction = db.transaction()
        await transaction.start()
        await db.execute("SELECT 1 FROM runs WHERE run_id = $1 FOR UPDATE", run_id)
        outcome: list[Any] = []

        async def deny() -> None:
            try:
                await ApprovalStore(pool).decide(run_id, "refund", Decision.DENIED, by="ana")
                outcome.append("denied")
            except DecisionRefused as refused:
                outcome.append(str(refused))

        async with anyio.create_task_group() as group:
            group.start_soon(deny)
            await blocked_on_a_lock(pool)  # the decision waits for the run's row
            await db.execute(  # as cancel's withdrawal does, second
                "UPDATE effects SET status = 'rejected' WHERE run_id = $1", run_id
            )
            await transaction.commit()
    assert len(outcome) == 1 and "was withdrawn" in outcome[0]  # decided after the cancel


# -- a wait never spins: its signals are found behind any others, a run cannot loop on claims --
async def test_a_wait_sees_its_signal_behind_any_number_of_other_signals(
    settings: Settings, store: RunStore, pool: asyncpg.Pool
) -> None:
    """150 signals nobody waits for, then the awaited one: the run is woken once, its step is
    given the awaited signal first, and the others it was not given stay for later steps."""
    signals = SignalStore(pool)
    async with running_worker(settings, [replies], **FAST):
        run_id = (await store.submit("replies", {})).run.run_id
        await parked(store, run_id)
        for n in range(150):
            await signals.send(run_id, "note", {"n": n})
        assert (await store.get(run_id)).state is RunState.WAITING  # notes do not wake it
        await signals.send(run_id, "reply", {"text": "yes"})
        run = await wait_for_run(store, run_id, within=30)
    assert run.state is RunState.SUCCEEDED
    assert run.result is not None and run.result["replies"] == [{"text": "yes"}]
    given_notes = len(run.result["others"])
    assert given_notes == 99  # a step is given at most 100 signals, the awaited one first
    claims = fenced_claims(await store.events(run_id))
    # Submitted, then woken once (a lease lost on a starved machine may add a replay): the
    # run is never re-claimed in a loop.
    assert 2 <= len(claims) <= 4
    history = await signals.history(run_id)
    consumed = [signal.name for signal, consumed_at, _ in history if consumed_at is not None]
    assert consumed.count("reply") == 1 and consumed.count("note") == given_notes
    # The notes it was not given are still pending, in order, for a later step.
    pending = await signals.pending(run_id)
    assert [s.data["n"] for s in pending] == list(range(given_notes, 150))


class WaitsForWhatHappened(Step):
    """A buggy step: it waits again for an effect key that was never requested (so it counts
    as settled) every time it is woken."""

    async def run(self, ctx: StepContext) -> Outcome:
        return Wait(then=WaitsForWhatHappened, effects=["never-requested"])


class WaitsUntilNow(Step):
    """A buggy poller: it waits until a time that has already come, again and again."""

    async def run(self, ctx: StepContext) -> Outcome:
        # A second back: database_now() errs ahead of the database clock (by the last
        # renewal's network delay), so "now" itself may still be in the future at the park.
        return Wait(then=WaitsUntilNow, until=ctx.database_now() - timedelta(seconds=1))


@pytest.mark.parametrize("first", [WaitsForWhatHappened, WaitsUntilNow])
async def test_a_run_parking_due_at_once_again_and_again_backs_off(
    settings: Settings, store: RunStore, first: type[Step]
) -> None:
    """On the code before the fix this run was claimed hundreds of times a second."""
    spinner = Agent("spinner", first=first)
    async with running_worker(settings, [spinner], **FAST):
        run_id = (await store.submit("spinner", {})).run.run_id
        with anyio.fail_after(60):
            while True:
                waits = [e for e in await store.events(run_id) if e.kind == "waiting"]
                if any("backed_off_seconds" in e.details for e in waits):
                    break
                await anyio.sleep(0.1)
        await anyio.sleep(3)  # a spinning run would be claimed many times meanwhile
        events = await store.events(run_id)
        # Read before the worker stops: its drain may release a run it holds back to queued.
        state = (await store.get(run_id)).state
    claims = fenced_claims(events)
    # Three parks due at once, then 1 s, 2 s, 4 s ... : a handful of claims in these seconds.
    assert len(claims) <= 8, f"{len(claims)} claims: the run is re-claimed in a loop"
    backed_off = [e.details for e in events if "backed_off_seconds" in e.details]
    assert backed_off[0]["wake_streak"] == 4
    assert all(0 < float(d["backed_off_seconds"]) <= 60 for d in backed_off)
    assert state in {RunState.WAITING, RunState.RUNNING}, f"the spinning run ended {state}"


class Lap(Step):
    async def run(self, ctx: StepContext) -> Outcome:
        laps = int((ctx.checkpoint or {}).get("laps", 0))
        if laps == 8:
            return Finish({"laps": laps})
        return Next(AwaitSettled, checkpoint={"laps": laps + 1})


class AwaitSettled(Step):
    """Waits for an effect that has settled by the time it parks (as a fast vendor's would)."""

    async def run(self, ctx: StepContext) -> Outcome:
        return Wait(then=Lap, effects=["settled-before-the-park"], checkpoint=ctx.checkpoint)


async def test_a_loop_that_progresses_between_waits_found_satisfied_is_never_backed_off(
    settings: Settings, store: RunStore
) -> None:
    looper = Agent("looper", first=Lap, steps=[AwaitSettled])
    run = await run_to_the_end(settings, store, looper, {}, **FAST)
    assert run.result == {"laps": 8}
    events = await store.events(run.run_id)
    assert not [e for e in events if "backed_off_seconds" in e.details]


async def test_the_backoff_grows_to_a_minute_and_progress_resets_it(
    store: RunStore, pool: asyncpg.Pool
) -> None:
    from orchestrator.db.store import Park, StepCommit

    run_id = (await store.submit("replies", {})).run.run_id
    wait = {"step": "turn", "signals": ["reply"], "effects": [], "until": None, "reason": None}
    await SignalStore(pool).send(run_id, "reply", {"n": 1})  # what it waits for is there

    async def claim_and_park(progressed: bool) -> float:
        """Claim the run (whenever it is due) and park it; the seconds it was backed off."""
        async with pool.acquire() as db:
            await db.execute(
                "UPDATE runs SET available_at = clock_timestamp() WHERE run_id = $1", run_id
            )
        claimed = (await store.claim("W", ["replies"], lease_seconds=300)).claimed[0]
        async with pool.acquire() as db, db.transaction():
            commit = StepCommit(claimed.lease, claimed.checkpoint_version, "turn", {})
            assert await store.commit_steps("W", [commit], db=db)
            park = Park(wait, None, progressed=progressed)
            assert await store.park_many("W", [(claimed.lease, park)], db=db)
        (parked_event,), _ = await store.events_tail(run_id, 1, kinds=["waiting"])
        backed_off = float(parked_event.details.get("backed_off_seconds") or 0)
        run = await store.get(run_id)
        if backed_off:  # the run is due then, not now
            assert run.available_at > await store.database_now()
        return backed_off

    delays = [await claim_and_park(progressed=False) for _ in range(12)]
    assert delays[:3] == [0, 0, 0]
    assert delays[3:] == [min(2**streak, 60) for streak in range(9)]  # 1, 2, 4 ... 60 s
    assert await claim_and_park(progressed=True) == 0  # progress: due at once again
    assert await claim_and_park(progressed=False) == 0  # and the count starts over


async def test_signals_re_read_mid_run_come_in_the_order_they_were_sent(
    store: RunStore, pool: asyncpg.Pool
) -> None:
    run_id = (await store.submit("replies", {})).run.run_id
    signals = SignalStore(pool)
    for name in ("note", "note", "reply", "note", "reply"):
        await signals.send(run_id, name, None)
    chosen = await signals.pending(run_id, awaited=["reply"])
    assert [s.seq for s in chosen] == sorted(s.seq for s in chosen)
    assert [s.name for s in chosen] == ["note", "note", "reply", "note", "reply"]
    assert all(s.data is None for s in chosen)


def test_a_stored_wait_reads_back_what_it_wrote() -> None:
    """``runs.wait`` is written by ``Wait.stored()`` and read back by the claim that wakes the run
    (and by ``runs show``): one class, both ways."""
    until = datetime(2030, 1, 2, 3, 4, 5, tzinfo=UTC)
    wait = Wait("Next", signals=["go", "go", "stop"], effects=["a", "a"], until=until, reason="x")
    stored = wait.stored()
    assert (stored.signals, stored.effects) == (("go", "stop"), ("a",))  # each named once
    assert StoredWait.from_json(stored.as_json()) == stored
    assert StoredWait.from_json(Wait("Next", reason="budget").stored().as_json()).until is None
    assert StoredWait.from_json(None) == StoredWait("")
    assert StoredWait.from_json({"signals": None, "until": None}) == StoredWait("")
