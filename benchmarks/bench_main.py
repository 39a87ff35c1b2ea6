"""A benchmark's main: the options they all take, the signals that unwind it, its report printed.

Not a benchmark itself (see ``serve_harness.py`` for the server and the processes, and
``bench_report.py`` for what is printed).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
from collections.abc import Awaitable, Callable, Mapping
from types import FrameType
from typing import Any, Protocol

from bench_report import elapsed, log
from serve_harness import Server, kill_children, postgres_server


class CommonOptions(Protocol):
    """The options ``benchmark_parser`` adds, as a benchmark's parsed configuration holds them."""

    @property
    def dsn(self) -> str | None: ...

    @property
    def json(self) -> bool: ...


def benchmark_parser(description: str, *, dsn: bool = True) -> argparse.ArgumentParser:
    """A benchmark's command line with the options they all take: ``--dsn`` (unless the
    benchmark starts servers of its own) and ``--json``."""
    parser = argparse.ArgumentParser(description=description)
    if dsn:
        parser.add_argument("--dsn", help="use this PostgreSQL server instead of an embedded one")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    return parser


def print_report(
    report: dict[str, Any], render: Callable[[dict[str, Any]], str], *, as_json: bool
) -> None:
    """The report on stdout, as JSON or as ``render`` lays it out, and the time it took."""
    print(json.dumps(report, indent=2, default=str) if as_json else render(report))
    log(f"done in {report['elapsed_seconds']:.0f}s")


def _terminate(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)


def run_benchmark(body: Callable[[], Awaitable[dict[str, Any]]]) -> dict[str, Any]:
    """Run ``body`` in an event loop and return its report, ``elapsed_seconds`` added last;
    SIGTERM and Ctrl-C unwind it through every ``finally``, and every child process still
    running afterwards is killed."""
    signal.signal(signal.SIGTERM, _terminate)

    async def guarded() -> dict[str, Any]:
        task = asyncio.current_task()
        if task is not None:
            asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
        report = await body()
        return {**report, "elapsed_seconds": elapsed()}

    try:
        return asyncio.run(guarded())
    except asyncio.CancelledError:
        log("terminated")
        raise SystemExit(128 + signal.SIGTERM) from None
    except KeyboardInterrupt:
        log("interrupted")
        raise SystemExit(128 + signal.SIGINT) from None
    finally:
        signal.signal(signal.SIGTERM, _terminate)
        left = kill_children()
        if left:
            log(f"killed {left} child process(es) still running")


def run_and_report(
    options: CommonOptions,
    name: str,
    body: Callable[[Server], Awaitable[dict[str, Any]]],
    render: Callable[[dict[str, Any]], str],
    *,
    server_settings: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """A benchmark's main: ``body`` on the server (an embedded one, started with
    ``server_settings``, unless ``options.dsn``), its report printed (``print_report``) and
    returned. SIGTERM and Ctrl-C unwind through every ``finally`` (pools, workers, scratch
    databases, the server)."""
    with postgres_server(
        options.dsn, prefix=f"orchestrator-bench-{name}-", server_settings=server_settings
    ) as server:
        report = run_benchmark(lambda: body(server))
    print_report(report, render, as_json=options.json)
    return report
