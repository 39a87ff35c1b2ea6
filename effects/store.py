"""The effect boundary's statements: the `effects` table's records and their dispatch (approvals.py
issues the approval decisions; tests/test_query_owners.py keeps the owners)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import asyncpg

from orchestrator.access import Actor
from orchestrator.db.audit import decide
from orchestrator.db.executor import Executor
from orchestrator.db.queries import query
from orchestrator.effect_model import (
    Acceptance,
    AcceptOutcome,
    Effect,
    EffectRecord,
    EffectStatus,
    idempotency_key,
    validate_effect_key,
)
from orchestrator.errors import InvalidInput, InvalidTransition, OrchestratorError
from orchestrator.ids import validate_run_id
from orchestrator.jsontext import compact
from orchestrator.models import JSON
from orchestrator.storable import check_text


class EffectNotFound(OrchestratorError):
    def __init__(self, run_id: str, effect_key: str) -> None:
        super().__init__(
            f"no effect {effect_key!r} for run {run_id}; "
            "`orchestrator effects list --run RUN_ID` shows its effects"
        )


@dataclass(frozen=True)
class ClaimedEffect:
    record: EffectRecord
    previous_status: EffectStatus
    sent_before: bool
    lost_timeline: bool = False
    """A promotion came between the effect's origin (its run's birth, its fence, its last
    claim) and this claim: the lost timeline may have sent it (docs/high-availability.md)."""

    @property
    def must_reconcile(self) -> bool:
        """A send may already have reached the vendor: look before sending again."""
        return self.lost_timeline or self.previous_status in (
            EffectStatus.UNCERTAIN,
            EffectStatus.DISPATCHING,
        )


@dataclass(frozen=True, slots=True)
class SettleRequest:
    """What the dispatcher learned about one effect it holds, to be recorded."""

    effect: EffectRecord
    status: EffectStatus
    external_id: str | None = None
    result: JSON = None
    error: JSON = None
    retry_after: float = 0.0


class EffectStore:
    def __init__(self, pool: asyncpg.Pool) -> None:
        self.pool = pool

    async def accept(
        self, db: Executor, run_id: str, fence: int, effect: Effect, *, worker_id: str | None
    ) -> Acceptance:
        """Apply the boundary's rule to one request, in the caller's transaction."""
        record = await db.fetchrow(
            query("accept_effect"),
            run_id,
            effect.key,
            fence,
            effect.kind,
            effect.policy.value,
            effect.payload,
            idempotency_key(run_id, effect.key),
            worker_id,
            effect.requires_approval,
            effect.approval_seconds,
        )
        assert record is not None
        status = record["status"]
        return Acceptance(
            AcceptOutcome(record["outcome"]),
            record["accepted_fence"],
            EffectStatus(status) if status else None,
            record["run_state"],
            fence,
        )

    async def get(
        self, run_id: str, effect_key: str, *, db: Executor | None = None
    ) -> EffectRecord:
        validate_run_id(run_id)
        validate_effect_key(effect_key)
        record = await (db or self.pool).fetchrow(query("get_effect"), run_id, effect_key)
        if record is None:
            raise EffectNotFound(run_id, effect_key)
        return EffectRecord.from_record(record)

    async def list_effects(
        self, *, run_id: str | None = None, status: EffectStatus | None = None, limit: int = 100
    ) -> list[EffectRecord]:
        if run_id is not None:
            validate_run_id(run_id)
        if not 1 <= limit <= 10_000:
            raise InvalidInput("limit must be between 1 and 10000")
        records = await self.pool.fetch(
            query("list_effects"), run_id, status.value if status else None, limit
        )
        return [EffectRecord.from_record(record) for record in records]

    async def needing_people(self) -> dict[str, int]:
        """How many effects are parked for a person (``parked``) or await an approval
        (``awaiting_approval``)."""
        record = await self.pool.fetchrow(query("effects_needing_people"))
        return {} if record is None else dict(record)

    async def claim(
        self,
        db: Executor,
        dispatcher: str,
        kinds: Sequence[str],
        *,
        limit: int,
        lease_seconds: float,
        trust_sync_replication: bool = False,
        flush_commit: bool = False,
    ) -> list[ClaimedEffect]:
        """``trust_sync_replication``: every send of a lost timeline waited for the standby
        (a required synchronous standby, or dispatchers that wait for one and hold without it),
        so no effect of a lost timeline was sent unseen and none needs a lookup for that
        reason. ``flush_commit``: the claim is flushed at commit (a standby is waited for)."""
        records = await db.fetch(
            query("claim_effects"),
            dispatcher,
            list(kinds),
            limit,
            lease_seconds,
            trust_sync_replication,
            flush_commit,
        )
        return [
            ClaimedEffect(
                EffectRecord.from_record(r),
                EffectStatus(r["previous_status"]),
                r["sent_before"],
                r["reconcile_first"],
            )
            for r in records
        ]

    async def may_dispatch(
        self, db: Executor, effect: EffectRecord, dispatcher: str
    ) -> tuple[bool, bool]:
        """(this dispatcher still holds it, its run is not cancelled)."""
        record = await db.fetchrow(
            query("effect_may_dispatch"), effect.run_id, effect.effect_key, dispatcher, effect.fence
        )
        if record is None:
            return False, False
        return bool(record["dispatcher_ok"]), bool(record["run_ok"])

    async def may_dispatch_many(
        self, db: Executor, dispatcher: str, effects: Sequence[EffectRecord]
    ) -> dict[tuple[str, str], tuple[bool, bool]]:
        """``may_dispatch`` for many effects in one statement, keyed by (run id, effect key);
        an effect that no longer exists is missing from the answer."""
        records = await db.fetch(
            query("effects_may_dispatch"),
            dispatcher,
            [effect.run_id for effect in effects],
            [effect.effect_key for effect in effects],
            [effect.fence for effect in effects],
        )
        return {
            (r["run_id"], r["effect_key"]): (bool(r["dispatcher_ok"]), bool(r["run_ok"]))
            for r in records
        }

    async def requesting_trace(self, db: Executor, effect: EffectRecord) -> str | None:
        """The ``traceparent`` of the attempt that requested ``effect`` (its run and fence), if
        that attempt was traced."""
        value = await db.fetchval(query("attempt_trace"), effect.run_id, effect.fence)
        return None if value is None else str(value)

    async def settle(
        self,
        db: Executor,
        effect: EffectRecord,
        dispatcher: str,
        status: EffectStatus,
        *,
        external_id: str | None = None,
        result: JSON = None,
        error: JSON = None,
        retry_after: float = 0.0,
    ) -> bool:
        record = await db.fetchrow(
            query("settle_effect"),
            effect.run_id,
            effect.effect_key,
            dispatcher,
            status.value,
            external_id,
            result,
            error,
            retry_after,
        )
        return record is not None

    async def settle_many(
        self, db: Executor, dispatcher: str, outcomes: Sequence[SettleRequest]
    ) -> set[tuple[str, str]]:
        """``settle`` for many effects in one statement. Returns the (run id, effect key) pairs
        settled; an effect whose run's row another transaction holds is not, and is settled
        alone with ``settle`` by the caller (see settle_effects in sql/queries.sql)."""
        records = await db.fetch(
            query("settle_effects"),
            dispatcher,
            [o.effect.run_id for o in outcomes],
            [o.effect.effect_key for o in outcomes],
            [o.status.value for o in outcomes],
            [o.external_id for o in outcomes],
            [None if o.result is None else compact(o.result) for o in outcomes],
            [None if o.error is None else compact(o.error) for o in outcomes],
            [o.retry_after for o in outcomes],
        )
        return {(r["run_id"], r["effect_key"]) for r in records}

    async def resolve(
        self,
        run_id: str,
        effect_key: str,
        *,
        sent: bool,
        by: str | None = None,
        external_id: str | None = None,
        actor: Actor | None = None,
    ) -> EffectRecord:
        """A decision on a parked effect by ``actor`` (None: the database role that connected;
        ``by``, a typed name, is kept as a note), in the timeline and the audit trail."""
        if external_id is not None:
            check_text(external_id, "the external id")
            if not 1 <= len(external_id) <= 500:
                raise InvalidInput("the external id must be 1-500 characters")
        acting = Actor.acting(actor, by)
        effect = await self.get(run_id, effect_key)
        record = await decide(
            self.pool,
            "resolve_sent" if sent else "resolve_not_sent",
            acting,
            query("resolve_parked_effect"),
            run_id,
            effect_key,
            sent,
            external_id,
            run_id=run_id,
            effect_key=effect_key,
        )
        if record is None:
            raise InvalidTransition(
                f"effect {effect_key!r} of run {run_id} is {effect.status.value}, not parked; "
                "only parked effects wait for a person's decision"
            )
        return await self.get(run_id, effect_key)
