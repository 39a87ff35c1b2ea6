"""The operator's command line: the attempts in `runs show`, `runs watch`, time and state filters,
bulk cancel and retry with a dry run, `workers list`, `queue stats` and `db status`."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import anyio
import asyncpg
import pytest

from orchestrator.agents.noop import noop
from orchestrator.db.connections import redact_dsn
from orchestrator.db.migrations import latest_version
from orchestrator.db.store import RunStore
from orchestrator.models import RunState
from orchestrator.settings import Settings
from orchestrator.testing import running_worker
from support import cli

pytestmark = pytest.mark.slow


async def test_runs_show_tells_each_attempt_and_how_it_ended(
    database_url: str, store: RunStore
) -> None:
    run_id = (await store.submit("summarise", {"doc": "x"})).run.run_id
    first = (await store.claim("worker-a", ["summarise"], lease_seconds=0.2)).claimed[0]
    await anyio.sleep(0.3)
    second = (await store.claim("worker-b", ["summarise"], lease_seconds=30)).claimed[0]
    assert not await store.commit_step(
        first.lease, expected_version=0, next_step="Two", checkpoint={}
    )
    assert await store.commit_step(second.lease, expected_version=0, next_step="Two", checkpoint={})
    assert await store.finish(second.lease, expected_version=1, result={"done": True})

    shown = cli(database_url, "runs", "show", run_id)
    assert shown.returncode == 0, shown.stderr
    assert "attempts" in shown.stdout
    lines = [line for line in shown.stdout.splitlines() if "worker-a" in line or "worker-b" in line]
    assert any("lease expired; claimed again" in line for line in lines), shown.stdout
    assert any("succeeded" in line and "worker-b" in line for line in lines), shown.stdout

    document = json.loads(cli(database_url, "runs", "show", run_id, "--json").stdout)
    attempts = document["attempts"]
    assert [(a["fence"], a["worker_id"]) for a in attempts] == [(1, "worker-a"), (2, "worker-b")]
    assert attempts[0]["ending"] == "lease expired; claimed again"
    assert attempts[1]["ending"] == "succeeded" and attempts[1]["checkpoints"] == 1

    cancelled = (await store.submit("summarise", {})).run.run_id
    await store.claim("worker-c", ["summarise"], lease_seconds=30)
    await store.cancel(cancelled)
    (attempt,) = json.loads(cli(database_url, "runs", "show", cancelled, "--json").stdout)[
        "attempts"
    ]
    assert (attempt["worker_id"], attempt["ending"]) == ("worker-c", "cancelled")
    assert all(event["details"] is not None for event in document["events"])


def watch_process(run_id: str, env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "orchestrator.cli", "runs", "watch", run_id, "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


async def test_runs_watch_follows_a_run_until_it_ends(
    database_url: str, settings: Settings, store: RunStore
) -> None:
    run_id = (await store.submit("noop", {"steps": 3})).run.run_id
    env = {**os.environ, "ORCHESTRATOR_DATABASE_URL": database_url}
    watcher = watch_process(run_id, env)
    await anyio.sleep(1.0)  # it is watching a queued run
    async with running_worker(settings, [noop], poll_seconds=0.1):
        out, err = await anyio.to_thread.run_sync(lambda: watcher.communicate(timeout=30))
    assert watcher.returncode == 0, err
    kinds = [json.loads(line)["kind"] for line in out.splitlines()]
    assert kinds[0] == "submitted" and kinds[-1] == "succeeded" and "claimed" in kinds

    timed_out = cli(
        database_url,
        "runs",
        "watch",
        (await store.submit("nobody_serves_this", {})).run.run_id,
        "--timeout",
        "0.5",
    )
    assert timed_out.returncode == 1 and "still queued after 0.5s" in timed_out.stderr
    missing = cli(database_url, "runs", "watch", "r_missing")
    assert missing.returncode == 1 and missing.stderr.count("\n") == 1


async def test_filters_and_bulk_cancel_and_retry_with_a_dry_run(
    database_url: str, store: RunStore, pool: asyncpg.Pool
) -> None:
    old = (await store.submit("a", {})).run.run_id
    await pool.execute("UPDATE run_events SET at = at - interval '3 hours' WHERE run_id = $1", old)
    fresh = [(await store.submit("a", {"n": n})).run.run_id for n in range(3)]
    other = (await store.submit("b", {})).run.run_id

    listed = json.loads(cli(database_url, "runs", "list", "--since", "1h", "--json").stdout)
    assert {run["run_id"] for run in listed} == {*fresh, other}
    older = json.loads(cli(database_url, "runs", "list", "--until", "2h", "--json").stdout)
    assert [run["run_id"] for run in older] == [old]
    bad = cli(database_url, "runs", "list", "--since", "yesterday")
    assert bad.returncode == 1 and bad.stderr.count("\n") == 1

    dry = cli(database_url, "runs", "cancel", "--agent", "a", "--since", "1h", "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert "3 runs match; nothing changed" in dry.stdout
    assert {(await store.get(run_id)).state for run_id in fresh} == {RunState.QUEUED}

    done = cli(
        database_url,
        "runs",
        "cancel",
        "--agent",
        "a",
        "--since",
        "1h",
        "--reason",
        "bulk",
        "--json",
    )
    assert done.returncode == 0, done.stderr
    assert set(json.loads(done.stdout)["done"]) == set(fresh)
    assert {(await store.get(run_id)).state for run_id in fresh} == {RunState.CANCELLED}
    assert (await store.get(old)).state is RunState.QUEUED
    assert (await store.get(other)).state is RunState.QUEUED

    nothing = cli(database_url, "runs", "cancel")  # an empty $RUN must not cancel everything
    assert nothing.returncode == 1 and "or --all" in nothing.stderr
    assert (await store.get(old)).state is RunState.QUEUED
    at = json.loads(
        cli(database_url, "runs", "list", "--since", "2000-01-01T00:00:00Z", "--json").stdout
    )
    assert len(at) == 5
    both = cli(database_url, "runs", "cancel", old, "--agent", "a")
    assert both.returncode == 1 and "not both" in both.stderr
    finished = cli(database_url, "runs", "cancel", "--state", "succeeded")
    assert finished.returncode == 1 and "only queued, running or waiting" in finished.stderr

    await pool.execute(
        "UPDATE runs SET state = 'dead', finished_at = clock_timestamp() WHERE run_id = $1", other
    )
    retried = cli(database_url, "runs", "retry", "--agent", "b", "--json")
    assert retried.returncode == 0, retried.stderr
    assert json.loads(retried.stdout)["done"] == [other]
    assert (await store.get(other)).state is RunState.QUEUED


async def test_workers_list_queue_stats_and_db_status(
    database_url: str, settings: Settings, store: RunStore
) -> None:
    for _ in range(3):
        await store.submit("stuck", {})
    async with running_worker(settings, [noop], worker_id="ops-worker", poll_seconds=0.1):
        listed = cli(database_url, "workers", "list", "--json")
        assert listed.returncode == 0, listed.stderr
        (worker,) = json.loads(listed.stdout)
        assert worker["worker_id"] == "ops-worker" and worker["alive"] is True
        assert worker["agents"] == ["noop"] and worker["runs_held"] == 0
        table = cli(database_url, "workers", "list")
        assert "ops-worker" in table.stdout and "alive" in table.stdout

    parked = (await store.submit("parked", {})).run.run_id  # waiting with no timeout: infinity
    await store.pool.execute(
        "UPDATE runs SET state = 'waiting', available_at = 'infinity' WHERE run_id = $1", parked
    )
    stats = json.loads(cli(database_url, "queue", "stats", "--json").stdout)
    (waiting,) = [row for row in stats if row["agent"] == "parked"]
    assert (waiting["waiting"], waiting["due"], waiting["oldest_due_seconds"]) == (1, 0, None)
    (stuck,) = [row for row in stats if row["agent"] == "stuck"]
    assert (stuck["queued"], stuck["due"], stuck["running"]) == (3, 3, 0)
    assert stuck["oldest_due_seconds"] >= 0
    assert "stuck" in cli(database_url, "queue", "stats").stdout

    status = json.loads(cli(database_url, "db", "status", "--json").stdout)
    assert status["schema_version"] == latest_version() and status["pending"] == []
    assert status["database"] == redact_dsn(database_url)
    assert f"at version {latest_version()}" in cli(database_url, "db", "status").stdout


PEAK_RSS = (
    "import resource, subprocess, sys\n"
    "code = subprocess.run(sys.argv[1:]).returncode\n"
    "print(f'peak_rss_kb={resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss}',"
    " file=sys.stderr)\n"
    "sys.exit(code)\n"
)


def cli_measured(database_url: str, *args: str) -> tuple[subprocess.CompletedProcess[str], int]:
    """``cli`` in a fresh parent that reports the command's peak resident memory (kB)."""
    env = {**os.environ, "ORCHESTRATOR_DATABASE_URL": database_url, "COLUMNS": "200"}
    done = subprocess.run(
        [sys.executable, "-c", PEAK_RSS, sys.executable, "-m", "orchestrator.cli", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    peak = [line for line in done.stderr.splitlines() if line.startswith("peak_rss_kb=")]
    return done, int(peak[-1].split("=")[1])


async def test_a_run_with_100000_events_is_shown_in_bounded_memory_and_paged_in_full(
    database_url: str, store: RunStore, pool: asyncpg.Pool
) -> None:
    """The history a run spinning on claims used to leave (issue 20): 50,000 claims, each
    parked again, and stale refusals among them. ``runs show`` read and printed all of it."""
    from orchestrator.client.stores import Stores
    from orchestrator.console.views import MAX_ROWS_SHOWN, run_page

    run_id = (await store.submit("summarise", {})).run.run_id
    await pool.execute(
        """
        INSERT INTO run_events (run_id, kind, fence, worker_id, details)
        SELECT $1, CASE WHEN i % 200 = 199 THEN 'stale_fence_rejected'
                        WHEN i % 2 = 0 THEN 'claimed' ELSE 'waiting' END,
               1 + i / 2, 'worker-' || (i % 7),
               jsonb_build_object('lease_until', clock_timestamp(), 'step', 'AwaitReply',
                                  'signals', jsonb_build_array('go'), 'padding', repeat('x', 200))
        FROM generate_series(0, 99999) AS i
        """,
        run_id,
    )
    await pool.execute("UPDATE runs SET fence = 50000 WHERE run_id = $1", run_id)
    total = 100_001  # with the run's "submitted"

    shown, peak_kb = cli_measured(database_url, "runs", "show", run_id)
    assert shown.returncode == 0, shown.stderr
    assert f"the newest 100 of {total:,} events" in shown.stdout
    assert f"runs events {run_id} --json" in shown.stderr  # how to read the rest
    assert peak_kb < 300_000, f"runs show peaked at {peak_kb:,} kB"

    as_json, peak_kb = cli_measured(database_url, "runs", "show", run_id, "--json")
    assert as_json.returncode == 0, as_json.stderr
    document = json.loads(as_json.stdout)
    assert len(document["events"]) == 100 and document["events_total"] == total
    assert document["claims"] == 50_000
    assert document["events_more"] and f"runs events {run_id}" in document["events_more"]
    attempts = document["attempts"]
    assert 0 < len(attempts) <= 100 and attempts[-1]["fence"] == 50_000
    assert peak_kb < 300_000, f"runs show --json peaked at {peak_kb:,} kB"

    # The console's run page reads as little.
    page = await run_page(Stores(pool), run_id, reveal=False)
    assert len(page["events"]) == MAX_ROWS_SHOWN and page["events_total"] == total
    assert len(page["attempts"]) <= 100 and len(page["stale_refusals"]) <= 100

    # `runs events` pages through every event, each once, in order; the store underneath it
    # pages the same way (in-process: eleven CLI processes would take long on a busy machine).
    first = cli(database_url, "runs", "events", run_id, "--json", "--limit", "10000")
    assert first.returncode == 0, first.stderr
    ids = [event["event_id"] for event in json.loads(first.stdout)]
    assert len(ids) == 10_000 and f"--after {ids[-1]} --limit 10000" in first.stderr
    second = cli(database_url, "runs", "events", run_id, "--after", str(ids[-1]), "--limit", "3")
    assert second.returncode == 0 and len(second.stdout.splitlines()) == 3, second.stderr
    seen: list[int] = []
    after = 0
    for _ in range(20):  # 100,001 events in pages of 10,000: 11 pages
        page_events = await store.events(run_id, after=after, limit=10_000)
        seen.extend(event.event_id for event in page_events)
        if len(page_events) < 10_000:
            break
        after = page_events[-1].event_id
    assert len(seen) == total and seen == sorted(set(seen))
    assert seen[:10_000] == ids
