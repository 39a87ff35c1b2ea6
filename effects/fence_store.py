"""The action proxy's own memory of the highest fence it accepted per run.

Why a store of its own: after a PostgreSQL failover the promoted standby may have lost the old
primary's last transactions, the boundary's ``effect_fences`` high-water mark and the claim that
raised ``runs.fence`` among them. For that database, a worker whose fence had already been
replaced owns the run again, and its effect requests pass the in-database rule. The proxy saw
the newer fence accepted; it keeps that fact where a failover cannot take it back, in a SQLite
file on its own disk (not in the database it fronts), and refuses a lower fence for the run
before the request reaches the database (``fence_regression``, see ``effects/proxy.py``). It is
the second line of defence: fences that never go backwards across a promotion are the first.

The rules, and why:

- A fence is remembered only once the database has *validated* a request under it (the
  boundary found it to be the run's current fence), and *before* the database commits that
  request: the proxy's transaction holds the acceptance open while ``admit`` writes the fence
  durably, then commits. So nothing can act on a request under a new higher fence (no
  dispatcher sees the effect) before the fence is on the proxy's disk, and a forged or
  mistaken fence, which the database refuses, never becomes the remembered one (it would fence
  out the real owner). If ``admit`` fails the transaction rolls back: nothing was recorded.
- ``admit`` is one SQLite transaction begun with ``BEGIN IMMEDIATE`` (the file's write lock, so
  proxy processes sharing the file take turns): read the run's fence; below it, refuse; above
  it, raise it; commit. Check and raise are atomic across threads and processes, and a fence
  only ever rises.
- It is durable before ``admit`` returns: WAL journal, ``synchronous=FULL`` (an fsync of the WAL
  per commit; ``NORMAL`` may lose the last commits in a power cut, which is the very loss this
  guards against). Only a fence above the remembered one writes (once per claim that requests
  effects), or a re-request under the same fence whose entry was last touched over
  ``TOUCH_SECONDS`` ago.
- Waits are bounded: a statement waits at most ``BUSY_TIMEOUT_SECONDS`` for another process's
  write lock, then fails with a message saying so (the proxy answers 503 and rolls back).
- Writes run in a worker thread: a durable write waits for the disk (0.3-0.5 ms on the reference
  machine, far longer on a busy disk) and for the write lock, and the proxy's other requests
  must not wait with it. Reads run on the event loop: a WAL reader waits for no lock and no
  flush (its busy timeout is 0; a busy answer is retried in a thread), and a read (a few µs)
  costs far less than the hop to a thread and back. ``benchmarks/proxy_fences.py`` measures
  both.
- Bounded: an entry untouched for ``retention`` (default 7 days) is forgotten, in batches of
  ``PRUNE_BATCH`` by a background task. A regression comes from a worker that was stale when the
  old primary died, and it acts within a lease or two of the failover, not days later; a run that
  is still busy after a week touches its entry again. So the store holds the runs that requested
  effects in the last week, about 100 bytes each.
- A local disk only: SQLite's locks are unreliable on network file systems. Proxy processes on
  one host may share the file; proxies on different hosts each remember what they accepted, so
  route a run's requests to one proxy (or one host) for the full protection.
"""

from __future__ import annotations

import queue
import sqlite3
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Self, TypeVar

import anyio
import anyio.to_thread

from orchestrator.errors import InvalidInput, OrchestratorError, error_fields

T = TypeVar("T")

DEFAULT_RETENTION = timedelta(days=7)
MIN_RETENTION = timedelta(hours=1)
"""Below this the store would forget a run while a failover's stale workers may still act."""
TOUCH_SECONDS = 3600.0
"""An entry's last-use time is refreshed at most this often by re-requests under its fence."""
PRUNE_BATCH = 500
"""Entries per delete statement: each batch is one short write transaction."""
PRUNE_BATCHES_PER_ROUND = 20
PRUNE_PAUSE_SECONDS = 0.05
"""Between batches: SQLite's busy handler polls, so requests' writes need a real gap to get in."""
PRUNE_INTERVAL_SECONDS = 600.0
BUSY_TIMEOUT_SECONDS = 5.0
"""How long a statement waits for another process holding the file's write lock (the proxy's
database transaction stays open meanwhile, so this bounds how long a run's row is held)."""
THREADS = 4
"""SQLite calls in flight at once (each on its own connection)."""
SCHEMA_VERSION = 1

_RECORD = """
INSERT INTO run_fences (run_id, fence, touched) VALUES (?, ?, ?)
ON CONFLICT (run_id) DO UPDATE
SET fence = max(fence, excluded.fence), touched = max(touched, excluded.touched)
"""
_READ = "SELECT fence, touched FROM run_fences WHERE run_id = ?"
_PRUNE = """
DELETE FROM run_fences WHERE run_id IN (
    SELECT run_id FROM run_fences WHERE touched < ? ORDER BY touched LIMIT ?
)
"""


class FenceStoreUnavailable(OrchestratorError):
    """The fence store's file could not be read or written while serving (a full or failing
    disk): the proxy answers 503, since it can no longer tell a regression."""


@dataclass(frozen=True)
class Remembered:
    """What the store holds for one run."""

    fence: int
    """The highest fence the proxy saw the database accept for the run."""
    touched: float
    """When a request last raised or refreshed it (Unix time): what retention counts from."""


def _read(connection: sqlite3.Connection, run_id: str) -> Remembered | None:
    row = connection.execute(_READ, (run_id,)).fetchone()
    return None if row is None else Remembered(int(row[0]), float(row[1]))


def check_retention(retention: timedelta, what: str = "--fence-store-retention") -> timedelta:
    if retention < MIN_RETENTION:
        raise InvalidInput(
            f"{what} must be at least 1h: a failover's stale workers may act for minutes after "
            "it, and a forgotten run's regression is no longer caught"
        )
    return retention


class FenceStore:
    """The highest accepted fence per run, in a SQLite file. ``open`` it, then use it from the
    event loop; ``close`` it once nothing uses it."""

    def __init__(
        self,
        path: Path,
        *,
        retention: timedelta = DEFAULT_RETENTION,
        clock: Callable[[], float] = time.time,
        busy_timeout: float = BUSY_TIMEOUT_SECONDS,
    ) -> None:
        self.path = path
        self.retention = check_retention(retention)
        self.busy_timeout = busy_timeout
        self._clock = clock
        self._idle: queue.SimpleQueue[sqlite3.Connection] = queue.SimpleQueue()
        self._reader: sqlite3.Connection | None = None
        """The event loop's own connection, for reads (see ``remembered``)."""
        self._closed = False
        self._lock = threading.Lock()
        self._limiter = anyio.CapacityLimiter(THREADS)

    @classmethod
    def open(
        cls,
        path: Path,
        *,
        retention: timedelta = DEFAULT_RETENTION,
        clock: Callable[[], float] = time.time,
        busy_timeout: float = BUSY_TIMEOUT_SECONDS,
        option: str = "--fence-store",
    ) -> Self:
        """Open (creating if needed) the store at ``path`` and prove it is writable, or raise
        ``InvalidInput`` in one line naming the path and what is wrong. Blocking: call it at
        start, before serving. The directory must exist: a mistyped one must not quietly start
        an empty store."""
        store = cls(path, retention=retention, clock=clock, busy_timeout=busy_timeout)
        hint = f"set {option} (ORCHESTRATOR_PROXY_FENCE_STORE) to a writable file on a local disk"
        try:
            if not path.parent.is_dir():
                missing = "is not a directory" if path.parent.exists() else "does not exist"
                raise InvalidInput(
                    f"cannot use {option} {str(path)!r}: {str(path.parent)!r} {missing}; {hint}"
                )
            if path.is_dir():
                raise InvalidInput(f"cannot use {option} {str(path)!r}: it is a directory; {hint}")
            connection = store._connect()
            try:
                store._prepare(connection, option)
            finally:
                connection.close()
        except OSError as error:
            raise InvalidInput(
                f"cannot use {option} {str(path)!r}: {error.strerror or error}; {hint}"
            ) from None
        except sqlite3.Error as error:
            raise InvalidInput(f"cannot use {option} {str(path)!r}: {error}; {hint}") from None
        return store

    def _connect(self, busy_timeout: float | None = None) -> sqlite3.Connection:
        # Autocommit (isolation_level=None): each statement is its own transaction, so the
        # UPSERT is atomic on its own and no connection ever holds the write lock between calls.
        connection = sqlite3.connect(
            self.path,
            timeout=self.busy_timeout if busy_timeout is None else busy_timeout,
            isolation_level=None,
            check_same_thread=False,
        )
        connection.execute("PRAGMA synchronous = FULL")
        return connection

    def _prepare(self, connection: sqlite3.Connection, option: str) -> None:
        mode = connection.execute("PRAGMA journal_mode = WAL").fetchone()
        if mode is None or str(mode[0]).lower() != "wal":
            raise InvalidInput(
                f"cannot use {option} {str(self.path)!r}: SQLite cannot keep a WAL journal "
                "there; put it on a local disk"
            )
        # BEGIN IMMEDIATE takes the write lock, and setting user_version writes the header:
        # a file that can be read but not written fails here, at start, not on the first accept.
        connection.execute("BEGIN IMMEDIATE")
        try:
            version = int(connection.execute("PRAGMA user_version").fetchone()[0])
            if version > SCHEMA_VERSION:
                raise InvalidInput(
                    f"cannot use {option} {str(self.path)!r}: a newer orchestrator wrote it "
                    f"(format {version}, this one knows {SCHEMA_VERSION})"
                )
            connection.execute(
                "CREATE TABLE IF NOT EXISTS run_fences ("
                " run_id TEXT PRIMARY KEY, fence INTEGER NOT NULL, touched REAL NOT NULL"
                ") WITHOUT ROWID"
            )
            connection.execute(
                "CREATE INDEX IF NOT EXISTS run_fences_touched ON run_fences (touched)"
            )
            connection.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
            connection.execute("COMMIT")
        except BaseException:
            connection.execute("ROLLBACK")
            raise

    # -- serving ---------------------------------------------------------------------------------
    async def remembered(self, run_id: str) -> Remembered | None:
        """The run's entry, or None when the proxy never saw a fence of it accepted (or forgot).

        Read on the event loop, on a connection kept for it: a WAL reader takes no lock a writer
        holds and waits for no disk flush, so the read costs microseconds, far less than the
        hop to a worker thread (``benchmarks/proxy_fences.py``). Its busy timeout is 0: in the
        rare case SQLite answers busy (another process recovering the file), the read is
        repeated in a worker thread that may wait."""
        try:
            reader = self._reader
            if reader is None:
                reader = self._reader = self._connect(busy_timeout=0.0)
            return _read(reader, run_id)
        except sqlite3.OperationalError as error:
            if getattr(error, "sqlite_errorcode", None) not in (
                sqlite3.SQLITE_BUSY,
                sqlite3.SQLITE_LOCKED,
            ):
                raise self._unavailable(error) from error
        except sqlite3.Error as error:
            raise self._unavailable(error) from error
        return await self._run(lambda connection: _read(connection, run_id))

    async def admit(self, run_id: str, fence: int) -> Remembered | None:
        """Admit ``fence`` for ``run_id``, atomically and durably: ``None`` when it is at least the
        remembered fence (which is then raised to it, on disk before this returns), or the
        higher entry that refuses it (nothing written).

        One ``BEGIN IMMEDIATE`` transaction in a worker thread, so the check and the raise hold
        across threads and processes sharing the file. A request under the remembered fence itself,
        recently touched, needs no call at all (``needs_admit``)."""
        now = self._clock()

        def admit(connection: sqlite3.Connection) -> Remembered | None:
            connection.execute("BEGIN IMMEDIATE")
            try:
                found = _read(connection, run_id)
                if found is not None and fence < found.fence:
                    connection.execute("ROLLBACK")
                    return found
                if found is None or fence > found.fence or now - found.touched >= TOUCH_SECONDS:
                    connection.execute(_RECORD, (run_id, fence, now))
                connection.execute("COMMIT")  # synchronous=FULL: the WAL is fsynced here
            except BaseException:
                if connection.in_transaction:
                    connection.execute("ROLLBACK")
                raise
            return None

        return await self._run(admit)

    def needs_admit(self, seen: Remembered | None, fence: int) -> bool:
        """Whether a request under ``fence``, the database having accepted it, must write: a fence
        above the remembered one (or the first of a run), or an entry due for a refresh."""
        return seen is None or fence > seen.fence or self._clock() - seen.touched >= TOUCH_SECONDS

    async def remember(self, run_id: str, fence: int) -> None:
        """Raise the run's fence to at least ``fence`` (never lowers it), durably."""
        await self.admit(run_id, fence)

    async def prune(self, *, batch: int = PRUNE_BATCH) -> int:
        """Forget up to ``batch`` entries untouched for longer than the retention, oldest first;
        how many went. One short write transaction."""
        cutoff = self._clock() - self.retention.total_seconds()

        def delete(connection: sqlite3.Connection) -> int:
            return int(connection.execute(_PRUNE, (cutoff, batch)).rowcount)

        return await self._run(delete)

    async def prune_round(self, *, batch: int = PRUNE_BATCH) -> int:
        """Up to ``PRUNE_BATCHES_PER_ROUND`` batches, until one comes back short; between
        batches the file's write lock is free for the requests' writes."""
        pruned = 0
        for _ in range(PRUNE_BATCHES_PER_ROUND):
            deleted = await self.prune(batch=batch)
            pruned += deleted
            if deleted < batch:
                break
            await anyio.sleep(PRUNE_PAUSE_SECONDS)
        return pruned

    async def keep_pruned(self, log: Any, *, interval: float = PRUNE_INTERVAL_SECONDS) -> None:
        """Prune a round now and then every ``interval`` seconds, until cancelled. A failing
        round is logged and retried next time: serving does not depend on it."""
        while True:
            try:
                pruned = await self.prune_round()
            except FenceStoreUnavailable as error:
                log.error(
                    "cannot prune the fence store", path=str(self.path), **error_fields(error)
                )
            else:
                if pruned:
                    log.info("fence store pruned", path=str(self.path), forgotten=pruned)
            await anyio.sleep(interval)

    async def count(self) -> int:
        """How many runs the store remembers (a full scan of a small index: for start-up and
        tests, not for every request)."""

        def count(connection: sqlite3.Connection) -> int:
            return int(connection.execute("SELECT count(*) FROM run_fences").fetchone()[0])

        return await self._run(count)

    def close(self) -> None:
        """Close the idle connections; one still in a thread is closed when it comes back."""
        with self._lock:
            self._closed = True
        if self._reader is not None:
            self._reader.close()
            self._reader = None
        while True:
            try:
                self._idle.get_nowait().close()
            except queue.Empty:
                return

    def _unavailable(self, error: sqlite3.Error) -> FenceStoreUnavailable:
        if getattr(error, "sqlite_errorcode", None) in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED):
            return FenceStoreUnavailable(
                f"the action proxy's fence store {str(self.path)!r} stayed locked by another "
                f"process for over {self.busy_timeout:g}s ({error}): is a proxy sharing it "
                "stuck on a slow disk?"
            )
        return FenceStoreUnavailable(
            f"the action proxy's fence store {str(self.path)!r} failed: {error}"
        )

    async def _run(self, work: Callable[[sqlite3.Connection], T]) -> T:
        # Not cancellable (anyio's default): a write that began finishes, and its answer is kept.
        return await anyio.to_thread.run_sync(self._on_a_connection, work, limiter=self._limiter)

    def _on_a_connection(self, work: Callable[[sqlite3.Connection], T]) -> T:
        try:
            connection = self._idle.get_nowait()
        except queue.Empty:
            connection = None
        try:
            if connection is None:
                connection = self._connect()
            return work(connection)
        except sqlite3.Error as error:
            raise self._unavailable(error) from error
        finally:
            if connection is not None:
                with self._lock:  # never parked after close() emptied the queue
                    if not self._closed:
                        self._idle.put(connection)
                        connection = None
                if connection is not None:
                    connection.close()
