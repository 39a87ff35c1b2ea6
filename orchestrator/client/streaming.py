"""Following a run's live output (docs/streaming.md): ``client.runs.stream``, the console's
server-sent events and ``runs watch`` all read it here.

A reader asks for what follows its position, woken by the NOTIFY each append sends (one
listening connection per client) and reading again every ``poll_seconds`` in case a
notification was lost. Positions are gap-free and committed in order, so a reader that resumes
after the last position it saw misses nothing and sees nothing twice. Each read first retracts
what an attempt that lost the run left unfinished, so every reader sees that retraction at the
same position. A publisher's own retraction (a model call that failed midway and was tried
again: ``agent.output.OutputPart``) is read back here as the ``retracted`` event it stands for.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import anyio
import asyncpg

from orchestrator.client.wakeups import RunWakeups
from orchestrator.db.connections import DRIVER_ERRORS, connect, database_failed, resolve_dsn
from orchestrator.db.deadlines import DATABASE_ERRORS
from orchestrator.db.notifications import OUTPUT_CHANNEL, Listener
from orchestrator.db.output import OutputEvent, OutputStore
from orchestrator.db.store import RunStore
from orchestrator.errors import InvalidInput
from orchestrator.ids import validate_run_id
from orchestrator.models import Run
from orchestrator.settings import Settings

POLL_SECONDS = 1.0
"""A reader reads again this often without a notification (a safety net, not the mechanism)."""
PAGE = 500


class OutputFollower:
    """Every stream of one client (or console), sharing one listening connection."""

    def __init__(
        self, runs: RunStore, outputs: OutputStore, settings: Settings | None = None
    ) -> None:
        self.runs = runs
        self.outputs = outputs
        self.settings = settings
        self._waiting = RunWakeups()
        self._stopping = False
        self._listener = Listener(
            (OUTPUT_CHANNEL,),
            self._waiting.wake,
            **({"connect": self._connect} if settings is not None else {"pool": runs.pool}),
            on_listening=self._waiting.wake_all,
        )

    async def stream(
        self,
        run_id: str,
        *,
        after: int = 0,
        until_end: bool = True,
        poll_seconds: float = POLL_SECONDS,
    ) -> AsyncIterator[OutputEvent]:
        """The run's output after position ``after``, as it is published: each event once, in
        order, a retraction where an attempt lost the run. With ``until_end``, it ends once the
        run has ended and everything it published has been read; otherwise the caller stops."""
        validate_run_id(run_id)
        if isinstance(after, bool) or not isinstance(after, int) or after < 0:
            raise InvalidInput(f"a stream position is 0 or more, not {after!r}")
        if not poll_seconds > 0:
            raise InvalidInput("poll_seconds must be above 0")
        with self._waiting.waiting(run_id) as woken:
            await self._listen()
            position = after
            while not self._stopping:  # or with the run (until_end), or when the caller stops
                woken.clear()
                # The state first: a run that has ended publishes nothing after it.
                ended = until_end and (await self._get_run(run_id)).state.terminal
                events = await self._read(run_id, position)
                for event in events:
                    position = event.seq
                    yield event
                if len(events) == PAGE:
                    continue
                if ended:
                    return
                with anyio.move_on_after(poll_seconds):
                    await woken.wait()
                await self._listen()

    def stop(self) -> None:
        """End every stream at its next wake-up (a server shutting down: it waits for them)."""
        self._stopping = True
        self._waiting.wake_all()

    async def close(self) -> None:
        self.stop()
        await self._listener.close()

    async def _read(self, run_id: str, after: int) -> list[OutputEvent]:
        try:
            return await self.outputs.read(run_id, after=after, limit=PAGE)
        except DRIVER_ERRORS as error:
            raise database_failed(error) from error

    async def _get_run(self, run_id: str) -> Run:
        try:
            return await self.runs.get(run_id)
        except DRIVER_ERRORS as error:
            raise database_failed(error) from error

    async def _listen(self) -> None:
        # Polling covers a listener that cannot connect; the next round tries again.
        with contextlib.suppress(*DATABASE_ERRORS):
            await self._listener.listen()

    async def _connect(self) -> asyncpg.Connection:
        assert self.settings is not None
        return await connect(
            self.settings, dsn=resolve_dsn(self.settings), application_name="orchestrator-stream"
        )
