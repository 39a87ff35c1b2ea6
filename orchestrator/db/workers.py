"""Worker liveness: each worker holds an advisory lock on a session of its own, so a reaper can
tell a dead worker (lock gone) from a slow one and take its runs over at once."""

from __future__ import annotations

import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import asyncpg

from orchestrator.db.executor import Executor
from orchestrator.db.queries import query
from orchestrator.ids import validate_agent_name
from orchestrator.models import JsonFields, Row, WorkerInfo
from orchestrator.settings import DEFAULT_SCHEMA

LIVENESS_LOCK_NAMESPACE = 0x6F72  # "or": the first key of every worker's liveness lock
REREGISTER_GRACE_SECONDS = 10.0
"""After a PostgreSQL restart, how long workers registered before it have to register again
before a reaper judges them dead (every worker checks its liveness session each second)."""


@dataclass(frozen=True)
class AgentVersion(JsonFields):
    """One version of one agent, as ``orchestrator agents versions`` shows it."""

    agent: str
    version: str
    workers: list[str]
    """Live workers that run this version."""
    claimed_by: list[str]
    """Live workers that may claim its runs: they run it, or upgrade from it."""
    unfinished_runs: int
    """Queued, running and waiting runs whose checkpoint this version wrote."""

    @property
    def stranded(self) -> bool:
        """Runs wait for it and no live worker may claim them."""
        return self.unfinished_runs > 0 and not self.claimed_by

    @classmethod
    def from_record(cls, record: Row) -> AgentVersion:
        return cls(
            record["agent"],
            record["version"],
            sorted(record["workers"]),
            sorted(record["claimed_by"]),
            int(record["unfinished_runs"]),
        )


@dataclass(frozen=True)
class ExpiredLease:
    run_id: str
    fence: int
    previous_owner: str


def liveness_namespace(schema: str) -> int:
    """The first key of the liveness locks of one schema's workers. Advisory locks belong to
    the database, not to a schema: two schemas in one database must not share key spaces."""
    if schema == DEFAULT_SCHEMA:
        return LIVENESS_LOCK_NAMESPACE
    return 0x10000 + zlib.crc32(schema.encode()) % 0x7FFE0000


class WorkerRegistry:
    """Worker liveness for dead-session takeover (see sql/migrations/0002_workers.sql)."""

    def __init__(self, schema: str = DEFAULT_SCHEMA) -> None:
        self.namespace = liveness_namespace(schema)

    async def list_workers(self, db: Executor) -> list[WorkerInfo]:
        """Registered workers, alive or dead, with the runs each holds."""
        return [
            WorkerInfo.from_record(r) for r in await db.fetch(query("list_workers"), self.namespace)
        ]

    async def agent_versions(self, db: Executor, agent: str | None = None) -> list[AgentVersion]:
        """Each version of each agent (of ``agent``): its live workers, the live workers that
        may claim its runs, and its unfinished runs (docs/upgrades.md)."""
        if agent is not None:
            validate_agent_name(agent)
        rows = await db.fetch(query("agent_versions"), self.namespace, agent)
        return [AgentVersion.from_record(row) for row in rows]

    async def register(
        self,
        connection: asyncpg.Connection,
        *,
        worker_id: str,
        host: str,
        pid: int,
        agents: Sequence[str],
        versions: Mapping[str, Sequence[str]] | None = None,
    ) -> int:
        """Take a liveness lock on ``connection`` and record the worker; returns its key.

        The lock is taken before the row is written, so a registered worker is never judged
        dead for want of a lock it has not yet taken. ``connection`` must stay open, and do
        nothing else, for as long as the worker lives.
        """
        key = int(await connection.fetchval(query("next_session_key")))
        locked = await connection.fetchval(query("hold_session_lock"), self.namespace, key)
        if not locked:
            raise RuntimeError(f"liveness lock {key} is held by another session")
        await connection.execute(
            query("register_worker"),
            worker_id,
            key,
            host,
            pid,
            list(agents),
            None if versions is None else {agent: list(v) for agent, v in versions.items()},
        )
        return key

    async def served_agents(self, db: Executor) -> list[str]:
        return [record["agent"] for record in await db.fetch(query("served_agents"))]

    async def unregister(self, db: Executor, worker_id: str) -> None:
        await db.execute(query("unregister_worker"), worker_id)

    async def expire_dead_owners(
        self, db: Executor, *, reregister_grace_seconds: float = REREGISTER_GRACE_SECONDS
    ) -> list[ExpiredLease]:
        """End the leases of workers whose session is gone, so their runs are claimable now."""
        records = await db.fetch(
            query("expire_dead_owners"), self.namespace, reregister_grace_seconds
        )
        return [ExpiredLease(r["run_id"], r["fence"], r["lease_owner"]) for r in records]

    async def expire_unheld_leases(
        self, db: Executor, worker_id: str, held: Sequence[str]
    ) -> list[ExpiredLease]:
        """End ``worker_id``'s leases on runs it does not hold (``held``: those it does)."""
        records = await db.fetch(query("expire_unheld_leases"), worker_id, list(held))
        return [ExpiredLease(r["run_id"], r["fence"], worker_id) for r in records]
