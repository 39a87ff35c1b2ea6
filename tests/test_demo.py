"""`orchestrator demo` as a user runs it: real worker processes, vendors and the scripted model
on the test database. What it points at and what it counts must be what happened."""

from __future__ import annotations

import os
import re
import sys

import anyio
import pytest

from orchestrator.cli.demo_story import WORKER_A
from orchestrator.db.store import RunStore

pytestmark = pytest.mark.slow


def measure(output: str, label: str) -> int:
    found = re.search(rf"{re.escape(label)}\s*│\s*(\d+)", output)
    assert found is not None, f"no {label!r} row in:\n{output}"
    return int(found.group(1))


async def test_the_demo_points_at_a_run_a_held_and_counts_both_ways_a_stale_worker_stops(
    database_url: str, store: RunStore
) -> None:
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in ("OPENAI_API_KEY", "OPENAI_BASE_URL", "ORCHESTRATOR_MODEL_BASE_URL")
    }
    with anyio.fail_after(240):
        finished = await anyio.run_process(
            [sys.executable, "-m", "orchestrator.cli", "demo"],
            env={**env, "ORCHESTRATOR_DATABASE_URL": database_url, "COLUMNS": "200"},
            check=False,
        )
    printed, logged = finished.stdout.decode(), finished.stderr.decode()
    assert finished.returncode == 0, printed + logged
    pointed = re.search(
        r"worker A held and worker B took over: orchestrator runs show (\S+)", printed
    )
    assert pointed is not None, printed
    claims = [e.worker_id for e in await store.events(pointed.group(1)) if e.kind == "claimed"]
    assert WORKER_A in claims
    assert any(worker != WORKER_A for worker in claims[claims.index(WORKER_A) :]), claims

    own_check = measure(printed, "stale worker stopped by its own lease check")
    fence = measure(printed, "stale worker stopped by the fence")
    events = [e for run in await store.list_runs(limit=100) for e in await store.events(run.run_id)]
    stopped = {
        (e.run_id, e.fence) for e in events if e.kind in ("lease_lost", "stale_fence_rejected")
    }
    assert own_check + fence == len(stopped) >= 1
    assert measure(printed, "lost leases") == sum(e.kind == "lease_lost" for e in events)
