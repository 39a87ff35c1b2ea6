"""What effects waiting for a standby cost, on a primary + asynchronous streaming standby.

    python benchmarks/standby_wait.py [--rounds 3] [--latency-effects 200] [--backlog 2000]
                                      [--runs 2000] [--json]

On one ``ReplicatedPostgres`` pair (loopback, the standby streaming through its slot), each round
measures the same three things with the dispatcher waiting for the standby
(``--standby-wait any``, the default) and not waiting (``off``), in alternating order:

* **commit to confirmed**: one effect at a time is accepted in its own transaction (as a step
  commit accepts it), the dispatcher woken as the commit's NOTIFY would; the time from the
  commit's answer to the dispatcher's settle of ``confirmed`` (p50, p99);
* **effects/s**: a backlog of effects committed before the dispatcher starts (concurrency 20,
  batch 20), dispatched to the last;
* **runs/s**: no-op runs through a worker that also dispatches (its gate active), with the
  standby attached: runs do not wait, so the two should match;
* **the other way to wait**: a claim-sized commit (one UPDATE) followed by the LSN wait, against
  the same commit made synchronous for its own transaction (``set_config('synchronous_commit',
  'remote_write', true)`` in the statement, with ``synchronous_standby_names`` listing the
  standby for the measurement and every other session at ``local``): p50 and p99 of each.

The vendor is an HTTP server on loopback. The goals (issue 38): p50 within 2 ms of not waiting,
effects/s at least 0.8 of not waiting, runs/s unchanged. Ratios of one run, never absolute times.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from orchestrator.agents.noop import noop
from orchestrator.db.bootstrap import ensure_schema
from orchestrator.db.connections import create_pool
from orchestrator.db.store import RunStore
from orchestrator.effect_model import Effect
from orchestrator.effects.adapters import Adapter
from orchestrator.effects.dispatcher import Dispatcher
from orchestrator.effects.store import EffectStore
from orchestrator.effects.vendors import adapter_from_config
from orchestrator.settings import Settings, StandbyPolicy, StandbyWait
from orchestrator.telemetry import configure_logging
from orchestrator.testing import LocalVendor, running_worker
from orchestrator.testing.replicated import ReplicatedPostgres

MODES = {"wait": StandbyPolicy(), "off": StandbyPolicy(StandbyWait.OFF)}
AGENT = "bench-requester"


class TimedDispatcher(Dispatcher):
    """The shipped dispatcher, noting when each effect's outcome was recorded."""

    def __init__(self, *args: Any, **options: Any) -> None:
        super().__init__(*args, **options)
        self.settled: dict[str, asyncio.Event] = {}
        self.settled_at: dict[str, float] = {}

    async def _record(self, effect: Any, outcome: Any, **options: Any) -> str:
        status = await super()._record(effect, outcome, **options)
        self.settled_at[effect.run_id] = time.perf_counter()
        self.settled.setdefault(effect.run_id, asyncio.Event()).set()
        return status


async def claimed_runs(store: RunStore, prefix: str, count: int) -> list[Any]:
    """``count`` runs submitted and claimed, ready to accept an effect each."""
    for n in range(count):
        await store.submit(AGENT, {"n": n}, run_id=f"{prefix}{n:06d}")
    runs: list[Any] = []
    while len(runs) < count:
        batch = await store.claim("bench", [AGENT], limit=500, lease_seconds=3600)
        if not batch.claimed:
            raise SystemExit(f"claimed {len(runs)} of {count} runs, then none")
        runs.extend(batch.claimed)
    return runs


async def accept(pool: Any, effects: EffectStore, run: Any) -> None:
    effect = Effect("note", "crm", {"run": run.run_id})
    async with pool.acquire() as db, db.transaction():
        answer = await effects.accept(db, run.run_id, run.fence, effect, worker_id="bench")
    if answer.outcome != "accepted":
        raise SystemExit(f"effect of {run.run_id}: {answer.outcome}")


async def latency(
    pool: Any, adapter: Adapter, policy: StandbyPolicy, prefix: str, n: int
) -> list[float]:
    store, effects = RunStore(pool), EffectStore(pool)
    runs = await claimed_runs(store, prefix, n)
    dispatcher = TimedDispatcher(
        pool, {"crm": adapter}, standby=policy, poll_seconds=5, dispatcher_id=prefix
    )
    samples: list[float] = []
    async with anyio.create_task_group() as group:
        group.start_soon(dispatcher.run)
        await anyio.sleep(0.5)
        for run in runs:
            event = dispatcher.settled.setdefault(run.run_id, asyncio.Event())
            await accept(pool, effects, run)
            committed = time.perf_counter()
            dispatcher.wake()
            with anyio.fail_after(30):
                await event.wait()
            samples.append(dispatcher.settled_at[run.run_id] - committed)
        group.cancel_scope.cancel()
    return samples


async def throughput(
    pool: Any, adapter: Adapter, policy: StandbyPolicy, prefix: str, n: int
) -> float:
    store, effects = RunStore(pool), EffectStore(pool)
    for run in await claimed_runs(store, prefix, n):
        await accept(pool, effects, run)
    dispatcher = TimedDispatcher(
        pool, {"crm": adapter}, standby=policy, poll_seconds=0.05, dispatcher_id=prefix
    )
    began = time.perf_counter()
    async with anyio.create_task_group() as group:
        group.start_soon(dispatcher.run)
        with anyio.fail_after(600):
            while len(dispatcher.settled_at) < n:  # noqa: ASYNC110
                await anyio.sleep(0.01)
        group.cancel_scope.cancel()
    return n / (max(dispatcher.settled_at.values()) - began)


async def runs_per_second(
    settings: Settings, pool: Any, adapter: Adapter, policy: StandbyPolicy, n: int
) -> float:
    store = RunStore(pool)
    ids = [(await store.submit("noop", {})).run.run_id for _ in range(n)]
    began = time.perf_counter()
    async with running_worker(
        Settings(database_url=settings.database_url, standby=policy),
        [noop],
        effect_adapters={"crm": adapter},
        concurrency=50,
        poll_seconds=0.05,
    ):
        with anyio.fail_after(600):
            while await succeeded(pool, ids) < n:  # noqa: ASYNC110
                await anyio.sleep(0.02)
        elapsed = time.perf_counter() - began
    return n / elapsed


async def succeeded(pool: Any, ids: list[str]) -> int:
    return int(
        await pool.fetchval(
            "SELECT count(*) FROM orchestrator.runs WHERE run_id = ANY($1) AND state = 'succeeded'",
            ids,
        )
    )


async def commit_then_wait(pair: ReplicatedPostgres, n: int) -> dict[str, list[float]]:
    """A claim-sized commit made durable on the standby two ways, alternating, on one
    connection: the LSN wait the dispatcher uses, and a synchronous commit scoped to it."""
    import asyncpg

    from orchestrator.db.standby_wait import until_held

    db = await asyncpg.connect(pair.primary_dsn())
    found: dict[str, list[float]] = {"lsn_wait": [], "sync_commit": []}
    names = "FIRST 1 (standby)"
    try:
        await db.execute("SET search_path = orchestrator")
        await db.execute("CREATE TABLE IF NOT EXISTS bench_claims (id int PRIMARY KEY, n int)")
        await db.execute("INSERT INTO bench_claims VALUES (1, 0) ON CONFLICT DO NOTHING")
        await db.execute(f"ALTER SYSTEM SET synchronous_standby_names = '{names}'")
        await db.execute("ALTER SYSTEM SET synchronous_commit = 'local'")
        await db.execute("SELECT pg_reload_conf()")
        await anyio.sleep(0.5)
        for _ in range(n):
            began = time.perf_counter()
            await db.execute("UPDATE bench_claims SET n = n + 1 WHERE id = 1")
            await until_held(db, StandbyPolicy(), within=10, flushed=True)
            found["lsn_wait"].append(time.perf_counter() - began)
            began = time.perf_counter()
            await db.execute(
                "UPDATE bench_claims SET n = n + 1 WHERE id = 1 "
                "AND set_config('synchronous_commit', 'remote_write', true) IS NOT NULL"
            )
            found["sync_commit"].append(time.perf_counter() - began)
    finally:
        await db.execute("ALTER SYSTEM SET synchronous_standby_names = ''")
        await db.execute("ALTER SYSTEM SET synchronous_commit = 'on'")
        await db.execute("SELECT pg_reload_conf()")
        await db.close()
    return found


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def main(options: argparse.Namespace) -> dict[str, Any]:
    configure_logging(json_logs=True, level="ERROR")
    pair = ReplicatedPostgres()
    await anyio.to_thread.run_sync(pair.start)
    try:
        settings = Settings(database_url=pair.dsn())
        await ensure_schema(settings, pair.dsn(), auto_migrate=True)
        pool = await create_pool(settings, application_name="bench-standby", max_size=24)
        results: dict[str, dict[str, list[float]]] = {
            mode: {"latency": [], "effects_per_second": [], "runs_per_second": []} for mode in MODES
        }
        async with LocalVendor() as vendor:
            adapter = adapter_from_config("crm", {"adapter": "http", "url": vendor.send_url})
            for round_ in range(options.rounds):
                order = list(MODES) if round_ % 2 == 0 else list(reversed(MODES))
                for mode in order:
                    policy = MODES[mode]
                    tag = f"r{round_}{mode}"
                    results[mode]["latency"] += await latency(
                        pool, adapter, policy, f"{tag}l", options.latency_effects
                    )
                    results[mode]["effects_per_second"].append(
                        await throughput(pool, adapter, policy, f"{tag}t", options.backlog)
                    )
                    results[mode]["runs_per_second"].append(
                        await runs_per_second(settings, pool, adapter, policy, options.runs)
                    )
                    print(f"round {round_ + 1} {mode}: done", file=sys.stderr, flush=True)
            scoped = await commit_then_wait(pair, options.latency_effects * options.rounds)
        await pool.close()
    finally:
        await anyio.to_thread.run_sync(pair.close)
    summary: dict[str, Any] = {}
    for mode, found in results.items():
        summary[mode] = {
            "commit_to_confirmed_p50_ms": round(pct(found["latency"], 0.5) * 1000, 3),
            "commit_to_confirmed_p99_ms": round(pct(found["latency"], 0.99) * 1000, 3),
            "effects_per_second": round(statistics.median(found["effects_per_second"]), 1),
            "runs_per_second": round(statistics.median(found["runs_per_second"]), 1),
            "effects_per_second_rounds": [round(v, 1) for v in found["effects_per_second"]],
            "runs_per_second_rounds": [round(v, 1) for v in found["runs_per_second"]],
        }
    wait, off = summary["wait"], summary["off"]
    summary["p50_extra_ms"] = round(
        wait["commit_to_confirmed_p50_ms"] - off["commit_to_confirmed_p50_ms"], 3
    )
    summary["p99_extra_ms"] = round(
        wait["commit_to_confirmed_p99_ms"] - off["commit_to_confirmed_p99_ms"], 3
    )
    summary["effects_per_second_ratio"] = round(
        wait["effects_per_second"] / off["effects_per_second"], 3
    )
    summary["runs_per_second_ratio"] = round(wait["runs_per_second"] / off["runs_per_second"], 3)
    for way, samples in scoped.items():
        summary[f"claim_commit_{way}_p50_ms"] = round(pct(samples, 0.5) * 1000, 3)
        summary[f"claim_commit_{way}_p99_ms"] = round(pct(samples, 0.99) * 1000, 3)
    return summary


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--latency-effects", type=int, default=200)
    parser.add_argument("--backlog", type=int, default=2000)
    parser.add_argument("--runs", type=int, default=2000)
    parser.add_argument("--json", action="store_true")
    arguments = parser.parse_args()
    found = anyio.run(main, arguments)
    if arguments.json:
        print(json.dumps(found, indent=2))
    else:
        for key, value in found.items():
            print(f"{key}: {value}")
