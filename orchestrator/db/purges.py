"""Deleting finished runs with everything kept for them, in small batches (each a short
transaction that skips rows others hold), by workers in the background and by ``orchestrator runs
purge``; the rules (ages, batch sizes, pacing) are ``retention.py``."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta

import anyio
import asyncpg

from orchestrator.db.audit import decision_span
from orchestrator.db.executor import Executor
from orchestrator.db.queries import query
from orchestrator.db.retention import (
    PURGE_BATCH,
    PURGE_BATCHES_PER_ROUND,
    PURGE_PAUSE_RATIO,
)

RETENTION_LOCK = "orchestrator retention of schema "
"""One worker at a time purges (a transaction-level advisory lock per schema, taken by each
batch); the others skip their round."""

_TRY_RETENTION_LOCK = (
    "SELECT pg_try_advisory_xact_lock(hashtextextended($1 || current_schema(), 0))"
)


@dataclass(frozen=True)
class Purged:
    runs: int
    other_rows: int
    """Events, transcript messages, effects, signals, budget rows deleted with them."""
    audit_seq: int | None = None
    """The batch's purge row in the audit trail (None: it deleted no run)."""


class PurgeStore:
    """Deletes from every table a run owns rows in; ``db`` is a pool or a transaction's
    connection (a worker's round holds the retention lock in its transaction)."""

    def __init__(self, db: Executor) -> None:
        self.db = db

    async def count(self, cutoff: datetime) -> int:
        """How many runs a purge before ``cutoff`` would delete now."""
        return int(await self.db.fetchval(query("count_purgeable"), cutoff))

    async def delete_batch(self, cutoff: datetime, batch: int) -> Purged:
        """Delete one batch of finished runs older than ``cutoff``; the database function
        audits a batch that deleted runs, as the role that connected."""
        with decision_span("purge", None) as recorded:
            record = await self.db.fetchrow(query("purge_finished"), cutoff, batch)
            assert record is not None
            if record["audit_seq"] is not None:
                recorded(record["principal"], record["audit_seq"])
        return Purged(record["runs"], record["other_rows"], record["audit_seq"])

    async def try_retention_lock(self) -> bool:
        """In a transaction: take the schema's retention lock, or learn another worker has it."""
        return bool(await self.db.fetchval(_TRY_RETENTION_LOCK, RETENTION_LOCK))

    async def clock(self) -> datetime:
        """The database's clock now (not the transaction's start), which ages runs."""
        now: datetime = await self.db.fetchval("SELECT clock_timestamp()")
        return now


async def purge(
    pool: asyncpg.Pool,
    cutoff: datetime,
    *,
    batch: int = PURGE_BATCH,
    max_batches: int | None = None,
    pause_ratio: float = PURGE_PAUSE_RATIO,
    progress: Callable[[Purged], None] = lambda total: None,
) -> Purged:
    """Batch after batch until none is left (or ``max_batches``), pausing ``pause_ratio`` times
    each batch's duration after it (0: flat out); ``progress`` sees the running total after
    each. Each batch that deleted runs is audited, as the database role that connected, in its
    own transaction."""
    runs = other = 0
    done = 0
    while max_batches is None or done < max_batches:
        began = time.monotonic()
        purged = await PurgeStore(pool).delete_batch(cutoff, batch)
        done += 1
        runs, other = runs + purged.runs, other + purged.other_rows
        progress(Purged(runs, other))
        if purged.runs < batch:
            break
        await anyio.sleep((time.monotonic() - began) * pause_ratio)
    return Purged(runs, other)


async def purge_round(pool: asyncpg.Pool, age: timedelta) -> Purged | None:
    """A worker's round: up to ``PURGE_BATCHES_PER_ROUND`` batches older than ``age`` by the
    database clock, each in a transaction holding the schema's retention lock; ``None``:
    another worker holds it (it is purging)."""
    runs = other = 0
    for _ in range(PURGE_BATCHES_PER_ROUND):
        began = time.monotonic()
        async with pool.acquire() as connection, connection.transaction():
            purges = PurgeStore(connection)
            if not await purges.try_retention_lock():
                return None if runs == 0 else Purged(runs, other)
            purged = await purges.delete_batch(await purges.clock() - age, PURGE_BATCH)
        runs, other = runs + purged.runs, other + purged.other_rows
        if purged.runs < PURGE_BATCH:
            break
        await anyio.sleep((time.monotonic() - began) * PURGE_PAUSE_RATIO)
    return Purged(runs, other)
