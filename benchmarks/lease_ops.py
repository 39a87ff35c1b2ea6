"""Lease-path throughput: RunStore against raw asyncpg running the same SQL.

What is measured, in one run, on one PostgreSQL server and with the same concurrency (``--tasks``
asyncio tasks sharing one pool of as many connections):

* claims/s through ``RunStore.claim`` with ``limit=1`` and ``limit=50`` (the ``claim``
  statement; a claim is one run handed to a worker),
* renewals/s through ``RunStore.renew`` (``renew_lease``, one statement per lease) and through
  ``RunStore.renew_many`` (``renew_leases``, 1,000 leases per statement),
* step commits/s through ``RunStore.commit_step`` (``commit_step``: checkpoint + event),

and, for each of them, a baseline: the same statement shape, copied inline below from
``sql/queries.sql``, sent straight through ``asyncpg`` on the same pool (same jsonb codec) with
the smallest possible Python around it. The ratio store/baseline is therefore the cost of the
store's Python layers (argument handling, model construction, validation, transaction wrapping),
not of PostgreSQL; the target is that the store reaches at least 80% of the baseline.

Why this shape: the machine this runs on has two cores shared by the client and the server, so
absolute numbers are noisy and move from run to run. Each measurement is therefore repeated
(after a warm-up), the store and baseline measurements of a round run back to back in an order
that rotates every round, and the ratio reported is the median of the per-round ratios of this
one run. Every loop is bounded in count and in time, and the whole run takes about 1.5 minutes.

The workload is fixed: each claim measurement starts from an emptied table holding only its own
queue (2,000 runs for batch 1, 5,000 for batch 50); renewals and commits run on leases created
up front (8 x 1,000 and 8 x 50 running runs, each task's leases in contiguous rows, as a batch
claim hands them out), the store and the baseline renewing and committing the same leases.

The benchmark also reads ``pg_stat_user_tables`` for ``runs`` around each phase (each operation
runs on a pool of its own, closed at the end of the phase so that its backends flush their
statistics): the schema was laid out so that a renewal (which touches only ``lease_until`` and
``updated_at``, in no index, on pages kept 30% free) is a HOT update; the reported share of HOT
updates in the two renewal phases says whether it is.

The server (embedded and durable, or ``--dsn``), the scratch database, ``--json`` and the
clean-up are those of every benchmark ("Common to all" in benchmarks/README.md). Run from the
repository root: ``.venv/bin/python benchmarks/lease_ops.py``.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import asyncpg

from bench_main import benchmark_parser, run_and_report
from bench_report import elapsed, log, render_table, report_heading, server_line, workload
from orchestrator.db.connections import connect, create_pool
from orchestrator.db.migrations import migrate
from orchestrator.db.notifications import FINISHED_CHANNEL
from orchestrator.db.queries import query
from orchestrator.db.store import RunStore
from orchestrator.models import Lease
from orchestrator.settings import Settings
from serve_harness import DURABILITY_SHOWN, Server, create_database, drop_database, server_facts

TARGET_RATIO = 0.80
MIN_ROUNDS = 3
"""Rounds every operation gets even when the time budget (``--budget``) is spent."""
RENEW_BATCH = 1_000
LEASE_SECONDS = 600.0
"""Long enough that no lease taken or renewed here expires while the benchmark runs."""

# -- the baseline's SQL: the statements of sql/queries.sql, copied inline -------------------------
# Kept textually identical (comments aside) to the store's; `check_sql_copies` warns when
# queries.sql changed and these copies no longer measure the same statement.

CLAIM_SQL = f"""
WITH expired AS (
    SELECT run_id, lease_owner AS previous_owner, lease_until AS previous_lease_until,
           attempt >= max_attempts AS exhausted, wait
    FROM runs
    WHERE $6::text IS NULL AND $5::boolean AND state = 'running' AND agent = ANY($2::text[])
      AND lease_until < clock_timestamp()
    LIMIT $3
    FOR UPDATE SKIP LOCKED
), due AS (
    SELECT d.run_id, NULL::text AS previous_owner, NULL::timestamptz AS previous_lease_until,
           false AS exhausted, d.wait
    FROM unnest($2::text[]) AS a(agent)
    CROSS JOIN LATERAL (
        SELECT run_id, available_at, wait
        FROM runs
        WHERE $6::text IS NULL AND state IN ('queued', 'waiting') AND agent = a.agent
          AND available_at <= (SELECT clock_timestamp())
        ORDER BY available_at
        LIMIT $3
        FOR UPDATE SKIP LOCKED
    ) AS d
    ORDER BY d.available_at
    LIMIT $3
), named AS (
    SELECT run_id,
           CASE WHEN state = 'running' THEN lease_owner END AS previous_owner,
           CASE WHEN state = 'running' THEN lease_until END AS previous_lease_until,
           state = 'running' AND attempt >= max_attempts AS exhausted, wait
    FROM runs
    WHERE run_id = $6::text
      AND ((state IN ('queued', 'waiting') AND available_at <= clock_timestamp())
           OR (state = 'running' AND lease_until < clock_timestamp()))
    FOR UPDATE SKIP LOCKED
), picked AS (
    SELECT *
    FROM (SELECT * FROM expired UNION ALL SELECT * FROM due UNION ALL SELECT * FROM named)
        AS candidates
    LIMIT $3
), claimed AS (
    UPDATE runs AS r
    SET state = 'running', lease_owner = $1,
        lease_until = clock_timestamp() + make_interval(secs => $4),
        fence = r.fence + 1, attempt = r.attempt + 1, updated_at = clock_timestamp()
    FROM picked AS p
    WHERE r.run_id = p.run_id AND NOT p.exhausted
    RETURNING r.run_id, r.agent, r.input, r.fence, r.lease_until, r.attempt, r.max_attempts,
              r.step, r.checkpoint, r.checkpoint_version, p.previous_owner,
              p.previous_lease_until, clock_timestamp() AS claimed_at, p.wait,
              CASE WHEN r.signals_pending > 0 THEN (
                  SELECT jsonb_agg(jsonb_build_object(
                             'seq', s.seq, 'name', s.name, 'data', s.data,
                             'idempotency_key', s.idempotency_key, 'sent_at', s.sent_at)
                         ORDER BY s.seq)
                  FROM (SELECT * FROM run_signals AS s
                        WHERE s.run_id = r.run_id AND s.consumed_at IS NULL
                        ORDER BY s.seq LIMIT 100) AS s
              ) END AS signals, r.signals_pending
), dead AS (
    UPDATE runs AS r
    SET state = 'dead', lease_owner = NULL, lease_until = NULL, updated_at = clock_timestamp(),
        finished_at = clock_timestamp(),
        error = jsonb_build_object(
            'type', 'LeaseExpired',
            'message', format('the lease of %s expired during attempt %s of %s',
                              p.previous_owner, r.attempt, r.max_attempts))
    FROM picked AS p
    WHERE r.run_id = p.run_id AND p.exhausted
    RETURNING r.run_id, r.fence, r.attempt, p.previous_owner, p.previous_lease_until, r.watched
), logged AS (
    INSERT INTO run_events (run_id, kind, fence, worker_id, details)
    SELECT run_id, 'claimed', fence, $1,
           jsonb_build_object('lease_until', lease_until, 'attempt', attempt,
                              'checkpoint_version', checkpoint_version,
                              'previous_owner', previous_owner,
                              'previous_lease_until', previous_lease_until)
    FROM claimed
    UNION ALL
    SELECT run_id, 'dead_lettered', fence, $1,
           jsonb_build_object('reason', 'lease expired on the last attempt', 'attempt', attempt,
                              'previous_owner', previous_owner,
                              'previous_lease_until', previous_lease_until)
    FROM dead
), finished_told AS (
    SELECT pg_notify('{FINISHED_CHANNEL}', run_id) FROM dead WHERE watched
)
SELECT 'claimed' AS outcome, run_id, agent, input, fence, lease_until, attempt, max_attempts, step,
       checkpoint, checkpoint_version, previous_owner, previous_lease_until, claimed_at, wait,
       signals, signals_pending
FROM claimed
UNION ALL
SELECT 'dead_lettered', run_id, NULL, NULL, fence, NULL, attempt, NULL, NULL, NULL, NULL,
       previous_owner, previous_lease_until, NULL, NULL, NULL, NULL
FROM dead
WHERE (SELECT count(*) FROM finished_told) >= 0
"""

RENEW_LEASE_SQL = """
UPDATE runs
SET lease_until = clock_timestamp() + make_interval(secs => $4), updated_at = clock_timestamp()
WHERE run_id = $1 AND lease_owner = $2 AND fence = $3 AND state = 'running'
  AND lease_until > clock_timestamp()
RETURNING run_id, lease_until
"""

RENEW_LEASES_SQL = """
WITH batch AS MATERIALIZED (
    SELECT l.run_id, l.fence, l.lease_seconds, $4::text AS owner, clock_timestamp() AS now
    FROM unnest($1::text[], $2::bigint[], $3::float8[]) AS l(run_id, fence, lease_seconds)
)
UPDATE runs AS r
SET lease_until = clock_timestamp() + make_interval(secs => l.lease_seconds),
    updated_at = clock_timestamp()
FROM batch AS l
WHERE r.run_id = ANY($1::text[]) AND r.run_id = l.run_id AND r.lease_owner = l.owner
  AND r.fence = l.fence AND r.lease_until > l.now
RETURNING r.run_id, r.lease_until
"""

COMMIT_STEP_SQL = """
WITH committed AS (
    UPDATE runs
    SET step = $5, checkpoint = $6, checkpoint_version = checkpoint_version + 1, attempt = 1,
        updated_at = clock_timestamp()
    WHERE run_id = $1 AND lease_owner = $2 AND fence = $3 AND state = 'running'
      AND lease_until > clock_timestamp() AND checkpoint_version = $4
    RETURNING run_id, fence, checkpoint_version, lease_until
), logged AS (
    INSERT INTO run_events (run_id, kind, fence, worker_id, details)
    SELECT c.run_id, e.kind, c.fence, $2, e.details
    FROM committed AS c, jsonb_to_recordset($7::jsonb) AS e(kind text, details jsonb)
)
SELECT checkpoint_version, lease_until FROM committed
"""

INLINE_COPIES = {
    "claim": CLAIM_SQL,
    "renew_lease": RENEW_LEASE_SQL,
    "renew_leases": RENEW_LEASES_SQL,
    "commit_step": COMMIT_STEP_SQL,
}

# -- set-up statements (never timed) -------------------------------------------------------------

INSERT_QUEUED_SQL = """
INSERT INTO runs (run_id, agent, input)
SELECT $1 || lpad(g::text, 6, '0'), $2,
       jsonb_build_object('topic', 'lease benchmark', 'n', g, 'tags', jsonb_build_array('a', 'b'))
FROM generate_series(1, $3) AS g
"""

INSERT_LEASED_SQL = """
INSERT INTO runs (run_id, agent, input, state, fence, lease_owner, lease_until, attempt)
SELECT $1 || lpad(g::text, 6, '0'), $2,
       jsonb_build_object('topic', 'lease benchmark', 'n', g, 'tags', jsonb_build_array('a', 'b')),
       'running', 1, $3 || (g / $4)::text, clock_timestamp() + make_interval(secs => $5), 1
FROM generate_series(0, $6 - 1) AS g
RETURNING run_id, lease_owner, fence
"""

TABLE_STATS_SQL = "SELECT to_jsonb(s) FROM pg_stat_user_tables AS s WHERE relid = 'runs'::regclass"

SERVER_SETTINGS_SHOWN = (
    *DURABILITY_SHOWN,
    "wal_sync_method",
    "shared_buffers",
    "max_wal_size",
    "autovacuum",
)

PHASE_LABELS = {
    "claim1": "claims, batch 1",
    "claim50": "claims, batch 50",
    "renew_one": "renewals, 1 lease/statement",
    "renew_many": f"renewals, {RENEW_BATCH:,} leases/statement",
    "commit": "step commits",
}

EXTRA_BASELINES = {"baseline_txn": "vs baseline in BEGIN/COMMIT"}
"""Further baselines, reported for attribution only (not part of the target)."""


def normalise_sql(text: str) -> str:
    return " ".join(text.split())


def check_sql_copies() -> dict[str, bool]:
    """Whether each inline copy is still the statement the store sends."""
    matches = {
        name: normalise_sql(copy) == normalise_sql(query(name))
        for name, copy in INLINE_COPIES.items()
    }
    for name, same in matches.items():
        if not same:
            log(
                f"WARNING: the inline copy of {name!r} differs from sql/queries.sql; the baseline "
                "no longer runs the store's statement (update the copy in this file)"
            )
    return matches


# -- measurements ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sample:
    """One timed measurement: ``ops`` operations (claims, renewals, commits) in ``seconds``."""

    ops: int
    seconds: float
    statements: int
    timed_out: bool

    @property
    def rate(self) -> float:
        return self.ops / self.seconds if self.seconds > 0 else 0.0


Worker = Callable[[int, float], Awaitable[tuple[int, int]]]
"""``worker(task_index, deadline)`` -> (operations, statements); stops at its count or deadline."""


async def run_concurrently(tasks: int, max_seconds: float, worker: Worker) -> Sample:
    start = time.perf_counter()
    deadline = start + max_seconds
    results = await asyncio.gather(*(worker(index, deadline) for index in range(tasks)))
    elapsed = time.perf_counter() - start
    return Sample(
        ops=sum(ops for ops, _ in results),
        seconds=elapsed,
        statements=sum(statements for _, statements in results),
        timed_out=time.perf_counter() > deadline,
    )


Measure = Callable[[int, float], Awaitable[Sample]]
"""``measure(round, scale)``: one timed measurement; ``scale`` < 1 for the warm-up."""


@dataclass
class Case:
    name: str
    unit: str
    rounds: int
    variants: dict[str, Measure]
    """``store`` and ``baseline`` always; further baselines are reported as extra rows."""
    samples: dict[str, list[Sample]] = field(default_factory=dict)
    warm_up: dict[str, Sample] = field(default_factory=dict)

    def ops_done(self) -> int:
        """Every operation performed, warm-up included."""
        measured = sum(sample.ops for samples in self.samples.values() for sample in samples)
        return measured + sum(sample.ops for sample in self.warm_up.values())


@dataclass(frozen=True)
class Config:
    """The workload; every field has a command-line flag of the same name."""

    dsn: str | None
    json: bool
    tasks: int
    rounds: int
    claim1_rounds: int
    warmup_scale: float
    max_seconds: float
    budget: float
    claim_runs: int
    claim_batch_runs: int
    renewals_per_task: int
    batched_statements_per_task: int
    commits_per_task: int
    commit_leases_per_task: int
    only: tuple[str, ...]

    def describe(self) -> dict[str, Any]:
        return {**workload(self), "pool_size": self.tasks, "renew_batch": RENEW_BATCH}


@dataclass
class Context:
    args: Config
    admin: asyncpg.Connection
    pool: asyncpg.Pool | None = None

    @property
    def live_pool(self) -> asyncpg.Pool:
        if self.pool is None:
            raise RuntimeError("no pool is open outside a phase")
        return self.pool

    @property
    def store(self) -> RunStore:
        return RunStore(self.live_pool)


Prepare = Callable[[str, int, float], Awaitable[Worker]]
"""``prepare(side, round, scale)``: set up one measurement of ``side`` and return its worker."""


def paired_case(
    ctx: Context,
    name: str,
    unit: str,
    prepare: Prepare,
    *,
    sides: Sequence[str] = ("store", "baseline"),
    rounds: int | None = None,
) -> Case:
    """A case with a variant for each side, each run by ``ctx.args.tasks`` tasks at once."""

    def measure(side: str) -> Measure:
        async def run(round_index: int, scale: float) -> Sample:
            worker = await prepare(side, round_index, scale)
            return await run_concurrently(ctx.args.tasks, ctx.args.max_seconds, worker)

        return run

    return Case(
        name=name,
        unit=unit,
        rounds=ctx.args.rounds if rounds is None else rounds,
        variants={side: measure(side) for side in sides},
    )


def worker_id(index: int) -> str:
    return f"bench-w{index}"


async def analyze(ctx: Context) -> None:
    await ctx.admin.execute("ANALYZE runs")


# claims ------------------------------------------------------------------------------------------


def claim_case(ctx: Context, limit: int, total: int) -> Case:
    tasks = ctx.args.tasks

    async def prepare(side: str, round_index: int, scale: float) -> Worker:
        # Every measurement starts from the same table: only its own `wanted` queued runs.
        # (How claim cost grows with the backlog is a property of the SQL, the same for
        # store and baseline; it would only blur the comparison here.)
        name = f"bench-claim-b{limit}-{side}-r{round_index}"
        wanted = max(int(total * scale), limit * tasks)
        await ctx.admin.execute("TRUNCATE runs, run_events")
        await ctx.admin.execute(INSERT_QUEUED_SQL, f"r_{name}_", name, wanted)
        await analyze(ctx)
        claimed = [0]
        statements_bound = wanted // limit + 4 * tasks

        async def store_worker(index: int, deadline: float) -> tuple[int, int]:
            store, me, ops, statements = ctx.store, worker_id(index), 0, 0
            for _ in range(statements_bound):
                if claimed[0] >= wanted or time.perf_counter() > deadline:
                    break
                batch = await store.claim(me, [name], limit=limit, lease_seconds=LEASE_SECONDS)
                statements += 1
                if not batch.claimed:
                    break
                ops += len(batch.claimed)
                claimed[0] += len(batch.claimed)
            return ops, statements

        async def baseline_worker(index: int, deadline: float) -> tuple[int, int]:
            pool, me, agents, ops, statements = ctx.live_pool, worker_id(index), [name], 0, 0
            for _ in range(statements_bound):
                if claimed[0] >= wanted or time.perf_counter() > deadline:
                    break
                records = await pool.fetch(CLAIM_SQL, me, agents, limit, LEASE_SECONDS, True, None)
                statements += 1
                got = sum(1 for record in records if record["outcome"] == "claimed")
                if not got:
                    break
                ops += got
                claimed[0] += got
            return ops, statements

        return store_worker if side == "store" else baseline_worker

    rounds = ctx.args.claim1_rounds if limit == 1 else ctx.args.rounds
    return paired_case(ctx, f"claim, batch {limit}", "claims/s", prepare, rounds=rounds)


# leases for renewals and commits -----------------------------------------------------------------


@dataclass
class LeaseSet:
    """Leases held by each benchmark worker (task), as the store and the baseline take them."""

    leases: list[list[Lease]]
    run_ids: list[list[str]]
    fences: list[list[int]]
    versions: dict[str, int]


async def create_leases(ctx: Context, agent: str, per_task: int) -> LeaseSet:
    """``per_task`` running runs leased to each task, in contiguous blocks of rows, as batch
    claims hand them out (the runs one claim takes were submitted together)."""
    tasks = ctx.args.tasks
    prefix, total = f"r_{agent}_", per_task * tasks
    records = await ctx.admin.fetch(
        INSERT_LEASED_SQL, prefix, agent, "bench-w", per_task, LEASE_SECONDS, total
    )
    await analyze(ctx)
    leases: list[list[Lease]] = [[] for _ in range(tasks)]
    for record in records:
        owner = record["lease_owner"]
        leases[int(owner.removeprefix("bench-w"))].append(
            Lease(record["run_id"], owner, record["fence"])
        )
    return LeaseSet(
        leases=leases,
        run_ids=[[lease.run_id for lease in mine] for mine in leases],
        fences=[[lease.fence for lease in mine] for mine in leases],
        versions={record["run_id"]: 0 for record in records},
    )


def renew_one_case(ctx: Context, held: LeaseSet, per_task: int) -> Case:
    async def prepare(side: str, round_index: int, scale: float) -> Worker:
        count = max(int(per_task * scale), 1)

        async def store_worker(index: int, deadline: float) -> tuple[int, int]:
            store, mine, ops = ctx.store, held.leases[index], 0
            offset = round_index * count
            for step in range(count):
                if time.perf_counter() > deadline:
                    break
                lease = mine[(offset + step) % len(mine)]
                if await store.renew(lease, lease_seconds=LEASE_SECONDS) is None:
                    raise RuntimeError(f"store renewal of {lease.run_id} did not hold")
                ops += 1
            return ops, ops

        async def baseline_worker(index: int, deadline: float) -> tuple[int, int]:
            pool, me, ops = ctx.live_pool, worker_id(index), 0
            run_ids, fences = held.run_ids[index], held.fences[index]
            offset = round_index * count
            for step in range(count):
                if time.perf_counter() > deadline:
                    break
                at = (offset + step) % len(run_ids)
                record = await pool.fetchrow(
                    RENEW_LEASE_SQL, run_ids[at], me, fences[at], LEASE_SECONDS
                )
                if record is None:
                    raise RuntimeError(f"baseline renewal of {run_ids[at]} did not hold")
                ops += 1
            return ops, ops

        return store_worker if side == "store" else baseline_worker

    return paired_case(ctx, "renew, 1 lease/statement", "renewals/s", prepare)


def renew_many_case(ctx: Context, held: LeaseSet, statements_per_task: int) -> Case:
    async def prepare(side: str, round_index: int, scale: float) -> Worker:
        count = max(int(statements_per_task * scale), 1)

        async def store_worker(index: int, deadline: float) -> tuple[int, int]:
            store, me, mine = ctx.store, worker_id(index), held.leases[index]
            ops = statements = 0
            for _ in range(count):
                if time.perf_counter() > deadline:
                    break
                renewed = await store.renew_many(me, mine, lease_seconds=LEASE_SECONDS)
                statements += 1
                if len(renewed) != len(mine):
                    raise RuntimeError(f"store renew_many: {len(renewed)}/{len(mine)} held")
                ops += len(renewed)
            return ops, statements

        async def baseline_worker(index: int, deadline: float) -> tuple[int, int]:
            pool, me, ops, statements = ctx.live_pool, worker_id(index), 0, 0
            run_ids, fences = held.run_ids[index], held.fences[index]
            seconds = [LEASE_SECONDS] * len(run_ids)
            for _ in range(count):
                if time.perf_counter() > deadline:
                    break
                records = await pool.fetch(RENEW_LEASES_SQL, run_ids, fences, seconds, me)
                statements += 1
                if len(records) != len(run_ids):
                    raise RuntimeError(f"baseline renewals: {len(records)}/{len(run_ids)} held")
                ops += len(records)
            return ops, statements

        return store_worker if side == "store" else baseline_worker

    return paired_case(ctx, f"renew, {RENEW_BATCH:,} leases/statement", "renewals/s", prepare)


# step commits ------------------------------------------------------------------------------------


def checkpoint_for(version: int) -> dict[str, Any]:
    """A small, realistic checkpoint: where the agent is and a little state."""
    return {
        "step": version,
        "messages": [{"role": "assistant", "content": f"finished step {version}"}],
        "tokens": {"prompt": 812, "completion": 164},
    }


def commit_case(ctx: Context, held: LeaseSet, per_task: int) -> Case:
    async def prepare(side: str, round_index: int, scale: float) -> Worker:
        count = max(int(per_task * scale), 1)
        versions = held.versions

        async def store_worker(index: int, deadline: float) -> tuple[int, int]:
            store, mine, ops = ctx.store, held.leases[index], 0
            for step in range(count):
                if time.perf_counter() > deadline:
                    break
                lease = mine[step % len(mine)]
                version = versions[lease.run_id]
                result = await store.commit_step(
                    lease,
                    expected_version=version,
                    next_step=f"step-{version + 1}",
                    checkpoint=checkpoint_for(version + 1),
                )
                if result is None:
                    raise RuntimeError(f"store commit of {lease.run_id} was refused")
                versions[lease.run_id] = result.checkpoint_version
                ops += 1
            return ops, ops

        async def baseline_worker(index: int, deadline: float) -> tuple[int, int]:
            pool, me, ops = ctx.live_pool, worker_id(index), 0
            run_ids, fences = held.run_ids[index], held.fences[index]
            in_transaction = side == "baseline_txn"
            for step in range(count):
                if time.perf_counter() > deadline:
                    break
                at = step % len(run_ids)
                run_id, version = run_ids[at], versions[run_ids[at]]
                next_step = f"step-{version + 1}"
                details = {"version": version + 1, "step": next_step}
                events = [{"kind": "checkpoint", "details": details}]
                checkpoint = checkpoint_for(version + 1)
                arguments = (run_id, me, fences[at], version, next_step, checkpoint, events)
                if in_transaction:
                    async with pool.acquire() as connection, connection.transaction():
                        record = await connection.fetchrow(COMMIT_STEP_SQL, *arguments)
                else:
                    record = await pool.fetchrow(COMMIT_STEP_SQL, *arguments)
                if record is None:
                    raise RuntimeError(f"baseline commit of {run_id} was refused")
                versions[run_id] = record["checkpoint_version"]
                ops += 1
            return ops, ops

        return store_worker if side == "store" else baseline_worker

    sides = ("store", "baseline", "baseline_txn")
    return paired_case(ctx, "step commit", "commits/s", prepare, sides=sides)


# -- running rounds -------------------------------------------------------------------------------


async def run_case(ctx: Context, case: Case) -> None:
    """A warm-up, then ``case.rounds`` rounds; each round runs every variant, in an order that
    rotates from round to round."""
    names = list(case.variants)
    case.samples = {name: [] for name in names}
    rounds = case.rounds
    for round_index in range(rounds + 1):
        warm_up = round_index == 0
        over_budget = elapsed() > ctx.args.budget
        if round_index > MIN_ROUNDS and over_budget:
            log(f"{case.name}: time budget of {ctx.args.budget:.0f}s spent, stopping rounds")
            break
        scale = ctx.args.warmup_scale if warm_up else 1.0
        shift = round_index % len(names)
        order = names[shift:] + names[:shift]
        rates: list[str] = []
        for name in order:
            sample = await case.variants[name](round_index, scale)
            if sample.timed_out:
                log(f"{case.name}: {name} stopped at its {ctx.args.max_seconds:.0f}s bound")
            if warm_up:
                case.warm_up[name] = sample
            else:
                case.samples[name].append(sample)
            rates.append(f"{name} {sample.rate:,.0f}/s ({sample.ops:,} in {sample.seconds:.2f}s)")
        label = "warm-up" if warm_up else f"round {round_index}/{rounds}"
        log(f"{case.name} {label}: " + ", ".join(rates))


async def table_stats(admin: asyncpg.Connection) -> dict[str, Any]:
    await admin.execute("SELECT pg_stat_clear_snapshot()")
    stats = await admin.fetchval(TABLE_STATS_SQL)
    return dict(stats) if stats else {}


async def open_phase_pool(ctx: Context, dsn: str, name: str) -> None:
    ctx.pool = await create_pool(
        Settings(database_url=dsn),
        application_name=f"bench-{name}",
        min_size=ctx.args.tasks,
        max_size=ctx.args.tasks,
    )


async def close_phase_pool(ctx: Context, name: str) -> None:
    """Close the pool and wait for its backends to exit: an exiting backend flushes its table
    statistics, so counters read afterwards include everything the phase did."""
    if ctx.pool is None:
        return
    pool, ctx.pool = ctx.pool, None
    try:
        await asyncio.wait_for(pool.close(), timeout=10)
    except TimeoutError:
        log(f"WARNING: the pool of phase {name!r} did not close in 10s; terminating it")
        pool.terminate()
    for _ in range(100):
        left = await ctx.admin.fetchval(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1", f"bench-{name}"
        )
        if not left:
            return
        await asyncio.sleep(0.05)
    log(f"WARNING: backends of phase {name!r} still present; table statistics may lag")


def counter_delta(before: dict[str, Any], after: dict[str, Any], key: str) -> int | None:
    if key not in before or key not in after:
        return None
    return int(after[key]) - int(before[key])


def update_stats(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    updates = counter_delta(before, after, "n_tup_upd")
    hot = counter_delta(before, after, "n_tup_hot_upd")
    return {
        "updates": updates,
        "hot_updates": hot,
        "new_page_updates": counter_delta(before, after, "n_tup_newpage_upd"),
        "hot_share": (hot / updates) if updates and hot is not None else None,
    }


async def benchmark(server: Server, args: Config) -> dict[str, Any]:
    sql_copies = check_sql_copies()
    database = f"orchestrator_bench_{os.getpid()}"
    dsn = await create_database(server.dsn, database)
    try:
        return await benchmark_in(dsn, args, server.embedded, sql_copies)
    finally:
        await drop_database(server.dsn, database)


async def benchmark_in(
    dsn: str, args: Config, embedded: bool, sql_copies: dict[str, bool]
) -> dict[str, Any]:
    admin = await connect(Settings(database_url=dsn), application_name="bench-admin")
    try:
        await migrate(admin)
        ctx = Context(args=args, admin=admin)
        server = await server_facts(admin, SERVER_SETTINGS_SHOWN)
        log(
            f"PostgreSQL {server['server_version']}: fsync={server['fsync']} "
            f"synchronous_commit={server['synchronous_commit']} "
            f"full_page_writes={server['full_page_writes']}; {args.tasks} tasks, "
            f"{args.rounds} rounds after a warm-up ({args.claim1_rounds} for claims one by one)"
        )
        phases: dict[str, dict[str, Any]] = {}

        async def phase(name: str, cases: list[Case]) -> list[Case]:
            """Run ``cases`` on a pool of their own and record the row updates they caused."""
            before = await table_stats(admin)
            await open_phase_pool(ctx, dsn, name)
            try:
                for case in cases:
                    await run_case(ctx, case)
            finally:
                await close_phase_pool(ctx, name)
            phases[name] = update_stats(before, await table_stats(admin))
            phases[name]["operations"] = sum(case.ops_done() for case in cases)
            return cases

        # One phase per operation, so that row-update statistics are reported for each. Both
        # renewal phases renew the same leases.
        cases: list[Case] = []
        if "claim1" in args.only:
            cases += await phase("claim1", [claim_case(ctx, 1, args.claim_runs)])
        if "claim50" in args.only:
            cases += await phase("claim50", [claim_case(ctx, 50, args.claim_batch_runs)])
        if {"renew_one", "renew_many"} & set(args.only):
            leases = await create_leases(ctx, "bench-renew", RENEW_BATCH)
            if "renew_one" in args.only:
                renewals_per_task = args.renewals_per_task
                cases += await phase("renew_one", [renew_one_case(ctx, leases, renewals_per_task)])
            if "renew_many" in args.only:
                statements_per_task = args.batched_statements_per_task
                cases += await phase(
                    "renew_many", [renew_many_case(ctx, leases, statements_per_task)]
                )
        if "commit" in args.only:
            leases = await create_leases(ctx, "bench-commit", args.commit_leases_per_task)
            cases += await phase("commit", [commit_case(ctx, leases, args.commits_per_task)])
        return build_report(args, cases, phases, server, sql_copies, embedded)
    finally:
        await admin.close()


# -- reporting ------------------------------------------------------------------------------------


def summarise(samples: Sequence[Sample]) -> dict[str, Any]:
    rates = [sample.rate for sample in samples]
    return {
        "median_ops_per_s": statistics.median(rates) if rates else 0.0,
        "ops_per_s": rates,
        "ops": [sample.ops for sample in samples],
        "seconds": [sample.seconds for sample in samples],
        "statements": [sample.statements for sample in samples],
    }


def compare(case: Case, baseline: str, name: str) -> dict[str, Any]:
    """Store against one baseline. The ratio is the median of the per-round ratios: the two
    measurements of a round ran back to back, so each round's ratio compares like with like."""
    store, base = case.samples["store"], case.samples[baseline]
    paired = [s.rate / b.rate for s, b in zip(store, base, strict=True) if b.rate > 0]
    store_summary, base_summary = summarise(store), summarise(base)
    ratio = statistics.median(paired) if paired else 0.0
    base_median = base_summary["median_ops_per_s"]
    return {
        "operation": name,
        "unit": case.unit,
        "baseline_kind": baseline,
        "store": store_summary,
        "baseline": base_summary,
        "ratio": ratio,
        "ratio_of_medians": store_summary["median_ops_per_s"] / base_median if base_median else 0.0,
        "paired_ratios": paired,
        "meets_target": ratio >= TARGET_RATIO,
    }


def build_report(
    args: Config,
    cases: Sequence[Case],
    phases: dict[str, dict[str, Any]],
    server: dict[str, str],
    sql_copies: dict[str, bool],
    embedded: bool,
) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    for case in cases:
        rows.append({**compare(case, "baseline", case.name), "in_target": True})
        for extra in case.variants:
            if extra not in ("store", "baseline"):
                row = compare(case, extra, f"{case.name} ({EXTRA_BASELINES[extra]})")
                rows.append({**row, "in_target": False})
    targeted = [row for row in rows if row["in_target"]]
    return {
        **report_heading("lease_ops"),
        "server": {"embedded": embedded, **server},
        "config": args.describe(),
        "sql_copies_match_store": sql_copies,
        "target_ratio": TARGET_RATIO,
        "target_met": all(row["meets_target"] for row in targeted),
        "results": rows,
        "table_updates": phases,
    }


def format_table(report: dict[str, Any]) -> str:
    header = ("operation", "store ops/s", "baseline ops/s", "store/baseline", "rounds: min-max")
    lines: list[tuple[str, ...]] = []
    for row in report["results"]:
        paired = row["paired_ratios"]
        lines.append(
            (
                row["operation"],
                f"{row['store']['median_ops_per_s']:,.0f}",
                f"{row['baseline']['median_ops_per_s']:,.0f}",
                f"{row['ratio']:.2f}",
                f"{min(paired):.2f}-{max(paired):.2f}" if paired else "-",
            )
        )
    server, machine, config = report["server"], report["machine"], report["config"]
    out = [
        f"lease_ops: {report['date']}, {machine['cpus']} CPUs, Python {machine['python']}, "
        f"asyncpg {machine['asyncpg']}",
        f"{server_line(server)} full_page_writes={server['full_page_writes']} "
        f"shared_buffers={server['shared_buffers']}",
        f"{config['tasks']} concurrent tasks on a pool of {config['pool_size']}; "
        f"{config['rounds']} interleaved rounds after a warm-up ({config['claim1_rounds']} for "
        "claims with batch 1)",
        "ops/s: median of the rounds; store/baseline: median of the per-round ratios",
        "",
        *render_table(header, lines),
        "",
    ]
    out.append("row updates of `runs` per phase (pg_stat_user_tables, warm-up included):")
    for phase, stats in report["table_updates"].items():
        if stats.get("hot_share") is None:
            continue
        moved = stats["new_page_updates"]
        out.append(
            f"  {PHASE_LABELS.get(phase, phase)}: {stats['updates']:,} updates for "
            f"{stats['operations']:,} operations, {stats['hot_updates']:,} HOT "
            f"({stats['hot_share']:.1%})"
            + (f", {moved:,} moved to another page" if moved is not None else "")
        )
    missed = [
        f"{row['operation']} {row['ratio']:.2f}"
        for row in report["results"]
        if row["in_target"] and not row["meets_target"]
    ]
    met = f"NOT met ({'; '.join(missed)})" if missed else "met"
    out.append(f"target: store >= {TARGET_RATIO:.0%} of the inline baseline: {met}")
    stale = [name for name, same in report["sql_copies_match_store"].items() if not same]
    if stale:
        out.append(f"WARNING: inline SQL differs from sql/queries.sql for: {', '.join(stale)}")
    return "\n".join(out)


# -- entry point ----------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> Config:
    parser = benchmark_parser(
        "Throughput of RunStore's claim, renew and commit paths against raw asyncpg."
    )
    parser.add_argument("--tasks", type=int, default=8, help="concurrent tasks and pool size")
    parser.add_argument("--rounds", type=int, default=6, help="measured rounds per operation")
    parser.add_argument(
        "--claim1-rounds",
        type=int,
        default=3,
        help="rounds for claims with batch 1 (slow: each claim reads the whole queue)",
    )
    parser.add_argument("--warmup-scale", type=float, default=0.25, help="warm-up size fraction")
    parser.add_argument(
        "--max-seconds", type=float, default=8.0, help="time bound of one measurement"
    )
    parser.add_argument(
        "--budget",
        type=float,
        default=110.0,
        help=f"after this many seconds, run no round beyond the {MIN_ROUNDS}th of an operation",
    )
    parser.add_argument("--claim-runs", type=int, default=2_000, help="runs claimed, batch 1")
    parser.add_argument("--claim-batch-runs", type=int, default=5_000, help="runs, batch 50")
    parser.add_argument("--renewals-per-task", type=int, default=150)
    parser.add_argument("--batched-statements-per-task", type=int, default=8)
    parser.add_argument("--commits-per-task", type=int, default=150)
    parser.add_argument("--commit-leases-per-task", type=int, default=50)
    parser.add_argument(
        "--only",
        type=lambda text: tuple(part.strip() for part in text.split(",") if part.strip()),
        default=tuple(PHASE_LABELS),
        help=f"comma-separated subset of: {', '.join(PHASE_LABELS)}",
    )
    config = Config(**vars(parser.parse_args(argv)))
    unknown = set(config.only) - set(PHASE_LABELS)
    if unknown or not config.only:
        parser.error(f"--only takes a comma-separated subset of {', '.join(PHASE_LABELS)}")
    numbers = [
        value
        for value in asdict(config).values()
        if isinstance(value, int | float) and not isinstance(value, bool)
    ]
    if any(value <= 0 for value in numbers) or config.warmup_scale > 1:
        parser.error("every count and duration must be positive, and --warmup-scale at most 1")
    return config


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    run_and_report(args, "lease_ops", lambda server: benchmark(server, args), format_table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
