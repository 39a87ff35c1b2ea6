"""The campaign's faults: a seeded schedule, and one injector per kind that reports whether the
fault took effect (a stopped process the kernel shows stopped, a proxy that held bytes, a
vendor or model request that met the fault, a backend that was terminated, ...)."""

from __future__ import annotations

import random
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import anyio
import asyncpg

from orchestrator.chaos.cluster import Cluster, Member
from orchestrator.chaos.vendor import ChaosVendor
from orchestrator.db.deadlines import DATABASE_ERRORS
from orchestrator.db.embedded import EmbeddedPostgres
from orchestrator.db.replicated import ReplicatedPostgres, ReplicationError
from orchestrator.effects.approvals import ApprovalStore, Decision, DecisionRefused
from orchestrator.effects.model import Effect, EffectPolicy
from orchestrator.effects.store import EffectStore
from orchestrator.errors import InvalidInput, InvalidTransition, OrchestratorError
from orchestrator.loopback import RateLimited, ScriptedModelServer, ServerError, Slow
from orchestrator.signals import SignalStore

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
)
"""The kinds a campaign schedules unless told otherwise: each works on one server."""
REPLICATED_FAULT_KINDS = ("failover",)
"""Kinds that need a primary and a standby: asked for, they put the campaign on a pair."""
ALL_FAULT_KINDS = (*FAULT_KINDS, *REPLICATED_FAULT_KINDS)
CAMPAIGN_ERRORS: tuple[type[BaseException], ...] = (*DATABASE_ERRORS, OrchestratorError)
"""What a fault (or the campaign's person) may meet: the database restarting or backends being
terminated, or no run to act on."""
STATEMENT_SECONDS = 5.0
CANCEL_ATTEMPTS = 5
CAMPAIGN_APPLICATION = "chaos-campaign"
"""The campaign's own connections, which its faults leave alone."""


@dataclass(frozen=True)
class ScheduledFault:
    at: float
    """Seconds after the fault window opens."""
    kind: str
    target: int
    """Which member (of the kind's role) or candidate, modulo how many there are."""


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


@dataclass
class FaultRecord:
    at: float
    kind: str
    target: str
    fired: bool = False
    detail: str = ""

    def as_json(self) -> dict[str, Any]:
        return {
            "at": round(self.at, 3),
            "kind": self.kind,
            "target": self.target,
            "fired": self.fired,
            "detail": self.detail,
        }


@dataclass
class Faults:
    """What the injectors act on, and what they leave behind for the report."""

    cluster: Cluster
    vendor: ChaosVendor
    model: ScriptedModelServer
    pool: asyncpg.Pool
    """Straight to PostgreSQL, never through a proxy."""
    database: EmbeddedPostgres | ReplicatedPostgres
    started: float
    records: list[FaultRecord] = field(default_factory=list)
    victims: list[tuple[str, int, float]] = field(default_factory=list)
    """(run id, fence, when) of runs a faulted worker held: recovery is measured from them."""
    stale_refused: int = 0
    failover_recovery: list[float] = field(default_factory=list)
    """Seconds from each failover's kill to the first claim the promoted server granted."""
    acting: int = 0
    """Faults injected and not yet over."""
    database_lock: anyio.Lock = field(default_factory=anyio.Lock)
    clients: ClientGate = field(default_factory=lambda: ClientGate())
    """The campaign's own clients (submitter, person) pass it; a failover closes it."""
    failovers: int = 0

    async def inject(self, fault: ScheduledFault) -> FaultRecord:
        record = FaultRecord(time.monotonic() - self.started, fault.kind, "")
        self.records.append(record)
        injector: Callable[[ScheduledFault, FaultRecord], Awaitable[None]] = getattr(
            self, f"_{fault.kind}"
        )
        self.acting += 1
        try:
            await injector(fault, record)
        except CAMPAIGN_ERRORS as error:
            record.detail = f"{record.detail} error: {error}".strip()
        finally:
            self.acting -= 1
        return record

    async def over(self, expected: int, within: float) -> bool:
        """Whether ``expected`` faults were injected and every one ended within ``within``."""
        return await until(lambda: len(self.records) >= expected and not self.acting, within)

    # -- processes ------------------------------------------------------------------------
    def _member(self, role: str, fault: ScheduledFault) -> Member:
        members = self.cluster.of(role)
        return members[fault.target % len(members)]

    async def _held_runs(self, member: Member) -> None:
        if member.role != "worker":
            return
        try:
            rows = await self.pool.fetch(
                "SELECT run_id, fence FROM orchestrator.runs "
                "WHERE state = 'running' AND lease_owner = $1",
                member.name,
                timeout=2,
            )
        except CAMPAIGN_ERRORS:
            return
        now = time.time()
        self.victims.extend((row["run_id"], row["fence"], now) for row in rows)

    async def _stop(self, role: str, fault: ScheduledFault, record: FaultRecord) -> None:
        member = self._member(role, fault)
        timing = self.cluster.timing
        lease = timing.lease_seconds if role == "worker" else timing.dispatch_lease_seconds
        async with member.lock:
            await self._revive(member)
            record.target = member.name
            if not member.alive:
                record.detail = "not running"
                return
            assert member.process is not None
            await self._held_runs(member)
            member.process.send_signal(signal.SIGSTOP)
            await anyio.sleep(0.05)
            record.fired = member.stopped()
            await anyio.sleep(lease * 1.5)
            member.process.send_signal(signal.SIGCONT)
            record.detail = f"stopped {lease * 1.5:.1f}s"

    async def _sigstop_worker(self, fault: ScheduledFault, record: FaultRecord) -> None:
        await self._stop("worker", fault, record)

    async def _sigstop_dispatcher(self, fault: ScheduledFault, record: FaultRecord) -> None:
        await self._stop("dispatcher", fault, record)

    async def _revive(self, member: Member) -> None:
        """A process that exited on its own (PostgreSQL was down when it started) is the
        fault's target still: start it again and give it a moment to connect."""
        for _ in range(3):
            if member.alive:
                return
            self.cluster.restart(member)
            await anyio.sleep(1.0)

    async def _kill(self, member: Member, record: FaultRecord) -> None:
        await self._revive(member)
        record.target = member.name
        if not member.alive:
            record.detail = "not running"
            return
        await self._held_runs(member)
        status = await anyio.to_thread.run_sync(self.cluster.kill, member)
        record.fired = status == -signal.SIGKILL
        self.cluster.restart(member)
        record.detail = f"restarted as {member.name}"

    async def _sigkill_worker(self, fault: ScheduledFault, record: FaultRecord) -> None:
        member = self._member("worker", fault)
        async with member.lock:
            await self._kill(member, record)

    async def _sigkill_dispatcher(self, fault: ScheduledFault, record: FaultRecord) -> None:
        member = self._member("dispatcher", fault)
        async with member.lock:
            await self._kill(member, record)

    async def _kill_on_accept(self, fault: ScheduledFault, record: FaultRecord) -> None:
        """The vendor accepts the next new request, then the dispatcher sending it is killed
        before it can confirm: the effect must be reconciled, never sent twice."""
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
            holder = await self.pool.fetchval(
                "SELECT dispatcher FROM orchestrator.effects WHERE idempotency_key = $1",
                key,
                timeout=STATEMENT_SECONDS,
            )
            member = self.cluster.by_name(holder) if holder else None
            if member is None:  # settled or taken over meanwhile: the next new request counts
                record.detail = f"no dispatcher held {key}; armed again"
                self.vendor.queue("kill_on_accept", on_accept)
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

        self.vendor.queue("kill_on_accept", on_accept)
        record.target = "vendor"
        with anyio.move_on_after(180):  # behind other vendor faults, while dispatchers recover
            await done.wait()

    # -- the network in front of PostgreSQL -----------------------------------------------
    async def _proxy_fault(
        self, fault: ScheduledFault, record: FaultRecord, mode: str, seconds: float
    ) -> None:
        members = self.cluster.members
        member = members[fault.target % len(members)]
        async with member.lock:
            await self._revive(member)
            record.target = member.name
            proxy = member.proxy
            before = proxy.held + proxy.dropped + proxy.delayed
            if member.role == "worker" and mode != "latency":
                await self._held_runs(member)
            proxy.mode = mode
            try:
                await anyio.sleep(seconds)
                # An idle process may not have spoken yet: hold the fault until it does.
                await until(lambda: proxy.held + proxy.dropped + proxy.delayed > before, seconds)
            finally:
                proxy.mode = "forward"
            touched = proxy.held + proxy.dropped + proxy.delayed - before
            record.fired = touched > 0
            record.detail = f"{mode} {seconds:.1f}s, {touched} chunks"

    async def _partition(self, fault: ScheduledFault, record: FaultRecord) -> None:
        await self._proxy_fault(fault, record, "blackhole", self.cluster.timing.lease_seconds * 2)

    async def _drop_replies(self, fault: ScheduledFault, record: FaultRecord) -> None:
        await self._proxy_fault(fault, record, "drop_replies", self.cluster.timing.lease_seconds)

    async def _latency(self, fault: ScheduledFault, record: FaultRecord) -> None:
        await self._proxy_fault(fault, record, "latency", 3.0)

    # -- PostgreSQL -------------------------------------------------------------------------
    async def _pg_terminate_backend(self, fault: ScheduledFault, record: FaultRecord) -> None:
        record.target = "postgres"
        async with self.database_lock:
            ended = await self.pool.fetch(
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

    async def _pg_restart(self, fault: ScheduledFault, record: FaultRecord) -> None:
        record.target = "postgres"
        async with self.database_lock:
            before = await self.pool.fetchval("SELECT pg_postmaster_start_time()")
            await anyio.to_thread.run_sync(self._restart_database)
            after = None
            for _ in range(150):  # up to 30 s for the server to take connections again
                try:
                    after = await self.pool.fetchval(
                        "SELECT pg_postmaster_start_time()", timeout=STATEMENT_SECONDS
                    )
                    break
                except CAMPAIGN_ERRORS:
                    await anyio.sleep(0.2)
        record.fired = after is not None and after != before
        record.detail = "down 0.5s"

    def _restart_database(self) -> None:
        if isinstance(self.database, ReplicatedPostgres):
            self.database.restart_primary(down_seconds=0.5)
        else:
            self.database.restart(down_seconds=0.5)

    async def _failover(self, fault: ScheduledFault, record: FaultRecord) -> None:
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
        pair = self.database
        if not isinstance(pair, ReplicatedPostgres):
            record.detail = "the campaign runs on one server: no standby to promote"
            return
        self.failovers += 1
        cut = 0.0 if self.failovers % 3 == 0 else self.cluster.timing.lease_seconds * 2
        killed_worker = ""
        async with self.database_lock, self.clients.closed(within=30):
            try:
                await anyio.to_thread.run_sync(pair.wait_replayed)
                await self._held_by_all()
                if cut:
                    await anyio.to_thread.run_sync(pair.stop_standby)
                    killed_worker = await self._kill_one_worker(fault)
                    await anyio.sleep(cut)
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
        member = self._member("worker", fault)
        try:
            busiest = await self.pool.fetchval(
                "SELECT lease_owner FROM orchestrator.runs WHERE state = 'running' "
                "GROUP BY lease_owner ORDER BY count(*) DESC, lease_owner LIMIT 1",
                timeout=STATEMENT_SECONDS,
            )
        except CAMPAIGN_ERRORS:
            busiest = None
        member = (self.cluster.by_name(busiest) if busiest else None) or member
        with anyio.move_on_after(5):
            async with member.lock:
                if not member.alive:
                    return ""
                name = member.name
                status = await anyio.to_thread.run_sync(self.cluster.kill, member)
                self.cluster.restart(member)
                return name if status == -signal.SIGKILL else ""
        return ""

    async def _held_by_all(self) -> None:
        for member in self.cluster.of("worker"):
            await self._held_runs(member)

    async def _first_claim_after(self, at: float, *, within: float) -> float | None:
        """When the database granted its first claim after ``at`` (its clock is this host's)."""
        for _ in range(round(within / 0.2)):
            try:
                first = await self.pool.fetchval(
                    "SELECT min(at) FROM orchestrator.run_events "
                    "WHERE kind = 'claimed' AND at > to_timestamp($1)",
                    at,
                    timeout=STATEMENT_SECONDS,
                )
            except CAMPAIGN_ERRORS:
                first = None
            if first is not None:
                return float(first.timestamp())
            await anyio.sleep(0.2)
        return None

    # -- vendors and the model ----------------------------------------------------------------
    async def _vendor(self, record: FaultRecord, kind: str) -> None:
        record.target = "vendor"
        before = self.vendor.fired[kind]
        self.vendor.queue(kind)
        record.fired = await until(lambda: self.vendor.fired[kind] > before, 30)

    async def _vendor_accept_timeout(self, fault: ScheduledFault, record: FaultRecord) -> None:
        await self._vendor(record, "vendor_accept_timeout")

    async def _vendor_5xx(self, fault: ScheduledFault, record: FaultRecord) -> None:
        await self._vendor(record, "vendor_5xx")

    async def _vendor_slow(self, fault: ScheduledFault, record: FaultRecord) -> None:
        await self._vendor(record, "vendor_slow")

    async def _model(self, record: FaultRecord, fault: RateLimited | ServerError | Slow) -> None:
        record.target = "model"
        name = type(fault).__name__
        before = self.model.faults_taken[name]
        self.model.fail_next(fault)
        record.fired = await until(lambda: self.model.faults_taken[name] > before, 30)

    async def _model_429(self, fault: ScheduledFault, record: FaultRecord) -> None:
        await self._model(record, RateLimited(retry_after=0.2))

    async def _model_500(self, fault: ScheduledFault, record: FaultRecord) -> None:
        await self._model(record, ServerError(500))

    async def _model_slow(self, fault: ScheduledFault, record: FaultRecord) -> None:
        await self._model(record, Slow(self.cluster.timing.lease_seconds * 1.5))

    # -- people and callers -------------------------------------------------------------------
    async def _pick(self, sql: str, fault: ScheduledFault, within: float = 20) -> asyncpg.Record:
        """A row of ``sql``'s candidates (``target`` picks which), waiting for one to exist."""
        for _ in range(round(within / 0.2)):
            try:
                rows = await self.pool.fetch(sql, timeout=STATEMENT_SECONDS)
            except CAMPAIGN_ERRORS:  # PostgreSQL restarting: look again
                rows = []
            if rows:
                return rows[fault.target % len(rows)]
            await anyio.sleep(0.2)
        raise NoCandidate(f"none within {within:g}s")

    async def _cancel(self, fault: ScheduledFault, record: FaultRecord) -> None:
        # A run picked while live may finish before the cancel lands; pick again, a few times.
        for _ in range(CANCEL_ATTEMPTS):
            row = await self._pick(
                "SELECT run_id FROM orchestrator.runs "
                "WHERE state IN ('queued', 'running', 'waiting') ORDER BY run_id LIMIT 50",
                fault,
            )
            record.target = row["run_id"]
            try:
                await _cancel_run(self.pool, row["run_id"])
            except InvalidTransition as error:
                record.detail = str(error)
                continue
            record.fired = True
            record.detail = ""
            return

    async def _late_approval(self, fault: ScheduledFault, record: FaultRecord) -> None:
        """Approve a request whose time ran out (denied by expiry): it must stay unsent."""
        row = await self._pick(
            "SELECT run_id, effect_key, payload_sha256 FROM orchestrator.effects "
            "WHERE requires_approval AND decided_by = 'expiry' ORDER BY decided_at DESC LIMIT 20",
            fault,
            within=60,
        )
        await self._decide_late(row, Decision.APPROVED, record)

    async def _late_denial(self, fault: ScheduledFault, record: FaultRecord) -> None:
        """Deny a request a person already approved: the approval stands."""
        row = await self._pick(
            "SELECT run_id, effect_key, payload_sha256 FROM orchestrator.effects "
            "WHERE requires_approval AND approved_sha256 IS NOT NULL "
            "ORDER BY decided_at DESC LIMIT 20",
            fault,
        )
        await self._decide_late(row, Decision.DENIED, record)

    async def _decide_late(
        self, row: asyncpg.Record, decision: Decision, record: FaultRecord
    ) -> None:
        record.target = f"{row['run_id']}/{row['effect_key']}"
        try:
            await ApprovalStore(self.pool).decide(
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

    async def _duplicate_signal(self, fault: ScheduledFault, record: FaultRecord) -> None:
        """``go`` twice under one key (the second must be the first), then once more without."""
        row = await self._pick(
            "SELECT run_id FROM orchestrator.runs WHERE state IN ('queued', 'running', 'waiting') "
            "AND (input->>'signal')::boolean ORDER BY run_id LIMIT 50",
            fault,
        )
        run_id = row["run_id"]
        record.target = run_id
        signals = SignalStore(self.pool)
        try:
            first = await signals.send(run_id, "go", {"by": "chaos"}, idempotency_key="go-twice")
            again = await signals.send(run_id, "go", {"by": "chaos"}, idempotency_key="go-twice")
            await signals.send(run_id, "go", {"by": "chaos, unkeyed"})
        except InvalidTransition as error:
            record.detail = str(error)
            return
        record.fired = not again.created and again.signal.seq == first.signal.seq
        record.detail = f"signal #{first.signal.seq} twice, then an unkeyed one"

    async def _stale_request(self, fault: ScheduledFault, record: FaultRecord) -> None:
        """Present the boundary a fence the run has moved past: it must refuse it."""
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
        async with self.pool.acquire() as connection, connection.transaction():
            acceptance = await EffectStore(self.pool).accept(
                connection, run_id, fence, effect, worker_id="chaos-stale"
            )
        record.fired = True
        record.detail = acceptance.outcome.value
        if acceptance.outcome.value == "stale":
            self.stale_refused += 1


class ClientGate:
    """Many clients pass at once (``open``); a failover closes the gate (``closed``): it waits,
    bounded, for the clients inside to leave and keeps new ones out until it reopens."""

    def __init__(self) -> None:
        self._lock = anyio.Lock()
        self.inside = 0

    @asynccontextmanager
    async def open(self) -> AsyncIterator[None]:
        async with self._lock:
            self.inside += 1
        try:
            yield
        finally:
            self.inside -= 1

    @asynccontextmanager
    async def closed(self, *, within: float) -> AsyncIterator[None]:
        async with self._lock:
            await until(lambda: self.inside == 0, within)
            yield


async def until(condition: Callable[[], bool], within: float, step: float = 0.05) -> bool:
    """Whether ``condition`` held within ``within`` seconds (polled: it reads counters)."""
    for _ in range(max(1, round(within / step))):
        if condition():
            return True
        await anyio.sleep(step)
    return condition()


class NoCandidate(OrchestratorError):
    """No run or request the fault could act on appeared in time."""


async def _cancel_run(pool: asyncpg.Pool, run_id: str) -> None:
    from orchestrator.db.store import RunStore

    await RunStore(pool).cancel(run_id, reason="chaos")
