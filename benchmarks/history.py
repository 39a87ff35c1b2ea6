"""History and retention: do claims and step commits slow down as finished runs pile up, and what
does a purge cost a worker running at full speed?

On one embedded PostgreSQL (or ``--dsn``), two databases: ``empty`` and ``history``, the latter
holding ``--history`` finished runs (default 1,000,000), each with three events, finished 40 days
ago. Rounds alternate between the two databases, in an order that rotates, measuring

* claims/s: ``RunStore.claim`` with ``limit=1`` by ``--tasks`` tasks draining a queue of 2,000
  runs;
* step commits/s: ``RunStore.commit_step`` on 2,000 claimed runs;

and report the median ratio history/empty of each (the target: at least 0.9).

Then, on the history database, a worker-like load (claim 50, finish each, ``--tasks`` tasks) runs
in alternating windows of ``--window`` seconds without and with a concurrent
``orchestrator.db.purges.purge`` (cutoff 30 days, its default pacing), reporting the purge's
rows/s (runs and what was kept for them) and the median ratio of the load's runs/s with the
purge to without (the target: at least 0.8).

Progress on stderr, the results on stdout (``--json`` for machine-readable output). Every loop is
bounded in count and in time. Run from the repository root:
``.venv/bin/python benchmarks/history.py`` (about five minutes with the default history).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import asyncpg

from orchestrator.db.connections import connect, create_pool
from orchestrator.db.embedded import EmbeddedPostgres
from orchestrator.db.migrations import migrate
from orchestrator.db.purges import Purged, purge
from orchestrator.db.store import RunStore
from orchestrator.settings import Settings

QUEUE = 2_000
BUDGET_SECONDS = 120.0
"""No single measurement may take longer than this."""


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


async def fill_history(pool: asyncpg.Pool, count: int) -> None:
    """``count`` succeeded runs finished 40 days ago, three events each, in chunks of 100,000."""
    for start in range(0, count, 100_000):
        end = min(count, start + 100_000)
        await pool.execute(
            "INSERT INTO runs (run_id, agent, state, input, fence, attempt, checkpoint_version, "
            "result, created_at, updated_at, finished_at) "
            "SELECT 'r_hist_' || g, 'history', 'succeeded', '{\"n\": 1}', 1, 1, 2, "
            "'{\"ok\": true}', now() - interval '41 days', now() - interval '40 days', "
            "now() - interval '40 days' + g * interval '1 millisecond' "
            "FROM generate_series($1::int, $2::int) AS g",
            start + 1,
            end,
        )
        await pool.execute(
            "INSERT INTO run_events (run_id, kind, fence, details) "
            "SELECT 'r_hist_' || g, kind, 1, '{}' FROM generate_series($1::int, $2::int) AS g, "
            "unnest(ARRAY['submitted', 'claimed', 'succeeded']) AS kind",
            start + 1,
            end,
        )
        log(f"  history: {end:,} of {count:,} finished runs")
    await pool.execute("VACUUM ANALYZE runs")
    await pool.execute("VACUUM ANALYZE run_events")


async def queue(pool: asyncpg.Pool, agent: str, count: int) -> None:
    await pool.execute(
        "INSERT INTO runs (run_id, agent, input) "
        "SELECT 'r_q_' || $1 || '_' || g, $1, '{}' FROM generate_series(1, $2::int) AS g",
        agent,
        count,
    )


async def parallel(tasks: int, work: Callable[[int], Awaitable[int]]) -> float:
    """Run ``work(i)`` in ``tasks`` tasks; operations per second over them all."""
    began = time.monotonic()
    done = await asyncio.wait_for(asyncio.gather(*(work(i) for i in range(tasks))), BUDGET_SECONDS)
    return sum(done) / (time.monotonic() - began)


async def claims_and_commits(store: RunStore, agent: str, tasks: int) -> tuple[float, float]:
    await queue(store.pool, agent, QUEUE)
    leases: list[Any] = []

    async def claim(index: int) -> int:
        claimed = 0
        for _ in range(QUEUE):
            batch = await store.claim(f"bench-{index}", [agent], limit=1, lease_seconds=300)
            if not batch.claimed:
                return claimed
            leases.extend(batch.claimed)
            claimed += 1
        return claimed

    claims = await parallel(tasks, claim)
    shares = [leases[i::tasks] for i in range(tasks)]

    async def commit(index: int) -> int:
        for run in shares[index]:
            await store.commit_step(run.lease, expected_version=0, next_step="Two", checkpoint={})
        return len(shares[index])

    commits = await parallel(tasks, commit)
    await store.pool.execute("DELETE FROM runs WHERE agent = $1", agent)
    await store.pool.execute("DELETE FROM run_events WHERE run_id LIKE 'r_q_' || $1 || '_%'", agent)
    return claims, commits


async def load(store: RunStore, agent: str, tasks: int, seconds: float) -> float:
    """Claim 50 and finish each, for ``seconds``: runs per second."""
    await queue(store.pool, agent, 200_000)

    async def work(index: int) -> int:
        finished = 0
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            batch = await store.claim(f"load-{index}", [agent], limit=50, lease_seconds=300)
            for run in batch.claimed:
                await store.finish(run.lease, expected_version=0, result={"ok": True})
                finished += 1
        return finished

    rate = await parallel(tasks, work)
    await store.pool.execute("DELETE FROM runs WHERE agent = $1", agent)
    return rate


async def main(arguments: argparse.Namespace) -> dict[str, Any]:
    home = Path(tempfile.mkdtemp(prefix="orchestrator-bench-history-"))
    server = None
    if arguments.dsn:
        base = arguments.dsn
    else:
        server = EmbeddedPostgres(home)
        base = server.ensure_running().dsn("postgres")
    admin = await asyncpg.connect(base)
    stores: dict[str, RunStore] = {}
    try:
        for name in ("empty", "history"):
            database = f"bench_history_{name}"
            await admin.execute(f"DROP DATABASE IF EXISTS {database}")
            await admin.execute(f"CREATE DATABASE {database}")
            dsn = base.rsplit("/", 1)[0] + "/" + database
            settings = Settings(database_url=dsn)
            connection = await connect(settings)
            await migrate(connection)
            await connection.close()
            pool = await create_pool(
                settings, min_size=arguments.tasks, max_size=arguments.tasks + 2
            )
            stores[name] = RunStore(pool)
        log(f"filling the history database with {arguments.history:,} finished runs")
        await fill_history(stores["history"].pool, arguments.history)
        ratios: dict[str, list[float]] = {"claims": [], "commits": []}
        rates: dict[str, dict[str, list[float]]] = {
            name: {"claims": [], "commits": []} for name in stores
        }
        log("warming up (not measured)")
        for name, store in stores.items():
            await claims_and_commits(store, f"warm{name}", arguments.tasks)
        await load(stores["history"], "warm", arguments.tasks, 2.0)
        for round_number in range(arguments.rounds):
            order = ["empty", "history"] if round_number % 2 == 0 else ["history", "empty"]
            measured = {}
            for name in order:
                measured[name] = await claims_and_commits(
                    stores[name], f"a{round_number}", arguments.tasks
                )
                rates[name]["claims"].append(measured[name][0])
                rates[name]["commits"].append(measured[name][1])
            ratios["claims"].append(measured["history"][0] / measured["empty"][0])
            ratios["commits"].append(measured["history"][1] / measured["empty"][1])
            log(
                f"round {round_number + 1}: claims/s {measured['empty'][0]:.0f} empty, "
                f"{measured['history'][0]:.0f} history; commits/s {measured['empty'][1]:.0f}, "
                f"{measured['history'][1]:.0f}"
            )
        history = stores["history"]
        cutoff = await history.database_now() - timedelta(days=30)
        purged = [Purged(0, 0)]
        purge_runs = purge_rows = 0
        purge_seconds = 0.0
        with_purge: list[float] = []
        without: list[float] = []
        for window in range(arguments.windows):
            quiet = await load(history, f"w{window}q", arguments.tasks, arguments.window)
            without.append(quiet)
            purged[0] = Purged(0, 0)
            began = time.monotonic()
            purging = asyncio.ensure_future(
                purge(
                    history.pool,
                    cutoff,
                    batch=500,
                    progress=lambda total: purged.__setitem__(0, total),
                )
            )
            busy = await load(history, f"w{window}b", arguments.tasks, arguments.window)
            purging.cancel()
            await asyncio.gather(purging, return_exceptions=True)
            purge_seconds += time.monotonic() - began
            purge_runs += purged[0].runs
            purge_rows += purged[0].runs + purged[0].other_rows
            with_purge.append(busy)
            log(
                f"window {window + 1}: {quiet:.0f} runs/s without a purge, {busy:.0f} with; "
                f"the purge deleted {purged[0].runs:,} runs"
            )
        return {
            "history_runs": arguments.history,
            "tasks": arguments.tasks,
            "claims_ratio_history_to_empty": statistics.median(ratios["claims"]),
            "commits_ratio_history_to_empty": statistics.median(ratios["commits"]),
            "claims_per_second": {k: statistics.median(v["claims"]) for k, v in rates.items()},
            "commits_per_second": {k: statistics.median(v["commits"]) for k, v in rates.items()},
            "purge_runs_per_second": purge_runs / purge_seconds,
            "purge_rows_per_second": purge_rows / purge_seconds,
            "load_runs_per_second": {
                "without_purge": statistics.median(without),
                "with_purge": statistics.median(with_purge),
            },
            "load_ratio_with_purge": statistics.median(
                [b / q for b, q in zip(with_purge, without, strict=True)]
            ),
        }
    finally:
        for store in stores.values():
            await store.pool.close()
        for name in ("empty", "history"):
            await admin.execute(f"DROP DATABASE IF EXISTS bench_history_{name}")
        await admin.close()
        if server is not None:
            server.stop(mode="immediate")


def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dsn", help="An existing server (default: an embedded one).")
    parser.add_argument("--history", type=int, default=1_000_000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tasks", type=int, default=8)
    parser.add_argument("--windows", type=int, default=4)
    parser.add_argument("--window", type=float, default=10.0, help="Seconds per load window.")
    parser.add_argument("--json", action="store_true")
    arguments = parser.parse_args()
    results = asyncio.run(main(arguments))
    if arguments.json:
        print(json.dumps(results, indent=2))
    else:
        for name, value in results.items():
            print(f"{name:32} {value}")


if __name__ == "__main__":
    cli()
