"""A chaos campaign: a cluster on its own embedded PostgreSQL (or a primary and a streaming
standby, for failovers), a steady workload and schedules firing, faults from a seeded schedule,
then heal, quiescence (bounded) and the checker.

The campaign's own connections go straight to PostgreSQL; every worker and dispatcher goes
through a ``FaultProxy`` of its own (one per server of a pair, behind a multi-host DSN).
Everything listens on 127.0.0.1.
"""

from __future__ import annotations

import importlib.util
import json
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import asyncpg

from orchestrator.access import Actor
from orchestrator.chaos.agents import CHAOS_SCRIPT, LEAF, MCP_SERVER, MCP_URL_ENV, tools_prompt
from orchestrator.chaos.checker import check
from orchestrator.chaos.cluster import Cluster, Timing
from orchestrator.chaos.context import ClientGate, FaultContext, FaultRecord, ScheduledFault
from orchestrator.chaos.faults import (
    ALL_FAULT_KINDS,
    FAULT_KINDS,
    REPLICATED_FAULT_KINDS,
    Faults,
    schedule,
)
from orchestrator.chaos.findings import TERMINAL, Findings
from orchestrator.chaos.grants import read_grants
from orchestrator.chaos.limits import (
    CAMPAIGN_LIMITS,
    KEYED_SHARE,
    CampaignLimit,
    LimitSampler,
    concurrency_key,
    set_limits,
)
from orchestrator.chaos.proxies import MemberProxy
from orchestrator.chaos.schedule_checks import refused_fires
from orchestrator.chaos.schedules import (
    CAMPAIGN_SCHEDULES,
    PENDING,
    CampaignSchedule,
    create_schedules,
)
from orchestrator.chaos.statements import CAMPAIGN_APPLICATION, CAMPAIGN_ERRORS
from orchestrator.chaos.vendor import ChaosVendor
from orchestrator.db.budgets import BudgetStore
from orchestrator.db.connections import connect, create_pool
from orchestrator.db.embedded import EmbeddedPostgres
from orchestrator.db.migrations import migrate
from orchestrator.db.signals import SignalStore
from orchestrator.db.store import RunStore
from orchestrator.effects.approvals import ApprovalStore, Decision, DecisionRefused
from orchestrator.errors import InvalidInput, OrchestratorError
from orchestrator.settings import Settings
from orchestrator.testing.loopback import FaultProxy, ScriptedModelServer
from orchestrator.testing.replicated import ReplicatedPostgres

SERVER_SETTINGS = {
    # Durability across a machine crash is not under test; a restart is a clean shutdown.
    "fsync": "off",
    "full_page_writes": "off",
    "synchronous_commit": "on",
    "max_connections": "400",
}
PAIR_SETTINGS = {"max_connections": "400"}
"""A replicated pair sets its own durability (``fsync`` off, ``synchronous_commit`` on) and
keeps full-page writes, which a base backup needs."""
FAULT_SHARE = 0.85
AGENTS = ("chaos_steps", "chaos_tools", "chaos_tree")
SPAWNED = {"chaos_tree": (LEAF,)}
"""The agents of the children each agent of the workload starts: limited as the workload's."""


PERSON = Actor.acting(None, "chaos-person")
"""Who the campaign's decisions are by (the database role, with this note)."""


@dataclass(frozen=True)
class CampaignConfig:
    seed: int = 1
    duration: float = 60.0
    """Seconds of the fault window: the workload is submitted over all of it, the faults are
    scheduled over its first 85%."""
    runs: int = 200
    workers: int = 3
    dispatchers: int = 2
    fault_rate: float = 1.0
    """Faults per second, on average, over the fault window."""
    kinds: Sequence[str] = FAULT_KINDS
    """Which faults to schedule (each at least once)."""
    settle_seconds: float = 180.0
    """How long quiescence may take after healing before unfinished runs count as lost."""
    timing: Timing = field(default_factory=Timing)
    work_dir: Path | None = None
    """Where the embedded server, configs and process logs live; a temporary directory (removed
    after a passing campaign) by default."""
    command: Sequence[str] = (sys.executable, "-m", "orchestrator.cli")
    """How members are launched (a deliberately broken build is launched another way)."""
    env: dict[str, str] = field(default_factory=dict)
    after_migrate: str | None = None
    """SQL run once after the schema is migrated (a broken build of the database side)."""
    agents: Sequence[str] = AGENTS
    """The workload's agents, submitted in turn."""
    replicated: bool = False
    """Run on a primary with an asynchronous streaming standby (``ReplicatedPostgres``), the
    members reaching it by a multi-host DSN. Implied by a kind that needs it (``failover``)."""
    keyed_share: float = KEYED_SHARE
    """How many of the runs carry a concurrency key (``limits.KEYS``, skewed)."""
    limits: Sequence[CampaignLimit] = CAMPAIGN_LIMITS
    """Set on every agent of the workload before the workers start; the checker samples them."""
    schedules: Sequence[CampaignSchedule] = CAMPAIGN_SCHEDULES
    """Created once the workers serve, ending with the fault window (``schedules.py``)."""

    @property
    def on_pair(self) -> bool:
        return self.replicated or any(kind in REPLICATED_FAULT_KINDS for kind in self.kinds)


@dataclass
class Report:
    seed: int
    duration: float
    runs_submitted: int
    findings: Findings
    faults: list[FaultRecord]
    scheduled: Counter[str]
    recovery_seconds: list[float]
    restarts: int
    exits: list[tuple[str, int | None]]
    stale_requests_refused: int
    elapsed: float
    work_dir: Path
    replicated: bool = False
    failover_recovery_seconds: list[float] = field(default_factory=list)
    agents: Sequence[str] = AGENTS
    runs_keyed: int = 0

    @property
    def unfired(self) -> list[FaultRecord]:
        return [record for record in self.faults if not record.fired]

    @property
    def passed(self) -> bool:
        return not self.findings.violations and not self.unfired

    def fired(self) -> Counter[str]:
        return Counter(record.kind for record in self.faults if record.fired)

    def recovery(self, quantile: float) -> float | None:
        if not self.recovery_seconds:
            return None
        if len(self.recovery_seconds) == 1:
            return self.recovery_seconds[0]
        cuts = statistics.quantiles(self.recovery_seconds, n=100, method="inclusive")
        return cuts[round(quantile * 100) - 1]

    def as_json(self) -> dict[str, Any]:
        fired = self.fired()
        return {
            "passed": self.passed,
            "seed": self.seed,
            "duration_seconds": self.duration,
            "elapsed_seconds": round(self.elapsed, 1),
            "runs_submitted": self.runs_submitted,
            "runs_keyed": self.runs_keyed,
            **self.findings.as_json(),
            "replicated": self.replicated,
            "faults": {
                kind: {"scheduled": self.scheduled[kind], "fired": fired[kind]}
                for kind in ALL_FAULT_KINDS
                if kind in FAULT_KINDS or self.scheduled[kind]
            },
            "faults_not_fired": [record.as_json() for record in self.unfired],
            "failovers": [record.as_json() for record in self.faults if record.kind == "failover"],
            "stale_requests_refused": self.stale_requests_refused,
            "process_restarts": self.restarts,
            "processes_exited_on_their_own": [
                {"process": name, "status": status} for name, status in self.exits
            ],
            "recovery_seconds": {
                "count": len(self.recovery_seconds),
                "p50": _round(self.recovery(0.5)),
                "p99": _round(self.recovery(0.99)),
            },
            "failover_recovery_seconds": [
                round(value, 3) for value in self.failover_recovery_seconds
            ],
            "work_dir": str(self.work_dir),
            "replay": f"orchestrator chaos --seed {self.seed} --duration {self.duration:g}"
            + (" --replicated" if self.replicated else "")
            + ("" if tuple(self.agents) == AGENTS else f" --agents {','.join(self.agents)}"),
        }


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


@dataclass(frozen=True)
class Plan:
    """What the campaign's person does for one run."""

    agent: str
    input: dict[str, Any]
    decision: str
    """``approve``, ``deny`` or ``ignore`` (let the approval expire)."""
    concurrency_key: str | None = None


def plans(
    seed: int, count: int, agents: Sequence[str] = AGENTS, keyed_share: float = KEYED_SHARE
) -> list[Plan]:
    """The workload: runs of ``agents`` in turn, ``keyed_share`` of them with a key."""
    unknown = sorted(set(agents) - set(AGENTS))
    if unknown or not agents:
        raise InvalidInput(f"unknown agents {unknown}: choose from {', '.join(AGENTS)}")
    rng = random.Random(seed * 7919 + 1)
    # Streams of their own, so that keys and trees leave the rest of a seed's workload as it was.
    keys = random.Random(seed * 7919 + 2)
    trees = random.Random(seed * 7919 + 3)
    made = []
    for n in range(count):
        customer = f"c{n}"
        key = concurrency_key(keys, keyed_share)
        if agents[n % len(agents)] == "chaos_tree":
            made.append(Plan("chaos_tree", tree_input(trees, customer, key), "approve", key))
        elif agents[n % len(agents)] == "chaos_steps":
            decision = rng.choices(("approve", "deny", "ignore"), (6, 3, 1))[0]
            refund = rng.choice((None, 40, 150, 250))
            made.append(
                Plan(
                    "chaos_steps",
                    {
                        "customer": customer,
                        "signal": rng.random() < 0.4,
                        "refund": refund,
                        "work_seconds": round(rng.uniform(0.1, 1.5), 2),
                        "approval_seconds": 3 if decision == "ignore" else 60,
                    },
                    decision,
                    key,
                )
            )
        else:
            decision = rng.choices(("approve", "deny"), (3, 1))[0]
            amount = rng.choice((30, 80, 150, 260))
            prompt = tools_prompt(customer, amount)
            made.append(Plan("chaos_tools", {"prompt": prompt}, decision, key))
    return made


def tree_input(rng: random.Random, customer: str, key: str | None) -> dict[str, Any]:
    """A tree of two or three leaves, spawned by the commit that waits for them or by the step
    before it, waited for all (half the trees), any one or two."""
    leaves = [
        {"customer": f"{customer}.{n}", "work_seconds": round(rng.uniform(0.2, 1.5), 2)}
        for n in range(rng.choice((2, 3)))
    ]
    return {
        "customer": customer,
        "fan": rng.choice(("wait", "next")),
        "need": rng.choice((None, None, 1, 2)),
        "tenant": key,
        "leaves": leaves,
    }


def limited_agents(agents: Sequence[str]) -> list[str]:
    """The workload's agents and those of the children they start."""
    return [*agents, *(child for agent in agents for child in SPAWNED.get(agent, ()))]


Progress = Callable[[str], None]


async def run_campaign(config: CampaignConfig, progress: Progress = lambda line: None) -> Report:
    started = time.monotonic()
    progress = _stamped(progress, started)
    # Faults stop before the workload does, so the last ones still meet traffic.
    timetable = schedule(
        config.seed, config.duration * FAULT_SHARE, config.fault_rate, config.kinds
    )
    plans(config.seed, 0, config.agents)  # unknown agents: one line, nothing started
    work_dir = config.work_dir or Path(tempfile.mkdtemp(prefix="orchestrator-chaos-"))
    work_dir.mkdir(parents=True, exist_ok=True)
    database: EmbeddedPostgres | ReplicatedPostgres
    if config.on_pair:
        database = ReplicatedPostgres(work_dir / "pair", server_settings=PAIR_SETTINGS)
        try:
            await anyio.to_thread.run_sync(database.start)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(database.close)
            raise
        dsn, ports = database.dsn(), list(database.ports)
    else:
        database = EmbeddedPostgres(work_dir / "home", server_settings=SERVER_SETTINGS)
        server = await anyio.to_thread.run_sync(database.ensure_running)
        dsn, ports = server.dsn(), [server.port]
    try:
        report = await _campaign(
            config, timetable, progress, work_dir, database, dsn, ports, started
        )
    finally:
        with anyio.CancelScope(shield=True):  # also when the campaign is interrupted
            await anyio.to_thread.run_sync(lambda: _stop_database(database))
    if report.passed and config.work_dir is None:
        shutil.rmtree(work_dir, ignore_errors=True)
    return report


def _stop_database(database: EmbeddedPostgres | ReplicatedPostgres) -> None:
    if isinstance(database, ReplicatedPostgres):
        database.close()
    else:
        database.stop(mode="immediate")


def _stamped(progress: Progress, started: float) -> Progress:
    def stamped(line: str) -> None:
        progress(f"[{time.monotonic() - started:6.1f}s] {line}")

    return stamped


async def _campaign(
    config: CampaignConfig,
    timetable: list[ScheduledFault],
    progress: Progress,
    work_dir: Path,
    database: EmbeddedPostgres | ReplicatedPostgres,
    dsn: str,
    ports: list[int],
    started: float,
) -> Report:
    settings = Settings(database_url=dsn)
    await _migrate(settings, dsn, config.after_migrate)
    async with AsyncExitStack() as stack:
        pool = await create_pool(
            settings, dsn=dsn, application_name=CAMPAIGN_APPLICATION, min_size=0, max_size=8
        )
        stack.push_async_callback(pool.close)
        await set_limits(pool, config.limits, limited_agents(config.agents))
        # A connection of its own, so that samples never wait behind the campaign's clients.
        sampler = LimitSampler(
            await create_pool(
                settings, dsn=dsn, application_name=CAMPAIGN_APPLICATION, min_size=0, max_size=1
            )
        )
        stack.push_async_callback(sampler.pool.close)
        vendor = await stack.enter_async_context(ChaosVendor(hang_seconds=20))
        model = await stack.enter_async_context(ScriptedModelServer(CHAOS_SCRIPT, latency=0.02))
        vendors = _vendors(vendor)
        env = dict(config.env)
        if importlib.util.find_spec("mcp") is not None:  # the mcp extra: an MCP effect too
            from orchestrator.chaos import mcp_vendor

            url = await stack.enter_async_context(mcp_vendor.serving(vendor))
            vendors["kinds"][MCP_SERVER] = mcp_vendor.dispatcher_kind(url)
            env[MCP_URL_ENV] = url
        cluster = await _cluster(stack, config, dsn, ports, work_dir, vendors, model, env)
        await _until_registered(pool, config.workers, cluster)
        on = "a primary and a streaming standby" if len(ports) > 1 else "one server"
        made = await create_schedules(pool, config.schedules, config.duration)
        progress(
            f"cluster up on {on}: {config.workers} workers, {config.dispatchers} dispatchers, "
            f"each behind its own proxy; {len(made)} schedules; logs in {work_dir}"
        )
        context = FaultContext(
            cluster,
            vendor,
            model,
            pool,
            database,
            time.monotonic(),
            trees=bool(SPAWNED.keys() & set(config.agents)),
        )
        faults = Faults(context)
        workload = plans(config.seed, config.runs, config.agents, config.keyed_share)
        submitted: dict[str, Plan] = {}
        progress(
            f"seed {config.seed}: {len(timetable)} faults over {config.duration:g}s, "
            f"{config.runs} runs"
        )
        async with anyio.create_task_group() as people:
            people.start_soon(_person, pool, submitted, context.clients)
            people.start_soon(cluster.supervise)
            people.start_soon(sampler.run, _sampling_bound(config))
            all_submitted = anyio.Event()
            async with anyio.create_task_group() as window:
                window.start_soon(
                    _submit,
                    pool,
                    workload,
                    submitted,
                    config.duration,
                    context.clients,
                    all_submitted,
                )
                window.start_soon(_inject, faults, timetable, window)
                window.start_soon(_report_progress, progress, pool, faults, submitted, config)
                await anyio.sleep(config.duration)
                if not await faults.over(len(timetable), within=max(60, config.duration / 4)):
                    progress("some faults were still acting long after the window: cut short")
                # A busy machine submits slower than the plan: every planned run is submitted
                # (bounded), so that the checker judges the workload the campaign was asked for.
                with anyio.move_on_after(max(60, config.duration)):
                    await all_submitted.wait()
                window.cancel_scope.cancel()
            vendor.clear()
            model.clear_faults()
            await anyio.to_thread.run_sync(cluster.heal)
            progress("healed: every proxy forwards, every process runs; waiting for quiescence")
            await _quiescence(pool, progress, config.settle_seconds)
            people.cancel_scope.cancel()
        await _stop(cluster)
        progress("cluster stopped; checking")
        # A pool of its own: the campaign's may hold connections the faults broke.
        checking = await create_pool(
            settings, dsn=dsn, application_name=CAMPAIGN_APPLICATION, min_size=1, max_size=2
        )
        try:
            findings = await check(
                checking,
                vendor,
                dispatch_lease_seconds=config.timing.dispatch_lease_seconds,
                grants=read_grants(work_dir / "grants"),
                submitted=submitted,
                served=cluster.served,
            )
            recovery = await _recovery(checking, context.victims)
        finally:
            await checking.close()
        sampler.report(findings)
        findings.schedule_fires_refused = refused_fires(work_dir)
        return Report(
            seed=config.seed,
            duration=config.duration,
            runs_submitted=len(submitted),
            findings=findings,
            faults=faults.records,
            scheduled=Counter(fault.kind for fault in timetable),
            recovery_seconds=recovery,
            restarts=cluster.restarts,
            exits=cluster.exits,
            stale_requests_refused=faults.stale_refused,
            elapsed=time.monotonic() - started,
            work_dir=work_dir,
            replicated=len(ports) > 1,
            failover_recovery_seconds=faults.failover_recovery,
            agents=config.agents,
            runs_keyed=sum(1 for plan in submitted.values() if plan.concurrency_key),
        )


async def _cluster(
    stack: AsyncExitStack,
    config: CampaignConfig,
    dsn: str,
    ports: list[int],
    work_dir: Path,
    vendors: dict[str, Any],
    model: ScriptedModelServer,
    env: dict[str, str],
) -> Cluster:
    """The workers and dispatchers, each behind a proxy of its own (one per server), started;
    stopped when ``stack`` closes."""
    effects_config = work_dir / "vendors.json"
    effects_config.write_text(json.dumps(vendors))
    grants_dir = work_dir / "grants"
    grants_dir.mkdir(exist_ok=True)
    cluster = Cluster(
        database_dsn=dsn,
        effects_config=effects_config,
        work_dir=work_dir,
        timing=config.timing,
        model_env={"OPENAI_BASE_URL": model.base_url, "OPENAI_API_KEY": "chaos"},
        command=config.command,
        env=env,
        grants_dir=grants_dir,
    )
    for role, count in (("worker", config.workers), ("dispatcher", config.dispatchers)):
        for _ in range(count):
            proxies = [
                await stack.enter_async_context(FaultProxy("127.0.0.1", port)) for port in ports
            ]
            cluster.add(role, MemberProxy(proxies))
    for member in cluster.members:
        cluster.start(member)
    stack.push_async_callback(_stop, cluster)
    return cluster


async def _migrate(settings: Settings, dsn: str, after_migrate: str | None) -> None:
    connection = await connect(settings, application_name=CAMPAIGN_APPLICATION, dsn=dsn)
    try:
        await migrate(connection)
        if after_migrate:
            await connection.execute(after_migrate)
    finally:
        await connection.close()


def _sampling_bound(config: CampaignConfig) -> float:
    """Longer than the window, its bounded waits, healing and quiescence together: the samples
    end when the people's task group does."""
    return 3 * max(60.0, config.duration) + config.settle_seconds


async def _stop(cluster: Cluster) -> None:
    """Stop every process, in a thread: their connections pass through this event loop's
    proxies, so it must keep running while they close them."""
    with anyio.CancelScope(shield=True):
        await anyio.to_thread.run_sync(cluster.stop_all)


def _vendors(vendor: ChaosVendor) -> dict[str, Any]:
    http = {
        "adapter": "http",
        "url": vendor.send_url,
        "reconcile": "lookup",
        "lookup_url": vendor.lookup_url,
    }
    return {"kinds": dict.fromkeys(("email", "crm", "payments"), http)}


async def _until_registered(pool: asyncpg.Pool, workers: int, cluster: Cluster) -> None:
    with anyio.fail_after(60):
        while await pool.fetchval("SELECT count(*) FROM orchestrator.workers") < workers:
            dead = [member.name for member in cluster.members if not member.alive]
            if dead:
                raise OrchestratorError(
                    f"{', '.join(dead)} exited at start; see their logs in {cluster.work_dir}"
                )
            await anyio.sleep(0.1)


async def _submit(
    pool: asyncpg.Pool,
    workload: list[Plan],
    submitted: dict[str, Plan],
    over: float,
    gate: ClientGate,
    done: anyio.Event,
) -> None:
    store = RunStore(pool)
    gap = over / max(1, len(workload))
    begun = time.monotonic()
    for index, plan in enumerate(workload):
        await anyio.sleep(max(0.0, begun + index * gap - time.monotonic()))
        for _ in range(100):  # bounded: the database may be restarting
            try:
                async with gate.open():
                    submission = await store.submit(
                        plan.agent,
                        plan.input,
                        idempotency_key=f"chaos-{index}",
                        max_attempts=100,
                        concurrency_key=plan.concurrency_key,
                    )
                submitted[submission.run.run_id] = plan
                break
            except CAMPAIGN_ERRORS:
                await anyio.sleep(0.2)
    done.set()


async def _inject(faults: Faults, timetable: list[Any], window: anyio.abc.TaskGroup) -> None:
    for fault in timetable:
        await anyio.sleep(max(0.0, faults.context.started + fault.at - time.monotonic()))
        window.start_soon(faults.inject, fault)


async def _person(pool: asyncpg.Pool, submitted: dict[str, Plan], gate: ClientGate) -> None:
    """Decides approvals as each run's plan says, sends ``go`` to runs waiting for it, and tops
    up runs waiting for budget."""
    approvals = ApprovalStore(pool)
    signals = SignalStore(pool)
    budgets = BudgetStore(pool)
    told: set[str] = set()
    while True:
        await anyio.sleep(0.3)
        try:
            async with gate.open():
                await _decide_and_signal(pool, approvals, signals, submitted, told)
                await _top_up(pool, budgets)
        except CAMPAIGN_ERRORS:
            continue


async def _top_up(pool: asyncpg.Pool, budgets: BudgetStore) -> None:
    """A run that spent its budget waits for a person (every lost lease replays turns, which
    are charged again): the campaign's person gives it as much again, so it can finish."""
    waiting = await pool.fetch(
        "SELECT run_id FROM orchestrator.runs WHERE state = 'waiting' "
        "AND wait->>'reason' = 'budget' AND updated_at < clock_timestamp() - interval '1s'"
    )
    for row in waiting:
        await budgets.top_up(row["run_id"], actor=PERSON, turns=12, tool_calls=16)


async def _decide_and_signal(
    pool: asyncpg.Pool,
    approvals: ApprovalStore,
    signals: SignalStore,
    submitted: dict[str, Plan],
    told: set[str],
) -> None:
    for effect in await approvals.pending(limit=100):
        plan = submitted.get(effect.run_id)
        if plan is None or plan.decision == "ignore":
            continue
        decision = Decision.APPROVED if plan.decision == "approve" else Decision.DENIED
        try:
            await approvals.decide(
                effect.run_id,
                effect.effect_key,
                decision,
                by="chaos-person",
                payload_sha256=effect.payload_sha256,
            )
        except DecisionRefused:
            continue
    waiting = await pool.fetch(
        "SELECT run_id FROM orchestrator.runs WHERE state = 'waiting' "
        "AND wait->'signals' ? 'go' AND updated_at < clock_timestamp() - interval '1s'"
    )
    for row in waiting:
        if row["run_id"] not in told:
            await signals.send(row["run_id"], "go", {"by": "person"}, idempotency_key="go")
            told.add(row["run_id"])


async def _report_progress(
    progress: Progress,
    pool: asyncpg.Pool,
    faults: Faults,
    submitted: dict[str, Plan],
    config: CampaignConfig,
) -> None:
    while True:
        await anyio.sleep(10)
        try:
            finished = await pool.fetchval(
                "SELECT count(*) FROM orchestrator.runs WHERE state = ANY($1::text[]) "
                "AND parent_run_id IS NULL AND schedule_id IS NULL",
                list(TERMINAL),
            )
        except CAMPAIGN_ERRORS:
            finished = "?"
        elapsed = time.monotonic() - faults.context.started
        fired = sum(1 for record in faults.records if record.fired)
        progress(
            f"{elapsed:5.0f}/{config.duration:g}s  runs {finished} finished of "
            f"{len(submitted)} submitted  faults {fired} fired of {len(faults.records)} injected"
        )


async def _quiescence(pool: asyncpg.Pool, progress: Progress, within: float) -> None:
    deadline = time.monotonic() + within
    last = 0.0
    while time.monotonic() < deadline:
        try:
            unfinished = await pool.fetchval(
                "SELECT count(*) FROM orchestrator.runs WHERE state <> ALL($1::text[])",
                list(TERMINAL),
            )
            unsettled = await pool.fetchval(
                "SELECT count(*) FROM orchestrator.effects "
                "WHERE status IN ('accepted', 'dispatching', 'uncertain')"
            )
            pending = await pool.fetchval(PENDING)
        except CAMPAIGN_ERRORS:
            await anyio.sleep(0.5)
            continue
        if unfinished == 0 and unsettled == 0 and pending == 0:
            progress("quiescent: every run finished, every effect settled, every schedule ended")
            return
        if time.monotonic() - last > 10:
            progress(
                f"settling: {unfinished} runs unfinished, {unsettled} effects in flight, "
                f"{pending} schedules with slots to decide"
            )
            last = time.monotonic()
        await anyio.sleep(0.5)
    progress(f"not quiescent after {within:g}s: the checker counts what is left as lost")


async def _recovery(pool: asyncpg.Pool, victims: list[tuple[str, int, float]]) -> list[float]:
    """For each run a faulted worker held: from the fault to the next claim by a newer fence."""
    if not victims:
        return []
    rows = await pool.fetch(
        "SELECT run_id, fence, at FROM orchestrator.run_events WHERE kind = 'claimed' "
        "AND run_id = ANY($1::text[]) ORDER BY event_id",
        list({run_id for run_id, _, _ in victims}),
    )
    claims: dict[str, list[tuple[int, float]]] = {}
    for row in rows:
        claims.setdefault(row["run_id"], []).append((row["fence"], row["at"].timestamp()))
    seconds = []
    for run_id, fence, at in victims:
        later = [when for claimed_fence, when in claims.get(run_id, []) if claimed_fence > fence]
        if later and later[0] >= at:
            seconds.append(later[0] - at)
    return sorted(seconds)
