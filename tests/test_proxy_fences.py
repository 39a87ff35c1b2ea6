"""The action proxy's own fence store: regressions refused before the database, fences only ever
raised, durable across restarts, bounded by pruning (in-process; OS processes are in
test_effects_proxy.py)."""

from __future__ import annotations

import contextlib
import random
import sqlite3
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import asyncpg
import httpx
import pytest

from orchestrator.db.connections import create_pool
from orchestrator.db.executor import Executor
from orchestrator.db.store import RunStore
from orchestrator.effect_model import AcceptOutcome, Effect
from orchestrator.effects.fence_store import (
    DEFAULT_RETENTION,
    PRUNE_BATCHES_PER_ROUND,
    TOUCH_SECONDS,
    FenceStore,
    FenceStoreUnavailable,
    Remembered,
)
from orchestrator.effects.proxy import create_app
from orchestrator.effects.store import EffectStore
from orchestrator.errors import InvalidInput
from orchestrator.settings import Settings

TOKEN = "fence-test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


class Clock:
    """Wall time a test moves by hand: retention is counted in it."""

    def __init__(self) -> None:
        self.now = 1_800_000_000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def clocked_fences(tmp_path: Path, clock: Clock) -> Iterator[FenceStore]:
    """A fence store whose wall time is ``clock``."""
    store = FenceStore.open(tmp_path / "f.sqlite3", clock=clock)
    yield store
    store.close()


@pytest.fixture
def fences(tmp_path: Path) -> Iterator[FenceStore]:
    store = FenceStore.open(tmp_path / "fences.sqlite3")
    yield store
    store.close()


@pytest.fixture
async def proxy(pool: asyncpg.Pool, fences: FenceStore) -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(pool, [TOKEN], fences=fences)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as client:
        yield client


def body(run_id: str, fence: int, key: str = "crm-note") -> dict[str, Any]:
    return {"run_id": run_id, "effect_key": key, "fence": fence, "kind": "crm", "payload": {}}


async def lose_transactions(
    db: Executor, run_id: str, *, fence: int, owner: str, effect_fences: str
) -> None:
    """What a promoted standby that missed the old primary's last transactions holds: the run
    back at ``fence`` under ``owner``, the newer effects gone, and the boundary's high-water mark
    gone (``effect_fences='deleted'``) or back at ``fence`` (``'lowered'``)."""
    if isinstance(db, asyncpg.Pool):
        async with db.acquire() as connection:
            await lose_transactions(
                connection, run_id, fence=fence, owner=owner, effect_fences=effect_fences
            )
        return
    async with db.transaction():
        await db.execute(
            "UPDATE runs SET fence = $2, lease_owner = $3, state = 'running',"
            " lease_until = now() + interval '1 hour' WHERE run_id = $1",
            run_id,
            fence,
            owner,
        )
        await db.execute("DELETE FROM effects WHERE run_id = $1 AND fence > $2", run_id, fence)
        if effect_fences == "deleted":
            await db.execute("DELETE FROM effect_fences WHERE run_id = $1", run_id)
        else:
            await db.execute("UPDATE effect_fences SET fence = $2 WHERE run_id = $1", run_id, fence)


async def database_would_accept(pool: asyncpg.Pool, run_id: str, fence: int, key: str) -> bool:
    """Whether the in-database boundary alone takes this request (asked, then rolled back)."""
    async with pool.acquire() as db:
        transaction = db.transaction()
        await transaction.start()
        try:
            answer = await EffectStore(pool).accept(
                db, run_id, fence, Effect(key, "crm", {}), worker_id=None
            )
        finally:
            await transaction.rollback()
    return answer.outcome is AcceptOutcome.ACCEPTED


async def snapshot(pool: asyncpg.Pool, run_id: str) -> tuple[Any, ...]:
    return (
        await pool.fetchval("SELECT count(*) FROM effects WHERE run_id = $1", run_id),
        await pool.fetchval("SELECT count(*) FROM run_events WHERE run_id = $1", run_id),
        await pool.fetchval("SELECT fence FROM effect_fences WHERE run_id = $1", run_id),
    )


async def two_claims(store: RunStore) -> tuple[str, int, int]:
    """A run claimed by A, then (A's lease expired) by B: its id and both fences."""
    await store.submit("agent", {})
    a = (await store.claim("A", ["agent"], lease_seconds=0.2)).claimed[0]
    with anyio.fail_after(60):
        while True:
            await anyio.sleep(0.25)
            claimed = (await store.claim("B", ["agent"], lease_seconds=600)).claimed
            if claimed:
                return a.run_id, a.fence, claimed[0].fence


@pytest.mark.parametrize("effect_fences", ["deleted", "lowered"])
async def test_a_fence_below_the_remembered_one_is_refused_after_the_database_forgot_it(
    proxy: httpx.AsyncClient,
    store: RunStore,
    pool: asyncpg.Pool,
    fences: FenceStore,
    effect_fences: str,
) -> None:
    run_id, old, new = await two_claims(store)
    assert (
        await proxy.post("/v1/effects", json=body(run_id, new), headers=AUTH)
    ).status_code == 201
    assert (await fences.remembered(run_id) or Remembered(0, 0)).fence == new

    await lose_transactions(pool, run_id, fence=old, owner="A", effect_fences=effect_fences)
    # The database alone now takes the replaced worker for the owner: the proxy must not.
    assert await database_would_accept(pool, run_id, old, "crm-note")
    before = await snapshot(pool, run_id)
    refused = await proxy.post("/v1/effects", json=body(run_id, old), headers=AUTH)
    assert refused.status_code == 409, refused.text
    answer = refused.json()
    assert answer["error"] == "fence_regression"
    assert (answer["remembered_fence"], answer["presented_fence"]) == (new, old)
    assert (answer["accepted_fence"], answer["current_fence"], answer["run_state"]) == (
        new,
        new,
        None,
    )
    assert f"fence {old} is below fence {new}" in answer["detail"]
    assert await snapshot(pool, run_id) == before  # nothing reached the database
    assert (await fences.remembered(run_id) or Remembered(0, 0)).fence == new


async def test_the_remembered_fence_itself_still_works_and_re_requests_are_idempotent(
    proxy: httpx.AsyncClient, store: RunStore, pool: asyncpg.Pool, fences: FenceStore
) -> None:
    await store.submit("agent", {})
    run = (await store.claim("A", ["agent"], lease_seconds=600)).claimed[0]
    first = await proxy.post("/v1/effects", json=body(run.run_id, run.fence), headers=AUTH)
    again = await proxy.post("/v1/effects", json=body(run.run_id, run.fence), headers=AUTH)
    other = await proxy.post(
        "/v1/effects", json=body(run.run_id, run.fence, key="second"), headers=AUTH
    )
    assert [r.status_code for r in (first, again, other)] == [201, 200, 201]
    assert again.json()["outcome"] == "existing"
    assert (await fences.remembered(run.run_id) or Remembered(0, 0)).fence == run.fence
    assert await pool.fetchval("SELECT count(*) FROM effects") == 2


async def test_refusals_of_the_database_remember_nothing(
    proxy: httpx.AsyncClient, store: RunStore, fences: FenceStore
) -> None:
    await store.submit("agent", {})
    run = (await store.claim("A", ["agent"], lease_seconds=600)).claimed[0]
    forged = await proxy.post("/v1/effects", json=body(run.run_id, 1_000), headers=AUTH)
    assert forged.json()["error"] == "fence_not_granted"
    unknown = await proxy.post("/v1/effects", json=body("r_nobody", 5), headers=AUTH)
    assert unknown.status_code == 404
    # A forged fence must not become the remembered one (it would fence out the real owner).
    assert await fences.remembered(run.run_id) is None
    assert await fences.remembered("r_nobody") is None
    own = await proxy.post("/v1/effects", json=body(run.run_id, run.fence), headers=AUTH)
    assert own.status_code == 201, own.text


async def test_concurrent_requests_leave_the_highest_accepted_fence(
    proxy: httpx.AsyncClient, store: RunStore, pool: asyncpg.Pool, fences: FenceStore
) -> None:
    run_id, old, new = await two_claims(store)
    # The run's first effect on its own: concurrent first requests for a run race on inserting
    # its effect_fences row in the database (one fails with a unique violation, 503), which is
    # the in-database boundary's business, not this test's.
    first = await proxy.post("/v1/effects", json=body(run_id, new, "first"), headers=AUTH)
    assert first.status_code == 201, first.text
    answers: list[httpx.Response] = []

    async def send(fence: int, key: str) -> None:
        answers.append(await proxy.post("/v1/effects", json=body(run_id, fence, key), headers=AUTH))

    async with anyio.create_task_group() as group:
        for i in range(40):
            group.start_soon(send, new if i % 2 else old, f"k{i}")
    assert sum(r.status_code == 201 for r in answers) == 20, [r.text for r in answers]
    assert {r.json()["error"] for r in answers if r.status_code != 201} <= {
        "stale_fence",
        "fence_regression",
    }
    assert (await fences.remembered(run_id) or Remembered(0, 0)).fence == new
    await lose_transactions(pool, run_id, fence=old, owner="A", effect_fences="deleted")
    refused = await proxy.post("/v1/effects", json=body(run_id, old, "late"), headers=AUTH)
    assert refused.json()["error"] == "fence_regression"


@dataclass(frozen=True)
class Sent:
    """One request of a race, as its sender saw it (monotonic times)."""

    fence: int
    sent: float
    answered: float
    status: int
    error: str | None


async def restore_the_new_owner(pool: asyncpg.Pool, run_id: str, fence: int) -> None:
    await pool.execute(
        "UPDATE runs SET fence = $2, lease_owner = 'B', state = 'running' WHERE run_id = $1",
        run_id,
        fence,
    )


async def race_on_a_forgetful_database(
    clients: list[httpx.AsyncClient],
    pool: asyncpg.Pool,
    run_id: str,
    old: int,
    new: int,
    *,
    requests: int = 40,
    headers: dict[str, str] = AUTH,
) -> list[Sent]:
    """Workers A (``old``) and B (``new``) send effect requests for one run at once, through
    ``clients`` in turn, while the database keeps failing over between a copy in which B owns
    the run and one that lost B's claim (A owns it again): both fences pass the database's own
    rule some of the time. B's first request goes before the race, to a database where B owns
    the run, so that an acceptance under B's fence does not depend on how the flips and the
    requests happen to interleave on a busy machine. What each request got, in the order the
    answers came."""
    sent: list[Sent] = []
    done = anyio.Event()
    await restore_the_new_owner(pool, run_id, new)
    began = time.monotonic()
    first = await clients[0].post("/v1/effects", json=body(run_id, new, "b-first"), headers=headers)
    assert first.status_code == 201, first.text
    sent.append(Sent(new, began, time.monotonic(), first.status_code, None))

    async def flip() -> None:
        while not done.is_set():
            await lose_transactions(pool, run_id, fence=old, owner="A", effect_fences="deleted")
            await anyio.lowlevel.checkpoint()
            await restore_the_new_owner(pool, run_id, new)
            await anyio.lowlevel.checkpoint()

    async def worker(fence: int, name: str) -> None:
        for i in range(requests):
            client = clients[i % len(clients)]
            began = time.monotonic()
            answer = await client.post(
                "/v1/effects", json=body(run_id, fence, f"{name}{i}"), headers=headers
            )
            error = None if answer.status_code < 300 else answer.json()["error"]
            sent.append(Sent(fence, began, time.monotonic(), answer.status_code, error))

    async with anyio.create_task_group() as group:
        group.start_soon(flip)
        async with anyio.create_task_group() as workers:
            workers.start_soon(worker, old, "a")
            workers.start_soon(worker, new, "b")
        done.set()
    await restore_the_new_owner(pool, run_id, new)
    return sent


def check_race(sent: list[Sent], old: int, new: int) -> None:
    """Once any request under B's fence was answered accepted, no request under A's sent after
    that answer is accepted: whatever the database forgot, the proxy did not go backwards."""
    accepted_new = [s.answered for s in sent if s.fence == new and s.status in (200, 201)]
    assert accepted_new, [s.error for s in sent if s.fence == new]
    first = min(accepted_new)
    late_old = [s for s in sent if s.fence == old and s.sent > first]
    assert late_old  # B's first acceptance came before A had sent all its requests
    assert [s for s in late_old if s.status in (200, 201)] == []
    assert all(s.status in (200, 201, 409, 503) for s in sent), sent
    assert {s.error for s in sent if s.status == 409} <= {
        "stale_fence",
        "fence_not_granted",
        "fence_regression",
        "run_not_running",
    }


async def test_two_workers_racing_through_failovers_never_go_backwards(
    proxy: httpx.AsyncClient, store: RunStore, pool: asyncpg.Pool, fences: FenceStore
) -> None:
    run_id, old, new = await two_claims(store)
    sent = await race_on_a_forgetful_database([proxy], pool, run_id, old, new)
    check_race(sent, old, new)
    assert (await fences.remembered(run_id) or Remembered(0, 0)).fence == new
    # The database forgets once more: the proxy still refuses A, deterministically.
    await lose_transactions(pool, run_id, fence=old, owner="A", effect_fences="lowered")
    refused = await proxy.post("/v1/effects", json=body(run_id, old, "last"), headers=AUTH)
    assert refused.json()["error"] == "fence_regression", refused.text


class CountedReads(FenceStore):
    """A fence store that counts its reads, so a test knows a request passed its first check."""

    reads = 0
    checked: anyio.Event | None = None

    async def remembered(self, run_id: str) -> Remembered | None:
        found = await super().remembered(run_id)
        self.reads += 1
        if self.checked is not None:
            self.checked.set()
        return found


async def test_a_request_that_waited_for_a_connection_is_checked_again(
    settings: Settings, store: RunStore, tmp_path: Path
) -> None:
    """A request passes the check, then waits for a connection while a newer fence is accepted
    and remembered and the database fails over, losing it: it is refused once it has one."""
    run_id, old, new = await two_claims(store)
    fences = CountedReads.open(tmp_path / "f.sqlite3")
    fences.checked = anyio.Event()
    one = await create_pool(settings, application_name="test-one", min_size=1, max_size=1)
    try:
        app = create_app(one, [TOKEN], fences=fences)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as client:
            answers: list[httpx.Response] = []

            async def stale() -> None:
                answers.append(
                    await client.post("/v1/effects", json=body(run_id, old), headers=AUTH)
                )

            # The connection is released before the task group waits for the request.
            async with anyio.create_task_group() as group, one.acquire() as held:
                group.start_soon(stale)
                with anyio.fail_after(60):
                    await fences.checked.wait()
                await fences.remember(run_id, new)  # a request under B's fence, accepted
                await lose_transactions(held, run_id, fence=old, owner="A", effect_fences="deleted")
            [answer] = answers
        assert answer.status_code == 409, answer.text
        assert answer.json()["error"] == "fence_regression"
        assert fences.reads == 2
        assert await store.pool.fetchval("SELECT count(*) FROM effects") == 0
    finally:
        await one.close()
        fences.close()


async def test_a_failing_store_is_a_503_not_a_silent_pass(
    proxy: httpx.AsyncClient, store: RunStore, fences: FenceStore
) -> None:
    await store.submit("agent", {})
    run = (await store.claim("A", ["agent"], lease_seconds=600)).claimed[0]
    with sqlite3.connect(fences.path) as other:
        other.execute("DROP TABLE run_fences")
    answer = await proxy.post("/v1/effects", json=body(run.run_id, run.fence), headers=AUTH)
    assert answer.status_code == 503, answer.text
    assert answer.json()["error"] == "unavailable"
    assert "fence store" in answer.json()["detail"]
    assert await store.pool.fetchval("SELECT count(*) FROM effects") == 0


class FailingWrites(FenceStore):
    """Reads work, the durable write fails (a full disk): the acceptance must not commit."""

    async def admit(self, run_id: str, fence: int) -> Remembered | None:
        raise FenceStoreUnavailable(f"the action proxy's fence store {str(self.path)!r} failed")


async def test_an_acceptance_whose_fence_cannot_be_written_is_rolled_back(
    pool: asyncpg.Pool, store: RunStore, tmp_path: Path
) -> None:
    await store.submit("agent", {})
    run = (await store.claim("A", ["agent"], lease_seconds=600)).claimed[0]
    fences = FailingWrites.open(tmp_path / "f.sqlite3")
    try:
        app = create_app(pool, [TOKEN], fences=fences)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as client:
            answer = await client.post(
                "/v1/effects", json=body(run.run_id, run.fence), headers=AUTH
            )
        assert answer.status_code == 503, answer.text
        assert "nothing was recorded" in answer.json()["detail"]
        # Nothing a dispatcher could send, and the boundary's own mark untouched.
        assert await pool.fetchval("SELECT count(*) FROM effects") == 0
        assert await pool.fetchval("SELECT count(*) FROM effect_fences") == 0
    finally:
        fences.close()


async def test_a_store_locked_past_the_bounded_wait_is_a_503_and_nothing_commits(
    pool: asyncpg.Pool, store: RunStore, tmp_path: Path
) -> None:
    """Another process holds the file's write lock (stuck on a slow disk, say): the request
    waits the busy timeout, no longer, and is refused with the reason; the database rolled
    back. Once the lock is free the same request is accepted."""
    await store.submit("agent", {})
    run = (await store.claim("A", ["agent"], lease_seconds=600)).claimed[0]
    fences = FenceStore.open(tmp_path / "f.sqlite3", busy_timeout=0.2)
    holder = sqlite3.connect(fences.path, isolation_level=None)
    try:
        app = create_app(pool, [TOKEN], fences=fences)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as client:
            holder.execute("BEGIN IMMEDIATE")
            with anyio.fail_after(30):
                locked = await client.post(
                    "/v1/effects", json=body(run.run_id, run.fence), headers=AUTH
                )
            assert locked.status_code == 503, locked.text
            assert "stayed locked by another process for over 0.2s" in locked.json()["detail"]
            assert await pool.fetchval("SELECT count(*) FROM effects") == 0
            holder.execute("ROLLBACK")
            again = await client.post("/v1/effects", json=body(run.run_id, run.fence), headers=AUTH)
        assert again.status_code == 201, again.text
        assert (await fences.remembered(run.run_id) or Remembered(0, 0)).fence == run.fence
    finally:
        holder.close()
        fences.close()


class WatchedWrites(FenceStore):
    """After each durable write, looks from outside: is the fence in the file (a new SQLite
    connection) while the effect is still invisible to the database's other sessions?"""

    pool: asyncpg.Pool
    seen: list[tuple[int | None, int]]

    async def admit(self, run_id: str, fence: int) -> Remembered | None:
        refused = await super().admit(run_id, fence)
        with contextlib.closing(sqlite3.connect(self.path)) as outside:
            row = outside.execute(
                "SELECT fence FROM run_fences WHERE run_id = ?", (run_id,)
            ).fetchone()
        visible = await self.pool.fetchval(
            "SELECT count(*) FROM effects WHERE run_id = $1 AND fence = $2", run_id, fence
        )
        self.seen.append((None if row is None else int(row[0]), int(visible)))
        return refused


async def test_a_new_fence_is_on_disk_before_its_acceptance_commits(
    pool: asyncpg.Pool, store: RunStore, tmp_path: Path
) -> None:
    run_id, _, new = await two_claims(store)
    fences = WatchedWrites.open(tmp_path / "f.sqlite3")
    fences.pool, fences.seen = pool, []
    try:
        app = create_app(pool, [TOKEN], fences=fences)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as client:
            for key in ("a", "b"):
                answer = await client.post("/v1/effects", json=body(run_id, new, key), headers=AUTH)
                assert answer.status_code == 201, answer.text
        # One write (the run's first fence); the second request under it needed none. When it
        # was written, the file had it and no other session could see the effect yet.
        assert fences.seen == [(new, 0)]
        assert await pool.fetchval("SELECT count(*) FROM effects") == 2
    finally:
        fences.close()


async def test_fences_only_rise_under_concurrent_writers(fences: FenceStore) -> None:
    values = list(range(1, 301)) * 2
    random.Random(7).shuffle(values)
    seen: list[int] = []
    refusals: list[tuple[int, int]] = []

    async def write(fence: int) -> None:
        higher = await fences.admit("r_race", fence)
        if higher is not None:
            refusals.append((fence, higher.fence))

    async def watch() -> None:
        while len(seen) < 200:
            remembered = await fences.remembered("r_race")
            seen.append(0 if remembered is None else remembered.fence)

    async with anyio.create_task_group() as group:
        group.start_soon(watch)
        for fence in values:
            group.start_soon(write, fence)
    assert seen == sorted(seen)  # never lowered, as each read saw it
    assert (await fences.remembered("r_race") or Remembered(0, 0)).fence == 300
    assert refusals and all(fence < higher for fence, higher in refusals)


async def test_the_store_survives_reopening(tmp_path: Path) -> None:
    path = tmp_path / "fences.sqlite3"
    first = FenceStore.open(path)
    await first.remember("r_a", 7)
    first.close()
    second = FenceStore.open(path)
    try:
        assert (await second.remembered("r_a") or Remembered(0, 0)).fence == 7
        await second.remember("r_a", 3)
        assert (await second.remembered("r_a") or Remembered(0, 0)).fence == 7
    finally:
        second.close()


async def test_pruning_forgets_runs_untouched_for_the_retention_in_batches(
    tmp_path: Path,
) -> None:
    clock = Clock()
    fences = FenceStore.open(tmp_path / "f.sqlite3", retention=timedelta(days=7), clock=clock)
    try:
        for i in range(1_200):
            await fences.remember(f"r_old{i}", 3)
        clock.now += 6 * 86_400
        await fences.remember("r_busy", 2)
        # A re-request under the same fence refreshes the entry once TOUCH_SECONDS have passed.
        await fences.remember("r_old0", 3)
        clock.now += 2 * 86_400
        assert await fences.prune(batch=500) == 500
        assert await fences.prune_round(batch=500) == 699  # two more batches, the last short
        assert await fences.count() == 2
        assert await fences.remembered("r_old1") is None
        assert (await fences.remembered("r_old0") or Remembered(0, 0)).fence == 3
        assert (await fences.remembered("r_busy") or Remembered(0, 0)).fence == 2
        clock.now += 8 * 86_400
        assert await fences.prune_round() == 2
    finally:
        fences.close()


async def test_a_round_prunes_a_bounded_number_of_batches(
    clocked_fences: FenceStore, clock: Clock
) -> None:
    for i in range(PRUNE_BATCHES_PER_ROUND * 5 + 3):
        await clocked_fences.remember(f"r_{i}", 1)
    clock.now += DEFAULT_RETENTION.total_seconds() + 1
    assert await clocked_fences.prune_round(batch=5) == PRUNE_BATCHES_PER_ROUND * 5
    assert await clocked_fences.prune_round(batch=5) == 3


async def test_a_re_request_under_the_same_fence_writes_only_to_refresh(
    clocked_fences: FenceStore, clock: Clock
) -> None:
    assert clocked_fences.needs_admit(None, 4)
    assert await clocked_fences.admit("r_a", 4) is None
    seen = await clocked_fences.remembered("r_a")
    assert seen == Remembered(4, clock.now)
    clock.now += TOUCH_SECONDS / 2
    assert not clocked_fences.needs_admit(seen, 4)
    assert clocked_fences.needs_admit(seen, 5)
    assert await clocked_fences.admit("r_a", 4) is None  # admitted, nothing to write
    assert await clocked_fences.remembered("r_a") == seen
    clock.now += TOUCH_SECONDS
    assert clocked_fences.needs_admit(seen, 4)
    assert await clocked_fences.admit("r_a", 4) is None
    assert await clocked_fences.remembered("r_a") == Remembered(4, clock.now)


async def test_admit_refuses_a_lower_fence_with_the_entry_and_writes_nothing(
    clocked_fences: FenceStore, clock: Clock
) -> None:
    assert await clocked_fences.admit("r_a", 9) is None
    clock.now += 2 * TOUCH_SECONDS
    assert await clocked_fences.admit("r_a", 8) == Remembered(9, clock.now - 2 * TOUCH_SECONDS)
    assert await clocked_fences.remembered("r_a") == Remembered(9, clock.now - 2 * TOUCH_SECONDS)
    assert await clocked_fences.admit("r_a", 10) is None
    assert await clocked_fences.remembered("r_a") == Remembered(10, clock.now)


@pytest.mark.parametrize(
    ("make", "says"),
    [
        (lambda base: base / "missing" / "f.sqlite3", "does not exist"),
        (lambda base: base, "is a directory"),
        (lambda base: base / "not-sqlite", "file is not a database"),
        (lambda base: base / "not-sqlite" / "f.sqlite3", "is not a directory"),
        (lambda base: Path("/proc/orchestrator-fences.sqlite3"), "unable to open"),
    ],
)
def test_an_unusable_path_is_one_clear_line(tmp_path: Path, make: Any, says: str) -> None:
    (tmp_path / "not-sqlite").write_text("hello, not a database\n" * 100)
    path = make(tmp_path)
    with pytest.raises(InvalidInput) as raised:
        FenceStore.open(path)
    message = str(raised.value)
    assert "\n" not in message and str(path) in message and says in message, message
    assert "ORCHESTRATOR_PROXY_FENCE_STORE" in message


def test_a_store_from_a_newer_release_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "f.sqlite3"
    FenceStore.open(path).close()
    with sqlite3.connect(path) as newer:
        newer.execute("PRAGMA user_version = 99")
    with pytest.raises(InvalidInput, match="a newer orchestrator wrote it"):
        FenceStore.open(path)


def test_too_short_a_retention_is_refused(tmp_path: Path) -> None:
    with pytest.raises(InvalidInput, match="at least 1h"):
        FenceStore.open(tmp_path / "f.sqlite3", retention=timedelta(minutes=5))


def test_without_a_setting_there_is_no_store_and_the_variable_names_one() -> None:
    assert Settings.from_env({"ORCHESTRATOR_HOME": "/srv/o"}).proxy_fence_store is None
    assert Settings.from_env(
        {"ORCHESTRATOR_PROXY_FENCE_STORE": "/var/lib/p.sqlite3"}
    ).proxy_fence_store == Path("/var/lib/p.sqlite3")


async def test_without_a_store_the_database_alone_decides_as_before(
    pool: asyncpg.Pool, store: RunStore
) -> None:
    """The default: no fence store, so a fence the database forgot is not caught by the proxy
    (what --fence-store is for); every other answer is the database's, as before."""
    run_id, old, new = await two_claims(store)
    app = create_app(pool, [TOKEN])
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as client:
        first = await client.post("/v1/effects", json=body(run_id, new), headers=AUTH)
        stale = await client.post("/v1/effects", json=body(run_id, old, "b"), headers=AUTH)
        await lose_transactions(pool, run_id, fence=old, owner="A", effect_fences="deleted")
        forgotten = await client.post("/v1/effects", json=body(run_id, old, "c"), headers=AUTH)
    assert [first.status_code, stale.status_code, forgotten.status_code] == [201, 409, 201]
    assert stale.json()["error"] == "stale_fence"
