"""A worker whose database turns read-only under it (it reconnected to a standby, or its primary
was demoted by a failover) stops acting on its runs at its next heartbeat, not at its lease's
end: no renewal can succeed there, and the run may already be someone else's elsewhere."""

from __future__ import annotations

from urllib.parse import urlsplit

import anyio
import asyncpg

from orchestrator.agents.sleepy import sleepy
from orchestrator.db.store import RunStore
from orchestrator.settings import Settings
from orchestrator.testing import running_worker
from orchestrator.worker.execution import Disposition

LEASE = 30.0
HEARTBEAT = 1.0


async def test_a_worker_stops_within_a_heartbeat_when_its_database_turns_read_only(
    settings: Settings, store: RunStore, pool: asyncpg.Pool
) -> None:
    assert settings.database_url is not None
    database = urlsplit(settings.database_url).path.lstrip("/")
    async with running_worker(
        settings,
        [sleepy],
        worker_id="ro-worker",
        lease_seconds=LEASE,
        heartbeat_seconds=HEARTBEAT,
        poll_seconds=0.1,
        dead_session_takeover=False,
    ) as worker:
        run_id = (await store.submit("sleepy", {"steps": 1, "seconds": 60})).run.run_id
        with anyio.fail_after(30):
            while run_id not in worker.active:
                await anyio.sleep(0.05)
        # Every session the worker opens from now on is read-only, as on a standby.
        await pool.execute(f'ALTER DATABASE "{database}" SET default_transaction_read_only = on')
        try:
            await pool.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE application_name = 'ro-worker'"
            )
            began = anyio.current_time()
            with anyio.fail_after(LEASE / 2):
                while run_id in worker.active:
                    await anyio.sleep(0.05)
            # Two heartbeats at most (one may have been in flight), far less than the lease.
            assert anyio.current_time() - began < 3 * HEARTBEAT + 1
            assert worker.counters.finished.get(Disposition.LOST.value, 0) == 1
        finally:
            await pool.execute(f'ALTER DATABASE "{database}" RESET default_transaction_read_only')
