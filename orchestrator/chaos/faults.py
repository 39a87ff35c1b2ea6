"""The campaign's faults: a seeded schedule, and one injector per kind that reports whether the
fault took effect (a stopped process the kernel shows stopped, a proxy that held bytes, a
vendor or model request that met the fault, a backend that was terminated, agents cut over to
the version a deploy started, ...). The injectors live in groups by what they act on;
``Faults`` sends each scheduled fault to its group."""

from __future__ import annotations

import random
import time
from collections.abc import Awaitable, Callable, Sequence

from orchestrator.chaos.caller_faults import CallerFaults
from orchestrator.chaos.context import FaultContext, FaultRecord, ScheduledFault, until
from orchestrator.chaos.database_faults import DatabaseFaults
from orchestrator.chaos.deploy_faults import DeployFaults
from orchestrator.chaos.network_faults import NetworkFaults
from orchestrator.chaos.process_faults import ProcessFaults
from orchestrator.chaos.service_faults import ServiceFaults
from orchestrator.chaos.statements import CAMPAIGN_ERRORS
from orchestrator.errors import InvalidInput

FAULT_KINDS = (
    "sigstop_worker",
    "sigstop_dispatcher",
    "sigkill_worker",
    "sigkill_dispatcher",
    "kill_on_accept",
    "partition",
    "drop_replies",
    "latency",
    "pg_terminate_backend",
    "pg_restart",
    "vendor_accept_timeout",
    "vendor_5xx",
    "vendor_slow",
    "model_429",
    "model_500",
    "model_slow",
    "cancel",
    "late_approval",
    "late_denial",
    "duplicate_signal",
    "stale_request",
    "deploy",
)
"""The kinds a campaign schedules unless told otherwise: each works on one server."""
REPLICATED_FAULT_KINDS = ("failover",)
"""Kinds that need a primary and a standby: asked for, they put the campaign on a pair."""
ALL_FAULT_KINDS = (*FAULT_KINDS, *REPLICATED_FAULT_KINDS)

Injector = Callable[[ScheduledFault, FaultRecord], Awaitable[None]]
"""Injects one scheduled fault and fills in its record (target, whether it fired, detail)."""


def schedule(
    seed: int, duration: float, rate: float, kinds: Sequence[str] = FAULT_KINDS
) -> list[ScheduledFault]:
    """``rate`` faults per second on average over ``duration``, as many of each of ``kinds``
    (at least one), at times drawn from ``seed``."""
    unknown = sorted(set(kinds) - set(ALL_FAULT_KINDS))
    if unknown or not kinds:
        raise InvalidInput(
            f"unknown fault kinds {unknown}: choose from {', '.join(ALL_FAULT_KINDS)}"
            if unknown
            else "no fault kinds chosen"
        )
    rng = random.Random(seed)
    each = max(1, round(duration * rate / len(kinds)))
    faults = [
        ScheduledFault(rng.uniform(0, duration), kind, rng.randrange(1 << 30))
        for kind in kinds
        for _ in range(each)
    ]
    return sorted(faults, key=lambda fault: fault.at)


class Faults:
    """Injects each scheduled fault through the group that acts on its kind, and keeps the
    records and counts the report reads."""

    def __init__(self, context: FaultContext) -> None:
        self.context = context
        self.records: list[FaultRecord] = []
        self.acting = 0
        """Faults injected and not yet over."""
        self._database = DatabaseFaults(context)
        self._callers = CallerFaults(context)
        groups = (
            ProcessFaults(context),
            NetworkFaults(context),
            self._database,
            ServiceFaults(context),
            self._callers,
            DeployFaults(context),
        )
        self._injectors: dict[str, Injector] = {
            kind: getattr(group, kind)
            for group in groups
            for kind in ALL_FAULT_KINDS
            if hasattr(group, kind)
        }
        assert sorted(self._injectors) == sorted(ALL_FAULT_KINDS), "a kind without an injector"

    @property
    def stale_refused(self) -> int:
        return self._callers.stale_refused

    @property
    def failover_recovery(self) -> list[float]:
        """Seconds from each failover's kill to the first claim the promoted server granted."""
        return self._database.failover_recovery

    async def inject(self, fault: ScheduledFault) -> FaultRecord:
        record = FaultRecord(time.monotonic() - self.context.started, fault.kind, "")
        self.records.append(record)
        self.acting += 1
        try:
            await self._injectors[fault.kind](fault, record)
        except CAMPAIGN_ERRORS as error:
            record.detail = f"{record.detail} error: {error}".strip()
        finally:
            self.acting -= 1
        return record

    async def over(self, expected: int, within: float) -> bool:
        """Whether ``expected`` faults were injected and every one ended within ``within``."""
        return await until(lambda: len(self.records) >= expected and not self.acting, within)
