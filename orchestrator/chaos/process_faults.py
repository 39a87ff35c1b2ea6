"""Faults on the worker and dispatcher processes: SIGSTOP for longer than a lease (every other
worker's while it holds a schedule's lease, ``schedule_faults.py``), SIGKILL and a restart, and a
dispatcher killed the moment a vendor accepted what it sent."""

from __future__ import annotations

import signal

import anyio

from orchestrator.chaos.cluster import Member
from orchestrator.chaos.context import FaultGroup, FaultRecord, ScheduledFault
from orchestrator.chaos.schedule_faults import stop_a_schedule_holder
from orchestrator.chaos.statements import CAMPAIGN_ERRORS, STATEMENT_SECONDS


class ProcessFaults(FaultGroup):
    async def sigstop_worker(self, fault: ScheduledFault, record: FaultRecord) -> None:
        """Every other one stops a worker caught holding a schedule's lease, when one is."""
        if fault.target % 2 == 1 and await stop_a_schedule_holder(self.context, record):
            return
        await self._stop("worker", fault, record)

    async def sigstop_dispatcher(self, fault: ScheduledFault, record: FaultRecord) -> None:
        await self._stop("dispatcher", fault, record)

    async def sigkill_worker(self, fault: ScheduledFault, record: FaultRecord) -> None:
        member = self.context.member("worker", fault)
        async with member.lock:
            await self._kill(member, record)

    async def sigkill_dispatcher(self, fault: ScheduledFault, record: FaultRecord) -> None:
        member = self.context.member("dispatcher", fault)
        async with member.lock:
            await self._kill(member, record)

    async def kill_on_accept(self, fault: ScheduledFault, record: FaultRecord) -> None:
        """The vendor accepts the next new request, then the dispatcher sending it is killed
        before it can confirm: the effect must be reconciled, never sent twice."""
        context = self.context
        done = anyio.Event()

        async def on_accept(key: str) -> bool:
            try:
                killed = await kill_holder(key)
            except CAMPAIGN_ERRORS as error:  # it runs in the vendor's handler: never raise
                record.detail = f"error: {error}"
                killed = False
            if killed or not record.detail.endswith("armed again"):
                done.set()
            return killed

        async def kill_holder(key: str) -> bool:
            holder = await context.pool.fetchval(
                "SELECT dispatcher FROM orchestrator.effects WHERE idempotency_key = $1",
                key,
                timeout=STATEMENT_SECONDS,
            )
            member = context.cluster.by_name(holder) if holder else None
            if member is None:  # settled or taken over meanwhile: the next new request counts
                record.detail = f"no dispatcher held {key}; armed again"
                context.vendor.queue("kill_on_accept", on_accept)
                return False
            acquired = False
            with anyio.move_on_after(10):
                await member.lock.acquire()
                acquired = True
            if not acquired:
                record.detail = f"{member.name} was busy with another fault"
                return False
            try:
                if member.name == holder:
                    await self._kill(member, record)
                    record.detail = f"{key} accepted; {record.detail}"
            finally:
                member.lock.release()
            return record.fired

        context.vendor.queue("kill_on_accept", on_accept)
        record.target = "vendor"
        with anyio.move_on_after(180):  # behind other vendor faults, while dispatchers recover
            await done.wait()

    async def _stop(self, role: str, fault: ScheduledFault, record: FaultRecord) -> None:
        member = self.context.member(role, fault)
        timing = self.context.cluster.timing
        lease = timing.lease_seconds if role == "worker" else timing.dispatch_lease_seconds
        async with member.lock:
            await self.context.revive(member)
            record.target = member.name
            if not member.alive:
                record.detail = "not running"
                return
            assert member.process is not None
            await self.context.held_runs(member)
            member.process.send_signal(signal.SIGSTOP)
            await anyio.sleep(0.05)
            record.fired = member.stopped()
            await anyio.sleep(lease * 1.5)
            member.process.send_signal(signal.SIGCONT)
            record.detail = f"stopped {lease * 1.5:.1f}s"

    async def _kill(self, member: Member, record: FaultRecord) -> None:
        await self.context.revive(member)
        record.target = member.name
        if not member.alive:
            record.detail = "not running"
            return
        await self.context.held_runs(member)
        status = await anyio.to_thread.run_sync(self.context.cluster.kill, member)
        record.fired = status == -signal.SIGKILL
        self.context.cluster.restart(member)
        record.detail = f"restarted as {member.name}"
