"""What every fault injector shares: the cluster and services it acts on, a record to fill in,
and the few cluster moves several kinds of fault make (revive a member, note the runs it held)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import anyio
import asyncpg

from orchestrator.chaos.cluster import Cluster, Member
from orchestrator.chaos.statements import CAMPAIGN_ERRORS
from orchestrator.chaos.vendor import ChaosVendor
from orchestrator.db.embedded import EmbeddedPostgres
from orchestrator.testing.loopback import ScriptedModelServer
from orchestrator.testing.replicated import ReplicatedPostgres


@dataclass(frozen=True)
class ScheduledFault:
    at: float
    """Seconds after the fault window opens."""
    kind: str
    target: int
    """Which member (of the kind's role) or candidate, modulo how many there are."""


@dataclass
class FaultRecord:
    at: float
    kind: str
    target: str
    fired: bool = False
    detail: str = ""

    def as_json(self) -> dict[str, Any]:
        return {
            "at": round(self.at, 3),
            "kind": self.kind,
            "target": self.target,
            "fired": self.fired,
            "detail": self.detail,
        }


@dataclass
class FaultContext:
    """What the injectors act on, and the victims they leave behind for the report."""

    cluster: Cluster
    vendor: ChaosVendor
    model: ScriptedModelServer
    pool: asyncpg.Pool
    """Straight to PostgreSQL, never through a proxy."""
    database: EmbeddedPostgres | ReplicatedPostgres
    started: float
    victims: list[tuple[str, int, float]] = field(default_factory=list)
    """(run id, fence, when) of runs a faulted worker held: recovery is measured from them."""
    clients: ClientGate = field(default_factory=lambda: ClientGate())
    """The campaign's own clients (submitter, person) pass it; a failover closes it."""
    trees: bool = False
    """Whether the workload starts trees of runs (a cancel then sometimes picks a tree's root)."""

    def member(self, role: str, fault: ScheduledFault) -> Member:
        members = self.cluster.of(role)
        return members[fault.target % len(members)]

    async def held_runs(self, member: Member) -> None:
        """Note the runs a worker holds as it is faulted: their recovery is measured."""
        if member.role != "worker":
            return
        try:
            rows = await self.pool.fetch(
                "SELECT run_id, fence FROM orchestrator.runs "
                "WHERE state = 'running' AND lease_owner = $1",
                member.name,
                timeout=2,
            )
        except CAMPAIGN_ERRORS:
            return
        now = time.time()
        self.victims.extend((row["run_id"], row["fence"], now) for row in rows)

    async def revive(self, member: Member) -> None:
        """A process that exited on its own (PostgreSQL was down when it started) is the
        fault's target still: start it again and give it a moment to connect."""
        for _ in range(3):
            if member.alive:
                return
            self.cluster.restart(member)
            await anyio.sleep(1.0)


class FaultGroup:
    """Injectors that act on one part of the system, each a method named after the fault kind
    it injects (``Faults`` finds them by name)."""

    def __init__(self, context: FaultContext) -> None:
        self.context = context


class ClientGate:
    """Many clients pass at once (``open``); a failover closes the gate (``closed``): it waits,
    bounded, for the clients inside to leave and keeps new ones out until it reopens."""

    def __init__(self) -> None:
        self._lock = anyio.Lock()
        self.inside = 0

    @asynccontextmanager
    async def open(self) -> AsyncIterator[None]:
        async with self._lock:
            self.inside += 1
        try:
            yield
        finally:
            self.inside -= 1

    @asynccontextmanager
    async def closed(self, *, within: float) -> AsyncIterator[None]:
        async with self._lock:
            await until(lambda: self.inside == 0, within)
            yield


async def until(condition: Callable[[], bool], within: float, step: float = 0.05) -> bool:
    """Whether ``condition`` held within ``within`` seconds (polled: it reads counters)."""
    for _ in range(max(1, round(within / step))):
        if condition():
            return True
        await anyio.sleep(step)
    return condition()
