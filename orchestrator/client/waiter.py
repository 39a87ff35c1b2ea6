"""Waiting for a run to end without polling: a run is marked watched before it is read, and
its final commit's NOTIFY wakes every wait on it; a re-read now and then covers a lost
notification."""

from __future__ import annotations

import anyio
import asyncpg

from orchestrator.client.wakeups import RunWakeups
from orchestrator.db.connections import connect, resolve_dsn
from orchestrator.db.notifications import FINISHED_CHANNEL, Listener
from orchestrator.db.store import RunStore
from orchestrator.errors import InvalidInput
from orchestrator.ids import validate_run_id
from orchestrator.models import Run
from orchestrator.settings import Settings

RECHECK_SECONDS = 5.0
"""While waiting, the run is read again this often in case a notification was lost (the
listening connection dropped): a safety net, not the mechanism."""


class RunWaiter:
    """Every wait of one client, sharing one listening connection."""

    def __init__(self, runs: RunStore, settings: Settings) -> None:
        self.runs = runs
        self.settings = settings
        self._finished = RunWakeups()
        # Opened by the first wait, and again by a wait that finds it lost (no task of its
        # own: a client has no task group, and a wait's re-read covers the gap). Listening
        # anew, every wait reads its run again: whatever ended meanwhile was missed.
        self._listener = Listener(
            (FINISHED_CHANNEL,),
            self._finished.wake,
            connect=self._connect_listener,
            on_listening=self._finished.wake_all,
        )

    async def wait(self, run_id: str, *, within: float) -> Run:
        """The run once it has ended; ``TimeoutError`` if it has not within ``within`` s."""
        validate_run_id(run_id)
        if not within > 0:
            raise InvalidInput("wait timeout must be above 0 seconds")
        await self._listener.listen()
        with self._finished.waiting(run_id) as event:
            # Watched before it is read: a final commit after the read will notify.
            await self.runs.watch(run_id)
            with anyio.fail_after(within):
                while True:
                    run = await self.runs.get(run_id)
                    if run.state.terminal:
                        return run
                    with anyio.move_on_after(RECHECK_SECONDS):
                        await event.wait()
                    event.clear()
                    await self._listener.listen()  # at once if it still listens

    async def close(self) -> None:
        await self._listener.close()

    async def _connect_listener(self) -> asyncpg.Connection:
        return await connect(
            self.settings, dsn=resolve_dsn(self.settings), application_name="orchestrator-wait"
        )
