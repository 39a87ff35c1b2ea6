"""A condition of the database that a process holds and looks at again once its last look is
stale: the synchronous standby requirement, and the dispatcher's view of its standbys."""

from __future__ import annotations

import time

from orchestrator.db.executor import Executor


class Rechecked:
    """Subclasses set ``recheck_seconds``, ``problem`` and ``_checked_at`` (``check`` sets the
    last two) and implement ``check``."""

    recheck_seconds: float
    problem: str | None
    _checked_at: float | None

    async def check(self, db: Executor) -> str | None:
        """Look now: the problem, or ``None`` when the condition holds."""
        raise NotImplementedError

    async def current_problem(self, db: Executor) -> str | None:
        """The problem, asking the server only when the last answer is stale."""
        checked = self._checked_at
        if checked is None or time.monotonic() - checked >= self.recheck_seconds:
            await self.check(db)
        return self.problem
