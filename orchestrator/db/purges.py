"""Deleting finished runs with everything kept for them: the statements behind retention, each
batch a short transaction (see retention.py for the pacing and the policy)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from orchestrator.db.audit import decision_span
from orchestrator.db.executor import Executor
from orchestrator.db.queries import query

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
