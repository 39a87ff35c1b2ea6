"""MCP effect latency: commit to confirmed through the dispatcher's ``mcp`` adapter, against the
same effect through the ``http`` adapter.

One in-process worker (``orchestrator.testing.running_worker``, its built-in dispatcher) on a
durable embedded PostgreSQL runs a two-step agent: step 1 commits one effect, step 2 waits for it
to settle (``ctx.effects.wait``). A run's latency is the effect record's ``settled_at`` minus its
``created_at``, both on the database clock: from the commit that recorded it (a little before
the COMMIT) to the dispatcher's record of the outcome. ``--runs`` runs (100), one at a time,
after ``--warmup-runs`` (5), for each of three vendors:

- ``http``: ``HttpAdapter`` to ``LocalVendor`` on 127.0.0.1 (in this process);
- ``mcp-http``: ``McpAdapter`` to an MCP server (the ``mcp`` SDK's ``MCPServer``, defined in this
  file) over streamable HTTP on loopback, in a child process;
- ``mcp-stdio``: the same server over stdio, a child of this process (the dispatcher's).

The MCP server appends every call to a ledger with the idempotency key from ``_meta``: the
report's ``duplicates`` (calls beyond one per key) must be 0. It needs the ``mcp`` extra. From
the repository root: ``.venv/bin/python benchmarks/mcp_effects.py`` (``--json``; ``--dsn`` for an
existing server). About a minute.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio

from bench_main import benchmark_parser, run_and_report
from bench_report import log, machine_facts, render_table
from orchestrator import Agent, Effect, Finish, Next, Outcome, Step, StepContext
from orchestrator.db.connections import connect, create_pool
from orchestrator.db.migrations import migrate
from orchestrator.db.store import RunStore
from orchestrator.effects.adapters import Adapter
from orchestrator.effects.http import HttpAdapter
from orchestrator.effects.store import EffectStore
from orchestrator.effects.vendors import adapter_from_config
from orchestrator.settings import Settings
from orchestrator.telemetry import configure_logging
from orchestrator.testing import running_worker, wait_for_run
from orchestrator.testing.loopback import LocalVendor
from serve_harness import Server, create_database, drop_database

THIS = os.path.abspath(__file__)
KIND = "bench"
EFFECT_KEY = "the-effect"
VENDORS = ("http", "mcp-http", "mcp-stdio")


class RequestEffect(Step):
    name = "request"

    async def run(self, ctx: StepContext) -> Outcome:
        assert isinstance(ctx.input, dict)
        effect = Effect(EFFECT_KEY, KIND, ctx.input["payload"])
        return Next(AwaitOutcome, checkpoint={}, effects=[effect])


class AwaitOutcome(Step):
    name = "await_outcome"

    async def run(self, ctx: StepContext) -> Outcome:
        record = await ctx.effects.wait(EFFECT_KEY, within=60)
        return Finish(result={"status": record.status.value})


# -- the MCP server (run as a child process) ------------------------------------------------------


def serve_mcp(transport: str, port: int) -> None:
    from mcp.server.mcpserver import Context, MCPServer

    ledger = os.environ["BENCH_MCP_LEDGER"]
    server = MCPServer("bench")

    async def record(note: str, ctx: Context) -> dict[str, Any]:
        """Record a note (once per idempotency key)."""
        key = str((ctx.request_context.meta or {}).get("orchestrator/idempotency_key"))
        with open(ledger, "a") as file:  # noqa: ASYNC230 - a small append, the whole point
            file.write(key + "\n")
        return {"id": f"n-{key[-12:]}"}

    record.__annotations__["ctx"] = Context  # resolved here: mcp is imported in this function
    server.add_tool(record)
    if transport == "http":
        server.run("streamable-http", host="127.0.0.1", port=port)
    else:
        server.run("stdio")


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@asynccontextmanager
async def vendor(name: str, ledger: Path) -> AsyncIterator[tuple[Adapter, Any]]:
    """The adapter for ``name`` and what a run's payload is."""
    env = {"BENCH_MCP_LEDGER": str(ledger), "PATH": os.environ.get("PATH", "")}
    if name == "http":
        async with LocalVendor() as local:
            yield HttpAdapter(KIND, url=local.send_url), {"note": "hello"}
            log(f"  http vendor: {local.requests} requests")
        return
    payload = {"server": "bench", "tool": "record", "arguments": {"note": "hello"}}
    options: dict[str, Any] = {"adapter": "mcp", "tools": ["record"]}
    if name == "mcp-stdio":
        options |= {"command": sys.executable, "args": [THIS, "--serve-mcp", "stdio"], "env": env}
        yield adapter_from_config(KIND, options), payload
        return
    port = _free_port()
    child = subprocess.Popen(  # noqa: ASYNC220 - once per vendor, before any measured run
        [sys.executable, THIS, "--serve-mcp", "http", "--port", str(port)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        with anyio.fail_after(30):
            while True:
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=1).close()
                    break
                except OSError:
                    await anyio.sleep(0.05)
        options["url"] = f"http://127.0.0.1:{port}/mcp"
        yield adapter_from_config(KIND, options), payload
    finally:
        child.kill()
        child.wait(10)


def percentiles(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    if not ordered:
        return {}

    def at(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    return {"p50": at(0.5), "p90": at(0.9), "p99": at(0.99), "max": ordered[-1]}


async def measure(dsn: str, name: str, index: int, args: Any) -> dict[str, Any]:
    settings = Settings(database_url=dsn)
    agent_name = f"bench_mcp_{index}"
    agent = Agent(agent_name, first=RequestEffect, steps=[AwaitOutcome])
    pool = await create_pool(settings, application_name="bench-mcp", min_size=1, max_size=2)
    ledger = Path(tempfile.mkdtemp(prefix="bench-mcp-")) / "ledger"
    ledger.touch()
    latencies: list[float] = []
    keys: list[str] = []
    try:
        store, effects = RunStore(pool), EffectStore(pool)
        async with vendor(name, ledger) as (adapter, payload):
            try:
                async with running_worker(
                    settings, [agent], effect_adapters={KIND: adapter}, poll_seconds=1.0
                ):
                    for number in range(args.warmup_runs + args.runs):
                        run_id = (await store.submit(agent_name, {"payload": payload})).run.run_id
                        await wait_for_run(store, run_id, within=60)
                        record = await effects.get(run_id, EFFECT_KEY)
                        if number < args.warmup_runs:
                            continue
                        assert record.settled_at is not None, record
                        keys.append(record.idempotency_key)
                        latencies.append(
                            (record.settled_at - record.created_at).total_seconds() * 1000
                        )
            finally:
                await adapter.aclose()
        calls = Counter(ledger.read_text().split())
    finally:
        await pool.close()
    summary = percentiles(latencies)
    log(f"{name}: p50 {summary['p50']:.1f} ms, p99 {summary['p99']:.1f} ms ({len(keys)} runs)")
    return {
        "vendor": name,
        "runs": len(latencies),
        "latency_ms": summary,
        "duplicates": sum(count - 1 for count in calls.values() if count > 1),
    }


async def body(server: Server, args: Any) -> dict[str, Any]:
    database = f"orchestrator_bench_mcp_{os.getpid()}"
    dsn = await create_database(server.dsn, database)
    try:
        admin = await connect(Settings(database_url=dsn), application_name="bench-admin")
        try:
            await migrate(admin)
        finally:
            await admin.close()
        rows = [await measure(dsn, name, index, args) for index, name in enumerate(VENDORS)]
    finally:
        await drop_database(server.dsn, database)
    http = rows[0]["latency_ms"]["p50"]
    for row in rows:
        row["p50_vs_http"] = row["latency_ms"]["p50"] / http if http else None
    return {
        "benchmark": "mcp_effects",
        "machine": machine_facts(),
        "config": {"runs": args.runs, "warmup_runs": args.warmup_runs},
        "rows": rows,
    }


def render(report: dict[str, Any]) -> str:
    header = ["vendor", "runs", "p50 ms", "p90 ms", "p99 ms", "max ms", "p50 / http", "dups"]
    lines = [
        [
            row["vendor"],
            str(row["runs"]),
            *(f"{row['latency_ms'][q]:.1f}" for q in ("p50", "p90", "p99", "max")),
            f"{row['p50_vs_http']:.2f}",
            str(row["duplicates"]),
        ]
        for row in report["rows"]
    ]
    return "\n".join(["commit to confirmed, one effect per run", *render_table(header, lines)])


def main() -> None:
    if sys.argv[1:2] == ["--serve-mcp"]:
        port = int(sys.argv[4]) if len(sys.argv) > 4 else 0
        serve_mcp(sys.argv[2], port)
        return
    configure_logging(json_logs=True, level="warning")
    parser = benchmark_parser(__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=100, help="Measured runs per vendor.")
    parser.add_argument("--warmup-runs", type=int, default=5, help="Runs not counted.")
    args = parser.parse_args()
    started = time.monotonic()
    run_and_report(args, "mcp-effects", lambda server: body(server, args), render)
    log(f"total {time.monotonic() - started:.0f}s")


if __name__ == "__main__":
    main()
