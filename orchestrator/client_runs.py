"""``client.runs``: submitting runs, reading them, waiting for their end and cancelling them."""

from __future__ import annotations

import builtins
from collections.abc import Sequence
from datetime import datetime, timedelta

from orchestrator.db.error_projection import project_errors
from orchestrator.db.stores import Stores
from orchestrator.errors import InvalidInput
from orchestrator.models import JSON, Run, RunState
from orchestrator.run_detail import DEFAULT_EVENTS, RunDetail, load_run_detail
from orchestrator.run_waiter import RunWaiter

MAX_DELAY_SECONDS = 10 * 366 * 86400.0


def start_time(now: datetime, at: datetime | None, delay: float | None) -> datetime | None:
    """When a run submitted ``now`` (the database's clock) is due: ``at``, or ``delay`` seconds
    on, within ten years of now either way (further is a typo, and past what dates hold). A
    time in the past is allowed: the run is due at once."""
    if at is not None and delay is not None:
        raise InvalidInput("give a start time or a delay, not both")
    if delay is not None:
        if not 0 <= delay <= MAX_DELAY_SECONDS:  # NaN fails this too
            raise InvalidInput(f"a delay is 0 or more seconds, at most ten years, not {delay!r}")
        return now + timedelta(seconds=delay)
    if at is not None:
        if not isinstance(at, datetime) or at.utcoffset() is None:
            raise InvalidInput("a run's start time must be timezone-aware (e.g. 2026-12-24T09:00Z)")
        if abs((at - now).total_seconds()) > MAX_DELAY_SECONDS:
            raise InvalidInput(f"a start time is at most ten years from now, not {at.isoformat()}")
    return at


class RunsHandle:
    """Runs: submit, get, list, wait, cancel, and the whole of one run (``detail``)."""

    def __init__(self, stores: Stores, waiter: RunWaiter) -> None:
        self._stores = stores
        self._waiter = waiter

    @project_errors
    async def submit(
        self,
        agent: str,
        input: JSON,
        *,
        idempotency_key: str | None = None,
        run_id: str | None = None,
        max_attempts: int = 5,
        at: datetime | None = None,
        delay_seconds: float | None = None,
    ) -> Run:
        """Queue a run of ``agent``, due now, ``at`` a time or after ``delay_seconds``. The same
        idempotency key returns the run it first created."""
        runs = self._stores.runs
        not_before = None
        if at is not None or delay_seconds is not None:
            not_before = start_time(await runs.database_now(), at, delay_seconds)
        submission = await runs.submit(
            agent,
            input,
            run_id=run_id,
            idempotency_key=idempotency_key,
            max_attempts=max_attempts,
            not_before=not_before,
        )
        return submission.run

    @project_errors
    async def get(self, run_id: str) -> Run:
        """The run as it is now; ``RunNotFound`` if there is none."""
        return await self._stores.runs.get(run_id)

    @project_errors
    async def list(
        self,
        *,
        state: RunState | Sequence[RunState] | None = None,
        agent: str | None = None,
        limit: int = 100,
        submitted_after: datetime | None = None,
        submitted_before: datetime | None = None,
    ) -> builtins.list[Run]:
        """Runs newest first, filtered by state(s), agent and submission time."""
        return await self._stores.runs.list_runs(
            state=state,
            agent=agent,
            limit=limit,
            submitted_after=submitted_after,
            submitted_before=submitted_before,
        )

    @project_errors
    async def wait(self, run_id: str, *, within: float) -> Run:
        """The run once it has ended (succeeded, failed, cancelled or dead); ``TimeoutError``
        if it has not within ``within`` seconds. Woken by the run's final commit."""
        return await self._waiter.wait(run_id, within=within)

    @project_errors
    async def cancel(self, run_id: str, *, reason: str | None = None) -> Run:
        """Cancel an unfinished run and raise its fence, so its owner can no longer act."""
        return await self._stores.runs.cancel(run_id, reason=reason)

    @project_errors
    async def detail(self, run_id: str, *, events: int = DEFAULT_EVENTS) -> RunDetail:
        """Everything ``runs show`` and the console's run page show of one run (the newest
        ``events`` timeline events, attempts, transcript, effects, signals, budget)."""
        return await load_run_detail(self._stores, run_id, events=events)
