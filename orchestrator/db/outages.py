"""One line when PostgreSQL becomes unreachable, one when it is back, per process.

A long-running process (``serve``, ``effects dispatch``, ``effects serve``, ``console``) keeps
retrying its database work while PostgreSQL is down: a restart, a failover, ``orchestrator db
stop``. A warning per retry, from each of its loops, buries everything else in the log, so the
loops of one process share a ``DatabaseOutage``: the first of them to find the database
unreachable logs ``database unavailable; retrying``, the first to reach it again afterwards
``database reachable again``, and every failure in between is logged at debug level. An error
that does not mean the database is unreachable (a statement refused) is not an outage: its loop
logs it as before.
"""

from __future__ import annotations

import time
from typing import Any

import anyio
import asyncpg

from orchestrator.db.deadlines import DATABASE_ERRORS
from orchestrator.errors import DatabaseUnavailable, error_fields

UNREACHABLE: tuple[type[BaseException], ...] = (
    DatabaseUnavailable,
    OSError,  # refused, reset, and TimeoutError: a deadline passed without an answer
    asyncpg.InterfaceError,  # the connection was closed under the statement
    asyncpg.InternalClientError,
    asyncpg.PostgresConnectionError,
    asyncpg.OperatorInterventionError,  # shutting down, starting up, terminated
)
"""What PostgreSQL being down or out of reach raises (see ``DATABASE_ERRORS``)."""

WATCH_SECONDS = 2.0
"""How often ``watch`` asks a process's pool for a connection: a process that only answers
requests (the action proxy, the console) has no loop of its own that would notice an outage."""


class DatabaseOutage:
    """Says once that the database is unreachable and once that it is back, however many of a
    process's loops fail and retry in between."""

    def __init__(self, log: Any) -> None:
        self.log = log
        self._down_since: float | None = None

    @property
    def down(self) -> bool:
        return self._down_since is not None

    def failed(self, error: BaseException, *, otherwise: str) -> None:
        """A loop's database call failed with ``error``: an outage if the database is out of
        reach, else a warning ``otherwise`` (the loop's own words for it)."""
        if not isinstance(error, UNREACHABLE):
            self.log.warning(otherwise, **error_fields(error))
        elif self._down_since is None:
            self._down_since = time.monotonic()
            self.log.warning("database unavailable; retrying", **error_fields(error))
        else:
            self.log.debug(otherwise, **error_fields(error))

    def reached(self) -> None:
        """A loop's database call succeeded: the outage, if there was one, is over."""
        if self._down_since is not None:
            down = time.monotonic() - self._down_since
            self._down_since = None
            self.log.info("database reachable again", unavailable_seconds=round(down, 1))


async def watch(pool: asyncpg.Pool, log: Any) -> None:
    """Ask ``pool`` for an answer every ``WATCH_SECONDS`` and log the outages it meets, until
    cancelled: for a process that only answers requests."""
    outage = DatabaseOutage(log)
    while True:
        try:
            with anyio.fail_after(WATCH_SECONDS):
                await pool.fetchval("SELECT 1")
        except DATABASE_ERRORS as error:
            outage.failed(error, otherwise="the database refused a liveness query")
        else:
            outage.reached()
        await anyio.sleep(WATCH_SECONDS)
