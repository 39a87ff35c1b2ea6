"""Faults on the network between a member and PostgreSQL, made by the member's proxy: a
partition, replies dropped, and latency."""

from __future__ import annotations

import anyio

from orchestrator.chaos.context import FaultGroup, FaultRecord, ScheduledFault, until

SILENT_MEMBER_SECONDS = 30.0
"""How long a network fault waits for a silent member to speak before it gives up unfired."""


class NetworkFaults(FaultGroup):
    async def partition(self, fault: ScheduledFault, record: FaultRecord) -> None:
        lease = self.context.cluster.timing.lease_seconds
        await self._through_proxy(fault, record, "blackhole", lease * 2)

    async def drop_replies(self, fault: ScheduledFault, record: FaultRecord) -> None:
        lease = self.context.cluster.timing.lease_seconds
        await self._through_proxy(fault, record, "drop_replies", lease)

    async def latency(self, fault: ScheduledFault, record: FaultRecord) -> None:
        await self._through_proxy(fault, record, "latency", 3.0)

    async def _through_proxy(
        self, fault: ScheduledFault, record: FaultRecord, mode: str, seconds: float
    ) -> None:
        members = self.context.cluster.members
        member = members[fault.target % len(members)]
        async with member.lock:
            await self.context.revive(member)
            record.target = member.name
            proxy = member.proxy
            before = proxy.held + proxy.dropped + proxy.delayed
            if member.role == "worker" and mode != "latency":
                await self.context.held_runs(member)
            proxy.mode = mode
            try:
                await anyio.sleep(seconds)
                # An idle process, or one just revived and still starting, may not have spoken
                # yet: hold the fault until it does (bounded).
                await until(
                    lambda: proxy.held + proxy.dropped + proxy.delayed > before,
                    max(seconds, SILENT_MEMBER_SECONDS),
                )
            finally:
                proxy.mode = "forward"
            touched = proxy.held + proxy.dropped + proxy.delayed - before
            record.fired = touched > 0
            record.detail = f"{mode} {seconds:.1f}s, {touched} chunks"
