"""``--require-sync-standby``: run only while no commit a client saw can be lost by a failover.

With a synchronous standby listed in ``synchronous_standby_names`` and ``synchronous_commit`` at
``on`` (or ``remote_apply``), PostgreSQL answers a commit only once the standby has it, so a
promoted standby holds every transaction orchestrator acted on (the one exception, a cancelled
wait, is refused by ``GuardedConnection``). In that mode even a vendor that cannot be looked up
(SMTP) gets an effect once through a failover (docs/high-availability.md). The requirement is
checked at start (the process refuses to start) and then every few seconds: while it fails, the
process reports not ready and its dispatcher sends nothing.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import structlog

from orchestrator.db.rechecks import Rechecked
from orchestrator.errors import OrchestratorError

if TYPE_CHECKING:
    from orchestrator.db.executor import Executor

log = structlog.get_logger("orchestrator.sync_standby")

RECHECK_SECONDS = 5.0
"""How stale the last answer may be before a dispatcher asks again (a losing standby is noticed
within about this long; commits meanwhile wait for it, they are not lost)."""

DURABLE_COMMIT_LEVELS = frozenset({"on", "remote_apply"})

_SETTINGS = """
SELECT pg_is_in_recovery() AS standby,
       current_setting('synchronous_standby_names') AS standby_names,
       current_setting('synchronous_commit') AS commit_level
"""


class SyncStandbyMissing(OrchestratorError):
    """``--require-sync-standby`` was given and the primary does not replicate synchronously."""


async def sync_standby_problem(db: Executor) -> str | None:
    """What keeps this session's commits from being synchronously replicated, or ``None``."""
    row = await db.fetchrow(_SETTINGS)
    assert row is not None
    if row["standby"]:
        return (
            "the server is a standby: connect to the primary (a multi-host URL with "
            "target_session_attrs=primary finds it)"
        )
    if not str(row["standby_names"]).strip():
        return (
            "the primary has no synchronous standby (synchronous_standby_names is empty): "
            "list one (Patroni: synchronous_mode: true), or run without --require-sync-standby"
        )
    level = str(row["commit_level"])
    if level not in DURABLE_COMMIT_LEVELS:
        return (
            f"synchronous_commit is {level!r} for orchestrator's sessions: it must be 'on' or "
            "'remote_apply' (ALTER ROLE ... SET synchronous_commit = on)"
        )
    return None


class SyncStandbyRequirement(Rechecked):
    """The requirement as one process holds it: checked at start, then re-checked when stale."""

    def __init__(self, required: bool, *, recheck_seconds: float = RECHECK_SECONDS) -> None:
        self.required = required
        self.recheck_seconds = recheck_seconds
        self.problem: str | None = None
        self._checked_at: float | None = None

    async def require_at_start(self, db: Executor) -> None:
        """Raise ``SyncStandbyMissing`` (the process must not start) if the requirement fails."""
        if not self.required:
            return
        problem = await self.check(db)
        if problem is not None:
            raise SyncStandbyMissing(f"--require-sync-standby: {problem}")

    async def check(self, db: Executor) -> str | None:
        """Ask the server now; log when the answer changes."""
        if not self.required:
            return None
        problem = await sync_standby_problem(db)
        if problem != self.problem:
            if problem is None:
                log.info("synchronous standby requirement met again")
            else:
                log.error("synchronous standby requirement not met", problem=problem)
        self.problem, self._checked_at = problem, time.monotonic()
        return problem

    async def satisfied(self, db: Executor) -> bool:
        """Whether it holds, asking the server only when the last answer is stale."""
        if not self.required:
            return True
        return await self.current_problem(db) is None
