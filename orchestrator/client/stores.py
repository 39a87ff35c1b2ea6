"""Every store over one pool, built once per client, command or console and handed to what
needs them, so that no caller builds a store by hand or issues a statement itself."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import datetime, timedelta
from typing import Unpack

import asyncpg

from orchestrator.access import Actor
from orchestrator.db.access import AccessStore
from orchestrator.db.agents import AgentStore
from orchestrator.db.audit import AuditStore
from orchestrator.db.bootstrap import PoolOptions, open_pool
from orchestrator.db.budgets import BudgetState, BudgetStore, LedgerEntry, TopUp
from orchestrator.db.forks import ForkStore
from orchestrator.db.limits import LimitStore
from orchestrator.db.output import OutputStore
from orchestrator.db.purges import PurgeStore
from orchestrator.db.rates import RateLimitStore
from orchestrator.db.retention import MAX_AGE
from orchestrator.db.schedules import ScheduleStore
from orchestrator.db.signals import Signal, SignalStore
from orchestrator.db.standby_wait import STANDBY_ACK_SECONDS
from orchestrator.db.standby_wait import wait_for_standby as wait_for_standby_at
from orchestrator.db.store import RunStore
from orchestrator.db.workers import WorkerRegistry
from orchestrator.effects.approvals import ApprovalStore
from orchestrator.effects.store import EffectStore
from orchestrator.errors import InvalidInput, InvalidTransition
from orchestrator.models import RunEvent
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
        self.limits = LimitStore(pool)
        self.rates = RateLimitStore(pool)
        self.agents = AgentStore(pool)
        self.forks = ForkStore(pool)
        self.schedules = ScheduleStore(pool, max_input_bytes=max_input_bytes)
        self.outputs = OutputStore(pool)
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

    # -- the answers the client, the command line and the console must give alike ----------------
    async def purge_cutoff(self, older_than: timedelta) -> datetime:
        """Finished runs that ended before this are purged: ``older_than`` back from the
        database's clock (a caller's clock may be off), above 0 and at most ``MAX_AGE``."""
        if not timedelta(0) < older_than <= MAX_AGE:
            raise InvalidInput(
                f"a purge's age must be above 0 and at most 100 years (36500 days), "
                f"not {older_than}"
            )
        return await self.runs.database_now() - older_than

    async def events_of(self, run_id: str, *, after: int, limit: int) -> list[RunEvent]:
        """A page of the run's timeline; ``RunNotFound`` for an unknown run, not an empty page."""
        await self.runs.get(run_id)
        return await self.runs.events(run_id, after=after, limit=limit)

    async def signals_of(
        self, run_id: str, *, newest: int | None = None
    ) -> list[tuple[Signal, datetime | None, int | None]]:
        """The run's signals; ``RunNotFound`` for an unknown run, not an empty list."""
        await self.runs.get(run_id)
        return await self.signals.history(run_id, newest=newest)

    async def budget_of(self, run_id: str) -> BudgetState | None:
        """The run's budget (``None``: its agent declares none, or it made no model call yet);
        ``RunNotFound`` for an unknown run, not "no budget"."""
        budget = await self.budgets.get(run_id)
        if budget is None:
            await self.runs.get(run_id)
        return budget

    async def ledger_of(self, run_id: str) -> list[LedgerEntry]:
        """The run's budget ledger; ``RunNotFound`` for an unknown run, not an empty ledger."""
        ledger = await self.budgets.ledger(run_id)
        if not ledger:
            await self.runs.get(run_id)
        return ledger

    async def top_up(
        self, run_id: str, *, actor: Actor | None = None, **amounts: Unpack[TopUp]
    ) -> BudgetState:
        """Raise the run's budget; ``RunNotFound`` for an unknown run, not "no budget"."""
        try:
            return await self.budgets.top_up(run_id, actor=actor, **amounts)
        except InvalidTransition:
            await self.runs.get(run_id)
            raise

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
