"""A worker's proof of life for dead-session takeover, kept up for as long as the worker runs.

The proof is a session-level advisory lock held on a dedicated connection, plus the worker's
row in ``workers`` naming the lock. PostgreSQL frees the lock the moment the session ends, so a
killed worker is known dead within a reaper's interval. But a session also ends when the server
restarts or the connection is cut while the worker lives on: then its lock is gone too, and the
worker must take a new one and register again, or no reaper could ever tell it died later. This
task checks the session every interval and re-establishes both as soon as it can.

A check that goes unanswered does not end the session it checked: the worker keeps that
connection open until a new session is registered. Ending it would free the lock, and any
reaper would then end this worker's leases at once, while it still runs their steps up to their
local deadlines; a worker cut off from PostgreSQL (answers dropped, a partition) would have
handed its runs over while still working on them. Kept open, the session lives as long as the
server can still see it, and the leases are honoured until they expire.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import KW_ONLY, dataclass, field

import anyio
import asyncpg
import structlog

from orchestrator.db.connections import connect
from orchestrator.db.deadlines import DATABASE_ERRORS
from orchestrator.db.store import WorkerRegistry
from orchestrator.settings import Settings
from orchestrator.telemetry import WORKER_ID

log = structlog.get_logger("orchestrator.liveness")

_REGISTRATION_ERRORS: tuple[type[BaseException], ...] = (*DATABASE_ERRORS, RuntimeError)
"""A database still down, or (RuntimeError) a lock key another session holds: try again."""


@dataclass(eq=False)
class Liveness:
    """``register()`` once before serving, then ``run()`` in the worker's task group."""

    settings: Settings
    dsn: str
    worker_id: str
    agents: Sequence[str]
    _: KW_ONLY
    versions: Mapping[str, Sequence[str]] | None = None
    """Per agent, its version and those it upgrades from (docs/upgrades.md), recorded with the
    worker."""
    check_seconds: float
    statement_seconds: float
    session_key: int | None = field(default=None, init=False)
    registrations: int = field(default=0, init=False)
    """How many times this worker has registered (more than one: its session was lost)."""
    _registry: WorkerRegistry = field(init=False, repr=False)
    _connection: asyncpg.Connection | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self._registry = WorkerRegistry(self.settings.schema)

    async def register(self) -> None:
        """Take a fresh liveness lock and record the worker (raises if the database is down);
        only then end the session it replaces, so that the worker always holds one."""
        with anyio.fail_after(self.statement_seconds):
            connection = await connect(
                self.settings, dsn=self.dsn, application_name=self.worker_id + ":liveness"
            )
            try:
                self.session_key = await self._registry.register(
                    connection,
                    worker_id=self.worker_id,
                    host=socket.gethostname(),
                    pid=os.getpid(),
                    agents=list(self.agents),
                    versions=self.versions,
                )
            except BaseException:
                connection.terminate()
                raise
        self._drop()
        self._connection = connection
        self.registrations += 1

    async def run(self, registered_again: Callable[[], Awaitable[None]] | None = None) -> None:
        """Check the session every interval; when it is gone or does not answer, register a new
        one until that works (the old one is kept open until then), then call
        ``registered_again``."""
        while True:
            await anyio.sleep(self.check_seconds)
            if await self._alive():
                continue
            # Not dropped: a session unanswered may still be alive (see the module's docstring).
            log.warning(
                "liveness session unconfirmed; registering a new one",
                **{WORKER_ID: self.worker_id},
            )
            while True:
                try:
                    await self.register()
                except _REGISTRATION_ERRORS as error:
                    log.debug("cannot register yet", error=str(error) or type(error).__name__)
                    await anyio.sleep(self.check_seconds)
                    continue
                log.info(
                    "liveness re-established",
                    session_key=self.session_key,
                    **{WORKER_ID: self.worker_id},
                )
                break
            if registered_again is not None:
                await registered_again()

    async def _alive(self) -> bool:
        connection = self._connection
        if connection is None or connection.is_closed():
            return False
        try:
            with anyio.fail_after(self.statement_seconds):
                # Waited for, never cancelled: a statement given up on aborts its connection
                # (``GuardedConnection``), which would end the very session being checked.
                await asyncio.shield(connection.execute("SELECT 1"))
        except DATABASE_ERRORS:
            return False
        return True

    def _drop(self) -> None:
        if self._connection is not None:
            self._connection.terminate()
            self._connection = None

    async def close(self) -> None:
        """Unregister (a clean stop is not a death) and end the session, bounded."""
        with anyio.move_on_after(5, shield=True):
            connection = self._connection
            if connection is not None and not connection.is_closed():
                with contextlib.suppress(*DATABASE_ERRORS):
                    await self._registry.unregister(connection, self.worker_id)
        self._drop()
