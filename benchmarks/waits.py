"""Waiting costs workers nothing, a signal wakes a run at once, a client hears a result at once.

Three measurements, in one run, on one PostgreSQL server:

* **Claims with waiting runs.** Claims/s through ``RunStore.claim`` (batch 1 and batch 50, the
  expired-lease look included, as an idle worker claims) from a queue of queued runs, in a
  database that also holds ``--waiting`` (default 100,000) parked runs (state ``waiting``,
  ``runs.wait`` set, due at 'infinity': what ``park_runs`` leaves) against the same queue in a
  database holding none. The two databases are measured back to back in an order that rotates
  every round; the ratio is the median of the per-round ratios. Target: at least 0.9.
* **Signal to step.** An in-process worker serves an agent whose first step waits for a signal.
  For each of ``--samples`` parked runs in turn (an idle system), a signal is sent
  (``SignalStore.send``) and the time until the woken step starts is taken (the step stamps
  ``time.perf_counter`` in this process). The baseline, measured in the same run and worker: a
  submit until the new run's first step starts (the same NOTIFY and claim path). Target: p50
  under 5 ms.
* **Client round trip.** ``Client.submit`` and then ``Client.wait`` for the result of a no-op
  run, one after another, p50/p99; against the same baseline.

Progress goes to stderr, the table to stdout (``--json`` for the report as JSON). About a
minute. Run from the repository root: ``.venv/bin/python benchmarks/waits.py``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Awaitable, Callable
from typing import Any

import anyio

from bench_main import benchmark_parser, run_and_report
from bench_report import fmt, log, machine_facts, percentile, render_table
from orchestrator import Agent, Finish, Outcome, Step, StepContext, Wait
from orchestrator.client import Client
from orchestrator.db.connections import connect, create_pool
from orchestrator.db.migrations import migrate
from orchestrator.db.signals import SignalStore
from orchestrator.db.store import RunStore
from orchestrator.models import RunState
from orchestrator.telemetry import configure_logging
from orchestrator.testing import running_worker
from serve_harness import Server, create_database, drop_database, settings_for

CLAIM_TARGET = 0.9
SIGNAL_TARGET_MS = 5.0
QUEUE = {1: 3_000, 50: 20_000}
"""Queued runs each claim measurement starts from, per batch size."""
TASKS = 4

STARTED: dict[str, float] = {}
"""run id -> when its latest step started (perf_counter), written by the agents below."""


class Waiting(Step):
    async def run(self, ctx: StepContext) -> Outcome:
        STARTED[ctx.run_id] = time.perf_counter()
        if not ctx.signals:
            return Wait(then=Waiting, signals=["go"])
        return Finish({"signals": len(ctx.signals)})


class Quick(Step):
    async def run(self, ctx: StepContext) -> Outcome:
        STARTED[ctx.run_id] = time.perf_counter()
        return Finish({"ok": True})


waiting_agent = Agent("bench_wait", first=Waiting)
quick_agent = Agent("bench_quick", first=Quick)

PARK_SQL = """
INSERT INTO runs (run_id, agent, input, state, fence, attempt, available_at, wait)
SELECT 'w_' || lpad(g::text, 7, '0'), $2, '{}'::jsonb, 'waiting', 1, 0, 'infinity',
       jsonb_build_object('step', 'turn', 'signals', jsonb_build_array('reply'),
                          'effects', '[]'::jsonb, 'until', NULL, 'reason', NULL)
FROM generate_series(1, $1) AS g
"""
QUEUE_SQL = """
INSERT INTO runs (run_id, agent, input)
SELECT $1 || lpad(g::text, 7, '0'), $2, jsonb_build_object('n', g) FROM generate_series(1, $3) AS g
"""


# -- claims with and without waiting runs ---------------------------------------------------------
async def claims_per_second(dsn: str, batch: int, round_number: int) -> float:
    """Claim a fresh queue of ``QUEUE[batch]`` runs with ``TASKS`` tasks; claims per second."""
    settings = settings_for(dsn)
    admin = await connect(settings, application_name="bench-setup")
    try:
        await admin.execute("DELETE FROM runs WHERE state <> 'waiting'")
        await admin.execute("DELETE FROM run_events")
        await admin.execute(QUEUE_SQL, f"q{round_number}_", "bench", QUEUE[batch])
        await admin.execute("VACUUM ANALYZE runs")
    finally:
        await admin.close()
    pool = await create_pool(settings, min_size=TASKS, max_size=TASKS)
    try:
        store = RunStore(pool)
        claimed = 0

        async def claimer(me: str) -> None:
            nonlocal claimed
            while True:
                batch_claimed = await store.claim(me, ["bench"], limit=batch, lease_seconds=600)
                if not batch_claimed.claimed:
                    return
                claimed += len(batch_claimed.claimed)

        began = time.perf_counter()
        with anyio.fail_after(300):
            async with anyio.create_task_group() as group:
                for task in range(TASKS):
                    group.start_soon(claimer, f"w{task}")
        seconds = time.perf_counter() - began
    finally:
        await pool.close()
    if claimed != QUEUE[batch]:
        raise RuntimeError(f"claimed {claimed} of {QUEUE[batch]} runs")
    return claimed / seconds


async def claims_with_waiting(server: Server, waiting: int, rounds: int) -> dict[str, Any]:
    names = {"empty": "bench_waits_empty", "waiting": "bench_waits_parked"}
    dsns: dict[str, str] = {}
    try:
        for label, name in names.items():
            dsns[label] = await create_database(server.dsn, name)
            connection = await connect(settings_for(dsns[label]))
            try:
                await migrate(connection)
                if label == "waiting":
                    log(f"parking {waiting:,} waiting runs")
                    await connection.execute(PARK_SQL, waiting, "bench")
            finally:
                await connection.close()
        results: dict[str, Any] = {}
        for batch in QUEUE:
            ratios: list[float] = []
            rates: dict[str, list[float]] = {"empty": [], "waiting": []}
            for number in range(rounds + 1):
                order = ["empty", "waiting"] if number % 2 else ["waiting", "empty"]
                measured = {
                    label: await claims_per_second(dsns[label], batch, number) for label in order
                }
                if number == 0:
                    continue  # warm-up
                for label, rate in measured.items():
                    rates[label].append(rate)
                ratios.append(measured["waiting"] / measured["empty"])
                log(
                    f"claims batch {batch} round {number}: {measured['waiting']:,.0f}/s with "
                    f"{waiting:,} waiting vs {measured['empty']:,.0f}/s without"
                )
            results[f"batch{batch}"] = {
                "with_waiting_per_s": statistics.median(rates["waiting"]),
                "without_per_s": statistics.median(rates["empty"]),
                "ratio": statistics.median(ratios),
                "ratios": ratios,
            }
        return results
    finally:
        for name in names.values():
            await drop_database(server.dsn, name)


# -- latencies -------------------------------------------------------------------------------------
def summary(samples_ms: list[float]) -> dict[str, float]:
    return {
        "p50_ms": percentile(samples_ms, 0.50),
        "p99_ms": percentile(samples_ms, 0.99),
        "mean_ms": statistics.fmean(samples_ms),
        "samples": len(samples_ms),
    }


async def step_started(run_id: str, after: float, within: float = 10.0) -> float:
    with anyio.fail_after(within):
        while STARTED.get(run_id, 0.0) <= after:  # noqa: ASYNC110 (a stamp in this process)
            await anyio.sleep(0.0002)
    return STARTED[run_id]


Probe = Callable[[int, float], Awaitable[float]]
"""``probe(index, sent)``: start sample ``index`` and return when (``perf_counter``) it ended."""


async def latencies_ms(count: int, probe: Probe) -> list[float]:
    """``count`` samples of ``probe``, each from its start to its end, in ms."""
    samples: list[float] = []
    for index in range(count):
        await anyio.sleep(0.01)  # idle between samples
        sent = time.perf_counter()
        samples.append((await probe(index, sent) - sent) * 1000)
    return samples


async def latencies(server: Server, samples: int) -> dict[str, Any]:
    name = "bench_waits_latency"
    dsn = await create_database(server.dsn, name)
    try:
        settings = settings_for(dsn)
        connection = await connect(settings)
        try:
            await migrate(connection)
        finally:
            await connection.close()
        pool = await create_pool(settings, min_size=2, max_size=4)
        client = await Client.connect(settings)
        try:
            store = RunStore(pool)
            signals = SignalStore(pool)
            options = {"poll_seconds": 1.0, "status_seconds": 3600.0, "concurrency": 50}
            async with running_worker(settings, [waiting_agent, quick_agent], **options):
                parked: list[str] = []
                for _ in range(samples):
                    run_id = (await store.submit("bench_wait", {})).run.run_id
                    parked.append(run_id)
                for run_id in parked:
                    await step_started(run_id, 0.0)
                with anyio.fail_after(30):  # each has committed its Wait
                    while len(await store.list_runs(state=RunState.WAITING, limit=samples)) < len(  # noqa: ASYNC110
                        parked
                    ):
                        await anyio.sleep(0.05)

                async def signal_parked(index: int, sent: float) -> float:
                    await signals.send(parked[index], "go", {"n": 1})
                    return await step_started(parked[index], sent)

                async def submit_quick(index: int, sent: float) -> float:
                    run_id = (await store.submit("bench_quick", {})).run.run_id
                    return await step_started(run_id, sent)

                async def submit_and_wait(index: int, sent: float) -> float:
                    run = await client.submit("bench_quick", {})
                    done = await client.wait(run.run_id, within=10)
                    ended = time.perf_counter()
                    if done.state is not RunState.SUCCEEDED:
                        raise RuntimeError(f"run {run.run_id} ended {done.state}")
                    return ended

                log(f"{samples} runs parked; signalling them one by one")
                signal_ms = await latencies_ms(len(parked), signal_parked)
                log("submit to first step (the baseline)")
                submit_ms = await latencies_ms(samples, submit_quick)
                log("Client.submit + Client.wait")
                client_ms = await latencies_ms(samples, submit_and_wait)
        finally:
            await client.close()
            await pool.close()
        baseline = summary(submit_ms)
        signal = summary(signal_ms)
        client_summary = summary(client_ms)
        return {
            "signal_to_step": {**signal, "vs_submit_p50": signal["p50_ms"] / baseline["p50_ms"]},
            "submit_to_step": baseline,
            "client_submit_wait": {
                **client_summary,
                "vs_submit_p50": client_summary["p50_ms"] / baseline["p50_ms"],
            },
        }
    finally:
        await drop_database(server.dsn, name)


# -- report ----------------------------------------------------------------------------------------
def render(report: dict[str, Any]) -> str:
    claims = report["claims"]
    lines = [
        f"claims/s with {report['waiting']:,} waiting runs vs none "
        f"(target ratio >= {CLAIM_TARGET})",
        *render_table(
            ["batch", "with waiting/s", "without/s", "ratio"],
            [
                [
                    key.removeprefix("batch"),
                    fmt(value["with_waiting_per_s"]),
                    fmt(value["without_per_s"]),
                    fmt(value["ratio"], ".2f"),
                ]
                for key, value in claims.items()
            ],
        ),
        "",
        f"latencies, ms (target: signal to step p50 < {SIGNAL_TARGET_MS:g} ms)",
        *render_table(
            ["path", "p50", "p99", "mean", "p50 vs submit"],
            [
                [
                    label,
                    fmt(values["p50_ms"], ".2f"),
                    fmt(values["p99_ms"], ".2f"),
                    fmt(values["mean_ms"], ".2f"),
                    fmt(values.get("vs_submit_p50"), ".2f"),
                ]
                for label, values in report["latency"].items()
            ],
        ),
        "",
        f"claims target met: {report['claims_target_met']}; "
        f"signal target met: {report['signal_target_met']}",
    ]
    return "\n".join(lines)


async def body(server: Server, args: argparse.Namespace) -> dict[str, Any]:
    claims = await claims_with_waiting(server, args.waiting, args.rounds)
    latency = await latencies(server, args.samples)
    return {
        "machine": machine_facts(),
        "waiting": args.waiting,
        "claims": claims,
        "latency": latency,
        "claims_target_met": all(v["ratio"] >= CLAIM_TARGET for v in claims.values()),
        "signal_target_met": latency["signal_to_step"]["p50_ms"] < SIGNAL_TARGET_MS,
    }


def main() -> None:
    configure_logging(json_logs=True, level="warning")  # the worker's per-run lines are noise here
    parser = benchmark_parser(__doc__.split("\n\n")[0])
    parser.add_argument("--waiting", type=int, default=100_000, help="Parked runs (default 100k).")
    parser.add_argument("--rounds", type=int, default=7, help="Claim rounds per batch size.")
    parser.add_argument("--samples", type=int, default=200, help="Latency samples per path.")
    args = parser.parse_args()
    run_and_report(args, "waits", lambda server: body(server, args), render)


if __name__ == "__main__":
    main()
