"""Live output: how long a streamed token takes from the model server to a ``Client`` reader, and
how many appends (commits) the stream costs per token.

One in-process worker (``orchestrator.testing.running_worker``) on a durable embedded PostgreSQL
runs ``--runs`` (10) runs one after the other; each run's one step asks the scripted
OpenAI-compatible model server (``ScriptedModelServer``, in this process, over real HTTP through
the official ``openai`` client) for an answer of ``--tokens`` (200) pieces of 4 characters, one
every ``--token-ms`` (10 ms: 100 tokens/s, a fast model), with ``llm.chat(stream=True)``, which
publishes each piece to the run's live output (``ctx.output``). A ``Client`` in this process
follows each run with ``client.runs.stream`` (woken by the append's NOTIFY).

**Latency**: for each piece, the time from the model server writing it to the socket
(``time.monotonic()``, recorded by the server) to the reader receiving the event that holds
its last character; p50, p90 and p99 over all pieces. Target: p50 under 10 ms. The publisher
writes a batch at most ``FLUSH_SECONDS`` (5 ms) after its first unwritten piece, so the
latency is that wait, one append's commit (durable: fsync on), the NOTIFY and one read.

**Commits per token**: the rows of text and progress the runs' output holds (each append
writes its text as one row, so that is the number of appends) over the pieces streamed. A run
makes at most one append per ``FLUSH_SECONDS`` window plus the one in flight, whatever the token
rate: at 100 tokens/s that is about one append per token, at 1,000 tokens/s (``--token-ms 1``)
one per several.

From the repository root: ``.venv/bin/python benchmarks/streaming.py`` (``--json`` for JSON;
``--dsn`` for an existing server). About half a minute.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

from bench_main import benchmark_parser, run_and_report
from bench_report import log, machine_facts, render_table
from orchestrator import Agent, Client, Finish, Step, StepContext
from orchestrator.agent import llm
from orchestrator.agent.steps import Outcome
from orchestrator.db.connections import connect, create_pool
from orchestrator.db.migrations import migrate
from orchestrator.db.output import OutputKind
from orchestrator.db.store import RunStore
from orchestrator.telemetry import configure_logging
from orchestrator.testing import running_worker, wait_for_run
from orchestrator.testing.loopback import ScriptedModelServer, ScriptedTurn, turns
from serve_harness import Server, create_database, drop_database, settings_for


class Answer(Step):
    async def run(self, ctx: StepContext) -> Outcome:
        completion = await llm.chat([{"role": "user", "content": str(ctx.input["q"])}], stream=True)
        return Finish({"chars": len(completion.text)})


streaming_bench = Agent("streaming_bench", first=Answer)


def percentile(values: Sequence[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


async def one_run(
    client: Client, store: RunStore, model: ScriptedModelServer, number: int
) -> tuple[list[float], int, int, float]:
    """The latencies (ms) of one run's pieces, its pieces, its appends and the seconds it
    streamed for."""
    model.streamed.clear()
    run_id = (await store.submit("streaming_bench", {"q": f"question {number}"})).run.run_id
    arrivals: list[tuple[float, int]] = []  # (when, characters received so far)
    received = 0
    appends = 0
    async for event in client.runs.stream(run_id):
        now = time.monotonic()
        if event.kind in (OutputKind.TEXT, OutputKind.PROGRESS):
            appends += 1
        if event.kind is OutputKind.TEXT:
            received += len(str(event.data["text"]))
            arrivals.append((now, received))
    await wait_for_run(store, run_id, within=60)
    latencies: list[float] = []
    sent = 0
    index = 0
    for when, piece in model.streamed:
        sent += len(piece)
        while index < len(arrivals) and arrivals[index][1] < sent:
            index += 1
        if index < len(arrivals):
            latencies.append((arrivals[index][0] - when) * 1000)
    streamed = model.streamed[-1][0] - model.streamed[0][0] if model.streamed else 0.0
    return latencies, len(model.streamed), appends, streamed


async def benchmark(server: Server, args: Any) -> dict[str, Any]:
    configure_logging(level="WARNING")
    name = "bench_streaming"
    dsn = await create_database(server.dsn, name)
    try:
        connection = await connect(settings_for(dsn), application_name="bench-setup")
        try:
            await migrate(connection)
        finally:
            await connection.close()
        pool = await create_pool(settings_for(dsn), application_name="bench", max_size=10)
        store = RunStore(pool)
        answer = "abcd" * args.tokens
        script = turns(ScriptedTurn(content=answer))
        latencies: list[float] = []
        pieces = appends = 0
        seconds = 0.0
        try:
            async with (
                ScriptedModelServer(
                    script, token_seconds=args.token_ms / 1000, token_chars=4
                ) as model,
                await Client.connect(settings_for(dsn)) as client,
            ):
                os.environ["OPENAI_BASE_URL"] = model.base_url
                os.environ.setdefault("OPENAI_API_KEY", "unused")
                async with running_worker(settings_for(dsn), [streaming_bench]):
                    for number in range(args.runs):
                        run_latencies, run_pieces, run_appends, run_seconds = await one_run(
                            client, store, model, number
                        )
                        seconds += run_seconds
                        latencies += run_latencies
                        pieces += run_pieces
                        appends += run_appends
                        log(
                            f"run {number + 1}/{args.runs}: p50 "
                            f"{statistics.median(run_latencies):.1f} ms, {run_appends} appends"
                        )
        finally:
            await pool.close()
    finally:
        await drop_database(server.dsn, name)
    return {
        "machine": machine_facts(),
        "runs": args.runs,
        "pieces": pieces,
        "token_ms": args.token_ms,
        "latency_ms": {
            "p50": statistics.median(latencies),
            "p90": percentile(latencies, 0.9),
            "p99": percentile(latencies, 0.99),
            "max": max(latencies),
        },
        "appends": appends,
        "appends_per_token": appends / pieces if pieces else None,
        "tokens_per_second": pieces / seconds if seconds else None,
        "appends_per_second": appends / seconds if seconds else None,
    }


def render(report: dict[str, Any]) -> str:
    latency = report["latency_ms"]
    rows = [
        ["token -> reader p50", f"{latency['p50']:.1f} ms", "< 10 ms"],
        ["token -> reader p90", f"{latency['p90']:.1f} ms", ""],
        ["token -> reader p99", f"{latency['p99']:.1f} ms", ""],
        ["appends (commits) per token", f"{report['appends_per_token']:.3f}", "batched"],
        ["appends per second of streaming", f"{report['appends_per_second']:.0f}", "<= 200"],
    ]
    head = (
        f"{report['runs']} runs, {report['pieces']} pieces of 4 characters, one every "
        f"{report['token_ms']:g} ms ({report['tokens_per_second']:.0f}/s as sent); "
        f"{report['appends']} appends"
    )
    return "\n".join([head, *render_table(["measure", "value", "target"], rows)])


def main(argv: Sequence[str] | None = None) -> int:
    parser = benchmark_parser(__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--token-ms", type=float, default=10.0)
    args = parser.parse_args(argv)
    if args.runs < 1 or args.tokens < 1 or args.token_ms < 0:
        parser.error("--runs and --tokens must be at least 1, --token-ms 0 or more")
    run_and_report(args, "streaming", lambda server: benchmark(server, args), render)
    return 0


if __name__ == "__main__":
    sys.exit(main())
