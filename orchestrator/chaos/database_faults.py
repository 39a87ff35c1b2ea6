"""Faults on PostgreSQL itself: backends terminated, the server restarted, and (on a replicated
pair) a failover to the standby."""

from __future__ import annotations

import signal
import time

import anyio
import asyncpg

from orchestrator.chaos.context import FaultContext, FaultGroup, FaultRecord, ScheduledFault
from orchestrator.chaos.grants import read_grants
from orchestrator.chaos.statements import CAMPAIGN_APPLICATION, CAMPAIGN_ERRORS, STATEMENT_SECONDS
from orchestrator.testing.replicated import ReplicatedPostgres, ReplicationError


class DatabaseFaults(FaultGroup):
    def __init__(self, context: FaultContext) -> None:
        super().__init__(context)
        self.lock = anyio.Lock()
        """One fault on the database at a time."""
        self.failovers = 0
        self.failover_recovery: list[float] = []
        """Seconds from each failover's kill to the first claim the promoted server granted."""

    async def pg_terminate_backend(self, fault: ScheduledFault, record: FaultRecord) -> None:
        record.target = "postgres"
        async with self.lock:
            ended = await self.context.pool.fetch(
                "SELECT application_name, pg_terminate_backend(pid) AS ended "
                "FROM pg_stat_activity WHERE datname = current_database() "
                "AND backend_type = 'client backend' AND application_name <> $1 "
                "ORDER BY random() LIMIT 2",
                CAMPAIGN_APPLICATION,
                timeout=STATEMENT_SECONDS,
            )
        names = [row["application_name"] for row in ended if row["ended"]]
        record.fired = bool(names)
        record.detail = ", ".join(names)

    async def pg_restart(self, fault: ScheduledFault, record: FaultRecord) -> None:
        pool = self.context.pool
        record.target = "postgres"
        async with self.lock:
            before = await pool.fetchval("SELECT pg_postmaster_start_time()")
            await anyio.to_thread.run_sync(self._restart_database)
            after = None
            for _ in range(150):  # up to 30 s for the server to take connections again
                try:
                    after = await pool.fetchval(
                        "SELECT pg_postmaster_start_time()", timeout=STATEMENT_SECONDS
                    )
                    break
                except CAMPAIGN_ERRORS:
                    await anyio.sleep(0.2)
        record.fired = after is not None and after != before
        record.detail = "down 0.5s"

    def _restart_database(self) -> None:
        database = self.context.database
        if isinstance(database, ReplicatedPostgres):
            database.restart_primary(down_seconds=0.5)
        else:
            database.restart(down_seconds=0.5)

    async def failover(self, fault: ScheduledFault, record: FaultRecord) -> None:
        """The primary dies and the standby takes over; a new standby is seeded so that the
        next failover can happen. Two in three (the first two, the fourth, the fifth, ...) first
        cut the standby off for two leases and SIGKILL a worker as the cut begins: its runs are
        taken over, claimed and stepped on the primary alone, and effects are accepted and
        dispatched there, all of which the promoted server never sees.

        The campaign's own clients (submitter, person) pause meanwhile, and what they were told
        had committed is replayed on the standby first: on an asynchronous standby a failover
        may take back a submit or an approval its client heard succeed, the topology's
        documented limit (docs/high-availability.md), not a fence or a send orchestrator
        repeats. What the failover takes back here is the cluster's own work."""
        record.target = "postgres"
        pair = self.context.database
        if not isinstance(pair, ReplicatedPostgres):
            record.detail = "the campaign runs on one server: no standby to promote"
            return
        self.failovers += 1
        cut = 0.0 if self.failovers % 3 == 0 else self.context.cluster.timing.lease_seconds * 2
        killed_worker = ""
        async with self.lock, self.context.clients.closed(within=30):
            try:
                await anyio.to_thread.run_sync(pair.wait_replayed)
                await self._held_by_all()
                if cut:
                    await anyio.to_thread.run_sync(pair.stop_standby)
                    cut_began = time.time()
                    killed_worker = await self._kill_one_worker(fault)
                    await anyio.sleep(cut)
                    # A busy machine may take longer than the cut to take the killed worker's
                    # runs over: a worker must have run a step under a claim the primary alone
                    # granted (bounded) for the promoted server to be tested on never granting
                    # that fence again.
                    await self._a_step_under_a_lost_claim(cut_began, within=30)
                killed = time.time()
                done = await anyio.to_thread.run_sync(pair.failover)
            except ReplicationError as error:  # not fired: the campaign fails, naming it
                record.detail = f"the pair failed: {error}"
                return
        record.fired = done.new_timeline > done.old_timeline
        cut_off = f"standby cut off {cut:.1f}s first" if cut else "no cut: killed at once"
        if killed_worker:
            cut_off += f" ({killed_worker} SIGKILLed as it began)"
        record.detail = (
            f"{cut_off}; timeline {done.old_timeline}→{done.new_timeline}; promoted "
            f"{done.kill_seconds + done.promote_seconds:.1f}s after the kill, new standby "
            f"seeded in {done.reseed_seconds:.1f}s"
        )
        first = await self._first_claim_after(killed, within=60)
        if first is not None:
            self.failover_recovery.append(first - killed)
            record.detail += f"; first claim {first - killed:.1f}s after the kill"

    async def _kill_one_worker(self, fault: ScheduledFault) -> str:
        """SIGKILL the worker holding the most runs (the fault's, if none holds any) unless
        another fault holds it for 5 s, and restart it; its name, or ``""``."""
        cluster = self.context.cluster
        member = self.context.member("worker", fault)
        try:
            busiest = await self.context.pool.fetchval(
                "SELECT lease_owner FROM orchestrator.runs WHERE state = 'running' "
                "GROUP BY lease_owner ORDER BY count(*) DESC, lease_owner LIMIT 1",
                timeout=STATEMENT_SECONDS,
            )
        except CAMPAIGN_ERRORS:
            busiest = None
        member = (cluster.by_name(busiest) if busiest else None) or member
        with anyio.move_on_after(5):
            async with member.lock:
                if not member.alive:
                    return ""
                name = member.name
                status = await anyio.to_thread.run_sync(cluster.kill, member)
                cluster.restart(member)
                return name if status == -signal.SIGKILL else ""
        return ""

    async def _held_by_all(self) -> None:
        for member in self.context.cluster.of("worker"):
            await self.context.held_runs(member)

    async def _a_step_under_a_lost_claim(self, since: float, *, within: float) -> None:
        """Wait (bounded) until a worker recorded a step under a claim granted after ``since``:
        during a cut the promoted server never learns of that claim."""
        directory = self.context.cluster.grants_dir
        for _ in range(round(within / 0.2)):
            claims = {(row["run_id"], row["fence"]) for row in await self._claims_after(since)}
            if claims and directory is None:
                return
            if claims and directory is not None:
                grants = await anyio.to_thread.run_sync(read_grants, directory)
                if any((grant.run_id, grant.fence) in claims for grant in grants):
                    return
            await anyio.sleep(0.2)

    async def _first_claim_after(self, at: float, *, within: float) -> float | None:
        """When the database granted its first claim after ``at`` (its clock is this host's)."""
        for _ in range(round(within / 0.2)):
            claims = await self._claims_after(at)
            if claims:
                return min(float(row["at"].timestamp()) for row in claims)
            await anyio.sleep(0.2)
        return None

    async def _claims_after(self, at: float) -> list[asyncpg.Record]:
        """The claims the database granted after ``at`` (none while it cannot answer)."""
        try:
            return await self.context.pool.fetch(
                "SELECT run_id, fence, at FROM orchestrator.run_events "
                "WHERE kind = 'claimed' AND at > to_timestamp($1)",
                at,
                timeout=STATEMENT_SECONDS,
            )
        except CAMPAIGN_ERRORS:
            return []
