"""Recovery after a PostgreSQL failover: from the old primary's death to the first claim on the
promoted server, and how much of that is the promotion itself.

What is measured, per iteration: one ``orchestrator serve`` process (the defaults a user runs
with, ``--poll-seconds`` 2) connected through a multi-host URL with
``target_session_attrs=primary`` to a primary and a streaming standby
(``orchestrator.testing.ReplicatedPostgres``, asynchronous unless ``--synchronous``). It holds
``--in-flight`` long runs (renewing their leases across the failover) while ``--due`` no-op runs
wait, submitted beforehand (replicated: the standby has replayed them) and due 0.2 s after the
primary is killed (so that the dying primary cannot hand them out). Then: the primary is
SIGKILLed (``kill_primary``), the standby promoted (``pg_ctl promote``, until it leaves
recovery), and the time of the first ``claimed`` event of a due run, on the promoted server, is
read. Three figures per iteration:

* death -> first claim: the host clock just before SIGKILL to that event's ``at``;
* promotion: SIGKILL to the promoted server leaving recovery (the server's own work, not ours);
* beyond the promotion: the first claim minus the moment the promoted server left recovery (or
  the runs became due, if later): the worker noticing, reconnecting through the multi-host URL
  and claiming. Target: p99 under 5 s.

The event's ``at`` is the promoted server's ``clock_timestamp()``; the server runs on this host,
so one clock measures both ends. Every claim on the promoted server must carry a fence of the
new epoch (checked and reported). After each iteration the due runs are finished, a new standby
is seeded from the promoted server (not timed), and the next iteration fails over again.

About 10 s per iteration. Progress on stderr, the table on stdout (``--json`` for JSON). From
the repository root: ``.venv/bin/python benchmarks/failover.py``.
"""

from __future__ import annotations

import logging
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import anyio
import anyio.to_thread

from bench_main import benchmark_parser, print_report, run_benchmark
from bench_report import fmt, log, percentile, render_table, report_heading, verdict, workload
from orchestrator.db.connections import create_pool
from orchestrator.db.migrations import migrate
from orchestrator.db.store import RunStore
from orchestrator.errors import DatabaseError
from orchestrator.fences import epoch_of
from orchestrator.testing import ReplicatedPostgres
from serve_harness import ServeProcess, settings_for

TARGET_P99_SECONDS = 5.0
STARTUP_SECONDS = 60.0
CLAIM_WITHIN_SECONDS = 120.0
DUE_AFTER_KILL_SECONDS = 0.2
"""The due runs become due this long after the kill: never claimable on the dying primary."""

FIRST_CLAIM_SQL = """
SELECT min(at) AS at, min(fence) AS lowest_fence, count(*) AS claims FROM run_events
WHERE run_id = ANY($1::text[]) AND kind = 'claimed'
"""


@dataclass(frozen=True)
class Config:
    iterations: int
    in_flight: int
    due: int
    synchronous: bool
    json: bool


@dataclass(frozen=True)
class Iteration:
    iteration: int
    death_to_claim: float
    promotion: float
    beyond_promotion: float
    epoch: int
    """The epoch of the lowest fence granted on the promoted server to a due run."""
    new_epoch: bool


async def wait_until_claimed(
    store: RunStore, run_ids: list[str], *, within: float
) -> tuple[datetime, int]:
    """The first ``claimed`` event of these runs on whichever server answers: (its time, the
    lowest fence among their claims)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            row = await store.pool.fetchrow(FIRST_CLAIM_SQL, run_ids)
        except (DatabaseError, OSError):
            row = None
        if row is not None and row["at"] is not None:
            return row["at"], row["lowest_fence"]
        await anyio.sleep(0.02)
    raise RuntimeError(f"none of {len(run_ids)} due runs was claimed within {within:.0f}s")


async def wait_until_finished(store: RunStore, run_ids: list[str], *, within: float) -> None:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            runs = [await store.get(run_id) for run_id in run_ids]
        except (DatabaseError, OSError):
            runs = []
        if runs and all(run.state.terminal for run in runs):
            return
        await anyio.sleep(0.1)
    raise RuntimeError(f"the due runs did not finish within {within:.0f}s")


async def measure(pair: ReplicatedPostgres, config: Config) -> list[Iteration]:
    dsn = pair.dsn()
    pool = await create_pool(settings_for(dsn), application_name="bench-failover", max_size=2)
    worker = ServeProcess(
        dsn,
        "--agents",
        "orchestrator.agents.noop",
        "--agents",
        "orchestrator.agents.sleepy",
        name="failover",
    )
    results: list[Iteration] = []
    try:
        async with pool.acquire() as connection:
            await migrate(connection)
        store = RunStore(pool)
        await worker.wait_for_event("serving", within=STARTUP_SECONDS)
        held = [
            (await store.submit("sleepy", {"steps": 1, "seconds": 3600})).run.run_id
            for _ in range(config.in_flight)
        ]
        for iteration in range(1, config.iterations + 1):
            due_at = datetime.now(UTC) + timedelta(seconds=2)
            due = [
                (await store.submit("noop", {}, not_before=due_at)).run.run_id
                for _ in range(config.due)
            ]
            await anyio.to_thread.run_sync(pair.wait_replayed)
            kill_at = due_at - timedelta(seconds=DUE_AFTER_KILL_SECONDS)
            await anyio.sleep(max(0.0, (kill_at - datetime.now(UTC)).total_seconds()))
            killed_at = time.time()
            await anyio.to_thread.run_sync(pair.kill_primary)
            await anyio.to_thread.run_sync(pair.promote)
            promoted_at = time.time()
            claimed_at, lowest_fence = await wait_until_claimed(
                store, due, within=CLAIM_WITHIN_SECONDS
            )
            claim = claimed_at.timestamp()
            result = Iteration(
                iteration=iteration,
                death_to_claim=claim - killed_at,
                promotion=promoted_at - killed_at,
                beyond_promotion=claim - max(promoted_at, due_at.timestamp()),
                epoch=epoch_of(lowest_fence),
                new_epoch=epoch_of(lowest_fence) == iteration,
            )
            results.append(result)
            log(
                f"  failover #{iteration}: first claim {result.death_to_claim:.3f}s after the "
                f"primary's death, {result.beyond_promotion:.3f}s beyond the promotion "
                f"({result.promotion:.3f}s); fence epoch {result.epoch}"
            )
            await wait_until_finished(store, due, within=CLAIM_WITHIN_SECONDS)
            await anyio.to_thread.run_sync(pair.reseed)
        for run_id in held:
            await store.cancel(run_id, reason="benchmark done")
    finally:
        await worker.stop(within=10)
        await pool.close()
    return results


def summarise(config: Config, iterations: Sequence[Iteration]) -> dict[str, Any]:
    def stats(values: Sequence[float]) -> dict[str, float]:
        return {
            "p50": percentile(values, 0.5),
            "p99": percentile(values, 0.99),
            "max": max(values),
            "mean": statistics.fmean(values),
        }

    beyond = stats([i.beyond_promotion for i in iterations])
    new_epochs = all(i.new_epoch for i in iterations)
    return {
        **report_heading("failover"),
        "config": workload(config),
        "death_to_claim": stats([i.death_to_claim for i in iterations]),
        "promotion": stats([i.promotion for i in iterations]),
        "beyond_promotion": beyond,
        "fences_in_new_epoch": new_epochs,
        "iterations": [asdict(i) for i in iterations],
        "target_p99_seconds": TARGET_P99_SECONDS,
        "target_met": beyond["p99"] < TARGET_P99_SECONDS and new_epochs,
    }


def format_report(report: dict[str, Any]) -> str:
    machine, config = report["machine"], report["config"]
    mode = "synchronous" if config["synchronous"] else "asynchronous"
    out = [
        f"failover: {report['date']}, {machine['cpus']} CPUs, Python {machine['python']}",
        f"primary + {mode} standby (embedded binaries), one `serve` with its defaults holding "
        f"{config['in_flight']} runs, {config['due']} runs due at the primary's death",
        "",
    ]
    header = ["seconds", "p50", "p99", "max", "mean"]
    rows = [
        [label, *(fmt(report[key][s], ".3f") for s in ("p50", "p99", "max", "mean"))]
        for label, key in (
            ("death -> first claim", "death_to_claim"),
            ("promotion (pg_ctl promote)", "promotion"),
            ("beyond the promotion", "beyond_promotion"),
        )
    ]
    out += render_table(header, rows)
    out += [
        "",
        "every first claim on a promoted server in its new epoch: "
        + ("yes" if report["fences_in_new_epoch"] else "NO"),
        f"target: p99 beyond the promotion < {report['target_p99_seconds']:g}s: "
        f"{verdict(report['target_met'])} ({len(report['iterations'])} failovers)",
    ]
    return "\n".join(out)


def parse_args(argv: Sequence[str] | None) -> Config:
    parser = benchmark_parser(
        "Seconds from a primary's death to the first claim on the promoted standby.", dsn=False
    )
    parser.add_argument("--iterations", type=int, default=10, help="failovers (default 10)")
    parser.add_argument("--in-flight", type=int, default=5, help="long runs held throughout")
    parser.add_argument("--due", type=int, default=5, help="runs due at each primary's death")
    parser.add_argument("--synchronous", action="store_true", help="a synchronous standby")
    config = Config(**vars(parser.parse_args(argv)))
    if min(config.iterations, config.due) < 1 or config.in_flight < 0:
        parser.error("--iterations and --due must be at least 1, --in-flight not negative")
    return config


def main(argv: Sequence[str] | None = None) -> int:
    config = parse_args(argv)
    # The benchmark's own pool retries its connections while no primary answers: expected here.
    logging.getLogger("asyncpg.pool").setLevel(logging.ERROR)

    async def body() -> dict[str, Any]:
        pair = ReplicatedPostgres(synchronous=config.synchronous)
        try:
            await anyio.to_thread.run_sync(pair.start)
            log(f"pair started: primary :{pair.ports[0]}, standby :{pair.ports[1]}")
            return summarise(config, await measure(pair, config))
        finally:
            await anyio.to_thread.run_sync(pair.close)

    print_report(run_benchmark(body), format_report, as_json=config.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
