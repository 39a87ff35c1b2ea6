"""Run leases: claiming due or lease-expired runs, renewing leases and handing runs back. Each
statement's WHERE clause proves ownership; a refused one changes nothing."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime

from orchestrator.db.commit_records import same_worker
from orchestrator.db.executor import Executor
from orchestrator.db.pool_store import PoolStore
from orchestrator.db.queries import query
from orchestrator.ids import validate_run_id
from orchestrator.models import ClaimBatch, ClaimedRun, Lease, Row


class Leases(PoolStore):
    """Claims, renewals and releases of run leases (the ``runs`` table's owner columns)."""

    async def claim(
        self,
        worker_id: str,
        agents: Sequence[str],
        *,
        limit: int = 1,
        lease_seconds: float = 45.0,
        include_expired: bool = True,
        after_key: str | None = None,
        versions: Mapping[str, Sequence[str]] | None = None,
        db: Executor | None = None,
    ) -> ClaimBatch:
        """Claim up to ``limit`` due or lease-expired runs of ``agents`` in one statement.

        ``include_expired=False`` claims due runs only, without reading the running set to find
        expired leases (see claim in sql/queries.sql). ``after_key``: where the last claim's
        turn over the concurrency keys ended (``ClaimBatch.next_key``). ``versions``: per agent,
        the versions of its code a run's checkpoint may have been written under for this
        claimer to take it (``None``: any; docs/upgrades.md).
        """
        # Each agent is probed once; a repeated name would fill the limit with duplicates.
        unique_agents = list(dict.fromkeys(agents))
        records = await (db or self.pool).fetch(
            query("claim"),
            worker_id,
            unique_agents,
            limit,
            lease_seconds,
            include_expired,
            None,
            after_key,
            None if versions is None else {agent: list(v) for agent, v in versions.items()},
        )
        return self._claim_batch(records, worker_id)

    async def claim_run(
        self,
        worker_id: str,
        run_id: str,
        *,
        lease_seconds: float = 45.0,
        versions: Mapping[str, Sequence[str]] | None = None,
        db: Executor | None = None,
    ) -> ClaimedRun | None:
        """Claim one specific run if it is due or its lease expired (and, with ``versions``,
        its checkpoint was written under one of them); ``None`` otherwise."""
        validate_run_id(run_id)
        records = await (db or self.pool).fetch(
            query("claim"),
            worker_id,
            [],
            1,
            lease_seconds,
            True,
            run_id,
            None,
            None if versions is None else {agent: list(v) for agent, v in versions.items()},
        )
        batch = self._claim_batch(records, worker_id)
        return batch.claimed[0] if batch.claimed else None

    @staticmethod
    def _claim_batch(records: Sequence[Row], worker_id: str) -> ClaimBatch:
        claimed: list[ClaimedRun] = []
        dead: list[str] = []
        planned, cursor, held_back = False, None, 0
        for record in records:
            outcome = record["outcome"]
            if outcome == "claimed":
                claimed.append(ClaimedRun.from_record(record, worker_id))
            elif outcome == "dead_lettered":
                dead.append(record["run_id"])
            else:  # where flow control's turn over the keys ended
                planned, cursor = True, record["next_key"]
                held_back = record["held_back"] or 0
        return ClaimBatch(
            claimed=claimed, dead_lettered=dead, planned=planned, cursor=cursor, held_back=held_back
        )

    async def renew(
        self, lease: Lease, *, lease_seconds: float = 45.0, db: Executor | None = None
    ) -> datetime | None:
        """Extend one lease; ``None`` means ownership is lost or cannot be proven."""
        record = await (db or self.pool).fetchrow(
            query("renew_lease"), lease.run_id, lease.worker_id, lease.fence, lease_seconds
        )
        return None if record is None else record["lease_until"]

    async def renew_many(
        self,
        worker_id: str,
        leases: Sequence[Lease],
        *,
        lease_seconds: float | Sequence[float],
        db: Executor | None = None,
    ) -> dict[str, datetime]:
        """Extend many leases of one worker in one statement; returns the ones that held."""
        same_worker(worker_id, leases)
        seconds = (
            [float(lease_seconds)] * len(leases)
            if isinstance(lease_seconds, int | float)
            else [float(value) for value in lease_seconds]
        )
        records = await (db or self.pool).fetch(
            query("renew_leases"),
            [lease.run_id for lease in leases],
            [lease.fence for lease in leases],
            seconds,
            worker_id,
        )
        return {record["run_id"]: record["lease_until"] for record in records}

    async def release(
        self, lease: Lease, *, reason: str = "shutdown", db: Executor | None = None
    ) -> bool:
        """Hand a run back without raising its fence (graceful shutdown)."""
        record = await (db or self.pool).fetchrow(
            query("release_lease"), lease.run_id, lease.worker_id, lease.fence, reason
        )
        return record is not None
