"""The client's handles on what runs wait for and what operators do: ``client.effects``,
``client.approvals``, ``client.signals``, ``client.budgets``, ``client.limits`` and
``client.ops``. Each is a thin
layer over the stores that projects driver errors onto ``DatabaseError``."""

from __future__ import annotations

import builtins
from datetime import datetime, timedelta
from typing import Any, TypeVar, Unpack

from orchestrator.client.stores import Stores
from orchestrator.db.budgets import BudgetState, LedgerEntry, TopUp
from orchestrator.db.error_projection import project_errors
from orchestrator.db.limits import Limit, Per
from orchestrator.db.purges import Purged, purge
from orchestrator.db.rates import RateLimit, RateNumbers
from orchestrator.db.retention import PURGE_BATCH
from orchestrator.db.signals import Signal
from orchestrator.db.standby_wait import acknowledgement_seconds
from orchestrator.effect_model import EffectRecord, EffectStatus
from orchestrator.effects.approvals import Decision
from orchestrator.errors import InvalidInput
from orchestrator.models import JSON, WorkerInfo

T = TypeVar("T")


class StoresHandle:
    """A client handle: a thin layer over the client's stores."""

    def __init__(self, stores: Stores) -> None:
        self._stores = stores

    async def _held(self, done: T, within: float | None) -> T:
        """``done`` once a standby holds it, when the caller asked to wait for one."""
        await self._stores.held_by_standby(within)
        return done


class EffectsHandle(StoresHandle):
    """Effect records at the fenced boundary: list, get, and resolve parked ones."""

    @project_errors
    async def list(
        self, *, run_id: str | None = None, status: EffectStatus | None = None, limit: int = 100
    ) -> builtins.list[EffectRecord]:
        """Effect records, newest first."""
        return await self._stores.effects.list_effects(run_id=run_id, status=status, limit=limit)

    @project_errors
    async def get(self, run_id: str, effect_key: str) -> EffectRecord:
        return await self._stores.effects.get(run_id, effect_key)

    @project_errors
    async def resolve(
        self,
        run_id: str,
        effect_key: str,
        *,
        sent: bool,
        by: str | None = None,
        external_id: str | None = None,
    ) -> EffectRecord:
        """A person's decision on a parked effect, after checking with the vendor by hand:
        ``sent`` confirms it, otherwise it is sent again. The principal recorded is the
        database role the client connected as; ``by`` is kept as a note."""
        return await self._stores.effects.resolve(
            run_id, effect_key, sent=sent, by=by, external_id=external_id
        )


class ApprovalsHandle(StoresHandle):
    """Effects awaiting a person's decision. Calling the handle lists them, as the flat
    ``client.approvals(...)`` method did."""

    async def __call__(
        self, *, run_id: str | None = None, limit: int = 100
    ) -> builtins.list[EffectRecord]:
        return await self.list(run_id=run_id, limit=limit)

    @project_errors
    async def list(
        self, *, run_id: str | None = None, limit: int = 100
    ) -> builtins.list[EffectRecord]:
        """Effects awaiting a person's decision, oldest first."""
        return await self._stores.approvals.pending(run_id=run_id, limit=limit)

    @project_errors
    async def approve(
        self,
        run_id: str,
        effect_key: str,
        *,
        by: str | None = None,
        payload_sha256: str,
        note: str | None = None,
        run_fence: int | None = None,
        wait_for_standby: bool | float | None = False,
    ) -> EffectRecord:
        """Approve the payload the person saw (its ``payload_sha256``); refused if it changed.
        ``wait_for_standby``: return once a standby holds the decision (see ``runs.submit``)."""
        options = {"by": by, "note": note, "run_fence": run_fence}
        return await self._decide(
            run_id, effect_key, Decision.APPROVED, payload_sha256, wait_for_standby, **options
        )

    @project_errors
    async def deny(
        self,
        run_id: str,
        effect_key: str,
        *,
        by: str | None = None,
        note: str | None = None,
        payload_sha256: str | None = None,
        run_fence: int | None = None,
        wait_for_standby: bool | float | None = False,
    ) -> EffectRecord:
        """Deny it; the model is told "denied by reviewer: NOTE"."""
        options = {"by": by, "note": note, "run_fence": run_fence}
        return await self._decide(
            run_id, effect_key, Decision.DENIED, payload_sha256, wait_for_standby, **options
        )

    async def _decide(
        self,
        run_id: str,
        effect_key: str,
        decision: Decision,
        payload_sha256: str | None,
        wait_for_standby: bool | float | None,
        **options: Any,
    ) -> EffectRecord:
        within = acknowledgement_seconds(wait_for_standby)
        decided = await self._stores.approvals.decide(
            run_id, effect_key, decision, payload_sha256=payload_sha256, **options
        )
        return await self._held(decided, within)


class SignalsHandle(StoresHandle):
    """Messages to runs, stored durably and consumed exactly once."""

    @project_errors
    async def send(
        self,
        run_id: str,
        name: str,
        data: JSON = None,
        *,
        idempotency_key: str | None = None,
        wait_for_standby: bool | float | None = False,
    ) -> Signal:
        """Send ``run_id`` a signal (stored durably; the same key twice is one signal).
        ``wait_for_standby``: return once a standby holds it (see ``runs.submit``)."""
        within = acknowledgement_seconds(wait_for_standby)
        sent = await self._stores.signals.send(run_id, name, data, idempotency_key=idempotency_key)
        return await self._held(sent.signal, within)

    @project_errors
    async def list(
        self, run_id: str, *, newest: int | None = None
    ) -> builtins.list[tuple[Signal, datetime | None, int | None]]:
        """The run's signals (or its ``newest``), oldest first, each with when and by which
        fence it was consumed (``None`` while it waits)."""
        return await self._stores.signals_of(run_id, newest=newest)


class BudgetsHandle(StoresHandle):
    """What runs may spend on models: read a budget and its ledger, top it up."""

    @project_errors
    async def get(self, run_id: str) -> BudgetState | None:
        """The run's budget; ``None`` if its agent declares none or it made no model call."""
        return await self._stores.budget_of(run_id)

    @project_errors
    async def ledger(self, run_id: str) -> builtins.list[LedgerEntry]:
        """Every reservation and settlement of the run's budget, oldest first."""
        return await self._stores.ledger_of(run_id)

    @project_errors
    async def top_up(self, run_id: str, **amounts: Unpack[TopUp]) -> BudgetState:
        """Raise a run's budget (``cost_usd=``, ``turns=``, ...) and wake it if it waits."""
        return await self._stores.top_up(run_id, **amounts)


class LimitsHandle(StoresHandle):
    """Flow control (docs/flow-control.md): how many runs of an agent run at once, and the rate
    limits every process shares. Each change is an audited decision of the connected login."""

    @project_errors
    async def list(self, agent: str | None = None) -> builtins.list[Limit]:
        """Every limit (of ``agent``), with the runs it counts now and the due runs it covers."""
        return await self._stores.limits.list(agent)

    @project_errors
    async def set(
        self, agent: str, max_running: int, *, keys: str = "*", per: Per = "all"
    ) -> int | None:
        """Set a limit (raise or lower it) from the next claim on; returns the one it replaced."""
        return await self._stores.limits.set(agent, max_running, key_pattern=keys, per=per)

    @project_errors
    async def clear(self, agent: str, *, keys: str = "*", per: Per = "all") -> int:
        """Remove a limit; returns what it was (``InvalidInput`` when there is none)."""
        return await self._stores.limits.clear(agent, key_pattern=keys, per=per)

    @project_errors
    async def rates(self, name: str | None = None) -> builtins.list[RateLimit]:
        """Every rate limit (or ``name``): what is left now, a provider's pause, runs waiting."""
        return await self._stores.rates.list(name)

    @project_errors
    async def set_rate(self, name: str, **numbers: Unpack[RateNumbers]) -> None:
        """Set rate limit ``name`` (``model:MODEL``, ``effect:KIND`` or a step's own):
        ``requests=``, ``tokens=`` per ``per_seconds=`` (60)."""
        await self._stores.rates.set(name, **numbers)

    @project_errors
    async def clear_rate(self, name: str) -> None:
        """Remove rate limit ``name`` and any pause on it."""
        await self._stores.rates.clear(name)


class OpsHandle(StoresHandle):
    """What an operator looks at and does: the queue, the workers, purging old runs."""

    @project_errors
    async def queue_stats(self) -> builtins.list[dict[str, Any]]:
        """Per agent: runs queued, due, running and waiting, and the oldest due run's age."""
        return await self._stores.runs.queue_stats()

    @project_errors
    async def workers(self) -> builtins.list[WorkerInfo]:
        """Registered workers, alive or dead, with the runs each holds."""
        return await self._stores.workers.list_workers(self._stores.pool)

    @project_errors
    async def purgeable(self, older_than: timedelta) -> int:
        """How many finished runs a purge of those ``older_than`` would delete now."""
        return await self._stores.purges.count(await self._stores.purge_cutoff(older_than))

    @project_errors
    async def purge(self, older_than: timedelta, *, batch: int = PURGE_BATCH) -> Purged:
        """Delete finished runs older than ``older_than`` (by the database clock) with all
        their rows, ``batch`` runs per short transaction."""
        if not 1 <= batch <= 10_000:
            raise InvalidInput(f"a purge batch is 1 to 10000 runs, not {batch!r}")
        return await purge(
            self._stores.pool, await self._stores.purge_cutoff(older_than), batch=batch
        )
