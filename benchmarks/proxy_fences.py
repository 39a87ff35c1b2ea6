"""What the action proxy's fence store costs, and whether its SQLite calls belong off the loop.

Two measurements, in one run:

1. **Store operations** (no PostgreSQL): one read and one durable write (``synchronous=FULL``,
   an fsync) on a SQLite connection called directly, a ``FenceStore`` write (through
   ``anyio.to_thread``), a ``FenceStore`` read (on the loop) and the same read through
   ``anyio.to_thread``, ``--ops`` each (reads: five or ten times as many), one at a time; µs per
   operation.
2. **Proxy requests** (PostgreSQL): the proxy app (``effects.proxy.create_app``) called in
   process through ``httpx.ASGITransport`` (the HTTP server's own cost is the same whatever the
   store does, so it is left out) by ``--concurrency`` tasks, each request a new effect of a
   running run, in four variants run back to back in an order that rotates each of
   ``--rounds`` rounds:

   - ``shipped``: the shipped store: reads on the event loop, durable writes in a thread;
   - ``threaded``: every SQLite call in a worker thread, reads too (not shipped);
   - ``inline``: every SQLite call on the event loop, durable writes too (not shipped);
   - ``none``: no store at all (``create_app`` without one: the proxy without ``--fence-store``,
     which takes no per-run turns either).

   and two workloads: ``steady`` (``--requests`` requests over 50 runs: after each run's first,
   the store only reads, twice a request) and ``first`` (every request is its run's first: a
   durable write each, inside the acceptance's open transaction, the worst case). Reported:
   requests/s (median of the rounds), the ratio to ``none`` (median of the per-round ratios),
   p50/p99 request latency, and the event loop's lag: a task that sleeps 1 ms in a loop records
   how late each wake-up is (p99 and max). A blocking call on the loop shows there first.

By default an embedded PostgreSQL is started in a temporary directory with the project's
durable settings and removed at the end (``--dsn`` for an existing server: a scratch database is
created and dropped there). The SQLite file lives in a temporary directory on the same disk.
About a minute. Run from the repository root: ``.venv/bin/python benchmarks/proxy_fences.py``.
"""

from __future__ import annotations

import argparse
import shutil
import sqlite3
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import anyio
import asyncpg
import httpx

from bench_main import benchmark_parser, run_and_report
from bench_report import fmt, log, machine_facts, percentile, render_table
from orchestrator.db.connections import create_pool
from orchestrator.db.migrations import migrate
from orchestrator.db.store import RunStore
from orchestrator.effects.fence_store import FenceStore, Remembered
from orchestrator.effects.proxy import create_app
from orchestrator.telemetry import configure_logging
from serve_harness import Server, create_database, drop_database, settings_for

T = TypeVar("T")
TOKEN = "bench-token"
VARIANTS = ("shipped", "threaded", "inline", "none")
STEADY_RUNS = 50
READ = "SELECT fence, touched FROM run_fences WHERE run_id = ?"


class ThreadedFences(FenceStore):
    """Reads in a worker thread too: the alternative the shipped store was measured against."""

    async def remembered(self, run_id: str) -> Remembered | None:
        def read(connection: sqlite3.Connection) -> Remembered | None:
            row = connection.execute(READ, (run_id,)).fetchone()
            return None if row is None else Remembered(int(row[0]), float(row[1]))

        return await self._run(read)


class InlineFences(FenceStore):
    """The store with its SQLite calls on the event loop: the alternative being measured."""

    async def _run(self, work: Callable[[sqlite3.Connection], T]) -> T:
        return self._on_a_connection(work)


STORES: dict[str, type[FenceStore] | None] = {
    "shipped": FenceStore,
    "threaded": ThreadedFences,
    "inline": InlineFences,
    "none": None,  # create_app without a store: the proxy without --fence-store
}


async def store_operations(directory: Path, ops: int) -> dict[str, float]:
    store = FenceStore.open(directory / "ops.sqlite3")
    connection = store._connect()
    try:
        results: dict[str, float] = {}
        write = (
            "INSERT INTO run_fences (run_id, fence, touched) VALUES (?, ?, ?) ON CONFLICT (run_id)"
            " DO UPDATE SET fence = max(fence, excluded.fence), touched = excluded.touched"
        )
        began = time.perf_counter()
        for i in range(ops):
            connection.execute(write, (f"r_{i % 100}", i, time.time()))
        results["write_direct_us"] = (time.perf_counter() - began) / ops * 1e6
        began = time.perf_counter()
        for i in range(ops * 10):
            connection.execute(READ, (f"r_{i % 100}",)).fetchone()
        results["read_direct_us"] = (time.perf_counter() - began) / (ops * 10) * 1e6
        began = time.perf_counter()
        for i in range(ops):
            await store.remember(f"r_{i % 100}", ops + i)
        results["write_to_thread_us"] = (time.perf_counter() - began) / ops * 1e6
        began = time.perf_counter()
        for i in range(ops * 5):
            await store.remembered(f"r_{i % 100}")
        results["read_on_loop_us"] = (time.perf_counter() - began) / (ops * 5) * 1e6
        threaded = ThreadedFences.open(directory / "ops.sqlite3")
        try:
            began = time.perf_counter()
            for i in range(ops * 5):
                await threaded.remembered(f"r_{i % 100}")
            results["read_to_thread_us"] = (time.perf_counter() - began) / (ops * 5) * 1e6
        finally:
            threaded.close()
        return results
    finally:
        connection.close()
        store.close()


async def claimed_runs(pool: asyncpg.Pool, count: int) -> list[tuple[str, int]]:
    store = RunStore(pool)
    for _ in range(count):
        await store.submit("bench", {})
    claimed: list[tuple[str, int]] = []
    while len(claimed) < count:
        batch = await store.claim("bench", ["bench"], limit=500, lease_seconds=3600)
        claimed.extend((run.run_id, run.fence) for run in batch.claimed)
    return claimed


async def loop_lag(lags: list[float], stop: anyio.Event) -> None:
    while not stop.is_set():
        began = time.perf_counter()
        await anyio.sleep(0.001)
        lags.append(time.perf_counter() - began - 0.001)


async def one_measurement(
    pool: asyncpg.Pool,
    fences: FenceStore | None,
    targets: list[tuple[str, int]],
    concurrency: int,
    tag: str,
) -> dict[str, float]:
    app = create_app(pool, [TOKEN], fences=fences)
    headers = {"Authorization": f"Bearer {TOKEN}"}
    latencies: list[float] = []
    lags: list[float] = []
    queue = list(enumerate(targets))
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as client:

        async def sender() -> None:
            while queue:
                i, (run_id, fence) = queue.pop()
                body = {
                    "run_id": run_id,
                    "effect_key": f"{tag}-{i}",
                    "fence": fence,
                    "kind": "crm",
                    "payload": {"n": i},
                }
                began = time.perf_counter()
                answer = await client.post("/v1/effects", json=body, headers=headers)
                latencies.append(time.perf_counter() - began)
                if answer.status_code != 201:
                    raise RuntimeError(f"unexpected answer {answer.status_code}: {answer.text}")

        stop = anyio.Event()
        began = time.perf_counter()
        async with anyio.create_task_group() as group:
            group.start_soon(loop_lag, lags, stop)
            async with anyio.create_task_group() as senders:
                for _ in range(concurrency):
                    senders.start_soon(sender)
            took = time.perf_counter() - began
            stop.set()
    return {
        "requests_per_second": len(targets) / took,
        "p50_ms": percentile(latencies, 0.5) * 1e3,
        "p99_ms": percentile(latencies, 0.99) * 1e3,
        "lag_p99_ms": percentile(lags, 0.99) * 1e3,
        "lag_max_ms": max(lags) * 1e3,
    }


async def proxy_requests(
    server: Server, directory: Path, args: argparse.Namespace
) -> dict[str, Any]:
    dsn = await create_database(server.dsn, "bench_proxy_fences")
    pool = await create_pool(settings_for(dsn), application_name="bench", max_size=10)
    try:
        async with pool.acquire() as connection:
            await migrate(connection)
        workloads: dict[str, Callable[[int], Awaitable[list[tuple[str, int]]]]] = {}
        steady = await claimed_runs(pool, STEADY_RUNS)

        async def steady_targets(round_: int) -> list[tuple[str, int]]:
            return [steady[i % STEADY_RUNS] for i in range(args.requests)]

        async def first_targets(round_: int) -> list[tuple[str, int]]:
            return await claimed_runs(pool, args.requests)

        workloads = {"steady": steady_targets, "first": first_targets}
        results: dict[str, Any] = {}
        for workload, targets_of in workloads.items():
            rows: dict[str, list[dict[str, float]]] = {variant: [] for variant in VARIANTS}
            ratios: dict[str, list[float]] = {variant: [] for variant in VARIANTS}
            for round_ in range(args.rounds):
                order = VARIANTS[round_ % 4 :] + VARIANTS[: round_ % 4]
                measured: dict[str, float] = {}
                for variant in order:
                    targets = await targets_of(round_)
                    kind = STORES[variant]
                    fences = (
                        None
                        if kind is None
                        else kind.open(directory / f"{workload}-{variant}.sqlite3")
                    )
                    try:
                        row = await one_measurement(
                            pool, fences, targets, args.concurrency, f"{variant}{round_}"
                        )
                    finally:
                        if fences is not None:
                            fences.close()
                    rows[variant].append(row)
                    measured[variant] = row["requests_per_second"]
                for variant in VARIANTS:
                    ratios[variant].append(measured[variant] / measured["none"])
                log(
                    f"{workload} round {round_ + 1}/{args.rounds}: "
                    + ", ".join(f"{v} {measured[v]:,.0f}/s" for v in VARIANTS)
                )
            results[workload] = {
                variant: {
                    "requests_per_second": statistics.median(
                        r["requests_per_second"] for r in rows[variant]
                    ),
                    "ratio_to_none": statistics.median(ratios[variant]),
                    **{
                        key: statistics.median(r[key] for r in rows[variant])
                        for key in ("p50_ms", "p99_ms", "lag_p99_ms")
                    },
                    "lag_max_ms": max(r["lag_max_ms"] for r in rows[variant]),
                }
                for variant in VARIANTS
            }
        return results
    finally:
        await pool.close()
        await drop_database(server.dsn, "bench_proxy_fences")


async def body(server: Server, args: argparse.Namespace) -> dict[str, Any]:
    directory = Path(tempfile.mkdtemp(prefix="orchestrator-bench-fences-"))
    try:
        log("store operations")
        operations = await store_operations(directory, args.ops)
        log("proxy requests")
        requests = await proxy_requests(server, directory, args)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    return {
        "machine": machine_facts(),
        "store_operations": operations,
        "proxy_requests": requests,
        "concurrency": args.concurrency,
        "requests": args.requests,
        "rounds": args.rounds,
    }


def render(report: dict[str, Any]) -> str:
    operations = report["store_operations"]
    lines = [
        "store operations (µs each): "
        + ", ".join(f"{name[:-3]} {value:,.1f}" for name, value in operations.items()),
        "",
        f"proxy requests ({report['requests']} per measurement, {report['concurrency']} at once, "
        f"median of {report['rounds']} rounds):",
    ]
    rows = [
        [
            workload,
            variant,
            fmt(row["requests_per_second"]),
            fmt(row["ratio_to_none"], ".2f"),
            fmt(row["p50_ms"], ".2f"),
            fmt(row["p99_ms"], ".2f"),
            fmt(row["lag_p99_ms"], ".2f"),
            fmt(row["lag_max_ms"], ".2f"),
        ]
        for workload, variants in report["proxy_requests"].items()
        for variant, row in variants.items()
    ]
    header = ["workload", "store", "req/s", "x none", "p50 ms", "p99 ms", "lag p99", "lag max"]
    lines += render_table(header, rows)
    return "\n".join(lines)


def main() -> None:
    configure_logging(json_logs=True, level="warning")
    parser = benchmark_parser(__doc__.split("\n\n")[0])
    parser.add_argument("--ops", type=int, default=500, help="Store operations per kind.")
    parser.add_argument("--requests", type=int, default=1_000, help="Requests per measurement.")
    parser.add_argument("--concurrency", type=int, default=8, help="Requests in flight at once.")
    parser.add_argument("--rounds", type=int, default=5, help="Rounds per workload.")
    args = parser.parse_args()
    run_and_report(args, "proxy-fences", lambda server: body(server, args), render)


if __name__ == "__main__":
    main()
