"""``client.runs``: submitting runs, reading them, waiting for their end and cancelling them."""

from __future__ import annotations

import builtins
from collections.abc import AsyncIterator
from datetime import datetime, timedelta
from typing import Unpack

from orchestrator.client.detail import DEFAULT_EVENTS, RunDetail, load_run_detail
from orchestrator.client.features import StoresHandle
from orchestrator.client.stores import Stores
from orchestrator.client.streaming import OutputFollower
from orchestrator.client.waiter import RunWaiter
from orchestrator.db.error_projection import project_errors
from orchestrator.db.forks import Fork
from orchestrator.db.output import OutputEvent
from orchestrator.db.run_reads import RunFilters
from orchestrator.db.standby_wait import acknowledgement_seconds
from orchestrator.db.store import SubmitOptions
from orchestrator.errors import InvalidInput
from orchestrator.models import JSON, Run

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


class RunsHandle(StoresHandle):
    """Runs: submit, get, list, wait, cancel, and the whole of one run (``detail``)."""

    def __init__(
        self, stores: Stores, waiter: RunWaiter, follower: OutputFollower | None = None
    ) -> None:
        super().__init__(stores)
        self._waiter = waiter
        self._follower = follower or OutputFollower(stores.runs, stores.outputs)

    @project_errors
    async def submit(
        self,
        agent: str,
        input: JSON,
        *,
        at: datetime | None = None,
        delay_seconds: float | None = None,
        wait_for_standby: bool | float | None = False,
        **options: Unpack[SubmitOptions],
    ) -> Run:
        """Queue a run of ``agent``, due now, ``at`` a time or after ``delay_seconds``
        (``idempotency_key=``, ``run_id=``, ``max_attempts=``, ``concurrency_key=``,
        ``priority=`` as ``RunStore.submit`` takes them; the last two: docs/flow-control.md).
        The same idempotency key returns the run it first created.

        ``wait_for_standby``: return only once a streaming standby holds the run, so that a
        failover cannot lose a run its caller was told of (``StandbyNotReached`` if none does
        within 30 s, or as many seconds as given; the run stands on the primary). Off by
        default: an asynchronous standby may lack the last runs submitted when the primary
        dies."""
        within = acknowledgement_seconds(wait_for_standby)
        runs = self._stores.runs
        not_before = None
        if at is not None or delay_seconds is not None:
            not_before = start_time(await runs.database_now(), at, delay_seconds)
        run = (await runs.submit(agent, input, not_before=not_before, **options)).run
        await self._stores.held_by_standby(within)
        return run

    @project_errors
    async def get(self, run_id: str) -> Run:
        """The run as it is now; ``RunNotFound`` if there is none."""
        return await self._stores.runs.get(run_id)

    @project_errors
    async def list(self, **filters: Unpack[RunFilters]) -> builtins.list[Run]:
        """Runs newest first, filtered by ``state`` (one or several), ``agent`` and submission
        time (``submitted_after``, ``submitted_before``); at most ``limit`` (100)."""
        return await self._stores.runs.list_runs(**filters)

    @project_errors
    async def wait(self, run_id: str, *, within: float) -> Run:
        """The run once it has ended (succeeded, failed, cancelled or dead); ``TimeoutError``
        if it has not within ``within`` seconds. Woken by the run's final commit."""
        return await self._waiter.wait(run_id, within=within)

    def stream(
        self, run_id: str, *, after: int = 0, until_end: bool = True
    ) -> AsyncIterator[OutputEvent]:
        """The run's live output after position ``after`` (0: from the start), as its steps
        publish it (docs/streaming.md)::

            async for event in client.runs.stream(run_id, after=last_seen):
                last_seen = event.seq

        Each event once, in order, with its position (``seq``), fence, ``kind`` (``text``,
        ``progress``, ``retracted``, ``truncated``) and ``data``. A ``retracted`` event takes
        back the unfinished output of an attempt that lost the run, or the text of a model call
        that failed midway and was tried again (``event.takes_back(e)``). ``SyncClient`` has
        the same as a blocking iterator.
        With ``until_end`` the iteration ends once the run has ended and all it published has
        been read; otherwise it goes on until the caller stops."""
        return self._follower.stream(run_id, after=after, until_end=until_end)

    @project_errors
    async def cancel(self, run_id: str, *, reason: str | None = None) -> Run:
        """Cancel an unfinished run and raise its fence, so its owner can no longer act."""
        return await self._stores.runs.cancel(run_id, reason=reason)

    @project_errors
    async def fork(
        self, run_id: str, *, version: int | None = None, step: str | None = None
    ) -> Fork:
        """A new run from a kept checkpoint of ``run_id`` (0: the start), or the latest from
        which ``step`` ran next, carrying the effects it had confirmed before that point as
        receipts (docs/child-runs.md); audited, ``operate``."""
        return await self._stores.forks.fork(run_id, version=version, step=step)

    @project_errors
    async def detail(self, run_id: str, *, events: int = DEFAULT_EVENTS) -> RunDetail:
        """Everything ``runs show`` and the console's run page show of one run (the newest
        ``events`` timeline events, attempts, transcript, effects, signals, budget)."""
        return await load_run_detail(self._stores, run_id, events=events)
