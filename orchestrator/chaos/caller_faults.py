"""Faults a person or an API caller makes: a cancel (of a plain run, or of a tree's root while
its children are mid-step), a decision that comes too late, a signal sent twice, and a request
under a fence the run has moved past."""

from __future__ import annotations

import anyio
import asyncpg

from orchestrator.chaos.context import FaultContext, FaultGroup, FaultRecord, ScheduledFault
from orchestrator.chaos.statements import CAMPAIGN_ERRORS, STATEMENT_SECONDS
from orchestrator.db.signals import SignalStore
from orchestrator.effect_model import Effect, EffectPolicy
from orchestrator.effects.approvals import ApprovalStore, Decision, DecisionRefused
from orchestrator.effects.store import EffectStore
from orchestrator.errors import InvalidTransition, OrchestratorError

CANCEL_ATTEMPTS = 5
UNFINISHED = "SELECT run_id FROM orchestrator.runs WHERE state IN ('queued', 'running', 'waiting')"
TREE_ROOTS = """
WITH trees AS (
    SELECT r.run_id, bool_or(c.state = 'running') AS mid_step
    FROM orchestrator.runs AS r JOIN orchestrator.runs AS c ON c.parent_run_id = r.run_id
    WHERE r.parent_run_id IS NULL AND r.state IN ('queued', 'running', 'waiting')
      AND c.state IN ('queued', 'running', 'waiting')
    GROUP BY r.run_id
)
SELECT run_id FROM trees WHERE mid_step OR NOT EXISTS (SELECT 1 FROM trees WHERE mid_step)
"""
"""Roots of trees with unfinished children: those with a child mid-step, when there are any."""


class NoCandidate(OrchestratorError):
    """No run or request the fault could act on appeared in time."""


class CallerFaults(FaultGroup):
    def __init__(self, context: FaultContext) -> None:
        super().__init__(context)
        self.stale_refused = 0
        """Requests under a stale fence the boundary refused."""

    async def cancel(self, fault: ScheduledFault, record: FaultRecord) -> None:
        """Cancel an unfinished run; every other one of a workload with trees, a tree's root."""
        tree = self.context.trees and fault.target % 2 == 0
        # A run picked while live may finish before the cancel lands; pick again, a few times.
        for _ in range(CANCEL_ATTEMPTS):
            row = await self._pick(
                f"{TREE_ROOTS if tree else UNFINISHED} ORDER BY run_id LIMIT 50", fault
            )
            record.target = row["run_id"]
            try:
                await _cancel_run(self.context.pool, row["run_id"])
            except InvalidTransition as error:
                record.detail = str(error)
                continue
            record.fired = True
            record.detail = await self._cascaded(row["run_id"]) if tree else ""
            return

    async def late_approval(self, fault: ScheduledFault, record: FaultRecord) -> None:
        """Approve a request whose time ran out (denied by expiry): it must stay unsent."""
        row = await self._pick(
            "SELECT run_id, effect_key, payload_sha256 FROM orchestrator.effects "
            "WHERE requires_approval AND decided_by = 'expiry' ORDER BY decided_at DESC LIMIT 20",
            fault,
            within=60,
        )
        await self._decide_late(row, Decision.APPROVED, record)

    async def late_denial(self, fault: ScheduledFault, record: FaultRecord) -> None:
        """Deny a request a person already approved: the approval stands."""
        row = await self._pick(
            "SELECT run_id, effect_key, payload_sha256 FROM orchestrator.effects "
            "WHERE requires_approval AND approved_sha256 IS NOT NULL "
            "ORDER BY decided_at DESC LIMIT 20",
            fault,
        )
        await self._decide_late(row, Decision.DENIED, record)

    async def duplicate_signal(self, fault: ScheduledFault, record: FaultRecord) -> None:
        """``go`` twice under one key (the second must be the first), then once more without."""
        signals = SignalStore(self.context.pool)
        # A run picked while live may finish before the signals land; pick again, a few times.
        for _ in range(CANCEL_ATTEMPTS):
            row = await self._pick(
                "SELECT run_id FROM orchestrator.runs "
                "WHERE state IN ('queued', 'running', 'waiting') "
                "AND (input->>'signal')::boolean ORDER BY run_id LIMIT 50",
                fault,
            )
            run_id = row["run_id"]
            record.target = run_id
            try:
                first = await signals.send(run_id, "go", {"by": "chaos"}, idempotency_key="twice")
                again = await signals.send(run_id, "go", {"by": "chaos"}, idempotency_key="twice")
                await signals.send(run_id, "go", {"by": "chaos, unkeyed"})
            except InvalidTransition as error:
                record.detail = str(error)
                continue
            record.fired = not again.created and again.signal.seq == first.signal.seq
            record.detail = f"signal #{first.signal.seq} twice, then an unkeyed one"
            return

    async def stale_request(self, fault: ScheduledFault, record: FaultRecord) -> None:
        """Present the boundary a fence the run has moved past: it must refuse it."""
        pool = self.context.pool
        row = await self._pick(
            "SELECT r.run_id, r.fence FROM orchestrator.runs AS r "
            "WHERE r.state = 'running' AND r.fence >= 2 AND EXISTS (SELECT 1 FROM "
            "orchestrator.run_events AS e WHERE e.run_id = r.run_id AND e.kind = 'claimed' "
            "AND e.fence = r.fence AND e.at < clock_timestamp() - interval '0.5 seconds') "
            "ORDER BY r.run_id LIMIT 50",
            fault,
        )
        run_id, fence = row["run_id"], row["fence"] - 1
        record.target = f"{run_id}@{fence}"
        effect = Effect(
            f"stale-{fault.target}",
            "crm",
            {"run": run_id, "stale": fence},
            EffectPolicy.IRREVERSIBLE,
        )
        async with pool.acquire() as connection, connection.transaction():
            acceptance = await EffectStore(pool).accept(
                connection, run_id, fence, effect, worker_id="chaos-stale"
            )
        record.fired = True
        record.detail = acceptance.outcome.value
        if acceptance.outcome.value == "stale":
            self.stale_refused += 1

    async def _cascaded(self, run_id: str) -> str:
        """The fault's detail for a tree's root: how many runs below it its cancel took."""
        try:
            below = await self.context.pool.fetchval(
                "SELECT count(*) FROM orchestrator.run_events "
                "WHERE kind = 'cancelled' AND details ->> 'with_ancestor' = $1",
                run_id,
                timeout=STATEMENT_SECONDS,
            )
        except CAMPAIGN_ERRORS:
            return "a tree's root"
        return f"a tree's root; runs cancelled below it: {below}"

    async def _pick(self, sql: str, fault: ScheduledFault, within: float = 20) -> asyncpg.Record:
        """A row of ``sql``'s candidates (``target`` picks which), waiting for one to exist."""
        for _ in range(round(within / 0.2)):
            try:
                rows = await self.context.pool.fetch(sql, timeout=STATEMENT_SECONDS)
            except CAMPAIGN_ERRORS:  # PostgreSQL restarting: look again
                rows = []
            if rows:
                return rows[fault.target % len(rows)]
            await anyio.sleep(0.2)
        raise NoCandidate(f"none within {within:g}s")

    async def _decide_late(
        self, row: asyncpg.Record, decision: Decision, record: FaultRecord
    ) -> None:
        record.target = f"{row['run_id']}/{row['effect_key']}"
        try:
            await ApprovalStore(self.context.pool).decide(
                row["run_id"],
                row["effect_key"],
                decision,
                by="chaos-late",
                payload_sha256=row["payload_sha256"],
            )
            record.detail = "accepted: a late decision changed a settled request"
        except DecisionRefused as refused:
            record.fired = True
            record.detail = f"refused: {refused}"


async def _cancel_run(pool: asyncpg.Pool, run_id: str) -> None:
    from orchestrator.db.store import RunStore

    await RunStore(pool).cancel(run_id, reason="chaos")
