"""Shared pieces of the benchmarks that need a PostgreSQL server and child processes.

Used by every benchmark but ``history.py`` (not a benchmark itself; their entry point is
``bench_main.py``, what they print ``bench_report.py``):

* ``postgres_server``: an embedded PostgreSQL in a temporary directory with the project's
  default (durable) settings, stopped and deleted on exit, or an existing server (``--dsn``);
* ``create_database`` / ``drop_database``: scratch databases on that server;
* ``ServeProcess``: ``python -m orchestrator.cli serve --log-json`` in its own process, its JSON
  log lines collected by a reader thread (optionally under another virtualenv's interpreter,
  for an older release); every process started here is killed by ``kill_children`` (the
  benchmarks call it in a ``finally``);
* ``CpuMeter``: CPU seconds of one process, of the PostgreSQL server's processes and of the
  whole machine, so that each figure can be read against the load that other programs put on
  this (shared, two-core) machine at the same time.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import asyncpg
import psutil  # type: ignore[import-untyped]  # psutil ships no type information

from bench_report import log
from orchestrator.db.connections import connect
from orchestrator.db.embedded import EmbeddedPostgres
from orchestrator.settings import Settings
from orchestrator.testing import with_database

DURABILITY_SHOWN = ("server_version", "fsync", "synchronous_commit", "full_page_writes")
"""What every report says of its server: the version, and whether commits are durable."""
SERVER_SETTINGS_SHOWN = (*DURABILITY_SHOWN, "shared_buffers", "max_connections")


# -- the PostgreSQL server -------------------------------------------------------------------------


@dataclass(frozen=True)
class Server:
    dsn: str
    """DSN of the server's maintenance database (``postgres``)."""
    postmaster_pid: int | None
    """Known for the embedded server only: its processes' CPU is measured through it."""
    embedded: bool


@contextlib.contextmanager
def postgres_server(
    dsn: str | None, *, prefix: str, server_settings: Mapping[str, str] | None = None
) -> Iterator[Server]:
    """The server to benchmark on: ``dsn``, or an embedded one (started with
    ``server_settings`` beside the defaults) that is removed afterwards."""
    if dsn:
        yield Server(dsn=dsn, postmaster_pid=None, embedded=False)
        return
    home = Path(tempfile.mkdtemp(prefix=prefix))
    embedded = EmbeddedPostgres(home, server_settings=server_settings)
    try:
        log(f"starting embedded PostgreSQL in {home} (default settings: durable commits)")
        running = embedded.ensure_running()
        yield Server(dsn=running.dsn("postgres"), postmaster_pid=running.pid, embedded=True)
    except BaseException:
        if embedded.running() is None:
            tail = embedded.log_file.read_text(errors="replace").splitlines()[-15:]
            log("the embedded server is not running; the end of its log:\n" + "\n".join(tail))
        raise
    finally:
        log("stopping embedded PostgreSQL")
        try:
            embedded.stop(mode="immediate")
        except Exception as error:  # cleanup must go on to remove the directory
            log(f"WARNING: stopping the embedded server failed: {error}")
        shutil.rmtree(home, ignore_errors=True)


def settings_for(dsn: str) -> Settings:
    return Settings(database_url=dsn)


async def create_database(server_dsn: str, name: str, *, template: str | None = None) -> str:
    """Create database ``name`` (from ``template`` if given) and return its DSN."""
    admin = await connect(settings_for(server_dsn), application_name="bench-admin")
    try:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        suffix = f' TEMPLATE "{template}"' if template else ""
        await admin.execute(f'CREATE DATABASE "{name}"{suffix}')
    finally:
        await admin.close()
    return with_database(server_dsn, name)


async def drop_database(server_dsn: str, name: str) -> None:
    """Drop a scratch database; a failure is logged, not raised (it runs in ``finally``
    blocks, where raising would hide the error that got there)."""
    try:
        admin = await connect(settings_for(server_dsn), application_name="bench-admin")
        try:
            await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        finally:
            await admin.close()
    except Exception as error:
        log(f"WARNING: could not drop database {name}: {error}")


def queue_runs_sql(run_id_prefix: str, agent: str, run_input: str) -> str:
    """One statement that queues ``$1`` runs of ``agent`` with their ``submitted`` events, as
    ``submit`` would (many times faster); ``run_input`` is the SQL of each run's input."""
    return f"""
WITH inserted AS (
    INSERT INTO runs (run_id, agent, input)
    SELECT '{run_id_prefix}' || lpad(g::text, 7, '0'), '{agent}', {run_input}
    FROM generate_series(1, $1) AS g
    RETURNING run_id, agent, fence, max_attempts, idempotency_key
)
INSERT INTO run_events (run_id, kind, fence, details)
SELECT run_id, 'submitted', fence,
       jsonb_build_object('agent', agent, 'max_attempts', max_attempts,
                          'idempotency_key', idempotency_key)
FROM inserted
"""


async def server_facts(
    connection: asyncpg.Connection, shown: Sequence[str] = SERVER_SETTINGS_SHOWN
) -> dict[str, str]:
    """The server settings ``shown``, as ``SHOW`` reports them."""
    return {name: str(await connection.fetchval(f"SHOW {name}")) for name in shown}


# -- processes -------------------------------------------------------------------------------------

_children: list[subprocess.Popen[str]] = []
_children_lock = threading.Lock()


def spawn(argv: Sequence[str], *, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    """Start a child whose stderr is piped (text) and remember it for ``kill_children``."""
    process = subprocess.Popen(
        list(argv),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    with _children_lock:
        _children.append(process)
    return process


def kill_children() -> int:
    """SIGKILL every child still running; return how many there were."""
    with _children_lock:
        alive = [process for process in _children if process.poll() is None]
        _children.clear()
    for process in alive:
        with contextlib.suppress(ProcessLookupError):
            process.kill()
    for process in alive:
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(10)
    return len(alive)


def child_env(database_url: str) -> dict[str, str]:
    """The children's environment: the database, the default schema (``ORCHESTRATOR_SCHEMA``
    unset, as on the benchmarks' own connections), and no OpenTelemetry SDK (API no-ops only)."""
    inherited = {key: value for key, value in os.environ.items() if key != "ORCHESTRATOR_SCHEMA"}
    return {
        **inherited,
        "ORCHESTRATOR_DATABASE_URL": database_url,
        "OTEL_TRACES_EXPORTER": "none",
        "OTEL_METRICS_EXPORTER": "none",
    }


class Child:
    """A child process whose stderr is read by a thread: JSON lines parsed, all lines kept."""

    def __init__(self, argv: Sequence[str], *, env: dict[str, str], name: str) -> None:
        self.name = name
        self.lines: list[dict[str, Any]] = []
        self.raw: list[str] = []
        self.process = spawn(argv, env=env)
        self.pid = self.process.pid
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        stream = self.process.stderr
        assert stream is not None
        for line in stream:
            self.raw.append(line)
            with contextlib.suppress(json.JSONDecodeError):
                parsed = json.loads(line)
                if isinstance(parsed, dict):
                    self.lines.append(parsed)

    def events(self, name: str) -> list[dict[str, Any]]:
        return [line for line in list(self.lines) if line.get("event") == name]

    def warnings(self) -> list[dict[str, Any]]:
        """JSON log lines at warning level or above."""
        return [
            line
            for line in list(self.lines)
            if line.get("level") in ("warning", "error", "critical", "exception")
        ]

    async def wait_for_event(self, name: str, *, within: float) -> dict[str, Any]:
        """Wait (polling, without blocking the event loop) for a log line with event ``name``."""
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            found = self.events(name)
            if found:
                return found[0]
            if self.process.poll() is not None:
                break
            await anyio.sleep(0.01)
        raise RuntimeError(
            f"{self.name} never logged {name!r} (exit code {self.process.poll()}); "
            f"last lines:\n{self.tail()}"
        )

    def tail(self, count: int = 15) -> str:
        return "".join(self.raw[-count:])

    def alive(self) -> bool:
        return self.process.poll() is None

    def kill(self) -> None:
        """SIGKILL (the process gets no chance to clean up) and reap it."""
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(10)
        self._reader.join(5)

    async def stop(self, *, within: float = 30) -> int | None:
        """SIGTERM (graceful drain) and wait; SIGKILL if it has not exited ``within`` seconds."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            await anyio.to_thread.run_sync(self.process.wait, within, abandon_on_cancel=True)
        except subprocess.TimeoutExpired:
            log(f"WARNING: {self.name} did not exit {within:.0f}s after SIGTERM; killing it")
            self.process.kill()
            self.process.wait(10)
        self._reader.join(5)
        return self.process.returncode


SERVE_COMMAND = ("-m", "orchestrator.cli", "serve", "--log-json")


class ServeProcess(Child):
    """``orchestrator serve --log-json --worker-id NAME ARGS...`` in its own process.

    ``python``: the interpreter and its options (default: this one, so the orchestrator this
    benchmark imports); another virtualenv's interpreter runs the orchestrator installed there,
    without this environment's ``PYTHONPATH``.
    """

    def __init__(
        self, database_url: str, *args: str, name: str, python: Sequence[str] = ()
    ) -> None:
        argv = [*(python or [sys.executable]), *SERVE_COMMAND, "--worker-id", name, *args]
        env = child_env(database_url)
        if python:
            env.pop("PYTHONPATH", None)
        super().__init__(argv, env=env, name=name)


# -- CPU accounting --------------------------------------------------------------------------------


@dataclass(frozen=True)
class CpuSample:
    at: float
    """``time.monotonic()`` when taken."""
    process: float | None
    """CPU seconds (user + system) of the measured process so far (its last reading once it
    has exited)."""
    postgres: float | None
    """CPU seconds of the postmaster and its children, each at its last reading."""
    machine_busy: float
    """CPU seconds all CPUs spent neither idle nor waiting for I/O."""
    this_process: float
    """CPU seconds of the benchmark process itself (the poller, the log reader)."""
    rss: int | None
    """Resident memory of the measured process, bytes (its last reading)."""


def _cpu_seconds(process: Any) -> float:
    times = process.cpu_times()
    return float(times.user + times.system)


class CpuMeter:
    """CPU use of one process, the PostgreSQL server and the whole machine between samples.

    An exited process can no longer be read, so each process counts with its last reading:
    sample often (every poll) so that a consumer that exits when its queue is empty, or a
    backend whose client disconnects, is read shortly before it goes.
    """

    def __init__(self, pid: int | None, postmaster_pid: int | None) -> None:
        self._process = psutil.Process(pid) if pid is not None else None
        self._postmaster = psutil.Process(postmaster_pid) if postmaster_pid is not None else None
        self._self = psutil.Process()
        self._process_cpu: float | None = None
        self._rss: int | None = None
        self._postgres_seen: dict[int, float] = {}

    def sample(self) -> CpuSample:
        if self._process is not None:
            with contextlib.suppress(psutil.Error), self._process.oneshot():
                self._process_cpu = _cpu_seconds(self._process)
                self._rss = int(self._process.memory_info().rss)
        machine = psutil.cpu_times()
        busy = float(sum(machine)) - float(machine.idle) - float(getattr(machine, "iowait", 0.0))
        return CpuSample(
            at=time.monotonic(),
            process=self._process_cpu,
            postgres=self._postgres_cpu(),
            machine_busy=busy,
            this_process=_cpu_seconds(self._self),
            rss=self._rss,
        )

    def _postgres_cpu(self) -> float | None:
        if self._postmaster is None:
            return None
        with contextlib.suppress(psutil.Error):
            for member in [self._postmaster, *self._postmaster.children()]:
                with contextlib.suppress(psutil.Error):
                    self._postgres_seen[member.pid] = _cpu_seconds(member)
        return sum(self._postgres_seen.values())


def cpu_shares(first: CpuSample, last: CpuSample) -> dict[str, float | None]:
    """Cores used on average between two samples: by the process, PostgreSQL, this benchmark,
    and everything else on the machine (other programs: the noise to read figures against)."""
    wall = last.at - first.at
    if wall <= 0:
        return {"seconds": 0.0, "process": None, "postgres": None, "other": None}

    def share(a: float | None, b: float | None) -> float | None:
        return None if a is None or b is None else (b - a) / wall

    process = share(first.process, last.process)
    postgres = share(first.postgres, last.postgres)
    this = share(first.this_process, last.this_process) or 0.0
    busy = (last.machine_busy - first.machine_busy) / wall
    other = busy - this - (process or 0.0) - (postgres or 0.0)
    return {
        "seconds": wall,
        "process": process,
        "postgres": postgres,
        "benchmark": this,
        "machine_busy": busy,
        "other": max(other, 0.0),
    }
