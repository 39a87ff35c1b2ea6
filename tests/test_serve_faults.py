"""`orchestrator serve` under real faults: SIGKILL, SIGSTOP, partitions, SIGTERM, DB restarts.

Workers are separate OS processes; PostgreSQL is real; partitions go through a loopback proxy.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import json
import signal
import socket
import subprocess
import time
from collections.abc import Awaitable, Callable
from datetime import datetime
from pathlib import Path
from typing import TypeVar
from urllib.parse import urlsplit

import anyio
import asyncpg
import pytest

from orchestrator.db.connections import create_pool
from orchestrator.db.embedded import EmbeddedPostgres
from orchestrator.db.store import RunStore
from orchestrator.errors import OrchestratorError
from orchestrator.models import Run, RunEvent, RunState
from orchestrator.settings import Settings
from orchestrator.telemetry import RUN_FENCE, RUN_ID
from orchestrator.testing import FaultProxy, wait_for_run
from support import (
    ServeProcess,
    cli,
    fenced_claims,
    handed_from_a_to_b,
    migrate_database,
    serving,
    started_and_migrated,
    submit_all,
    write_vendors_config,
)
from test_effects_proxy import free_port

pytestmark = pytest.mark.slow

T = TypeVar("T")
FAST = serving("support.agents_for_tests")


async def wait_for(
    fetch: Callable[[], Awaitable[T]], ok: Callable[[T], bool], *, within: float = 30
) -> T:
    with anyio.fail_after(within):
        while True:
            value = await fetch()
            if ok(value):
                return value
            await anyio.sleep(0.05)


async def wait_for_marker(marker_dir: Path, pattern: str, *, within: float = 30) -> Path:
    with anyio.fail_after(within):
        while True:
            found = await anyio.to_thread.run_sync(lambda: sorted(marker_dir.glob(pattern)))
            if found:
                return found[0]
            await anyio.sleep(0.02)


def is_json_object(line: str) -> bool:
    try:
        return isinstance(json.loads(line), dict)
    except json.JSONDecodeError:
        return False


async def submit_marked(store: RunStore, marker_dir: Path, *, steps: int, seconds: float) -> str:
    """A run of the ``marked`` agent, whose steps leave marker files in ``marker_dir``."""
    input = {"steps": steps, "seconds": seconds, "marker_dir": str(marker_dir)}
    return (await store.submit("marked", input)).run.run_id


def commits(events: list[RunEvent]) -> list[RunEvent]:
    return [e for e in events if e.kind in ("checkpoint", "succeeded", "failed")]


async def test_sigkill_mid_step_resumes_elsewhere_from_the_last_checkpoint(
    database_url: str, store: RunStore, tmp_path: Path
) -> None:
    args = [*FAST, "--lease-seconds", "30", "--heartbeat-seconds", "5"]
    run_id = await submit_marked(store, tmp_path, steps=4, seconds=0.6)
    with ServeProcess(database_url, *args, name="A") as worker_a:
        await wait_for(lambda: store.get(run_id), lambda r: r.checkpoint_version >= 2)
        worker_a.kill()
        killed_at = await store.database_now()
        pid_a = worker_a.process.pid
    version_at_kill = (await store.get(run_id)).checkpoint_version
    with ServeProcess(database_url, *args, name="B") as worker_b:
        final = await wait_for_run(store, run_id, within=60)
        pid_b = worker_b.process.pid
    events = await store.events(run_id)

    assert final.state is RunState.SUCCEEDED
    assert final.result == {"count": 4}
    claims = [e for e in events if e.kind == "claimed"]
    assert [(c.worker_id, c.fence) for c in claims] == [("A", 1), ("B", 2)]
    # Dead-session takeover: far sooner than the 30 s lease (half of it: a loaded machine is
    # slow to start B, but B did not wait for the lease to run out).
    assert "owner_session_gone" in [e.kind for e in events]
    assert (claims[1].at - killed_at).total_seconds() < 15
    # Every checkpoint version committed exactly once, each by the owner of the time.
    versions = [e.details["version"] for e in commits(events)]
    assert versions == list(range(1, len(versions) + 1))
    # Steps before the last committed checkpoint ran once, by A, and were not run again.
    names = await anyio.to_thread.run_sync(lambda: [p.name for p in tmp_path.iterdir()])
    markers = [name.split(".") for name in names]
    for count in range(version_at_kill):
        ran = [m for m in markers if m[1] == str(count)]
        assert [(m[2], m[3]) for m in ran] == [(str(pid_a), "1")], (count, ran)
    assert all(m[2] == str(pid_b) for m in markers if int(m[1]) > version_at_kill)


async def test_sigstopped_worker_commits_nothing_after_its_lease_expires(
    database_url: str, store: RunStore, tmp_path: Path
) -> None:
    args = [*FAST, "--lease-seconds", "2", "--heartbeat-seconds", "0.5"]
    run_id = await submit_marked(store, tmp_path, steps=2, seconds=1.0)
    with ServeProcess(database_url, *args, name="A") as worker_a:
        await wait_for_marker(tmp_path, f"{run_id}.0.*")  # A loaded the checkpoint, is in a step
        worker_a.signal(signal.SIGSTOP)
        stopped_at = await store.database_now()
        with ServeProcess(database_url, *args, name="B"):
            final = await wait_for_run(store, run_id, within=60)
        worker_a.signal(signal.SIGCONT)
        await wait_for(
            lambda: store.events(run_id),
            lambda evs: any(e.kind == "lease_lost" and e.worker_id == "A" for e in evs),
            within=60,
        )
        await anyio.sleep(1.5)  # give A every chance to (wrongly) commit something
        assert worker_a.process.poll() is None, "A must survive losing a lease"
        assert worker_a.stop() == 0
    events = await store.events(run_id)
    assert final.state is RunState.SUCCEEDED and final.result == {"count": 2}
    a_fences, taken = handed_from_a_to_b(events)
    assert all(e.worker_id == "B" for e in commits(events)), commits(events)
    lost = [e.fence for e in events if e.kind == "lease_lost" and e.worker_id == "A"]
    assert lost == a_fences, events
    # A paused process keeps its session: no takeover, B waited for the lease to expire.
    assert "owner_session_gone" not in [e.kind for e in events]
    previous = datetime.fromisoformat(taken.details["previous_lease_until"])
    assert taken.at >= previous > stopped_at


@pytest.mark.parametrize("fault", ["blackhole", "drop_replies"])
async def test_partitioned_worker_gives_up_before_its_lease_ends_and_commits_nothing(
    database_url: str, store: RunStore, tmp_path: Path, fault: str
) -> None:
    """Also: a step that runs longer than the lease while renewals fail cannot commit."""
    target = urlsplit(database_url)
    assert target.hostname is not None and target.port is not None
    args = [*FAST, "--lease-seconds", "4", "--heartbeat-seconds", "1"]
    run_id = await submit_marked(store, tmp_path, steps=1, seconds=8)
    async with FaultProxy(target.hostname, target.port) as proxy:
        with ServeProcess(proxy.dsn_for(database_url), *args, name="A") as worker_a:
            await wait_for_marker(tmp_path, f"{run_id}.0.*")
            proxy.mode = fault
            lost = await worker_a.wait_for_log("lease lost", within=60)
            lost_at = datetime.fromisoformat(lost["timestamp"].replace("Z", "+00:00"))
            held = await store.get(run_id)
            # The database still holds A's lease: A stopped first, on its own local deadline.
            assert held.lease_owner == "A" and held.fence == lost[RUN_FENCE]
            assert held.lease_until is not None and lost_at < held.lease_until
            with ServeProcess(database_url, *args, name="B"):
                final = await wait_for_run(store, run_id, within=60)
            proxy.mode = "forward"
            await anyio.sleep(2)
            assert worker_a.process.poll() is None
    events = await store.events(run_id)
    assert final.state is RunState.SUCCEEDED
    _, taken = handed_from_a_to_b(events)
    assert all(e.worker_id == "B" for e in commits(events)), commits(events)
    # A's connection was alive (only stalled): no takeover, B waited for expiry.
    assert "owner_session_gone" not in [e.kind for e in events]
    previous = datetime.fromisoformat(taken.details["previous_lease_until"])
    assert taken.at >= previous


async def test_answers_dropped_mid_step_stop_the_owner_before_its_lease_ends(
    database_url: str, store: RunStore, tmp_path: Path
) -> None:
    """Issue 37: A's answers from PostgreSQL are dropped mid-step (its requests still land),
    then nothing passes at all, while B serves beside it. A stops its step at its local
    deadline, before the lease the database holds for it ends; nobody cuts that lease short
    (A keeps its liveness session), and B claims only once it has ended."""
    target = urlsplit(database_url)
    assert target.hostname is not None and target.port is not None
    args = [*FAST, "--lease-seconds", "10", "--heartbeat-seconds", "1"]
    ticking = {"tick_dir": str(tmp_path), "seconds": 60, "again_seconds": 0.2}
    run_id = (await store.submit("ticking", ticking)).run.run_id
    async with FaultProxy(target.hostname, target.port) as proxy:
        with ServeProcess(proxy.dsn_for(database_url), *args, name="A") as worker_a:
            await wait_for_marker(tmp_path, f"{run_id}.*")
            with ServeProcess(database_url, *args, name="B") as worker_b:
                await worker_b.wait_for_log("serving", within=60)
                # Renewed since its claim: A's heartbeat connection is open, so its next
                # renewals reach the database and only their answers are lost.
                claimed_until = (await store.get(run_id)).lease_until
                assert claimed_until is not None
                await wait_for(
                    lambda: store.get(run_id),
                    lambda run: run.lease_until is not None and run.lease_until > claimed_until,
                )
                proxy.mode = "drop_replies"
                lost = await worker_a.wait_for_log("lease lost", within=60)
                proxy.mode = "blackhole"
                final = await wait_for_run(store, run_id, within=60)
            proxy.mode = "forward"
    events = await store.events(run_id)
    assert final.state is RunState.SUCCEEDED
    a_fences, taken = handed_from_a_to_b(events)
    assert all(e.worker_id == "B" for e in commits(events)), commits(events)
    # Nobody judged A dead: its session outlived the fault, so its lease ran its full course.
    assert "owner_session_gone" not in [e.kind for e in events], events
    lost_at, logged_at, confirmed_until = (
        datetime.fromisoformat(lost[key].replace("Z", "+00:00"))
        for key in ("lost_at", "timestamp", "lease_until")
    )
    a_ended = datetime.fromisoformat(taken.details["previous_lease_until"])
    # Stopped, and said so, before the lease A last had confirmed ended; the database held it
    # at least that long (renewals whose answers were lost could only extend it).
    assert lost_at <= logged_at <= confirmed_until <= a_ended <= taken.at, lost
    # A's step did nothing once stopped, nor after its lease ended.
    names = await anyio.to_thread.run_sync(lambda: [p.name for p in tmp_path.iterdir()])
    ticks = [name.split(".") for name in names if name.startswith(run_id)]
    a_ticks = [int(ns) / 1e9 for _, fence, ns in ticks if int(fence) in a_fences]
    assert a_ticks and max(a_ticks) <= lost_at.timestamp() <= a_ended.timestamp()


async def test_sigterm_releases_leases_and_another_worker_claims_without_waiting_for_expiry(
    database_url: str, store: RunStore, tmp_path: Path
) -> None:
    args = [*FAST, "--lease-seconds", "30", "--heartbeat-seconds", "5", "--grace-seconds", "0.3"]
    run_id = await submit_marked(store, tmp_path, steps=1, seconds=60)
    with ServeProcess(database_url, *args, name="A") as worker_a:
        await wait_for_marker(tmp_path, f"{run_id}.0.*")
        with ServeProcess(database_url, *args, name="B") as worker_b:
            await worker_b.wait_for_log("serving")
            worker_a.signal(signal.SIGTERM)
            assert worker_a.process.wait(60) == 0
            events = await wait_for(
                lambda: store.events(run_id),
                lambda evs: [e.worker_id for e in evs if e.kind == "claimed"] == ["A", "B"],
                within=60,
            )
    released = [e for e in events if e.kind == "released"]
    claims = [e for e in events if e.kind == "claimed"]
    assert [(e.worker_id, e.fence) for e in released] == [("A", 1)]
    # Well before A's 30 s lease could have run out (a second when quiet; a loaded machine is
    # slower to wake B, but not by a lease).
    assert (claims[1].at - released[0].at).total_seconds() < 10
    assert claims[1].fence == 2 and claims[1].details["attempt"] == 1  # release cost no attempt


async def test_cancel_reaches_the_owning_worker_process(
    database_url: str, store: RunStore, tmp_path: Path
) -> None:
    args = [*FAST, "--lease-seconds", "6", "--heartbeat-seconds", "2"]
    run_id = await submit_marked(store, tmp_path, steps=3, seconds=3)
    with ServeProcess(database_url, *args, name="A") as worker_a:
        await wait_for_marker(tmp_path, f"{run_id}.0.*")
        await store.cancel(run_id, reason="test")
        started = time.monotonic()
        await worker_a.wait_for_log("lease lost", within=60)
        # At a renewal (every 2 s when quiet), within the 6 s lease on a loaded machine.
        assert time.monotonic() - started < 6.0
        await anyio.sleep(4)  # past the end of the step A was in
    run = await store.get(run_id)
    events = await store.events(run_id)
    assert run.state is RunState.CANCELLED and run.checkpoint_version == 0
    assert commits(events) == []
    assert [(e.worker_id, e.details["reason"]) for e in events if e.kind == "lease_lost"] == [
        ("A", "the run was cancelled")
    ]


async def test_postgres_restart_under_running_workers_loses_no_run(
    own_server: EmbeddedPostgres,
) -> None:
    settings = await started_and_migrated(own_server)
    # Runs of 3 steps of 3 s: one caught before its first checkpoint still has seconds of
    # work when the database goes down, however slowly a loaded machine gets there.
    run_ids = await submit_sleepy(settings, count=20, seconds=3.0)
    args = sleepy_args(concurrency=8)
    dsn = str(settings.database_url)
    with ServeProcess(dsn, *args, name="A") as a, ServeProcess(dsn, *args, name="B") as b:
        await mid_first_step(settings, run_ids)
        await anyio.to_thread.run_sync(own_server.restart)  # a quick restart: leases survive
        await anyio.sleep(1.0)
        # A long outage: every lease outlives its local deadline; the workers keep running,
        # give their runs up, and pick them up again when the database is back.
        before = await mid_first_step(settings, run_ids)
        await anyio.to_thread.run_sync(lambda: own_server.restart(down_seconds=5))
        runs = await wait_all_terminal(settings, run_ids, within=180)
        logs = a.tail() + b.tail()
        not_json = [line for line in a.raw + b.raw if not is_json_object(line)]
        alive = [a.process.poll(), b.process.poll()]
        lost_logged = {line.get(RUN_ID) for line in a.events("lease lost") + b.events("lease lost")}
    assert alive == [None, None], logs
    assert {run.state for run in runs} == {RunState.SUCCEEDED}, logs
    assert all(run.result == {"count": 3} for run in runs)
    held = await held_through_the_outage(settings, run_ids, before)
    # At least the run caught mid-step was held when the database went down for longer
    # than a lease: its owner gave it up, and a newer fence finished it.
    assert held, "no run was in flight during the outage"
    assert held <= lost_logged, (held, lost_logged, logs)
    # Every line is JSON with --log-json, the connection pool's own warnings included.
    assert not_json == [], "".join(not_json[:20])


async def test_a_database_outage_is_one_line_when_it_starts_and_one_when_it_ends(
    own_server: EmbeddedPostgres, tmp_path: Path
) -> None:
    """Issue 37: while PostgreSQL is down, every long-running process says so once, without a
    traceback (none of asyncpg's "Failed to restore the pool connection floor" retries), and
    once that it is back; nothing else is repeated retry after retry; the runs finish."""
    settings = await started_and_migrated(own_server)
    dsn = str(settings.database_url)
    config = write_vendors_config(
        tmp_path, {"crm": {"adapter": "http", "url": "http://127.0.0.1:9/"}}
    )
    with contextlib.ExitStack() as stack:
        processes = [
            stack.enter_context(process)
            for process in (
                ServeProcess(dsn, *sleepy_args(concurrency=4), name="serve"),
                ServeProcess(
                    dsn,
                    *("--effects-config", config, "--poll-seconds", "0.2"),
                    name="effects dispatch",
                    command=("effects", "dispatch"),
                ),
                ServeProcess(
                    dsn,
                    *("--listen", f"127.0.0.1:{free_port()}"),
                    name="effects serve",
                    command=("effects", "serve"),
                    env={"ORCHESTRATOR_PROXY_TOKENS": "a-token"},
                ),
                ServeProcess(
                    dsn,
                    *("--listen", f"127.0.0.1:{free_port()}"),
                    name="console",
                    command=("console",),
                ),
            )
        ]
        serve, dispatch, proxy, console = processes
        await serve.wait_for_log("serving", within=60)
        await dispatch.wait_for_log("dispatching", within=60)
        for process in (proxy, console):
            await process.wait_for_text("listening on", within=60)
        # Submitted once every process is up: on a busy machine the others may start after
        # runs submitted earlier are past their first step, which this outage must interrupt.
        run_ids = await submit_sleepy(settings, count=4, seconds=2.0)
        await mid_first_step(settings, run_ids)
        await anyio.to_thread.run_sync(lambda: own_server.restart(down_seconds=8))
        for process in processes:
            await process.wait_for_log("database reachable again", within=60)
        runs = await wait_all_terminal(settings, run_ids, within=120)
        outputs = {process.name: (list(process.raw), list(process.lines)) for process in processes}
    assert {run.state for run in runs} == {RunState.SUCCEEDED}
    for name, (raw, lines) in outputs.items():
        said = [
            line["event"] for line in lines if str(line.get("event", "")).startswith("database ")
        ]
        assert said == ["database unavailable; retrying", "database reachable again"], (name, said)
        assert not [line for line in raw if "Traceback" in line or "pool connection floor" in line]
        assert not [line for line in lines if "exception" in line], name
        # Per-run lines (a lease lost, its record not written) and the renewals of the leases
        # still held are each their own news; no other warning repeats retry after retry.
        warned = collections.Counter(
            line["event"]
            for line in lines
            if line.get("level") in ("warning", "error") and RUN_ID not in line
        )
        assert {event for event, count in warned.items() if count > 1} <= {"renewal failed"}, (
            name,
            warned,
        )


async def mid_first_step(settings: Settings, run_ids: list[str]) -> datetime:
    """Wait until some run is claimed and has not reached its first checkpoint; return the
    database's clock at that moment."""
    pool = await create_pool(settings, application_name="test-watch")
    try:
        store = RunStore(pool)
        await wait_for(
            lambda: store.list_runs(state=RunState.RUNNING),
            lambda runs: any(r.run_id in run_ids and r.checkpoint_version == 0 for r in runs),
            within=60,
        )
        return await store.database_now()
    finally:
        await pool.close()


async def held_through_the_outage(
    settings: Settings, run_ids: list[str], before: datetime
) -> set[str]:
    """Runs claimed before ``before`` and finished after the server's last start: each was held
    through the outage. Every run's timeline must obey the fencing rules, and a run held through
    the outage was finished by a newer fence than it had before it."""
    pool = await create_pool(settings, application_name="test-watch")
    try:
        store = RunStore(pool)
        started = await pool.fetchval("SELECT pg_postmaster_start_time()")
        held = set()
        for run_id in run_ids:
            events = await store.events(run_id)
            claims = fenced_claims(events)
            [end] = [e for e in events if e.kind == "succeeded"]
            earlier = [c.fence or 0 for c in claims if c.at < before]
            if earlier and end.at > started:
                assert end.fence is not None and end.fence > max(earlier), events
                held.add(run_id)
        return held
    finally:
        await pool.close()


def sleepy_args(*, concurrency: int) -> list[str]:
    """`serve` options for the sleepy agent on a 3 s lease renewed every second."""
    return [
        *FAST,
        "--agents",
        "orchestrator.agents.sleepy",
        "--lease-seconds",
        "3",
        "--heartbeat-seconds",
        "1",
        "--concurrency",
        str(concurrency),
    ]


async def submit_sleepy(settings: Settings, *, count: int, seconds: float) -> list[str]:
    return await submit_all(
        settings, "sleepy", ({"steps": 3, "seconds": seconds, "n": n} for n in range(count))
    )


async def wait_all_terminal(settings: Settings, run_ids: list[str], *, within: float) -> list[Run]:
    """Poll through a database that may be restarting; reconnect as needed."""
    deadline = time.monotonic() + within
    runs: list[Run] = []
    while time.monotonic() < deadline:
        try:
            pool = await create_pool(settings, application_name="test-watch")
            try:
                store = RunStore(pool)
                runs = [await store.get(run_id) for run_id in run_ids]
            finally:
                await pool.close()
            if all(run.state.terminal for run in runs):
                return runs
        except OrchestratorError:
            pass
        await anyio.sleep(0.5)
    return runs


async def test_a_second_signal_exits_at_once(
    database_url: str, store: RunStore, tmp_path: Path
) -> None:
    args = [*FAST, "--lease-seconds", "30", "--heartbeat-seconds", "5", "--grace-seconds", "60"]
    await submit_marked(store, tmp_path, steps=1, seconds=60)
    with ServeProcess(database_url, *args, name="A") as worker:
        await wait_for_marker(tmp_path, "*.0.*")
        worker.signal(signal.SIGTERM)
        await worker.wait_for_log("draining")
        worker.signal(signal.SIGTERM)
        started = time.monotonic()
        code = await anyio.to_thread.run_sync(lambda: worker.process.wait(60))
    assert code == 130
    assert time.monotonic() - started < 30  # not after the 60 s grace


async def test_after_a_postgres_restart_workers_register_again_and_takeover_still_works(
    own_server: EmbeddedPostgres, tmp_path: Path
) -> None:
    settings = await started_and_migrated(own_server)
    dsn = str(settings.database_url)
    # Room for all six runs on B and C together, whichever worker holds which.
    args = [*FAST, "--lease-seconds", "10", "--heartbeat-seconds", "2", "--concurrency", "4"]
    run_ids = await submit_all(
        settings,
        "marked",
        ({"steps": 1, "seconds": 60, "marker_dir": str(tmp_path), "n": n} for n in range(6)),
    )
    with ServeProcess(dsn, *args, name="A") as a:
        await a.wait_for_log("serving", within=60)
        await wait_for_marker(tmp_path, f"*.0.{a.process.pid}.*")  # A holds runs
        with (
            ServeProcess(dsn, *args, name="B") as b,
            ServeProcess(dsn, *args, name="C") as c,
        ):
            await restart_then_kill_a(a, b, c, tmp_path, run_ids, own_server, settings)


def embedded_cli(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return cli(None, *args, env={"ORCHESTRATOR_HOME": str(home)}, columns=None)


def test_the_embedded_server_comes_back_on_the_same_port(own_server: EmbeddedPostgres) -> None:
    first = own_server.ensure_running().port
    assert own_server.stop()
    assert own_server.ensure_running().port == first
    assert own_server.remembered_port() == first


async def test_db_stop_refuses_while_other_processes_are_connected_unless_forced(
    own_server: EmbeddedPostgres,
) -> None:
    home = own_server.home
    running = own_server.ensure_running()
    console = await asyncpg.connect(
        running.dsn("postgres"), server_settings={"application_name": "my-console"}
    )
    try:
        refused = await anyio.to_thread.run_sync(lambda: embedded_cli(home, "db", "stop"))
        assert refused.returncode == 1, refused.stderr
        [line] = refused.stderr.strip().splitlines()
        assert "1 session" in line and "'my-console'" in line and "--force" in line, line
        assert await console.fetchval("SELECT 1") == 1  # nothing was stopped
        assert own_server.running() is not None
        forced = await anyio.to_thread.run_sync(lambda: embedded_cli(home, "db", "stop", "--force"))
        assert forced.returncode == 0, forced.stderr
        assert own_server.running() is None
    finally:
        console.terminate()
    alone = await anyio.to_thread.run_sync(lambda: embedded_cli(home, "db", "stop"))
    assert alone.returncode == 0 and "not running" in alone.stderr, alone.stderr


@pytest.mark.parametrize("port_taken", [False, True], ids=["same-port", "port-taken"])
async def test_workers_find_the_embedded_server_again_after_db_stop(
    own_server: EmbeddedPostgres, port_taken: bool
) -> None:
    """`db stop`, then any command starts the server again: running workers reconnect to it,
    on its old port, or on a new one when something else took the old one meanwhile."""
    home = own_server.home
    settings = Settings(home=home)
    own_server.ensure_running()
    await migrate_database(settings)
    run_ids = await submit_sleepy(settings, count=10, seconds=1.0)
    args = sleepy_args(concurrency=10)
    with (
        socket.socket() as squatter,
        ServeProcess(None, *args, name="A", env={"ORCHESTRATOR_HOME": str(home)}) as worker,
    ):
        await worker.wait_for_log("serving", within=60)
        await anyio.sleep(1.0)
        stopped = await anyio.to_thread.run_sync(
            lambda: embedded_cli(home, "db", "stop", "--force")
        )
        assert stopped.returncode == 0, stopped.stderr
        old_port = own_server.remembered_port()
        assert old_port is not None
        if port_taken:
            squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            squatter.bind(("127.0.0.1", old_port))
            squatter.listen()
        listed = await anyio.to_thread.run_sync(lambda: embedded_cli(home, "runs", "list"))
        assert listed.returncode == 0, listed.stderr
        assert (own_server.remembered_port() == old_port) is not port_taken
        runs = await wait_all_terminal(settings, run_ids, within=60)
        alive = worker.process.poll()
    assert alive is None, worker.tail()
    assert {run.state for run in runs} == {RunState.SUCCEEDED}, worker.tail()


async def restart_then_kill_a(
    a: ServeProcess,
    b: ServeProcess,
    c: ServeProcess,
    tmp_path: Path,
    run_ids: list[str],
    server: EmbeddedPostgres,
    settings: Settings,
) -> None:
    """After a restart, no live worker is judged dead; then A is killed and taken over fast."""
    for worker in (b, c):
        await worker.wait_for_log("serving", within=60)
    for run_id in run_ids:
        await wait_for_marker(tmp_path, f"{run_id}.0.*")
    await anyio.to_thread.run_sync(server.restart)
    for worker in (a, b, c):
        await worker.wait_for_log("liveness re-established", within=60)
    await anyio.sleep(2.5)  # every reaper has looked at least twice since
    pool = await create_pool(settings, application_name="test-liveness")
    store = RunStore(pool)
    try:
        timelines = {run_id: await store.events(run_id) for run_id in run_ids}
        gone = [
            e
            for events in timelines.values()
            for e in events
            if e.kind in ("owner_session_gone", "lease_lost")
        ]
        assert gone == [], gone  # no live worker was judged dead
        registered = await pool.fetch("SELECT worker_id FROM workers ORDER BY 1")
        assert [r["worker_id"] for r in registered] == ["A", "B", "C"]
        held_by_a = [run_id for run_id in run_ids if (await store.get(run_id)).lease_owner == "A"]
        assert held_by_a, "A holds runs"
        a.kill()
        killed_at = await store.database_now()
        for run_id in held_by_a:
            claims = await wait_for(
                functools.partial(store.events, run_id),
                lambda events: [e.worker_id for e in events if e.kind == "claimed"][-1:] != ["A"],
                within=60,
            )
            takeover = [e for e in claims if e.kind == "claimed"][-1]
            assert takeover.worker_id in ("B", "C")
            # Far sooner than A's 10 s lease (2 s when quiet; a loaded machine is slower).
            assert (takeover.at - killed_at).total_seconds() < 5.0, takeover
            assert "owner_session_gone" in [e.kind for e in claims]
    finally:
        await pool.close()


async def test_a_worker_started_while_postgres_is_down_comes_up_with_it(
    own_server: EmbeddedPostgres,
) -> None:
    """A pod that starts during a database restart or failover: `serve` keeps trying (each try
    logged) for --start-retry-seconds, then serves; `effects dispatch` does the same."""
    settings = await started_and_migrated(own_server)
    run_ids = await submit_sleepy(settings, count=3, seconds=0.1)
    await anyio.to_thread.run_sync(lambda: own_server.stop(mode="fast"))
    dsn = str(settings.database_url)
    with ServeProcess(
        dsn, *FAST, "--agents", "orchestrator.agents.sleepy", "--start-retry-seconds", "60"
    ) as worker:
        await worker.wait_for_log("database unavailable at start; retrying", within=60)
        await anyio.to_thread.run_sync(own_server.ensure_running)
        runs = await wait_all_terminal(settings, run_ids, within=60)
        assert worker.process.poll() is None
    assert {run.state for run in runs} == {RunState.SUCCEEDED}
