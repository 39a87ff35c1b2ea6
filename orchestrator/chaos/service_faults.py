"""Faults in the HTTP services the cluster calls: a vendor that times out, fails or is slow,
and a model that rate-limits, fails or is slow."""

from __future__ import annotations

from orchestrator.chaos.context import FaultGroup, FaultRecord, ScheduledFault, until
from orchestrator.testing.loopback import RateLimited, ServerError, Slow


class ServiceFaults(FaultGroup):
    async def vendor_accept_timeout(self, fault: ScheduledFault, record: FaultRecord) -> None:
        await self._vendor(record, "vendor_accept_timeout")

    async def vendor_5xx(self, fault: ScheduledFault, record: FaultRecord) -> None:
        await self._vendor(record, "vendor_5xx")

    async def vendor_slow(self, fault: ScheduledFault, record: FaultRecord) -> None:
        await self._vendor(record, "vendor_slow")

    async def model_429(self, fault: ScheduledFault, record: FaultRecord) -> None:
        await self._model(record, RateLimited(retry_after=0.2))

    async def model_500(self, fault: ScheduledFault, record: FaultRecord) -> None:
        await self._model(record, ServerError(500))

    async def model_slow(self, fault: ScheduledFault, record: FaultRecord) -> None:
        await self._model(record, Slow(self.context.cluster.timing.lease_seconds * 1.5))

    async def _vendor(self, record: FaultRecord, kind: str) -> None:
        vendor = self.context.vendor
        record.target = "vendor"
        before = vendor.fired[kind]
        vendor.queue(kind)
        record.fired = await until(lambda: vendor.fired[kind] > before, 30)

    async def _model(self, record: FaultRecord, fault: RateLimited | ServerError | Slow) -> None:
        model = self.context.model
        record.target = "model"
        name = type(fault).__name__
        before = model.faults_taken[name]
        model.fail_next(fault)
        record.fired = await until(lambda: model.faults_taken[name] > before, 30)
