"""Database calls with deadlines, for the runtime.

Every database await in the runtime is bounded. When a bound is hit the connection is aborted
(``terminate()``: the socket is closed at once), never closed politely: a polite close on a
black-holed network waits for an answer that will not come.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, AsyncExitStack, asynccontextmanager
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
import asyncpg

from orchestrator.db.connections import connect
from orchestrator.errors import DatabaseUnavailable
from orchestrator.settings import Settings

if TYPE_CHECKING:
    from asyncpg.pool import PoolConnectionProxy

T = TypeVar("T")

DATABASE_ERRORS: tuple[type[BaseException], ...] = (
    DatabaseUnavailable,
    OSError,
    TimeoutError,
    asyncpg.PostgresError,
    asyncpg.InterfaceError,
    asyncpg.InternalClientError,
)
"""What a lost, slow or restarting database raises; the runtime survives all of them.

``InternalClientError`` ("cannot switch to state 15; another operation (2) is in progress"):
a connection whose server went away mid-statement is still consuming that error when the next
statement is sent. Seen once from the listener's keep-alive during a Postgres restart, where it
took the whole worker down; the connection is discarded like any other broken one.
"""


class DedicatedConnection:
    """One long-lived connection (heartbeat, reaper), reconnected on demand."""

    def __init__(self, settings: Settings, dsn: str, application_name: str) -> None:
        self._settings = settings
        self._dsn = dsn
        self._application_name = application_name
        self._connection: asyncpg.Connection | None = None
        self._lock = anyio.Lock()

    async def call(
        self, function: Callable[[asyncpg.Connection], Awaitable[T]], *, within: float
    ) -> T:
        """Run ``function`` on the connection within ``within`` seconds, or abort it.

        Callers take turns (one statement at a time on a connection); the wait for a turn
        counts against the deadline, but only the caller holding the connection aborts it.
        """
        with anyio.fail_after(within):
            async with self._lock:
                try:
                    if self._connection is None or self._connection.is_closed():
                        self._connection = await connect(
                            self._settings, dsn=self._dsn, application_name=self._application_name
                        )
                    return await function(self._connection)
                except BaseException:
                    self.abort()
                    raise

    def abort(self) -> None:
        if self._connection is not None:
            self._connection.terminate()
            self._connection = None

    async def close(self) -> None:
        connection, self._connection = self._connection, None
        if connection is None:
            return
        with anyio.move_on_after(2, shield=True) as scope:
            await connection.close()
        if scope.cancelled_caught:
            connection.terminate()


@asynccontextmanager
async def pooled(
    pool: asyncpg.Pool, *, within: float
) -> AsyncIterator[PoolConnectionProxy[asyncpg.Record]]:
    """A pool connection for at most ``within`` seconds; aborted on overrun, error or cancel."""
    with anyio.fail_after(within):
        connection = await pool.acquire()
    try:
        with anyio.fail_after(within):
            yield connection
    except BaseException:
        connection.terminate()
        raise
    finally:
        # Releasing a terminated connection returns at once; a healthy one resets quickly.
        with anyio.move_on_after(2, shield=True) as scope:
            await pool.release(connection)
        if scope.cancelled_caught:
            connection.terminate()


async def enter_when_reachable(
    stack: AsyncExitStack,
    opening: Callable[[], AbstractAsyncContextManager[T]],
    *,
    within: float,
    log: Any,
) -> T:
    """Enter ``opening()`` on ``stack``, trying again while PostgreSQL is unreachable, for up to
    ``within`` seconds (0: once), so that a process started during a database restart or
    failover comes up when the database does. Each retry is logged with the reason."""
    began = anyio.current_time()
    delay = 0.25
    while True:
        try:
            return await stack.enter_async_context(opening())
        except DATABASE_ERRORS as error:
            waited = anyio.current_time() - began
            if waited + delay > within:
                raise
            log.warning(
                "database unavailable at start; retrying",
                error=str(error) or type(error).__name__,
                retry_in=delay,
                gives_up_in=round(within - waited, 1),
            )
            await anyio.sleep(delay)
            delay = min(delay * 2, 5.0)
