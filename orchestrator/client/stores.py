"""Every store over one pool, built once per client, command or console and handed to what
needs them, so that no caller builds a store by hand or issues a statement itself."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Unpack

import asyncpg

from orchestrator.db.access import AccessStore
from orchestrator.db.audit import AuditStore
from orchestrator.db.bootstrap import PoolOptions, open_pool
from orchestrator.db.budgets import BudgetStore
from orchestrator.db.purges import PurgeStore
from orchestrator.db.signals import SignalStore
from orchestrator.db.standby_wait import STANDBY_ACK_SECONDS
from orchestrator.db.standby_wait import wait_for_standby as wait_for_standby_at
from orchestrator.db.store import RunStore
from orchestrator.db.workers import WorkerRegistry
from orchestrator.effects.approvals import ApprovalStore
from orchestrator.effects.store import EffectStore
from orchestrator.settings import DEFAULT_MAX_INPUT_BYTES, DEFAULT_SCHEMA, Settings, StandbyPolicy


class Stores:
    """The run store and the feature stores (small objects: each holds only the pool)."""

    def __init__(
        self,
        pool: asyncpg.Pool,
        *,
        max_input_bytes: int = DEFAULT_MAX_INPUT_BYTES,
        schema: str = DEFAULT_SCHEMA,
        standby: StandbyPolicy | None = None,
    ) -> None:
        self.pool = pool
        self.schema = schema
        self.standby = standby or StandbyPolicy()
        self.runs = RunStore(pool, max_input_bytes=max_input_bytes)
        self.effects = EffectStore(pool)
        self.approvals = ApprovalStore(pool)
        self.signals = SignalStore(pool)
        self.budgets = BudgetStore(pool)
        self.workers = WorkerRegistry(schema)
        self.purges = PurgeStore(pool)
        self.access = AccessStore(pool)
        self.audit = AuditStore(pool)

    @classmethod
    def of(cls, pool: asyncpg.Pool, settings: Settings) -> Stores:
        """The stores as ``settings`` configure them (input limit, schema, standby policy)."""
        return cls(
            pool,
            max_input_bytes=settings.max_input_bytes,
            schema=settings.schema,
            standby=settings.standby,
        )

    async def held_by_standby(self, within: float | None = STANDBY_ACK_SECONDS) -> None:
        """Return once a standby holds every commit this client made so far (a submission, a
        signal, a decision), so that a failover cannot take back what its caller is told;
        ``StandbyNotReached`` if none does within ``within`` seconds (``None``: no wait; see
        ``acknowledgement_seconds``). At once on a primary without standbys."""
        if within is None:
            return
        async with self.pool.acquire() as db:
            await wait_for_standby_at(db, self.standby, within=within)


@asynccontextmanager
async def open_stores(settings: Settings, **options: Unpack[PoolOptions]) -> AsyncIterator[Stores]:
    """Every store over one new pool (the schema checked, or migrated where that is safe),
    closed after."""
    async with open_pool(settings, **options) as pool:
        yield Stores.of(pool, settings)
