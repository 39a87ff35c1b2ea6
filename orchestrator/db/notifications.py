"""LISTEN/NOTIFY in one place: the name of every channel, and the one listener that hears them.

A notification is a wake-up, never the news itself: whoever listens re-reads the database, and
polls too, so a notification missed while its listener was reconnecting costs latency, never
correctness. Every ``pg_notify`` in ``sql/`` names one of the channels below
(tests/test_notifications.py checks).
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable, Iterable
from typing import Final, TypeAlias

import anyio
import asyncpg
from anyio.abc import TaskStatus
from asyncpg.pool import PoolConnectionProxy

from orchestrator.db.deadlines import DATABASE_ERRORS

RUNS_CHANNEL: Final = "orchestrator_runs"
"""Submits, releases, requeues, expiries and wakes of waiting runs send the agent's name; the
workers of that agent listen, to claim at once."""
CANCEL_CHANNEL: Final = "orchestrator_cancel"
"""A cancel sends the run id; the worker that owns the run listens, to cut its step short."""
FINISHED_CHANNEL: Final = "orchestrator_finished"
"""The final statement of a watched run sends its id; ``Client.wait`` listens."""
SETTLED_CHANNEL: Final = "orchestrator_effects"
"""Settling, resolving or deciding an effect sends its run's id; workers listen, to wake the
step that awaits it (``effects/waiting.py``)."""
DUE_CHANNEL: Final = "orchestrator_effects_due"
"""Accepting (or approving) an effect sends its kind; dispatchers listen, to send it at once."""
SIGNALS_CHANNEL: Final = "orchestrator_signals"
"""Sending a signal sends the run id; the worker that owns the run listens, to give it to the
run's next step."""

OUTPUT_CHANNEL: Final = "orchestrator_output"
"""Appending to a run's live output (or retracting a lost attempt's) sends the run id; stream
readers (``client.runs.stream``, the console, ``runs watch``) listen, to read it at once."""

CHANNELS: Final = frozenset(
    {
        OUTPUT_CHANNEL,
        RUNS_CHANNEL,
        CANCEL_CHANNEL,
        FINISHED_CHANNEL,
        SETTLED_CHANNEL,
        DUE_CHANNEL,
        SIGNALS_CHANNEL,
    }
)
"""Every channel orchestrator sends or listens on."""

Deliver = Callable[[str, str], None]
"""Called with (channel, payload) for each notification, on the event loop: it must not block."""

Listening: TypeAlias = "asyncpg.Connection | PoolConnectionProxy[asyncpg.Record]"
"""A dedicated connection, or one borrowed from a pool."""

RELEASE_SECONDS = 2.0
"""How long a borrowed pool connection may take to UNLISTEN before it is aborted instead."""


class Listener:
    """A connection that LISTENs to a set of channels and hands each notification to ``deliver``.

    The connection is either dedicated (``connect``: opened for it, aborted when dropped) or
    borrowed from ``pool`` (its channels are unlistened before it goes back, so a pool that
    keeps session state does not hand a listening connection to someone else). A long-lived
    owner runs ``run`` in its task group, which reconnects after the connection dies; one that
    listens only while it waits (``Client.wait``) calls ``listen`` when it needs to.
    """

    def __init__(
        self,
        channels: Iterable[str],
        deliver: Deliver,
        *,
        connect: Callable[[], Awaitable[asyncpg.Connection]] | None = None,
        pool: asyncpg.Pool | None = None,
        connect_seconds: float | None = None,
        check_seconds: float = 2.0,
        statement_seconds: float = 10.0,
        retry_seconds: float = 2.0,
        max_retry_seconds: float | None = None,
        on_listening: Callable[[], None] | None = None,
    ) -> None:
        """``connect_seconds``: the deadline for opening and LISTENing (``None``: only the
        driver's own connect timeout). ``run`` checks an idle connection with ``SELECT 1``
        every ``check_seconds`` (within ``statement_seconds``), and after losing it waits
        ``retry_seconds``, doubled after each failed attempt up to ``max_retry_seconds``
        (default: no doubling). ``on_listening`` is called each time a new connection listens:
        what was notified meanwhile was missed, and the owner looks for it."""
        if (connect is None) == (pool is None):
            raise ValueError("a listener needs either connect or pool")
        unknown = set(channels) - CHANNELS
        if unknown:
            raise ValueError(f"unknown channels: {sorted(unknown)}")
        self.channels = tuple(sorted(set(channels)))
        self._deliver = deliver
        self._connect = connect
        self._pool = pool
        self.connect_seconds = connect_seconds
        self.check_seconds = check_seconds
        self.statement_seconds = statement_seconds
        self.retry_seconds = retry_seconds
        self.max_retry_seconds = max(max_retry_seconds or retry_seconds, retry_seconds)
        self._on_listening = on_listening
        self._connection: Listening | None = None
        self._lock = anyio.Lock()

    @property
    def listening(self) -> bool:
        """Whether the connection is open (a dead socket is noticed by the driver or ``run``)."""
        return self._connection is not None and not _closed(self._connection)

    async def listen(self) -> bool:
        """Open the connection and LISTEN, unless it already does; ``True`` if it had to (and
        ``on_listening`` was called). Raises what opening raises."""
        async with self._lock:
            if self.listening:
                return False
            await self._drop(broken=True)
            with anyio.fail_after(self.connect_seconds):
                connection = await self._open()
                try:
                    for channel in self.channels:
                        await connection.add_listener(channel, self._on_notification)
                except BaseException:
                    _abort(connection)
                    await self._give_back(connection)
                    raise
            self._connection = connection
        if self._on_listening is not None:
            self._on_listening()
        return True

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Listen until cancelled, checking the connection and reconnecting when it is lost.

        Reports started after its first attempt to listen, whether that succeeded or not: the
        owner does not wait for a database that is down, it polls meanwhile.
        """
        started = False
        delay = self.retry_seconds
        while True:
            broken = False
            try:
                await self.listen()
                delay = self.retry_seconds
                if not started:
                    started = True
                    task_status.started()
                while self.listening:
                    await anyio.sleep(self.check_seconds)
                    connection = self._connection
                    if connection is None:
                        break
                    # Also what finds a black-holed network: its socket would look open.
                    with anyio.fail_after(self.statement_seconds):
                        await connection.execute("SELECT 1")
            except DATABASE_ERRORS:
                broken = True
            finally:
                await self._drop(broken=broken)
            if not started:
                started = True
                task_status.started()
            await anyio.sleep(delay)
            delay = min(delay * 2, self.max_retry_seconds)

    async def close(self) -> None:
        """Stop listening: a dedicated connection is aborted, a borrowed one given back."""
        await self._drop(broken=False)

    async def _open(self) -> Listening:
        if self._connect is not None:
            return await self._connect()
        assert self._pool is not None
        return await self._pool.acquire()

    async def _drop(self, *, broken: bool) -> None:
        """Let go of the connection. Never blocks for long, even when cancelled: a dedicated
        or broken one is aborted; a healthy borrowed one gets ``RELEASE_SECONDS`` to UNLISTEN."""
        connection, self._connection = self._connection, None
        if connection is None or _closed(connection):
            return  # a pool takes back its connection when it closes
        if self._pool is None or broken:
            _abort(connection)
        else:
            try:
                with anyio.move_on_after(RELEASE_SECONDS, shield=True) as scope:
                    for channel in self.channels:
                        await connection.remove_listener(channel, self._on_notification)
            except DATABASE_ERRORS:
                _abort(connection)
            if scope.cancelled_caught:
                _abort(connection)
        await self._give_back(connection)

    async def _give_back(self, connection: Listening) -> None:
        if self._pool is None or not isinstance(connection, PoolConnectionProxy):
            return
        # Releasing a terminated connection returns at once; a healthy one resets quickly.
        with anyio.move_on_after(RELEASE_SECONDS, shield=True) as scope:
            await self._pool.release(connection)
        if scope.cancelled_caught:
            _abort(connection)

    def _on_notification(self, connection: object, pid: int, channel: str, payload: object) -> None:
        self._deliver(channel, str(payload))


def _closed(connection: Listening) -> bool:
    try:
        return connection.is_closed()
    except asyncpg.InterfaceError:  # a pool's connection, released when it closed
        return True


def _abort(connection: Listening) -> None:
    """Close the socket at once (a borrowed connection goes back to its pool, to be replaced)."""
    with contextlib.suppress(asyncpg.InterfaceError):  # already back in its pool
        connection.terminate()


__all__ = [
    "CANCEL_CHANNEL",
    "CHANNELS",
    "DUE_CHANNEL",
    "FINISHED_CHANNEL",
    "OUTPUT_CHANNEL",
    "RUNS_CHANNEL",
    "SETTLED_CHANNEL",
    "SIGNALS_CHANNEL",
    "Deliver",
    "Listener",
]
