"""The dispatcher's batches: one re-check statement for a claimed batch, one settle statement for
many outcomes, and the same guarantees as one effect at a time."""

from __future__ import annotations

import json
from typing import Any

import anyio
import asyncpg
import pytest

from orchestrator.db.queries import query
from orchestrator.db.store import RunStore
from orchestrator.effect_model import Effect, EffectStatus
from orchestrator.effects.dispatcher import Dispatcher
from orchestrator.effects.settling import GroupSettler
from orchestrator.effects.store import EffectStore, SettleRequest
from orchestrator.models import RunState
from orchestrator.testing import LocalVendor
from test_effects_dispatch import http, requested


def crm(number: int) -> Effect:
    return Effect(f"crm-{number}", "crm", {"note": f"note {number}"})


async def test_a_cancel_after_the_claim_is_seen_by_the_batch_recheck_and_only_that_effect_waits(
    store: RunStore, pool: asyncpg.Pool
) -> None:
    runs = [await requested(store, pool, crm(n)) for n in range(4)]
    effects = EffectStore(pool)
    async with LocalVendor() as vendor:
        dispatcher = Dispatcher(pool, http(vendor), dispatcher_id="d1", lease_seconds=30)
        claimed = await dispatcher._claim()
        assert len(claimed) == 4
        await store.cancel(runs[1])  # after the claim, before the batch's re-check
        dispatcher._in_flight += len(claimed)
        with anyio.fail_after(30):
            await dispatcher._dispatch_batch(claimed, anyio.current_time() + 29)
        await dispatcher.adapters["crm"].aclose()
        assert vendor.requests == 3
        assert all(count == 1 for count in vendor.requests_by_key.values())
    statuses = {run: (await effects.get(run, f"crm-{n}")).status for n, run in enumerate(runs)}
    assert statuses.pop(runs[1]) is EffectStatus.REJECTED
    assert set(statuses.values()) == {EffectStatus.CONFIRMED}
    assert dispatcher._in_flight == 0


async def test_a_batch_whose_lease_may_have_ended_sends_nothing(
    store: RunStore, pool: asyncpg.Pool
) -> None:
    for n in range(3):
        await requested(store, pool, crm(n))
    async with LocalVendor() as vendor:
        dispatcher = Dispatcher(pool, http(vendor), dispatcher_id="late", lease_seconds=30)
        claimed = await dispatcher._claim()
        dispatcher._in_flight += len(claimed)
        with anyio.fail_after(30):
            await dispatcher._dispatch_batch(claimed, anyio.current_time() - 1)
        await dispatcher.adapters["crm"].aclose()
        assert vendor.requests == 0
    assert dispatcher.outcomes == {"lost_claim": 3}


async def test_one_settle_statement_settles_many_and_waits_alone_for_a_run_held_elsewhere(
    store: RunStore, pool: asyncpg.Pool
) -> None:
    """A worker's commit holds one run's row: the batch settles the others at once (it never
    waits for a row while holding others), then that one alone once the row is free."""
    runs = [await requested(store, pool, crm(n)) for n in range(3)]
    effects = EffectStore(pool)
    async with pool.acquire() as db:
        claimed = await effects.claim(db, "d1", ["crm"], limit=3, lease_seconds=60)
    settler = GroupSettler(pool, effects, "d1", statement_seconds=30)
    answers: dict[str, bool] = {}

    async def settle(request: SettleRequest) -> None:
        answers[request.effect.run_id] = await settler.settle(request)

    held = runs[0]
    async with pool.acquire() as holder:
        await holder.execute("BEGIN")
        await holder.execute("SELECT 1 FROM runs WHERE run_id = $1 FOR NO KEY UPDATE", held)
        async with anyio.create_task_group() as group:
            for effect in claimed:
                group.start_soon(
                    settle,
                    SettleRequest(
                        effect.record, EffectStatus.CONFIRMED, external_id="x", result={}
                    ),
                )
            others = {r for r in runs if r != held}
            with anyio.fail_after(20):
                while not all(  # noqa: ASYNC110
                    [(await effects.get(r, _key(runs, r))).settled_at for r in others]
                ):
                    await anyio.sleep(0.05)
            assert (await effects.get(held, _key(runs, held))).status is EffectStatus.DISPATCHING
            await holder.execute("COMMIT")  # the row is free: the held run's settle goes on
    assert answers == dict.fromkeys(runs, True)
    for run in runs:
        record = await effects.get(run, _key(runs, run))
        assert record.status is EffectStatus.CONFIRMED
        kinds = [e.kind for e in await store.events(run)]
        assert kinds.count("effect_confirmed") == 1


def _key(runs: list[str], run: str) -> str:
    return f"crm-{runs.index(run)}"


async def test_a_settle_by_a_dispatcher_that_lost_the_effect_records_nothing(
    store: RunStore, pool: asyncpg.Pool
) -> None:
    runs = [await requested(store, pool, crm(n)) for n in range(2)]
    effects = EffectStore(pool)
    async with pool.acquire() as db:
        claimed = await effects.claim(db, "old", ["crm"], limit=2, lease_seconds=0.1)
    await anyio.sleep(0.3)
    async with pool.acquire() as db:
        taken = await effects.claim(db, "new", ["crm"], limit=2, lease_seconds=60)
    assert len(taken) == 2 and all(t.must_reconcile for t in taken)
    settler = GroupSettler(pool, effects, "old", statement_seconds=30)
    answers: list[bool] = []

    async def settle(request: SettleRequest) -> None:
        answers.append(await settler.settle(request))

    async with anyio.create_task_group() as group:
        for effect in claimed:
            group.start_soon(settle, SettleRequest(effect.record, EffectStatus.CONFIRMED))
    assert answers == [False, False]
    for run in runs:
        holder = await pool.fetchval(
            "SELECT dispatcher FROM effects WHERE run_id = $1 AND status = 'dispatching'", run
        )
        assert holder == "new"


async def test_a_run_waiting_for_several_effects_settled_in_one_batch_is_woken(
    store: RunStore, pool: asyncpg.Pool
) -> None:
    """The batch wakes a run by any of its settled effects, not by one row picked per run."""
    await store.submit("agent", {})
    run = (await store.claim("W", ["agent"], limit=1, lease_seconds=60)).claimed[0]
    keys = ["a", "b", "c"]
    effects = EffectStore(pool)

    async def record(db: object, _: object) -> None:
        for key in keys:
            answer = await effects.accept(db, run.run_id, run.fence, crm_key(key), worker_id="W")  # type: ignore[arg-type]
            assert answer.outcome == "accepted"

    assert await store.commit_step(
        run.lease, expected_version=0, next_step="wait", checkpoint={}, in_transaction=record
    )
    await pool.execute(
        "UPDATE runs SET state = 'waiting', lease_owner = NULL, lease_until = NULL,"
        " available_at = 'infinity', wait = jsonb_build_object('effects', $2::jsonb)"
        " WHERE run_id = $1",
        run.run_id,
        ["c"],
    )
    async with pool.acquire() as db:
        claimed = await effects.claim(db, "d1", ["crm"], limit=3, lease_seconds=60)
        settled = await effects.settle_many(
            db, "d1", [SettleRequest(c.record, EffectStatus.CONFIRMED) for c in claimed]
        )
    assert len(settled) == 3
    woken = await store.get(run.run_id)
    assert woken.state is RunState.WAITING
    assert await pool.fetchval(
        "SELECT available_at <= clock_timestamp() FROM runs WHERE run_id = $1", run.run_id
    )


def crm_key(key: str) -> Effect:
    return Effect(key, "crm", {"note": key})


async def test_settings_that_would_never_send_are_refused_in_one_line(pool: asyncpg.Pool) -> None:
    from orchestrator.errors import InvalidInput

    for bad in (
        {"concurrency": 0},
        {"batch": -1},
        {"batch": 2.5},
        {"lease_seconds": 0},
        {"poll_seconds": float("nan")},
        {"statement_seconds": -3},
    ):
        with pytest.raises(InvalidInput, match=f"dispatcher {next(iter(bad))} must be") as error:
            Dispatcher(pool, {}, **bad)
        assert "\n" not in str(error.value)


class CountingVendor(LocalVendor):
    """Counts the requests it is answering at once."""

    def __init__(self) -> None:
        super().__init__()
        self.answering = 0
        self.most_at_once = 0

    async def respond(
        self, method: str, path: str, headers: dict[str, str], body: bytes
    ) -> tuple[int, Any]:
        self.answering += 1
        self.most_at_once = max(self.most_at_once, self.answering)
        try:
            return await super().respond(method, path, headers, body)
        finally:
            self.answering -= 1


async def test_concurrency_bounds_the_calls_at_the_vendor_while_outcomes_are_written(
    store: RunStore, pool: asyncpg.Pool
) -> None:
    """A slot is freed when its vendor call ends, before its outcome is written: never more
    than ``concurrency`` calls at the vendor, and every effect sent once."""
    runs = [await requested(store, pool, crm(n)) for n in range(24)]
    effects = EffectStore(pool)
    async with CountingVendor() as vendor:
        vendor.delay = 0.05
        dispatcher = Dispatcher(
            pool, http(vendor), concurrency=3, batch=10, lease_seconds=30, poll_seconds=0.05
        )
        async with anyio.create_task_group() as group:
            group.start_soon(dispatcher.run)
            with anyio.fail_after(60):
                for n, run in enumerate(runs):
                    while (await effects.get(run, f"crm-{n}")).status is not (  # noqa: ASYNC110
                        EffectStatus.CONFIRMED
                    ):
                        await anyio.sleep(0.05)
            group.cancel_scope.cancel()
    assert 1 <= vendor.most_at_once <= 3
    assert vendor.requests == 24 and set(vendor.requests_by_key.values()) == {1}


def _rows_read_from(plan: dict[str, Any], table: str) -> int:
    """Rows a plan's scans of ``table`` read: those returned and those their filters removed."""
    read = 0
    if plan.get("Relation Name") == table:
        loops = plan.get("Actual Loops", 1)
        read += int((plan.get("Actual Rows", 0) + plan.get("Rows Removed by Filter", 0)) * loops)
    for child in plan.get("Plans", ()):
        read += _rows_read_from(child, table)
    return read


@pytest.mark.parametrize(
    ("backlog_kind", "backlog_status"),
    [("crm", "accepted"), ("email", "accepted"), ("email", "dispatching")],
    ids=["its-own-kind", "another-kind-waiting", "another-kind-held-past-its-lease"],
)
async def test_a_claim_reads_about_as_many_effects_as_it_claims_however_long_the_backlog(
    store: RunStore, pool: asyncpg.Pool, backlog_kind: str, backlog_status: str
) -> None:
    """An outbox that backs up must not make every claim slower: the claim reads its candidates
    in index order up to its limit, not the whole backlog (sorted on each claim), and never
    reads past a backlog of a kind it does not serve (older than its own, so first in time)."""
    template = await requested(store, pool, crm(0))
    backlog = 3_000
    async with pool.acquire() as db:
        await db.execute(
            "INSERT INTO runs (run_id, agent, input) SELECT $1 || lpad(g::text, 6, '0'), agent, "
            "input FROM runs, generate_series(1, $2) AS g WHERE run_id = $1",
            template,
            backlog,
        )
        await db.execute(
            "INSERT INTO effects SELECT (jsonb_populate_record(NULL::effects, to_jsonb(e) "
            "|| jsonb_build_object('run_id', r.run_id, 'idempotency_key', "
            "e.idempotency_key || r.run_id, 'kind', $2::text, 'status', $3::text, "
            "'available_at', e.available_at - interval '1 hour', 'dispatcher', "
            "CASE WHEN $3 = 'dispatching' THEN 'gone' END, 'dispatcher_until', "
            "CASE WHEN $3 = 'dispatching' THEN e.available_at - interval '1 hour' END))).* "
            "FROM effects AS e, runs AS r WHERE e.run_id = $1 AND r.run_id LIKE $1 || '_%'",
            template,
            backlog_kind,
            backlog_status,
        )
        await db.execute("ANALYZE runs, effects")
        limit = 10
        transaction = db.transaction()
        await transaction.start()
        try:
            [[text]] = await db.fetch(
                "EXPLAIN (ANALYZE, FORMAT JSON) " + query("claim_effects"),
                "claimer",
                ["crm"],
                limit,
                60.0,
                False,
                False,
            )
        finally:
            await transaction.rollback()
        claimed = await EffectStore(pool).claim(
            db, "claimer", ["crm"], limit=limit, lease_seconds=60
        )
    [document] = json.loads(text) if isinstance(text, str) else text
    read = _rows_read_from(document["Plan"], "effects")
    assert read <= 3 * limit + 10, f"a claim of {limit} read {read} of {backlog + 1} effects"
    assert {c.record.kind for c in claimed} == {"crm"}
    assert len(claimed) == (limit if backlog_kind == "crm" else 1)


async def test_the_claim_keeps_one_generic_plan(store: RunStore, pool: asyncpg.Pool) -> None:
    """Planned afresh on every claim, the claim cost about three times as much server time as
    with its one generic plan: its kinds must not be estimated as an array parameter's ten."""
    await requested(store, pool, crm(0))
    async with pool.acquire() as db:
        for _ in range(12):
            await db.fetch(
                query("claim_effects"), "claimer", ["crm", "email"], 1, 60.0, False, True
            )
        plans = await db.fetchrow(
            "SELECT generic_plans, custom_plans FROM pg_prepared_statements WHERE statement = $1",
            query("claim_effects"),
        )
    assert plans is not None and plans["generic_plans"] > 0, dict(plans or {})


async def test_dispatchers_racing_over_several_kinds_send_each_effect_once(
    store: RunStore, pool: asyncpg.Pool
) -> None:
    """Two dispatchers serving the same two kinds claim past each other (each kind probed apart,
    rows of a kind a claim leaves out released at once); a third kind nobody serves waits."""
    from orchestrator.effects.http import HttpAdapter

    kinds = ("crm", "tickets")
    runs = [
        (await requested(store, pool, Effect(f"fx-{n}", kinds[n % 2], {"n": n})), f"fx-{n}")
        for n in range(30)
    ]
    unserved = await requested(store, pool, Effect("fx-mail", "mail", {"n": -1}))
    effects = EffectStore(pool)
    async with LocalVendor() as vendor:

        def adapters() -> dict[str, HttpAdapter]:
            return {
                kind: HttpAdapter(
                    kind, url=vendor.send_url, reconcile="lookup", lookup_url=vendor.lookup_url
                )
                for kind in kinds
            }

        racing = [
            Dispatcher(pool, adapters(), concurrency=4, batch=7, poll_seconds=0.05)
            for _ in range(2)
        ]
        async with anyio.create_task_group() as group:
            for dispatcher in racing:
                group.start_soon(dispatcher.run)
            with anyio.fail_after(60):
                for run_id, key in runs:
                    while (await effects.get(run_id, key)).status is not (  # noqa: ASYNC110
                        EffectStatus.CONFIRMED
                    ):
                        await anyio.sleep(0.05)
            group.cancel_scope.cancel()
    assert vendor.requests == len(runs) and set(vendor.requests_by_key.values()) == {1}
    assert (await effects.get(unserved, "fx-mail")).status is EffectStatus.ACCEPTED


async def test_a_claim_names_each_kind_once_and_none_claims_nothing(
    store: RunStore, pool: asyncpg.Pool
) -> None:
    """A kind listed twice is still one probe (a batch is not filled with the same effect
    twice); no kinds, or only a null one, claim nothing."""
    runs = [await requested(store, pool, crm(n)) for n in range(3)]
    effects = EffectStore(pool)
    async with pool.acquire() as db:
        for kinds in ([], [None]):
            assert await effects.claim(db, "d", kinds, limit=5, lease_seconds=60) == []  # type: ignore[arg-type]
        claimed = await effects.claim(db, "d", ["crm", "crm"], limit=3, lease_seconds=60)
    assert sorted(c.record.run_id for c in claimed) == sorted(runs)
