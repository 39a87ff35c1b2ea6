"""``Client`` and ``SyncClient``: what an application uses to start runs and talk to them.

Each feature has a handle: ``client.runs`` (submit, get, list, wait, cancel, detail),
``client.effects``, ``client.approvals``, ``client.signals``, ``client.budgets`` and
``client.ops`` (queue, workers, purging). Submit a run (an idempotency key makes a retried
request safe), then wait for its result (woken by NOTIFY when its final statement commits, never
by busy polling)::

    async with await Client.connect() as client:
        run = await client.runs.submit("support", {"message": "refund order 42"}, idempotency_key=k)
        done = await client.runs.wait(run.run_id, within=60)

The flat methods of earlier releases (``client.submit``, ``get``, ``wait``, ``cancel``,
``signal``, ``approvals``, ``approve``, ``deny``, ``budget``, ``top_up``) still work: each
stands for its handle's method. ``SyncClient`` offers the same from synchronous code (a WSGI
handler, a script): it runs one ``Client`` on an event loop of its own thread. See
docs/client.md for a web handler.
"""

from __future__ import annotations

import atexit
import contextlib
import threading
from concurrent.futures import Future
from types import TracebackType

import anyio
import anyio.from_thread
import asyncpg

from orchestrator.client.delegation import delegate
from orchestrator.client.features import (
    ApprovalsHandle,
    BudgetsHandle,
    EffectsHandle,
    LimitsHandle,
    OpsHandle,
    SignalsHandle,
)
from orchestrator.client.runs import RunsHandle
from orchestrator.client.schedules import SchedulesHandle
from orchestrator.client.stores import Stores
from orchestrator.client.streaming import OutputFollower
from orchestrator.client.sync import (
    SyncApprovals,
    SyncBudgets,
    SyncEffects,
    SyncLimits,
    SyncOps,
    SyncRuns,
    SyncSchedules,
    SyncSignals,
)
from orchestrator.client.waiter import RunWaiter
from orchestrator.db.bootstrap import ensure_schema
from orchestrator.db.connections import create_pool, resolve_dsn
from orchestrator.db.error_projection import project_errors
from orchestrator.settings import Settings

CLOSE_AT_EXIT_SECONDS = 5.0
"""How long ``SyncClient`` waits for its connections to close politely at exit."""


class Client:
    """An application's handle on orchestrator (async). Create with ``await Client.connect()``.

    ``runs``, ``effects``, ``approvals``, ``signals``, ``budgets``, ``limits``, ``schedules`` and
    ``ops`` are its feature handles, all over one set of stores built once. The flat methods
    below are kept for code written before the handles; each stands for the handle method it
    names.
    """

    def __init__(self, pool: asyncpg.Pool, settings: Settings) -> None:
        self.pool = pool
        self.settings = settings
        self.stores = Stores.of(pool, settings)
        self.store = self.stores.runs
        self._waiter = RunWaiter(self.stores.runs, settings)
        self._follower = OutputFollower(self.stores.runs, self.stores.outputs, settings)
        self.runs = RunsHandle(self.stores, self._waiter, self._follower)
        self.effects = EffectsHandle(self.stores)
        self.approvals = ApprovalsHandle(self.stores)
        self.signals = SignalsHandle(self.stores)
        self.budgets = BudgetsHandle(self.stores)
        self.limits = LimitsHandle(self.stores)
        self.schedules = SchedulesHandle(self.stores)
        self.ops = OpsHandle(self.stores)

    @classmethod
    @project_errors
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

    @project_errors
    async def close(self) -> None:
        await self._waiter.close()
        await self._follower.close()
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

    # -- the flat methods of earlier releases (``client.approvals(...)`` calls its handle) ------
    submit = delegate("runs", RunsHandle.submit)
    get = delegate("runs", RunsHandle.get)
    wait = delegate("runs", RunsHandle.wait)
    cancel = delegate("runs", RunsHandle.cancel)
    signal = delegate("signals", SignalsHandle.send)
    approve = delegate("approvals", ApprovalsHandle.approve)
    deny = delegate("approvals", ApprovalsHandle.deny)
    budget = delegate("budgets", BudgetsHandle.get)
    top_up = delegate("budgets", BudgetsHandle.top_up)


class SyncClient:
    """``Client`` for synchronous code: the same handles and methods, blocking, safe from many
    threads.

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
        client, portal = self._client, self._portal
        self.runs = SyncRuns(client.runs, portal)
        self.effects = SyncEffects(client.effects, portal)
        self.approvals = SyncApprovals(client.approvals, portal)
        self.signals = SyncSignals(client.signals, portal)
        self.budgets = SyncBudgets(client.budgets, portal)
        self.limits = SyncLimits(client.limits, portal)
        self.schedules = SyncSchedules(client.schedules, portal)
        self.ops = SyncOps(client.ops, portal)

    # -- the flat methods of earlier releases (``client.approvals(...)`` calls its handle) ------
    submit = delegate("runs", SyncRuns.submit)
    get = delegate("runs", SyncRuns.get)
    wait = delegate("runs", SyncRuns.wait)
    cancel = delegate("runs", SyncRuns.cancel)
    signal = delegate("signals", SyncSignals.send)
    approve = delegate("approvals", SyncApprovals.approve)
    deny = delegate("approvals", SyncApprovals.deny)
    budget = delegate("budgets", SyncBudgets.get)
    top_up = delegate("budgets", SyncBudgets.top_up)

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
