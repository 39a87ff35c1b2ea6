"""Lease expiry is judged by the database clock: a worker whose clock is hours off behaves the same.

Each worker runs in its own process (``tests/support/claimer_process.py serve``); the skewed ones
shift ``time.time``, ``time.time_ns`` and ``datetime.now``/``utcnow``/``today`` by hours before
orchestrator is imported. Every answer carries the database clock read just before and just after
the command, so the assertions are about the database clock only and hold however slow the machine
is: a lease of L seconds granted by a command that ran in [before, after] must end in [before + L,
after + L]; a refused claim must have started while the lease was still valid.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from orchestrator.db.store import RunStore

pytestmark = pytest.mark.slow

CLAIMER = Path(__file__).parent / "support" / "claimer_process.py"
AGENT = "skew-test"
HOURS = 3 * 3600.0
LONG = 30.0
"""Long enough that a lease this length certainly outlives the commands that follow it."""
SHORT = 1.0
"""Renewed to this so the test can wait for a real expiry."""


def when(value: str) -> datetime:
    return datetime.fromisoformat(value)


class ServedWorker:
    """One worker process, driven one JSON command at a time."""

    def __init__(self, worker_id: str, process: asyncio.subprocess.Process) -> None:
        self.worker_id = worker_id
        self.process = process

    async def call(self, op: str, **fields: Any) -> dict[str, Any]:
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write((json.dumps({"op": op, **fields}) + "\n").encode())
        await self.process.stdin.drain()
        line = await asyncio.wait_for(self.process.stdout.readline(), 60.0)
        assert line, f"worker {self.worker_id} exited (code {self.process.returncode})"
        answer: dict[str, Any] = json.loads(line)
        return answer

    async def claim_run(self, run_id: str, lease_seconds: float) -> dict[str, Any] | None:
        answer = await self.call("claim_run", run_id=run_id, lease_seconds=lease_seconds)
        if not answer["claimed"]:
            return None
        claim: dict[str, Any] = answer["claimed"][0]
        assert_lease_length(answer, when(claim["lease_until"]), lease_seconds)
        assert when(claim["claimed_at"]) < when(claim["lease_until"])
        return claim

    async def renew(self, claim: dict[str, Any], lease_seconds: float) -> datetime | None:
        answer = await self.call(
            "renew", run_id=claim["run_id"], fence=claim["fence"], lease_seconds=lease_seconds
        )
        if answer["lease_until"] is None:
            return None
        lease_until = when(answer["lease_until"])
        assert_lease_length(answer, lease_until, lease_seconds)
        return lease_until


@asynccontextmanager
async def served_worker(
    database_url: str, worker_id: str, skew_seconds: float
) -> AsyncIterator[ServedWorker]:
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        str(CLAIMER),
        "serve",
        "--worker-id",
        worker_id,
        "--clock-skew-seconds",
        str(skew_seconds),
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        env={**os.environ, "ORCHESTRATOR_DATABASE_URL": database_url},
    )
    worker = ServedWorker(worker_id, process)
    try:
        clock = await worker.call("clock")
        # The skew really is in effect in that process, for both clock APIs.
        db_now = when(clock["before"])
        assert abs(clock["local_time"] - db_now.timestamp() - skew_seconds) < 60
        assert abs((when(clock["local_now"]) - db_now).total_seconds() - skew_seconds) < 60
        yield worker
    finally:
        assert process.stdin is not None
        process.stdin.close()
        try:
            code = await asyncio.wait_for(process.wait(), 30.0)
        except TimeoutError:
            process.kill()
            await process.wait()
            raise
    assert code == 0, f"worker {worker_id} exited with {code}"


def assert_lease_length(answer: dict[str, Any], lease_until: datetime, seconds: float) -> None:
    """Granted by a statement that ran in [before, after] (DB clock): ends L seconds after it."""
    lease = timedelta(seconds=seconds)
    assert when(answer["before"]) + lease <= lease_until <= when(answer["after"]) + lease


async def claim_once_expired(
    worker: ServedWorker, run_id: str, lease_until: datetime, previous_owner: str
) -> dict[str, Any]:
    """Poll until the worker claims the run; every refusal must be while the lease was valid."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 60.0
    refusals = 0
    while True:
        answer = await worker.call("claim_run", run_id=run_id, lease_seconds=LONG)
        if answer["claimed"]:
            claim: dict[str, Any] = answer["claimed"][0]
            assert_lease_length(answer, when(claim["lease_until"]), LONG)
            assert when(claim["claimed_at"]) > lease_until
            assert claim["previous_owner"] == previous_owner
            assert when(claim["previous_lease_until"]) == lease_until
            print(f"{worker.worker_id} claimed {run_id} after {refusals} refusals")
            return claim
        # A claim that started after the lease ended by the database clock must not be refused.
        assert when(answer["before"]) <= lease_until, answer
        refusals += 1
        assert loop.time() < deadline, "the expired lease was never claimable"
        await asyncio.sleep(0.05)


async def db_lease(store: RunStore, run_id: str) -> tuple[datetime, datetime]:
    row = await store.pool.fetchrow(
        "SELECT lease_until, clock_timestamp() AS db_now FROM runs WHERE run_id = $1", run_id
    )
    assert row is not None
    return row["lease_until"], row["db_now"]


async def test_worker_hours_ahead_holds_its_lease_by_the_database_clock(
    store: RunStore, database_url: str
) -> None:
    run_id = (await store.submit(AGENT, {})).run.run_id
    async with (
        served_worker(database_url, "ahead", +HOURS) as ahead,
        served_worker(database_url, "normal", 0.0) as normal,
    ):
        claim = await ahead.claim_run(run_id, LONG)
        assert claim is not None and claim["fence"] == 1
        lease_until, db_now = await db_lease(store, run_id)
        assert lease_until == when(claim["lease_until"])
        assert db_now < lease_until <= db_now + timedelta(seconds=LONG)  # valid, not 3 h long

        # While the lease is valid by the database clock, nobody else can claim the run.
        refused = await normal.call("claim_run", run_id=run_id, lease_seconds=LONG)
        assert refused["claimed"] == [] and when(refused["before"]) < lease_until
        refused = await normal.call("claim", agent=AGENT, lease_seconds=LONG)
        assert refused["claimed"] == [] and when(refused["before"]) < lease_until
        assert await store.claim_run("test", run_id, lease_seconds=LONG) is None

        # Its renewals before expiry succeed and are measured by the database clock too.
        renewed = await ahead.renew(claim, LONG)
        assert renewed is not None
        short = await ahead.renew(claim, SHORT)
        assert short is not None
        assert (await db_lease(store, run_id))[0] == short

        # Only once that lease really expired can the normal worker take the run over.
        takeover = await claim_once_expired(normal, run_id, short, "ahead")
        assert takeover["fence"] == 2

        # The skewed worker, now stale, can neither renew nor commit.
        assert await ahead.renew(claim, LONG) is None
        stale = await ahead.call("commit", run_id=run_id, fence=1, expected_version=0)
        assert stale["version"] is None
        committed = await normal.call("commit", run_id=run_id, fence=2, expected_version=0)
        assert committed["version"] == 1


async def test_worker_hours_behind_cannot_claim_a_lease_valid_by_the_database_clock(
    store: RunStore, database_url: str
) -> None:
    run_id = (await store.submit(AGENT, {})).run.run_id
    async with (
        served_worker(database_url, "behind", -HOURS) as behind,
        served_worker(database_url, "normal", 0.0) as normal,
    ):
        claim = await normal.claim_run(run_id, LONG)
        assert claim is not None
        lease_until = when(claim["lease_until"])

        refused = await behind.call("claim_run", run_id=run_id, lease_seconds=LONG)
        assert refused["claimed"] == [] and when(refused["before"]) < lease_until
        refused = await behind.call("claim", agent=AGENT, lease_seconds=LONG)
        assert refused["claimed"] == [] and when(refused["before"]) < lease_until

        short = await normal.renew(claim, SHORT)
        assert short is not None
        takeover = await claim_once_expired(behind, run_id, short, "normal")
        assert takeover["fence"] == 2
        lease_until, db_now = await db_lease(store, run_id)
        assert lease_until == when(takeover["lease_until"])
        assert db_now < lease_until <= db_now + timedelta(seconds=LONG)  # not already expired

        assert await normal.renew(claim, LONG) is None
        renewed = await behind.renew(takeover, LONG)
        assert renewed is not None


async def test_lease_lengths_do_not_depend_on_the_worker_clock(
    store: RunStore, database_url: str
) -> None:
    skews = {"ahead": +HOURS, "normal": 0.0, "behind": -HOURS}
    lease = timedelta(seconds=15.0)
    run_ids = {name: (await store.submit(AGENT, {})).run.run_id for name in skews}
    durations: dict[str, timedelta] = {}
    slack: dict[str, timedelta] = {}
    for name, skew in skews.items():
        async with served_worker(database_url, name, skew) as worker:
            answer = await worker.call(
                "claim_run", run_id=run_ids[name], lease_seconds=lease.total_seconds()
            )
            [claim] = answer["claimed"]
            lease_until = when(claim["lease_until"])
            assert_lease_length(answer, lease_until, lease.total_seconds())
            durations[name] = lease_until - when(claim["claimed_at"])
            slack[name] = when(answer["after"]) - when(answer["before"])
            assert await worker.renew(claim, 2.5) is not None  # checks the renewed length too
    print(f"claimed lease lengths {durations}")
    for name in skews:
        # lease_until is computed a moment before claimed_at is read, in the same statement.
        assert timedelta(0) <= lease - durations[name] <= slack[name]
    assert max(durations.values()) - min(durations.values()) <= max(slack.values())
