"""The connection class every orchestrator connection uses: no answer that a failover may take
back is ever reported as a success.

With synchronous replication a commit waits for the standby; cancelling that wait (a client
timeout sends PostgreSQL a cancel request) commits the transaction locally, unreplicated, and the
client still receives success, with only a WARNING to tell. A failover then loses what the
client acted on (docs/high-availability.md). So this connection never asks the server to cancel:
a statement given up on by the client aborts the connection instead (an honest unknown outcome),
and a statement answered together with that warning raises ``OutcomeUnknown``. A statement
refused because the server is read-only (a standby, or a primary demoted by a failover) aborts
the connection too, so that a pool reconnects through a multi-host DSN to the new primary.
"""

from __future__ import annotations

import asyncio
from typing import Any

import asyncpg

from orchestrator.errors import OutcomeUnknown

UNREPLICATED_COMMIT_SQLSTATES = frozenset({"01000", "57P01"})
"""The SQLSTATEs of PostgreSQL's "canceling wait for synchronous replication" warnings (a
generic warning, and the one sent when an administrator ends the session). Matched by code,
not by text: message texts follow the server's ``lc_messages``. Orchestrator's own statements
raise no warnings, so any warning with these codes is taken as that one."""


class GuardedConnection(asyncpg.Connection):
    """An ``asyncpg.Connection`` that never sends a cancel request and raises ``OutcomeUnknown``
    for an answer that may not be durable."""

    __slots__ = ("_unreplicated_warning",)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._unreplicated_warning: str | None = None

    # asyncpg has no public hook for either behaviour: both overrides are of private methods,
    # pinned by tests/test_guarded_connection.py against the installed asyncpg.

    async def _cancel(self, waiter: asyncio.Future[None], cancel_waiter: Any = None) -> None:
        """Abort the connection where asyncpg would send PostgreSQL a cancel request."""
        try:
            if not self.is_closed():
                self.terminate()
        finally:
            private: Any = self  # asyncpg's own bookkeeping, which its stubs do not declare
            private._cancellations.discard(asyncio.current_task())
            if not waiter.done():
                waiter.set_result(None)

    def _process_log_message(self, fields: dict[str, str], last_query: str) -> None:
        severity = fields.get("V") or fields.get("S") or ""
        if severity.upper() == "WARNING" and fields.get("C") in UNREPLICATED_COMMIT_SQLSTATES:
            self._unreplicated_warning = fields.get("M") or "a warning from the server"
        base: Any = super()
        base._process_log_message(fields, last_query)

    async def _guard(self, statement: Any) -> Any:
        self._unreplicated_warning = None
        try:
            result = await statement
        except asyncpg.ReadOnlySQLTransactionError:
            self.terminate()
            raise
        warning, self._unreplicated_warning = self._unreplicated_warning, None
        if warning is not None:
            raise OutcomeUnknown(
                f"the server committed this statement without confirming it to a synchronous "
                f"standby ({warning}); a failover may undo it, so nothing acts on its answer"
            )
        return result

    async def execute(self, query: str, *args: Any, **kwargs: Any) -> Any:
        return await self._guard(super().execute(query, *args, **kwargs))

    async def executemany(self, command: str, args: Any, **kwargs: Any) -> Any:
        return await self._guard(super().executemany(command, args, **kwargs))

    async def fetch(self, query: str, *args: Any, **kwargs: Any) -> Any:
        return await self._guard(super().fetch(query, *args, **kwargs))

    async def fetchrow(self, query: str, *args: Any, **kwargs: Any) -> Any:
        return await self._guard(super().fetchrow(query, *args, **kwargs))

    async def fetchval(self, query: str, *args: Any, **kwargs: Any) -> Any:
        return await self._guard(super().fetchval(query, *args, **kwargs))
