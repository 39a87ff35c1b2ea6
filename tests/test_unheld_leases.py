"""A worker back on the database ends its leases on runs it is not running: a claim whose answer
was lost with its connection, a run whose final commit a failover took back, a restart under the
same ``--worker-id``. Without this such a run waits out its whole lease with nobody working on
it."""

from __future__ import annotations

from datetime import UTC, datetime

import anyio
import asyncpg

from orchestrator.agents.noop import noop
from orchestrator.agents.sleepy import sleepy
from orchestrator.db.store import RunStore
from orchestrator.models import RunState
from orchestrator.settings import Settings
from orchestrator.testing import running_worker

LEASE = 300.0
WORKER = {"lease_seconds": 30.0, "heartbeat_seconds": 1.0, "poll_seconds": 0.1}


async def _held_by_nobody(store: RunStore, worker_id: str, agent: str) -> str:
    """A run leased to ``worker_id`` for 5 minutes that ``worker_id`` knows nothing of."""
    run_id = (await store.submit(agent, {})).run.run_id
    claimed = await store.claim_run(worker_id, run_id, lease_seconds=LEASE)
    assert claimed is not None
    return run_id


async def _lease_ended(store: RunStore, run_id: str) -> bool:
    until = (await store.get(run_id)).lease_until
    return until is None or until <= datetime.now(UTC)


async def _kinds(pool: asyncpg.Pool, run_id: str) -> list[str]:
    rows = await pool.fetch(
        "SELECT kind FROM run_events WHERE run_id = $1 ORDER BY event_id", run_id
    )
    return [row["kind"] for row in rows]


async def test_a_worker_restarted_under_its_id_ends_the_leases_of_its_former_life(
    settings: Settings, store: RunStore, pool: asyncpg.Pool
) -> None:
    orphan = await _held_by_nobody(store, "steady-id", "noop")
    async with running_worker(settings, [noop], worker_id="steady-id", **WORKER):
        with anyio.fail_after(30):
            while (run := await store.get(orphan)).state is not RunState.SUCCEEDED:  # noqa: ASYNC110
                await anyio.sleep(0.05)
    assert run.attempt == 2
    assert "lease_abandoned" in await _kinds(pool, orphan)


async def test_after_its_session_is_lost_a_worker_ends_only_the_leases_it_does_not_run(
    settings: Settings, store: RunStore, pool: asyncpg.Pool
) -> None:
    # No reaper: a cut liveness session would otherwise be judged a death and end every lease.
    async with running_worker(
        settings,
        [sleepy],
        worker_id="back",
        dead_session_takeover=False,
        grace_seconds=0.5,
        **WORKER,
    ) as worker:
        held = (await store.submit("sleepy", {"steps": 1, "seconds": 120})).run.run_id
        with anyio.fail_after(30):
            while held not in worker.active:  # noqa: ASYNC110
                await anyio.sleep(0.05)
        fence = (await store.get(held)).fence
        # Leased to this worker by a claim whose answer it never read; of an agent it does
        # not serve, so that nothing here claims it again after its lease is ended.
        orphan = await _held_by_nobody(store, "back", "elsewhere")
        registrations = worker.running.liveness.registrations if worker.running else 0
        await pool.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE application_name = 'back:liveness'"
        )
        with anyio.fail_after(30):
            while not await _lease_ended(store, orphan):  # noqa: ASYNC110
                await anyio.sleep(0.05)
        assert worker.running is not None
        assert worker.running.liveness.registrations == registrations + 1
        still = await store.get(held)
        assert held in worker.active
        assert (still.state, still.fence, still.lease_owner) == (RunState.RUNNING, fence, "back")
        assert "lease_abandoned" not in await _kinds(pool, held)
        assert "lease_abandoned" in await _kinds(pool, orphan)
