"""Schedules (docs/schedules.md, issue 43): how soon a slot's run is claimed, and what idle
schedules cost the ``serve`` process that keeps them.

* **Slot to claim**: one ``orchestrator serve --agents orchestrator.agents.noop`` process, idle
  otherwise, fires ``--schedules`` (20) every-second schedules for ``--seconds`` (20) per round,
  fresh ones each round, and one cron schedule (``* * * * *``) over all the rounds. For each run a
  schedule started: its first ``claimed`` event minus its slot's instant (``runs.schedule_slot``),
  both on the database clock; also the slot to its ``submitted`` event (the fire). Each
  schedule's first slot is reported apart (``first``): a schedule created while the scheduler
  sleeps (at most a second, ``worker/scheduler.py``'s ``LONGEST_SLEEP``) is found when it wakes.
  Target (issue 43): p99 under one second.
* **Idle cost**: ``--idle-schedules`` (10,000) schedules whose next slots are hours away (a daily
  cron at a minute of an hour twelve hours from now, spread over that hour), and a ``serve``
  started on them, measured for ``--idle-seconds`` (30) after a warm-up: the CPU seconds the
  process used (user + system, psutil) over the wall time, against the same ``serve`` on a
  database with no schedule, measured in the same round right before. Target (issue 43): under
  5 % of one core with the schedules. PostgreSQL's CPU over the same windows is reported too.

One schedule is created through ``ScheduleStore.create`` (validated and audited, as an operator
would); the idle ones are copies of it made by one ``INSERT ... SELECT`` (each with its own cron
and next slot), so that setting up 10,000 takes a second.

By default an embedded PostgreSQL with the project's default, durable settings is started in a
temporary directory and removed at the end, also on error, SIGTERM or Ctrl-C; every process
started is killed. ``--dsn`` uses an existing server (scratch databases are created and dropped
there). Every wait is bounded. About five minutes with the defaults. Progress on stderr, the
table on stdout (``--json`` for JSON). From the repository root:
``.venv/bin/python benchmarks/schedules.py``.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg

import bench_report
from bench_main import benchmark_parser, run_and_report
from bench_report import fmt, log, percentile, render_table, report_heading, server_line
from orchestrator.db.connections import connect, create_pool
from orchestrator.db.migrations import migrate
from orchestrator.db.schedules import ScheduleSpec, ScheduleStore
from orchestrator.scheduling.calendar import Calendar
from serve_harness import (
    CpuMeter,
    ServeProcess,
    Server,
    cpu_shares,
    create_database,
    drop_database,
    server_facts,
    settings_for,
)

TARGET_P99_SECONDS = 1.0
TARGET_IDLE_CORE_SHARE = 0.05
STARTUP_SECONDS = 60.0
WARM_UP_SECONDS = 5.0
CLAIMS_WITHIN_SECONDS = 30.0
SERVE_ARGS = ("--agents", "orchestrator.agents.noop")

RUN_TIMES = """
SELECT r.schedule_id, r.schedule_slot,
       extract(epoch FROM (SELECT min(e.at) FROM run_events AS e
                           WHERE e.run_id = r.run_id AND e.kind = 'claimed')
                          - r.schedule_slot)::float8 AS to_claim,
       extract(epoch FROM (SELECT min(e.at) FROM run_events AS e
                           WHERE e.run_id = r.run_id AND e.kind = 'submitted')
                          - r.schedule_slot)::float8 AS to_fire
FROM runs AS r WHERE r.schedule_id = ANY($1::text[])
ORDER BY r.schedule_id, r.schedule_slot
"""
UNCLAIMED = """
SELECT count(*) FROM runs AS r WHERE r.schedule_id = ANY($1::text[])
  AND NOT EXISTS (SELECT 1 FROM run_events AS e WHERE e.run_id = r.run_id AND e.kind = 'claimed')
"""
COPIES = """
INSERT INTO schedules (schedule_id, name, agent, cron, every_seconds, timezone, overlap, catch_up,
                       catch_up_seconds, catch_up_limit, jitter_seconds, starts_at, ends_at, input,
                       concurrency_key, priority, max_attempts, paused, next_fire_at, created_by)
SELECT 'sch_idle' || g, 'idle-' || g, s.agent, format('%s %s * * *', g % 60, $2::int),
       NULL, s.timezone, s.overlap, s.catch_up, s.catch_up_seconds, s.catch_up_limit,
       s.jitter_seconds, s.starts_at, s.ends_at, s.input, s.concurrency_key, s.priority,
       s.max_attempts, false, s.next_fire_at + make_interval(mins => g % 60), s.created_by
FROM schedules AS s, generate_series(1, $3::int) AS g
WHERE s.name = $1
"""


@dataclass(frozen=True)
class Config:
    dsn: str | None
    json: bool
    rounds: int
    schedules: int
    seconds: float
    idle_schedules: int
    idle_seconds: float


# -- slot to claim ---------------------------------------------------------------------------------
async def slot_to_claim(dsn: str, config: Config) -> dict[str, Any]:
    pool = await create_pool(settings_for(dsn), application_name="bench-schedules", max_size=2)
    serve = ServeProcess(dsn, *SERVE_ARGS, name="bench-schedules")
    try:
        await serve.wait_for_event("serving", within=STARTUP_SECONDS)
        store = ScheduleStore(pool)
        cron = await store.create(
            ScheduleSpec("bench-cron", "noop", Calendar(cron="* * * * *"), overlap="allow_all")
        )
        rounds, pooled = [], []
        for index in range(1, config.rounds + 1):
            names = [f"bench-r{index}-{n}" for n in range(config.schedules)]
            ids = []
            for name in names:
                made = await store.create(
                    ScheduleSpec(
                        name, "noop", Calendar(every=timedelta(seconds=1)), overlap="allow_all"
                    )
                )
                ids.append(made.schedule_id)
            await asyncio.sleep(config.seconds)
            for name in names:
                await store.pause(name)
            rows = await _claimed(pool, ids)
            pooled.extend(rows)
            rounds.append(_distribution(f"round {index}", rows))
            log(_line(rounds[-1]))
        cron_rows = await _claimed(pool, [cron.schedule_id])
        await store.pause("bench-cron")
    finally:
        await serve.stop(within=30)
        await pool.close()
    cron = _distribution("cron * * * * *", cron_rows)
    log(_line(cron))
    return {"rounds": rounds, "all_rounds": _distribution("all rounds", pooled), "cron": cron}


async def _claimed(pool: asyncpg.Pool, ids: Sequence[str]) -> list[asyncpg.Record]:
    """The runs of ``ids``, once each is claimed (bounded: a run not claimed by then is left out
    and counted)."""
    deadline = time.monotonic() + CLAIMS_WITHIN_SECONDS
    while await pool.fetchval(UNCLAIMED, list(ids)) and time.monotonic() < deadline:  # noqa: ASYNC110
        await asyncio.sleep(0.1)
    return list(await pool.fetch(RUN_TIMES, list(ids)))


def _distribution(name: str, rows: Sequence[asyncpg.Record]) -> dict[str, Any]:
    firsts: set[str] = set()
    steady, first = [], []
    for row in rows:  # ordered by schedule and slot: each schedule's first slot comes first
        if row["to_claim"] is None:
            continue
        (steady if row["schedule_id"] in firsts else first).append(row)
        firsts.add(row["schedule_id"])
    claims = [row["to_claim"] for row in steady]
    fires = [row["to_fire"] for row in steady]
    return {
        "name": name,
        "runs": len(rows),
        "unclaimed": sum(1 for row in rows if row["to_claim"] is None),
        "p50": percentile(claims, 0.5) if claims else None,
        "p99": percentile(claims, 0.99) if claims else None,
        "max": max(claims, default=None),
        "fire_p50": percentile(fires, 0.5) if fires else None,
        "fire_p99": percentile(fires, 0.99) if fires else None,
        "first_slots": len(first),
        "first_max": max((row["to_claim"] for row in first), default=None),
    }


def _line(result: dict[str, Any]) -> str:
    return (
        f"{result['name']}: {result['runs']} runs, slot -> claim p50 {fmt(result['p50'], '.3f')}s "
        f"p99 {fmt(result['p99'], '.3f')}s max {fmt(result['max'], '.3f')}s; each schedule's "
        f"first slot max {fmt(result['first_max'], '.3f')}s"
    )


# -- idle cost -------------------------------------------------------------------------------------
async def idle_cost(server: Server, config: Config) -> list[dict[str, Any]]:
    results = []
    for index in range(1, config.rounds + 1):
        shares = {}
        for count in (0, config.idle_schedules):
            name = f"bench_schedules_idle_{os.getpid()}_{count}"
            dsn = await create_database(server.dsn, name)
            try:
                await _migrated(dsn)
                if count:
                    await _idle_schedules(dsn, count)
                shares[count] = await _idle_serve(dsn, server, config.idle_seconds)
            finally:
                await drop_database(server.dsn, name)
            log(
                f"idle round {index}, {count:,} schedules: serve "
                f"{100 * (shares[count]['process'] or 0):.2f}% of a core, PostgreSQL "
                f"{100 * (shares[count]['postgres'] or 0):.2f}%"
            )
        zero, many = shares[0], shares[config.idle_schedules]
        results.append(
            {
                "round": index,
                "without": zero,
                "with": many,
                "ratio": (many["process"] / zero["process"])
                if many["process"] and zero["process"]
                else None,
            }
        )
    return results


async def _migrated(dsn: str) -> None:
    connection = await connect(settings_for(dsn), application_name="bench-schedules")
    try:
        await migrate(connection)
    finally:
        await connection.close()


async def _idle_schedules(dsn: str, count: int) -> None:
    """``count`` daily schedules, at minute ``n % 60`` of the hour twelve hours from now."""
    hour = (datetime.now(UTC).hour + 12) % 24
    pool = await create_pool(settings_for(dsn), application_name="bench-schedules", max_size=1)
    try:
        await ScheduleStore(pool).create(
            ScheduleSpec("idle-0", "noop", Calendar(cron=f"0 {hour} * * *"))
        )
        await pool.execute(COPIES, "idle-0", hour, count - 1)
        await pool.execute("ANALYZE schedules")
        due = await pool.fetchval("SELECT min(next_fire_at) - clock_timestamp() FROM schedules")
        log(f"{count:,} schedules created; the first slot is {due} away")
    finally:
        await pool.close()


async def _idle_serve(dsn: str, server: Server, seconds: float) -> dict[str, Any]:
    serve = ServeProcess(dsn, *SERVE_ARGS, name="bench-schedules-idle")
    try:
        await serve.wait_for_event("serving", within=STARTUP_SECONDS)
        await asyncio.sleep(WARM_UP_SECONDS)
        meter = CpuMeter(serve.pid, server.postmaster_pid)
        first = meter.sample()
        deadline = time.monotonic() + seconds
        last = first
        while time.monotonic() < deadline:  # sampled often: a backend is read before it goes
            await asyncio.sleep(0.5)
            last = meter.sample()
        if not serve.alive():
            raise RuntimeError(f"serve exited while measured:\n{serve.tail()}")
        return cpu_shares(first, last)
    finally:
        await serve.stop(within=30)


# -- the report ------------------------------------------------------------------------------------
async def benchmark(server: Server, config: Config) -> dict[str, Any]:
    name = f"bench_schedules_{os.getpid()}"
    dsn = await create_database(server.dsn, name)
    try:
        connection = await connect(settings_for(dsn), application_name="bench-schedules")
        try:
            await migrate(connection)
            facts = await server_facts(connection)
        finally:
            await connection.close()
        latency = await slot_to_claim(dsn, config)
    finally:
        await drop_database(server.dsn, name)
    idle = await idle_cost(server, config)
    processes = [row["with"]["process"] or 0.0 for row in idle]
    ratios = [row["ratio"] for row in idle if row["ratio"] is not None]
    p99 = latency["all_rounds"]["p99"]
    return {
        **report_heading("schedules"),
        "server": {"embedded": server.embedded, **facts},
        "config": bench_report.workload(config),
        "slot_to_claim": latency,
        "idle": idle,
        "idle_with_schedules_median": statistics.median(processes),
        "idle_ratio_median": statistics.median(ratios) if ratios else None,
        "target_p99_seconds": TARGET_P99_SECONDS,
        "target_idle_core_share": TARGET_IDLE_CORE_SHARE,
        "p99_met": p99 is not None and p99 < TARGET_P99_SECONDS,
        "idle_met": max(processes) < TARGET_IDLE_CORE_SHARE,
    }


def format_report(report: dict[str, Any]) -> str:
    machine, server, config = report["machine"], report["server"], report["config"]
    latency = report["slot_to_claim"]
    out = [
        f"schedules: {report['date']}, {machine['cpus']} CPUs, Python {machine['python']}",
        server_line(server),
        f"slot -> claim of its run (database clock), one idle serve with the noop agent, "
        f"{config['schedules']} every-second schedules per round of {config['seconds']:g}s "
        "(each schedule's first slot apart)",
        "",
    ]
    header = ["", "runs", "p50 s", "p99 s", "max s", "fire p50 s", "fire p99 s", "first max s"]
    rows = [
        (
            row["name"],
            str(row["runs"]),
            fmt(row["p50"], ".3f"),
            fmt(row["p99"], ".3f"),
            fmt(row["max"], ".3f"),
            fmt(row["fire_p50"], ".3f"),
            fmt(row["fire_p99"], ".3f"),
            fmt(row["first_max"], ".3f"),
        )
        for row in [*latency["rounds"], latency["all_rounds"], latency["cron"]]
    ]
    out += render_table(header, rows)
    out += [
        "",
        f"idle serve, {config['idle_schedules']:,} schedules hours away against none, "
        f"{config['idle_seconds']:g}s each (% of one core)",
        "",
    ]
    header = ["round", "serve, none", "serve, with", "ratio", "PG, none", "PG, with", "other"]
    rows = [
        (
            str(row["round"]),
            fmt(_percent(row["without"]["process"]), ".2f"),
            fmt(_percent(row["with"]["process"]), ".2f"),
            fmt(row["ratio"], ".2f"),
            fmt(_percent(row["without"]["postgres"]), ".2f"),
            fmt(_percent(row["with"]["postgres"]), ".2f"),
            fmt(_percent(row["with"]["other"]), ".1f"),
        )
        for row in report["idle"]
    ]
    out += render_table(header, rows)
    fast, cheap = (bench_report.verdict(report[key]) for key in ("p99_met", "idle_met"))
    out += [
        "",
        f"target: slot -> claim p99 < {report['target_p99_seconds']:g}s: {fast} "
        f"(p99 {fmt(latency['all_rounds']['p99'], '.3f')}s)",
        f"target: idle serve with {config['idle_schedules']:,} schedules < "
        f"{100 * report['target_idle_core_share']:g}% of a core: {cheap} "
        f"(median {100 * report['idle_with_schedules_median']:.2f}%, "
        f"{fmt(report['idle_ratio_median'], '.2f')}x none)",
    ]
    return "\n".join(out)


def _percent(share: float | None) -> float | None:
    return None if share is None else 100 * share


def main(argv: Sequence[str] | None = None) -> int:
    config = parse_args(argv)
    run_and_report(config, "schedules", lambda server: benchmark(server, config), format_report)
    return 0


def parse_args(argv: Sequence[str] | None) -> Config:
    parser = benchmark_parser("A slot's run claimed how soon; idle schedules' cost to serve.")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--schedules", type=int, default=20, help="every-second, per round")
    parser.add_argument("--seconds", type=float, default=20.0, help="each latency round")
    parser.add_argument("--idle-schedules", type=int, default=10_000)
    parser.add_argument("--idle-seconds", type=float, default=30.0)
    config = Config(**vars(parser.parse_args(argv)))
    if min(config.rounds, config.schedules, config.idle_schedules) < 1:
        parser.error("--rounds, --schedules and --idle-schedules must be at least 1")
    if config.seconds < 3 or config.idle_seconds < 5:
        parser.error("--seconds must be at least 3 and --idle-seconds at least 5")
    return config


if __name__ == "__main__":
    sys.exit(main())
