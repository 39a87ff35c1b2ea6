"""What every benchmark prints: progress on stderr, the machine it ran on, and its table.

Not a benchmark itself; the benchmarks import it by path (their own folder is first on
``sys.path``), never through the orchestrator package, so a baseline interpreter with an older
orchestrator installed can run them too.
"""

from __future__ import annotations

import math
import os
import platform
import sys
import time
from collections.abc import Collection, Sequence
from dataclasses import asdict
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import asyncpg
import psutil  # type: ignore[import-untyped]  # psutil ships no type information

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

_STARTED = time.perf_counter()

COMMON_OPTIONS = ("dsn", "json")
"""The options every benchmark takes (``bench_main.benchmark_parser``): not part of a workload."""


def log(message: str) -> None:
    """Progress on stderr, stamped with the seconds since the benchmark started."""
    print(f"[{elapsed():6.1f}s] {message}", file=sys.stderr, flush=True)


def elapsed() -> float:
    return time.perf_counter() - _STARTED


def machine_facts() -> dict[str, Any]:
    return {
        "cpus": os.cpu_count(),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "asyncpg": asyncpg.__version__,
    }


def report_heading(benchmark: str, **more_machine_facts: Any) -> dict[str, Any]:
    """The first keys of every report: which benchmark, when, and on what machine."""
    return {
        "benchmark": benchmark,
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": {**machine_facts(), **more_machine_facts},
    }


def workload(config: DataclassInstance, *, leaving_out: Collection[str] = ()) -> dict[str, Any]:
    """A benchmark's configuration as its report records it: the fields of ``config`` but the
    common options and those ``leaving_out``."""
    left_out = {*COMMON_OPTIONS, *leaving_out}
    return {key: value for key, value in asdict(config).items() if key not in left_out}


def server_line(server: dict[str, Any]) -> str:
    """The start of a table's line on its server: version, which server, whether durable."""
    where = "embedded" if server["embedded"] else "--dsn"
    return (
        f"PostgreSQL {server['server_version']} ({where}): fsync={server['fsync']} "
        f"synchronous_commit={server['synchronous_commit']}"
    )


def render_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """A plain-text table: first column left-aligned, the others right-aligned."""
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]

    def render(cells: Sequence[str]) -> str:
        first = cells[0].ljust(widths[0])
        rest = [cell.rjust(width) for cell, width in zip(cells[1:], widths[1:], strict=True)]
        return "  ".join([first, *rest]).rstrip()

    return [render(header), render(["-" * width for width in widths]), *map(render, rows)]


def percentile(values: Sequence[float], fraction: float) -> float:
    """Nearest-rank percentile (no interpolation: with 20 samples, p99 is the largest)."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = min(len(ordered), max(1, math.ceil(fraction * len(ordered))))
    return ordered[rank - 1]


def fmt(value: float | None, spec: str = ",.0f") -> str:
    return "-" if value is None else format(value, spec)


def verdict(met: bool) -> str:
    """How a report line says whether a target was met."""
    return "met" if met else "NOT met"
