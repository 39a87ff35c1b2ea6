"""A worker stopped while it holds a schedule's lease: between its claim of the schedule and its
fire. Its lease runs out while it is stopped, another process claims the schedule under a higher
fence and fires its slots; when the stopped one goes on, its fire must be refused and change
nothing (``schedule_checks.py`` judges the slots). Every other ``sigstop_worker`` tries this
first (``process_faults.py``)."""

from __future__ import annotations

import signal

import anyio

from orchestrator.chaos.cluster import Member
from orchestrator.chaos.context import FaultContext, FaultRecord
from orchestrator.chaos.statements import CAMPAIGN_ERRORS, STATEMENT_SECONDS

CATCH_SECONDS = 5.0
"""How long to look for a lease holder before the fault stops the worker it was given."""
SETTLE_SECONDS = 0.05
"""After SIGSTOP: a statement the process had sent already is answered by then."""
HOLDERS = (
    "SELECT DISTINCT lease_owner FROM orchestrator.schedules "
    "WHERE lease_owner IS NOT NULL AND lease_until > clock_timestamp()"
)
HELD_BY = (
    "SELECT name FROM orchestrator.schedules "
    "WHERE lease_owner = $1 AND lease_until > clock_timestamp() ORDER BY name"
)


async def stop_a_schedule_holder(context: FaultContext, record: FaultRecord) -> bool:
    """SIGSTOP a worker caught holding a schedule's lease, for 1.5 leases; whether one was caught
    within ``CATCH_SECONDS`` (a worker stopped but found holding none is continued at once)."""
    cluster = context.cluster
    with anyio.move_on_after(CATCH_SECONDS):
        while True:
            try:
                owners = [
                    row["lease_owner"]
                    for row in await context.pool.fetch(HOLDERS, timeout=STATEMENT_SECONDS)
                ]
            except CAMPAIGN_ERRORS:
                owners = []
            for owner in owners:
                member = cluster.by_name(owner)
                if member is None or member.lock.locked() or not member.alive:
                    continue  # a retired process, or one another fault acts on
                async with member.lock:
                    if await _stop_holding(context, member, record):
                        return True
            await anyio.sleep(0.002)
    return False


async def _stop_holding(context: FaultContext, member: Member, record: FaultRecord) -> bool:
    process = member.process
    if process is None or not member.alive:
        return False
    lease = context.cluster.timing.lease_seconds
    process.send_signal(signal.SIGSTOP)
    try:
        await anyio.sleep(SETTLE_SECONDS)
        try:
            held = await context.pool.fetch(HELD_BY, member.name, timeout=STATEMENT_SECONDS)
        except CAMPAIGN_ERRORS:
            held = []
        if not held or not member.stopped():
            return False
        await context.held_runs(member)
        record.target = member.name
        record.fired = True
        await anyio.sleep(lease * 1.5)
        names = ", ".join(row["name"] for row in held)
        record.detail = f"stopped {lease * 1.5:.1f}s holding the lease of schedules {names}"
        return True
    finally:
        process.send_signal(signal.SIGCONT)
