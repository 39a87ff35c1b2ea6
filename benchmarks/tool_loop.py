"""The tool loop's own cost: the worker's CPU per turn as a conversation grows, and runs/s
against the plain step API doing the same work.

Both measurements run one in-process worker (``orchestrator.testing.running_worker``) on a durable
embedded PostgreSQL, against the scripted OpenAI-compatible model server
(``orchestrator.testing.loopback.ScriptedModelServer``) with no added latency, over real HTTP
through the official ``openai`` client. The model server runs in a child process, so that the CPU
this process spends is the worker's (and a poll of the run's state once a second).

1. **CPU per turn.** One run of each of ``--turns`` (200 and 1,000) turns; each turn's model
   answer is one read-only tool call whose result is a ``--message-bytes`` (2 KB) message, so
   the transcript grows by about 2 KB a turn. Turn k's CPU is the process CPU time
   (``time.process_time``) from the start of its ``chat`` span to the start of turn k+1's: the
   loop's part (from the model's answer to the next model call: the tool, the fenced commit of
   the turn's messages and checkpoint, preparing the next turn) and the model call's part
   (building the request body, which holds the whole conversation, sending it and reading the
   answer). A least squares line through each series (the first five turns, warming up, left
   out) gives the CPU of turn 10 and of the last turn, their ratio (target: at most 1.2, i.e.
   flat) and the slope in µs per turn per turn. Wall-clock medians are too noisy on a shared
   machine to tell a flat cost from a growing one; CPU time is not.

   The chat completions API is stateless: every request carries the whole conversation, 2.3 MB
   by the 1,000th turn, and sending that many bytes costs CPU however little the loop does
   around it. So, once the run is over (the worker still running, idle), the same process
   sends **bare requests** of the same bytes: at ``BARE_POINTS`` turns, the requests of that
   turn and the ``BARE_REPEATS`` before it, in order (each message encoded beforehand, as the
   loop keeps them), each joined into one body and POSTed with the same ``openai`` client to
   the same server (``client.post``), the median CPU. Its line is the cost of the bytes alone,
   its slope what each turn's bytes add; **the turn less the bytes' growth** (each turn's CPU
   less the bare line's growth since turn 10) is the turn's CPU as it would be if the request
   did not grow: the part that the loop can keep flat, held to the same 1.2.
2. **Runs/s against the step API.** ``--runs`` (300) runs of three model turns each, one
   read-only tool call per turn, through the ``ToolAgent``; and the same runs through a plain
   three-step agent whose every step makes the same model call (``llm.complete``) and calls the
   same function, then commits its checkpoint. The loop's own cost is how much lower the tool
   agent's runs/s is, in percent, as the median over ``--rounds`` (5) alternating rounds; the
   same for this process's CPU per run (less noisy than runs/s on a shared machine).
3. **The Pydantic AI path** (``--pydantic-ai``; needs the ``pydantic-ai`` extra): the same
   runs through ``PydanticAIAgent`` wrapping a ``pydantic_ai.Agent`` with the same tool and
   ``OpenAIChatModel`` on the same server, in the same rounds; its overhead per turn is its
   worker CPU per run minus the ``ToolAgent``'s, over the three turns (a new row and line; the
   rest of the output is unchanged).

The worker logs at WARNING to stderr, so stdout holds only the report. From the repository
root: ``.venv/bin/python benchmarks/tool_loop.py`` (``--json`` for JSON; ``--dsn`` for an
existing server). About three minutes.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any

import anyio
from opentelemetry.context import Context
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor

from bench_main import benchmark_parser, run_and_report
from bench_report import fmt, log, machine_facts, render_table
from orchestrator import Agent, Finish, Next, Outcome, Step, StepContext, ToolAgent, tool
from orchestrator.agent.llm import complete, model_client
from orchestrator.db.connections import connect, create_pool
from orchestrator.db.migrations import migrate
from orchestrator.db.store import RunStore
from orchestrator.models import TERMINAL_STATES, Message, Run
from orchestrator.telemetry import configure_logging
from orchestrator.testing import running_worker, wait_for_run
from orchestrator.testing.loopback import (
    ScriptedCall,
    ScriptedModelServer,
    ScriptedTurn,
    ScriptRequest,
)
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


def serve_model(turns: int, size: int) -> None:
    """The child process: the scripted model server until the parent closes our stdin."""

    async def serve() -> None:
        async with ScriptedModelServer(make_script(turns, size)) as model:
            print(model.base_url, flush=True)
            await anyio.to_thread.run_sync(sys.stdin.read)

    anyio.run(serve)


@contextlib.contextmanager
def model_server(turns: int, size: int) -> Iterator[str]:
    """A scripted model server in a child process (its CPU is not the worker's); its base URL."""
    process = subprocess.Popen(
        [sys.executable, __file__, "--serve-model", str(turns), str(size)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert process.stdin is not None and process.stdout is not None
    try:
        base_url = process.stdout.readline().strip()
        if not base_url:
            raise RuntimeError("the model server process did not start")
        yield base_url
    finally:
        process.stdin.close()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


class ChatCpu(SpanProcessor):
    """This process's CPU time at the start and the end of every ``chat`` span (a model call):
    the boundaries of each turn and of its model call."""

    def __init__(self) -> None:
        self.starts: list[float] = []
        self.ends: list[float] = []

    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        if span.name.startswith("chat "):
            self.starts.append(time.process_time())

    def on_end(self, span: ReadableSpan) -> None:
        if span.name.startswith("chat "):
            self.ends.append(time.process_time())

    def clear(self) -> None:
        self.starts.clear()
        self.ends.clear()


CHAT_CPU = ChatCpu()
WARM_UP_TURNS = 5
"""Turns left out of the fit: the first pay for imports, the model client and connections."""


def install_tracing() -> None:
    """An SDK tracer provider whose only processor is ``CHAT_CPU`` (no span is exported)."""
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider

    provider = TracerProvider()
    provider.add_span_processor(CHAT_CPU)
    trace.set_tracer_provider(provider)


def line(name: str, turns: Sequence[int], micros: Sequence[float], last: int) -> dict[str, Any]:
    """The least squares line through one series of CPU per turn: its value at turn 10 and at
    turn ``last``, their ratio and its slope."""
    slope, intercept = statistics.linear_regression(turns, micros)
    at_10, at_last = intercept + 10 * slope, intercept + last * slope
    return {
        "series": name,
        "us_at_turn_10": at_10,
        "us_at_last_turn": at_last,
        "ratio": at_last / at_10,
        "slope_us_per_turn": slope,
        "median_us": statistics.median(micros),
    }


async def finished(store: RunStore, run_id: str, within: float) -> Run:
    """The run once it has finished, polled once a second (this process's CPU is measured)."""
    with anyio.fail_after(within):
        while True:
            run = await store.get(run_id)
            if run.state in TERMINAL_STATES:
                return run
            await anyio.sleep(1.0)


def encoded(value: object) -> bytes:
    """JSON as the ``openai`` client encodes a request body (``llm.encode_message`` does the
    same; written out here so that the benchmark also measures releases without it)."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()


BARE_POINTS = 17
"""Turns whose request is sent again bare, evenly spread from the first fitted to the last."""
BARE_REPEATS = 25


async def bare_requests(
    messages: Sequence[Message], tools: Sequence[Any], first: int, last: int
) -> tuple[list[int], list[float], list[int]]:
    """This process's CPU (µs) for a bare request of turn k's bytes, at ``BARE_POINTS`` turns
    from ``first`` to ``last``: the turn's messages, encoded beforehand, joined into one body
    with one copy and POSTed with the worker's ``openai`` client to the same server. Also each
    body's size."""
    from openai.types.chat import ChatCompletion

    client, model = model_client()
    bodies = [m.body for m in messages]
    parts = [encoded(body) for body in bodies]
    assistants = [i for i, body in enumerate(bodies) if body["role"] == "assistant"]
    head = encoded({"model": model, "tools": list(tools)})[:-1] + b',"messages":['

    points = sorted({first + (last - first) * i // (BARE_POINTS - 1) for i in range(BARE_POINTS)})
    micros, sizes = [], []
    for point in points:
        # The requests of the turns up to this one, in order, as the loop sent them: each a
        # little larger than the last (an allocator reuses a freed body only when the next fits).
        samples = []
        for turn in range(max(1, point - BARE_REPEATS - 1), point + 1):
            # Turn k (1-based) sent the messages before the transcript's k-th assistant message
            # (at least the instructions and the prompt).
            sent = parts[: assistants[turn - 1]]
            assert len(sent) >= 2
            began = time.process_time()
            body = b",".join([head + sent[0], *sent[1:-1], sent[-1] + b"]}"])
            await client.post(
                "/chat/completions",
                cast_to=ChatCompletion,
                content=body,
                options={"headers": {"Content-Type": "application/json"}},
            )
            samples.append((time.process_time() - began) * 1e6)
        micros.append(statistics.median(samples[2:]))  # two to warm up
        sizes.append(len(body))
    return points, micros, sizes


async def cpu_per_turn(server: Server, args: argparse.Namespace, turns: int) -> dict[str, Any]:
    agent = ToolAgent(
        "long_talk", instructions="Read every page.", tools=[fetch_page], max_turns=turns + 1
    )
    name = f"bench_tool_overhead_{os.getpid()}_{turns}"
    dsn, store = await prepare(server, name)
    try:
        with model_server(turns, args.message_bytes) as base_url:
            os.environ["OPENAI_BASE_URL"] = base_url
            os.environ.pop("OPENAI_API_KEY", None)
            run_id = (await store.submit(agent.name, {"prompt": "long"})).run.run_id
            log(f"cpu per turn: one run of {turns} turns, {args.message_bytes:,}-byte messages")
            CHAT_CPU.clear()
            async with running_worker(
                settings_for(dsn), [agent], lease_seconds=30, heartbeat_seconds=10, poll_seconds=0.2
            ):
                run = await finished(store, run_id, args.max_seconds)
                starts, ends = list(CHAT_CPU.starts), list(CHAT_CPU.ends)
                messages = await store.messages(run_id)
                # Turn k (1-based) runs from chat start k to chat start k+1; the last turn has
                # no successor.
                numbers = list(range(WARM_UP_TURNS + 1, len(starts)))
                # With the worker still running (idle), as it ran around the loop's requests.
                log(f"cpu per turn: bare requests of the same bytes at {BARE_POINTS} turns")
                points, bare, sizes = await bare_requests(
                    messages, agent.loop.definitions, numbers[0], numbers[-1]
                )
    finally:
        await store.pool.close()
        await drop_database(server.dsn, name)
    total = [(starts[k] - starts[k - 1]) * 1e6 for k in numbers]
    model = [(ends[k - 1] - starts[k - 1]) * 1e6 for k in numbers]
    loop = [(starts[k] - ends[k - 1]) * 1e6 for k in numbers]
    last = numbers[-1]
    bare_fit = line("bare request of the same bytes", points, bare, last)
    # Each turn less what its request's bytes cost over turn 10's: the turn as it would be if
    # the request did not grow (the line's slope, not its noisier intercept, is what counts).
    slope = bare_fit["slope_us_per_turn"]
    own = [us - (k - 10) * slope for k, us in zip(numbers, total, strict=True)]
    return {
        "state": run.state.value,
        "turns": len(starts),
        "transcript_messages": len(messages),
        "transcript_bytes": sum(len(str(m.body)) for m in messages),
        "request_bytes": {"turn": points, "bytes": sizes},
        "bare_request_us": {"turn": points, "us": bare},
        "fits": [
            line("turn (all)", numbers, total, last),
            line("loop (tool, commit, next turn)", numbers, loop, last),
            line("model call (client side)", numbers, model, last),
            bare_fit,
            line("turn less the bytes' growth", numbers, own, last),
        ],
        "target_ratio": 1.2,
    }


def pydantic_ai_agent() -> Agent:
    """The tool agent's conversation through an existing Pydantic AI agent (the extra)."""
    from functools import cache

    from pydantic_ai import Agent as PydanticAgent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    from orchestrator.integrations.pydantic_ai import PydanticAIAgent

    talker = PydanticAgent(instructions="")

    @talker.tool_plain
    def fetch_page(page: int, size: int) -> dict[str, object]:
        """Fetch one page of a document."""
        return {"page": page, "text": PAYLOAD * size}

    @cache
    def model(base_url: str) -> OpenAIChatModel:
        return OpenAIChatModel(
            "gpt-4o-mini", provider=OpenAIProvider(base_url=base_url, api_key="unused")
        )

    return PydanticAIAgent(
        "short_talk_pai",
        talker,
        model=lambda: model(os.environ["OPENAI_BASE_URL"]),
        read_only=["fetch_page"],
        max_turns=5,
    )


async def throughput(server: Server, args: argparse.Namespace) -> dict[str, Any]:
    tool_agent = ToolAgent("short_talk", instructions="", tools=[fetch_page], max_turns=5)
    kinds = ["tool_agent", "step_api", *(["pydantic_ai"] if args.pydantic_ai else [])]
    agents = {
        "tool_agent": tool_agent,
        "step_api": plain,
        **({"pydantic_ai": pydantic_ai_agent()} if args.pydantic_ai else {}),
    }
    rates: dict[str, list[float]] = {kind: [] for kind in kinds}
    cpu: dict[str, list[float]] = {kind: [] for kind in kinds}
    with model_server(3, 64) as base_url:
        os.environ["OPENAI_BASE_URL"] = base_url
        for round_index in range(args.rounds):
            order = kinds if round_index % 2 == 0 else kinds[::-1]
            for kind in order:
                agent = agents[kind]
                name = f"bench_tool_rate_{os.getpid()}_{round_index}_{kind}"
                dsn, store = await prepare(server, name)
                try:
                    run_ids = [
                        (await store.submit(agent.name, {"prompt": f"{kind} {n}"})).run.run_id
                        for n in range(args.runs)
                    ]
                    began, cpu_began = time.monotonic(), time.process_time()
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
                    cpu[kind].append((time.process_time() - cpu_began) / args.runs * 1e6)
                finally:
                    await store.pool.close()
                    await drop_database(server.dsn, name)
                rates[kind].append(rate)
                log(f"round {round_index + 1} {kind}: {rate:,.1f} runs/s")
    ratios = [
        step / tool_ for tool_, step in zip(rates["tool_agent"], rates["step_api"], strict=True)
    ]
    cpu_ratios = [
        tool_ / step for tool_, step in zip(cpu["tool_agent"], cpu["step_api"], strict=True)
    ]
    extra: dict[str, Any] = {}
    if args.pydantic_ai:
        extra = {
            "pydantic_ai_runs_per_s": statistics.median(rates["pydantic_ai"]),
            "pydantic_ai_cpu_us_per_run": statistics.median(cpu["pydantic_ai"]),
            "pydantic_ai_overhead_cpu_us_per_turn": statistics.median(
                (p - t) / 3 for p, t in zip(cpu["pydantic_ai"], cpu["tool_agent"], strict=True)
            ),
            "pydantic_ai_overhead_cpu_percent": statistics.median(
                (p / t - 1) * 100
                for p, t in zip(cpu["pydantic_ai"], cpu["tool_agent"], strict=True)
            ),
        }
    return {
        **extra,
        "runs_per_round": args.runs,
        "turns_per_run": 3,
        "tool_agent_runs_per_s": statistics.median(rates["tool_agent"]),
        "step_api_runs_per_s": statistics.median(rates["step_api"]),
        "loop_cost_percent": (statistics.median(ratios) - 1) * 100,
        "loop_cost_percent_rounds": [(ratio - 1) * 100 for ratio in ratios],
        "rounds": dict(rates.items()),
        "tool_agent_cpu_us_per_run": statistics.median(cpu["tool_agent"]),
        "step_api_cpu_us_per_run": statistics.median(cpu["step_api"]),
        "loop_cpu_cost_percent": (statistics.median(cpu_ratios) - 1) * 100,
        "target_percent": 15.0,
    }


async def benchmark(server: Server, args: argparse.Namespace) -> dict[str, Any]:
    configure_logging(json_logs=True, level="warning")
    install_tracing()
    return {
        "benchmark": "tool_loop",
        "machine": machine_facts(),
        "cpu_per_turn": []
        if args.skip_cpu_per_turn
        else [await cpu_per_turn(server, args, turns) for turns in args.turns],
        "throughput": await throughput(server, args),
    }


def render(report: dict[str, Any]) -> str:
    t = report["throughput"]
    lines = [f"tool_loop: {report['machine'].get('cpus')} CPUs, Python {sys.version.split()[0]}"]
    for o in report["cpu_per_turn"]:
        last = o["turns"] - 1
        lines += [
            "",
            f"worker CPU per turn over one {o['turns']}-turn conversation "
            f"({o['transcript_messages']} messages, {o['transcript_bytes']:,} bytes of "
            "transcript; least squares line):",
            *render_table(
                ["series", "µs at turn 10", f"µs at turn {last}", "ratio", "slope µs/turn"],
                [
                    [
                        f["series"],
                        fmt(f["us_at_turn_10"]),
                        fmt(f["us_at_last_turn"]),
                        fmt(f["ratio"], ".2f"),
                        fmt(f["slope_us_per_turn"], ".3f"),
                    ]
                    for f in o["fits"]
                ],
            ),
            f"request body: {o['request_bytes']['bytes'][0]:,} bytes at turn "
            f"{o['request_bytes']['turn'][0]}, {o['request_bytes']['bytes'][-1]:,} at turn "
            f"{o['request_bytes']['turn'][-1]}; the bare request (one join of the encoded "
            "messages, POSTed by the same client) is the cost of the bytes alone; the turn less "
            "the bytes' growth is each turn less the bare line's growth since turn 10",
        ]
    lines += [
        "",
        f"runs/s, {t['runs_per_round']} runs of {t['turns_per_run']} turns "
        f"(median of {len(t['rounds']['tool_agent'])} rounds):",
        *render_table(
            ["agent", "runs/s", "worker CPU µs/run"],
            [
                [
                    "ToolAgent",
                    fmt(t["tool_agent_runs_per_s"], ",.1f"),
                    fmt(t["tool_agent_cpu_us_per_run"]),
                ],
                [
                    "plain steps, same calls",
                    fmt(t["step_api_runs_per_s"], ",.1f"),
                    fmt(t["step_api_cpu_us_per_run"]),
                ],
                *(
                    [
                        [
                            "PydanticAIAgent, same conversation",
                            fmt(t["pydantic_ai_runs_per_s"], ",.1f"),
                            fmt(t["pydantic_ai_cpu_us_per_run"]),
                        ]
                    ]
                    if "pydantic_ai_runs_per_s" in t
                    else []
                ),
            ],
        ),
        f"the loop's own cost: {t['loop_cost_percent']:.1f}% (target < {t['target_percent']:g}%; "
        f"rounds: {', '.join(f'{p:.1f}' for p in t['loop_cost_percent_rounds'])}); "
        f"in worker CPU per run: {t['loop_cpu_cost_percent']:.1f}%",
    ]
    if "pydantic_ai_runs_per_s" in t:
        lines.append(
            "the Pydantic AI path against ToolAgent: "
            f"{t['pydantic_ai_overhead_cpu_us_per_turn']:+,.0f} µs of worker CPU per turn "
            f"({t['pydantic_ai_overhead_cpu_percent']:+.1f}% per run)"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = benchmark_parser(__doc__.split("\n\n")[0])
    parser.add_argument("--turns", type=int, nargs="+", default=[200, 1000])
    parser.add_argument("--message-bytes", type=int, default=2048)
    parser.add_argument("--runs", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--max-seconds", type=float, default=600.0)
    parser.add_argument(
        "--pydantic-ai",
        action="store_true",
        help="also run the conversation through PydanticAIAgent (the pydantic-ai extra)",
    )
    parser.add_argument(
        "--skip-cpu-per-turn", action="store_true", help="measure only the runs/s rounds"
    )
    args = parser.parse_args(argv)
    if min(args.turns) < 20 or args.runs < 1 or args.rounds < 1:
        parser.error("--turns must be at least 20, --runs and --rounds at least 1")
    run_and_report(args, "tool_loop", lambda server: benchmark(server, args), render)
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve-model"]:
        serve_model(int(sys.argv[2]), int(sys.argv[3]))
        sys.exit(0)
    sys.exit(main())
