"""The tool loop's own cost: per-turn overhead as a conversation grows, and runs/s against the
plain step API doing the same work.

Both measurements run one in-process worker (``orchestrator.testing.running_worker``) on a
durable embedded PostgreSQL, against the scripted OpenAI-compatible model server
(``orchestrator.loopback.ScriptedModelServer``) with no added latency, over real HTTP through
the official ``openai`` client.

1. **Per-turn overhead.** One run of ``--turns`` (200) turns; each turn's model answer is one
   read-only tool call whose result is a ``--message-bytes`` (2 KB) message, so the transcript
   grows by about 4 KB a turn. The overhead of turn N is the time between the end of its
   ``chat`` span (the model's answer is in) and the start of turn N+1's ``chat`` span: running
   the tool, the fenced commit of the turn's messages and checkpoint, and preparing the next
   turn (the transcript comes from the execution's cache). Sending a longer conversation to the
   model is the model call's own cost and is not in it. Reported: the median overhead of turns
   1-10 and of the last ten, their ratio (target: at most 1.2, i.e. flat), and p50/p99 overall.
2. **Runs/s against the step API.** ``--runs`` (100) runs of three model turns each, one
   read-only tool call per turn, through the ``ToolAgent``; and the same runs through a plain
   three-step agent whose every step makes the same model call (``llm.complete``) and calls the
   same function, then commits its checkpoint. The loop's own cost is how much lower the tool
   agent's runs/s is, in percent, as the median over ``--rounds`` (3) alternating rounds.

From the repository root: ``.venv/bin/python benchmarks/tool_loop.py`` (``--json`` for JSON;
``--dsn`` for an existing server). About a minute.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

from bench_main import benchmark_parser, run_and_report
from bench_report import fmt, log, machine_facts, percentile, render_table
from orchestrator import Agent, Finish, Next, Outcome, Step, StepContext, ToolAgent, tool
from orchestrator.db.connections import connect, create_pool
from orchestrator.db.migrations import migrate
from orchestrator.db.store import RunStore
from orchestrator.llm import complete
from orchestrator.loopback import ScriptedCall, ScriptedModelServer, ScriptedTurn, ScriptRequest
from orchestrator.testing import running_worker, wait_for_run
from serve_harness import Server, create_database, drop_database, settings_for

PAYLOAD = "x"


@tool.read_only(timeout=30)
def fetch_page(page: int, size: int) -> dict[str, object]:
    """Fetch one page of a document.

    Args:
        page: The page number.
        size: How many characters the page has.
    """
    return {"page": page, "text": PAYLOAD * size}


def make_script(turns: int, size: int) -> Any:
    def script(request: ScriptRequest) -> ScriptedTurn:
        if request.turn >= turns - 1:
            return ScriptedTurn(content="done")
        return ScriptedTurn(
            calls=(ScriptedCall("fetch_page", {"page": request.turn, "size": size}),)
        )

    return script


class PlainTurn(Step):
    """What one tool-agent turn does, written as a plain step."""

    name = "plain_turn"

    async def run(self, ctx: StepContext) -> Outcome:
        turn = int((ctx.checkpoint or {}).get("turn", 0))
        messages = [{"role": "user", "content": str(ctx.input["prompt"])}]
        for index in range(turn):
            messages.append({"role": "assistant", "content": f"turn {index}"})
        reply = await complete(messages, tools=[fetch_page.definition()])
        if reply.tool_calls:
            call = reply.tool_calls[0]
            fetch_page.function(**fetch_page.parse(call.arguments))
            return Next(PlainTurn, checkpoint={"turn": turn + 1})
        return Finish(result={"output": reply.content})


plain = Agent("plain_loop", first=PlainTurn)


async def prepare(server: Server, name: str) -> tuple[str, RunStore]:
    dsn = await create_database(server.dsn, name)
    connection = await connect(settings_for(dsn), application_name="bench-setup")
    try:
        await migrate(connection)
    finally:
        await connection.close()
    pool = await create_pool(settings_for(dsn), application_name="bench", max_size=10)
    return dsn, RunStore(pool)


async def overhead(server: Server, args: argparse.Namespace) -> dict[str, Any]:
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    agent = ToolAgent(
        "long_talk", instructions="Read every page.", tools=[fetch_page], max_turns=args.turns + 1
    )
    dsn, store = await prepare(server, f"bench_tool_overhead_{os.getpid()}")
    try:
        async with ScriptedModelServer(make_script(args.turns, args.message_bytes)) as model:
            os.environ["OPENAI_BASE_URL"] = model.base_url
            os.environ.pop("OPENAI_API_KEY", None)
            run_id = (await store.submit(agent.name, {"prompt": "long"})).run.run_id
            log(f"overhead: one run of {args.turns} turns, {args.message_bytes:,}-byte messages")
            async with running_worker(
                settings_for(dsn), [agent], lease_seconds=30, heartbeat_seconds=10, poll_seconds=0.2
            ):
                run = await wait_for_run(store, run_id, within=args.max_seconds)
        chats = sorted(
            (s for s in exporter.get_finished_spans() if s.name.startswith("chat ")),
            key=lambda s: s.start_time or 0,
        )
        gaps = [
            ((nxt.start_time or 0) - (this.end_time or 0)) / 1e6
            for this, nxt in itertools.pairwise(chats)
        ]
        messages = await store.messages(run_id)
    finally:
        await store.pool.close()
        await drop_database(server.dsn, f"bench_tool_overhead_{os.getpid()}")
    early, late = statistics.median(gaps[:10]), statistics.median(gaps[-10:])
    return {
        "state": run.state.value,
        "turns": len(chats),
        "transcript_messages": len(messages),
        "transcript_bytes": sum(len(str(m.body)) for m in messages),
        "overhead_ms_first_10": early,
        "overhead_ms_last_10": late,
        "ratio_last_to_first": late / early,
        "overhead_ms_p50": percentile(gaps, 0.5),
        "overhead_ms_p99": percentile(gaps, 0.99),
        "target_ratio": 1.2,
    }


async def throughput(server: Server, args: argparse.Namespace) -> dict[str, Any]:
    tool_agent = ToolAgent("short_talk", instructions="", tools=[fetch_page], max_turns=5)
    rates: dict[str, list[float]] = {"tool_agent": [], "step_api": []}
    async with ScriptedModelServer(make_script(3, 64)) as model:
        os.environ["OPENAI_BASE_URL"] = model.base_url
        for round_index in range(args.rounds):
            order = (
                ("tool_agent", "step_api") if round_index % 2 == 0 else ("step_api", "tool_agent")
            )
            for kind in order:
                agent = tool_agent if kind == "tool_agent" else plain
                name = f"bench_tool_rate_{os.getpid()}_{round_index}_{kind}"
                dsn, store = await prepare(server, name)
                try:
                    run_ids = [
                        (await store.submit(agent.name, {"prompt": f"{kind} {n}"})).run.run_id
                        for n in range(args.runs)
                    ]
                    began = time.monotonic()
                    async with running_worker(
                        settings_for(dsn),
                        [agent],
                        concurrency=50,
                        claim_batch=50,
                        lease_seconds=30,
                        heartbeat_seconds=10,
                        poll_seconds=0.2,
                    ):
                        for run_id in run_ids:
                            await wait_for_run(store, run_id, within=args.max_seconds)
                    rate = args.runs / (time.monotonic() - began)
                finally:
                    await store.pool.close()
                    await drop_database(server.dsn, name)
                rates[kind].append(rate)
                log(f"round {round_index + 1} {kind}: {rate:,.1f} runs/s")
    ratios = [
        step / tool_ for tool_, step in zip(rates["tool_agent"], rates["step_api"], strict=True)
    ]
    return {
        "runs_per_round": args.runs,
        "turns_per_run": 3,
        "tool_agent_runs_per_s": statistics.median(rates["tool_agent"]),
        "step_api_runs_per_s": statistics.median(rates["step_api"]),
        "loop_cost_percent": (statistics.median(ratios) - 1) * 100,
        "rounds": dict(rates.items()),
    }


async def benchmark(server: Server, args: argparse.Namespace) -> dict[str, Any]:
    return {
        "benchmark": "tool_loop",
        "machine": machine_facts(),
        "overhead": await overhead(server, args),
        "throughput": await throughput(server, args),
    }


def render(report: dict[str, Any]) -> str:
    o, t = report["overhead"], report["throughput"]
    lines = [
        f"tool_loop: {report['machine'].get('cpus')} CPUs, Python {sys.version.split()[0]}",
        "",
        f"per-turn overhead over one {o['turns']}-turn conversation "
        f"({o['transcript_messages']} messages, {o['transcript_bytes']:,} bytes of transcript):",
        *render_table(
            ["turns", "overhead (median ms)"],
            [
                ["1-10", fmt(o["overhead_ms_first_10"], ".2f")],
                ["last 10", fmt(o["overhead_ms_last_10"], ".2f")],
            ],
        ),
        f"ratio last/first: {o['ratio_last_to_first']:.2f} (target <= {o['target_ratio']}); "
        f"p50 {o['overhead_ms_p50']:.2f} ms, p99 {o['overhead_ms_p99']:.2f} ms",
        "",
        f"runs/s, {t['runs_per_round']} runs of {t['turns_per_run']} turns (median of rounds):",
        *render_table(
            ["agent", "runs/s"],
            [
                ["ToolAgent", fmt(t["tool_agent_runs_per_s"], ",.1f")],
                ["plain steps, same calls", fmt(t["step_api_runs_per_s"], ",.1f")],
            ],
        ),
        f"the loop's own cost: {t['loop_cost_percent']:.1f}%",
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = benchmark_parser(__doc__.split("\n\n")[0])
    parser.add_argument("--turns", type=int, default=200)
    parser.add_argument("--message-bytes", type=int, default=2048)
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-seconds", type=float, default=300.0)
    args = parser.parse_args(argv)
    if args.turns < 20 or args.runs < 1 or args.rounds < 1:
        parser.error("--turns must be at least 20, --runs and --rounds at least 1")
    run_and_report(args, "tool_loop", lambda server: benchmark(server, args), render)
    return 0


if __name__ == "__main__":
    sys.exit(main())
