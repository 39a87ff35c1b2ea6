"""``orchestrator.Client``: what an application uses to start runs and talk to them.

Submit a run (an idempotency key makes a retried request safe), read it, wait for its result
(woken by NOTIFY when its final statement commits, never by busy polling), cancel it, send it a
signal, and record a person's decision on an effect that awaits approval::

    async with await Client.connect() as client:
        run = await client.submit("support", {"message": "refund order 42"}, idempotency_key=k)
        done = await client.wait(run.run_id, within=60)

``SyncClient`` offers the same from synchronous code (a WSGI handler, a script): it runs one
``Client`` on an event loop of its own thread. See docs/client.md for a web handler.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import functools
import threading
from collections.abc import Awaitable, Callable, Coroutine
from concurrent.futures import Future
from datetime import datetime, timedelta
from decimal import Decimal
from types import TracebackType
from typing import Any, ParamSpec, TypeVar

import anyio
import anyio.from_thread
import asyncpg

from orchestrator.budgets import BudgetState, BudgetStore
from orchestrator.db.bootstrap import ensure_schema
from orchestrator.db.connections import (
    DRIVER_ERRORS,
    connect,
    create_pool,
    database_failed,
    resolve_dsn,
)
from orchestrator.db.notifications import FINISHED_CHANNEL, Listener
from orchestrator.db.store import RunStore
from orchestrator.effects.approvals import ApprovalStore, Decision
from orchestrator.effects.model import EffectRecord
from orchestrator.errors import InvalidInput
from orchestrator.ids import validate_run_id
from orchestrator.models import JSON, Run
from orchestrator.settings import Settings
from orchestrator.signals import Signal, SignalStore

MAX_DELAY_SECONDS = 10 * 366 * 86400.0
CLOSE_AT_EXIT_SECONDS = 5.0
"""How long ``SyncClient`` waits for its connections to close politely at exit."""
RECHECK_SECONDS = 5.0
"""While waiting, the run is read again this often in case a notification was lost (the
listening connection dropped): a safety net, not the mechanism."""


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


P = ParamSpec("P")
T = TypeVar("T")


def _project_errors(method: Callable[P, Awaitable[T]]) -> Callable[P, Coroutine[Any, Any, T]]:
    """No driver exception reaches a caller: each becomes a ``DatabaseError`` (its cause kept).
    ``TimeoutError`` passes as it is: ``wait`` raises it by contract."""

    @functools.wraps(method)
    async def translated(*args: P.args, **kwargs: P.kwargs) -> T:
        try:
            return await method(*args, **kwargs)
        except TimeoutError:
            raise
        except DRIVER_ERRORS as error:
            raise database_failed(error) from error

    return translated


class Client:
    """An application's handle on orchestrator (async). Create with ``await Client.connect()``."""

    def __init__(self, pool: asyncpg.Pool, settings: Settings) -> None:
        self.pool = pool
        self.settings = settings
        self.store = RunStore(pool, max_input_bytes=settings.max_input_bytes)
        self._finished: dict[str, set[asyncio.Event]] = {}
        # Opened by the first wait, and again by a wait that finds it lost (no task of its
        # own: a client has no task group, and a wait's re-read covers the gap).
        self._listener = Listener(
            (FINISHED_CHANNEL,),
            self._on_finished,
            connect=self._connect_listener,
            on_listening=self._recheck_all,
        )

    @classmethod
    @_project_errors
    async def connect(
        cls, settings: Settings | None = None, *, max_connections: int = 10
    ) -> Client:
        """Connect to the database ``settings`` names (default: the environment's). The schema
        must be current (the embedded default is migrated on first use)."""
        settings = settings or Settings.from_env()
        dsn = resolve_dsn(settings)
        await ensure_schema(settings, dsn, auto_migrate=settings.database_url is None)
        pool = await create_pool(
            settings,
            dsn=dsn,
            application_name="orchestrator-client",
            min_size=1,
            max_size=max_connections,
        )
        return cls(pool, settings)

    @_project_errors
    async def close(self) -> None:
        await self._listener.close()
        await self.pool.close()

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    # -- runs -----------------------------------------------------------------------------------
    @_project_errors
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
        not_before = await self._start_time(at, delay_seconds)
        submission = await self.store.submit(
            agent,
            input,
            run_id=run_id,
            idempotency_key=idempotency_key,
            max_attempts=max_attempts,
            not_before=not_before,
        )
        return submission.run

    @_project_errors
    async def get(self, run_id: str) -> Run:
        return await self.store.get(run_id)

    @_project_errors
    async def wait(self, run_id: str, *, within: float) -> Run:
        """The run once it has ended (succeeded, failed, cancelled or dead); ``TimeoutError``
        if it has not within ``within`` seconds. Woken by the run's final commit."""
        validate_run_id(run_id)
        if not within > 0:
            raise InvalidInput("wait timeout must be above 0 seconds")
        await self._listener.listen()
        event = asyncio.Event()
        self._finished.setdefault(run_id, set()).add(event)
        try:
            # Watched before it is read: a final commit after the read will notify.
            await self.store.watch(run_id)
            with anyio.fail_after(within):
                while True:
                    run = await self.store.get(run_id)
                    if run.state.terminal:
                        return run
                    with anyio.move_on_after(RECHECK_SECONDS):
                        await event.wait()
                    event.clear()
                    await self._listener.listen()  # at once if it still listens
        finally:
            waiting = self._finished.get(run_id)
            if waiting is not None:
                waiting.discard(event)
                if not waiting:
                    del self._finished[run_id]

    @_project_errors
    async def cancel(self, run_id: str, *, reason: str | None = None) -> Run:
        return await self.store.cancel(run_id, reason=reason)

    # -- signals and approvals ------------------------------------------------------------------
    @_project_errors
    async def signal(
        self, run_id: str, name: str, data: JSON = None, *, idempotency_key: str | None = None
    ) -> Signal:
        """Send ``run_id`` a signal (stored durably; the same key twice is one signal)."""
        return (
            await SignalStore(self.pool).send(run_id, name, data, idempotency_key=idempotency_key)
        ).signal

    @_project_errors
    async def approvals(self, *, run_id: str | None = None, limit: int = 100) -> list[EffectRecord]:
        """Effects awaiting a person's decision, oldest first."""
        return await ApprovalStore(self.pool).pending(run_id=run_id, limit=limit)

    @_project_errors
    async def approve(
        self,
        run_id: str,
        effect_key: str,
        *,
        by: str,
        payload_sha256: str,
        note: str | None = None,
        run_fence: int | None = None,
    ) -> EffectRecord:
        """Approve the payload the person saw (its ``payload_sha256``); refused if it changed."""
        return await ApprovalStore(self.pool).decide(
            run_id,
            effect_key,
            Decision.APPROVED,
            by=by,
            note=note,
            payload_sha256=payload_sha256,
            run_fence=run_fence,
        )

    @_project_errors
    async def deny(
        self,
        run_id: str,
        effect_key: str,
        *,
        by: str,
        note: str | None = None,
        payload_sha256: str | None = None,
        run_fence: int | None = None,
    ) -> EffectRecord:
        """Deny it; the model is told "denied by reviewer: NOTE"."""
        return await ApprovalStore(self.pool).decide(
            run_id,
            effect_key,
            Decision.DENIED,
            by=by,
            note=note,
            payload_sha256=payload_sha256,
            run_fence=run_fence,
        )

    # -- budgets --------------------------------------------------------------------------------
    @_project_errors
    async def budget(self, run_id: str) -> BudgetState | None:
        return await BudgetStore(self.pool).get(run_id)

    @_project_errors
    async def top_up(self, run_id: str, **added: int | Decimal | float | str) -> BudgetState:
        """Raise a run's budget (``cost_usd=``, ``turns=``, ...) and wake it if it waits."""
        return await BudgetStore(self.pool).top_up(run_id, **added)  # type: ignore[arg-type]

    # -- internals ------------------------------------------------------------------------------
    async def _start_time(self, at: datetime | None, delay: float | None) -> datetime | None:
        if at is None and delay is None:
            return None
        return start_time(await self.store.database_now(), at, delay)

    async def _connect_listener(self) -> asyncpg.Connection:
        return await connect(
            self.settings, dsn=resolve_dsn(self.settings), application_name="orchestrator-wait"
        )

    def _recheck_all(self) -> None:
        """Listening anew: whatever ended while not listening was missed, so every wait reads
        its run again."""
        for events in self._finished.values():
            for event in events:
                event.set()

    def _on_finished(self, channel: str, run_id: str) -> None:
        for event in self._finished.get(run_id, ()):
            event.set()


class SyncClient:
    """``Client`` for synchronous code: the same methods, blocking, safe from many threads.

    Use it as ``with SyncClient() as client:``, or call ``close()``. One left open does not
    keep the interpreter from exiting: its event loop runs on a daemon thread, and it is closed
    (within a few seconds) at exit.
    """

    def __init__(self, settings: Settings | None = None, *, max_connections: int = 10) -> None:
        self._portal, self._thread = _portal_thread()
        self._closed = False
        try:
            self._client = self._portal.call(
                lambda: Client.connect(settings, max_connections=max_connections)
            )
        except BaseException:
            self._stop()
            raise
        atexit.register(self._close_at_exit)

    def _call(self, method: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return self._portal.call(lambda: method(*args, **kwargs))

    def submit(self, agent: str, input: JSON, **options: Any) -> Run:
        result: Run = self._call(self._client.submit, agent, input, **options)
        return result

    def get(self, run_id: str) -> Run:
        result: Run = self._call(self._client.get, run_id)
        return result

    def wait(self, run_id: str, *, within: float) -> Run:
        result: Run = self._call(self._client.wait, run_id, within=within)
        return result

    def cancel(self, run_id: str, *, reason: str | None = None) -> Run:
        result: Run = self._call(self._client.cancel, run_id, reason=reason)
        return result

    def signal(self, run_id: str, name: str, data: JSON = None, **options: Any) -> Signal:
        result: Signal = self._call(self._client.signal, run_id, name, data, **options)
        return result

    def approvals(self, **options: Any) -> list[EffectRecord]:
        result: list[EffectRecord] = self._call(self._client.approvals, **options)
        return result

    def approve(self, run_id: str, effect_key: str, **options: Any) -> EffectRecord:
        result: EffectRecord = self._call(self._client.approve, run_id, effect_key, **options)
        return result

    def deny(self, run_id: str, effect_key: str, **options: Any) -> EffectRecord:
        result: EffectRecord = self._call(self._client.deny, run_id, effect_key, **options)
        return result

    def budget(self, run_id: str) -> BudgetState | None:
        result: BudgetState | None = self._call(self._client.budget, run_id)
        return result

    def top_up(self, run_id: str, **added: Any) -> BudgetState:
        result: BudgetState = self._call(self._client.top_up, run_id, **added)
        return result

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self._close_at_exit)
        try:
            self._portal.call(self._client.close)
        finally:
            self._stop()

    def _close_at_exit(self) -> None:
        # Bounded: a database gone at exit must not hang the interpreter either.
        if self._closed:
            return
        self._closed = True
        # Exiting anyway: whatever fails here, the server drops the connections.
        with contextlib.suppress(Exception):
            self._portal.start_task_soon(self._client.close).result(CLOSE_AT_EXIT_SECONDS)

    def _stop(self) -> None:
        with contextlib.suppress(RuntimeError):  # the loop has already stopped
            self._portal.call(self._portal.stop, True)
        self._thread.join(CLOSE_AT_EXIT_SECONDS)

    def __enter__(self) -> SyncClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _portal_thread() -> tuple[anyio.from_thread.BlockingPortal, threading.Thread]:
    """An event loop on a daemon thread, and the portal that runs calls on it.

    Not ``anyio.from_thread.start_blocking_portal``: its loop runs in a worker thread the
    interpreter joins at exit, so a client never closed made a script hang there.
    """
    ready: Future[anyio.from_thread.BlockingPortal] = Future()

    async def serve() -> None:
        async with anyio.from_thread.BlockingPortal() as portal:
            ready.set_result(portal)
            await portal.sleep_until_stopped()

    def main() -> None:
        try:
            anyio.run(serve)
        except BaseException as error:
            if not ready.done():
                ready.set_exception(error)
            raise

    thread = threading.Thread(target=main, name="orchestrator-sync-client", daemon=True)
    thread.start()
    return ready.result(), thread


__all__ = ["Client", "SyncClient"]
