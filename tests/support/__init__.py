"""Helpers the tests share: the command line and `orchestrator serve` as real OS processes,
vendors configs, a server of a test's own brought to the latest schema, runs submitted and run
to their end, and the fencing rules every timeline must obey."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import anyio
import asyncpg

from orchestrator.agent.steps import Agent
from orchestrator.db.connections import connect, create_pool
from orchestrator.db.embedded import EmbeddedPostgres
from orchestrator.db.migrations import available_migrations, migrate
from orchestrator.db.store import RunStore
from orchestrator.models import JSON, Run, RunEvent
from orchestrator.settings import Settings
from orchestrator.testing import LocalVendor, running_worker, wait_for_run

TESTS_DIR = Path(__file__).parent.parent


def serving(agents_module: str) -> list[str]:
    """`serve` options for the agents of ``agents_module``: quick polling (wake-ups come by
    NOTIFY anyway) and quiet status lines."""
    return ["--agents", agents_module, "--poll-seconds", "0.2", "--status-seconds", "60"]


def cli_environment(
    database_url: str | None, env: Mapping[str, str] | None = None, *, columns: int | None = 200
) -> dict[str, str]:
    """The environment of a command run against ``database_url`` (None: the embedded server of
    ORCHESTRATOR_HOME); ``columns`` None leaves the width to the command, as in a pipe."""
    base = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    base.pop("ORCHESTRATOR_DATABASE_URL", None)
    if database_url is not None:
        base["ORCHESTRATOR_DATABASE_URL"] = database_url
    if columns is not None:
        base["COLUMNS"] = str(columns)
    return {**base, **(env or {})}


def cli(
    database_url: str | None,
    *args: str,
    stdin: str | None = None,
    env: Mapping[str, str] | None = None,
    columns: int | None = 200,
    timeout: float = 120,
) -> subprocess.CompletedProcess[str]:
    """Run the command line as a user does (a real process); wide by default so tables do not
    wrap."""
    return subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", *args],
        input=stdin,
        capture_output=True,
        text=True,
        env=cli_environment(database_url, env, columns=columns),
        timeout=timeout,
        check=False,
    )


def cli_bytes(
    database_url: str | None,
    *args: str | bytes,
    stdin: bytes | None = None,
    env: Mapping[str, str] | None = None,
) -> subprocess.CompletedProcess[bytes]:
    """``cli`` for input that is not text (invalid UTF-8), at the command's own width."""
    return subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", *args],
        input=stdin,
        capture_output=True,
        env=cli_environment(database_url, env, columns=None),
        timeout=60,
        check=False,
    )


def serve_args(
    agents: Sequence[str], effects_config: str, *, lease_seconds: str, heartbeat_seconds: str
) -> list[str]:
    """`serve` options: ``agents`` (its --agents and polling), effects sent as configured, a
    lease and heartbeat of the test's choosing."""
    return [
        *agents,
        "--effects-config",
        effects_config,
        "--lease-seconds",
        lease_seconds,
        "--heartbeat-seconds",
        heartbeat_seconds,
    ]


def crm_kind(vendor: LocalVendor, **options: JSON) -> dict[str, JSON]:
    """A vendors-config kind that sends to ``vendor`` and asks it what it has when unsure."""
    return {
        "adapter": "http",
        "url": vendor.send_url,
        "reconcile": "lookup",
        "lookup_url": vendor.lookup_url,
        **options,
    }


def write_vendors_config(directory: Path, kinds: Mapping[str, JSON]) -> str:
    """Write a vendors config (``--effects-config``) into ``directory``; return its path."""
    path = directory / "vendors.json"
    path.write_text(json.dumps({"kinds": dict(kinds)}))
    return str(path)


async def install_an_earlier_release(connection: asyncpg.Connection, *, migrations: int) -> None:
    """Build what a release that shipped the first ``migrations`` migrations built, in the
    connection's schema, recording them as that release did."""
    await connection.execute(
        "CREATE TABLE orchestrator_schema_migrations (version integer PRIMARY KEY, "
        "name text NOT NULL, applied_at timestamptz NOT NULL DEFAULT clock_timestamp())"
    )
    for migration in available_migrations()[:migrations]:
        await connection.execute(migration.sql)
        await connection.execute(
            "INSERT INTO orchestrator_schema_migrations (version, name) VALUES ($1, $2)",
            migration.version,
            migration.name,
        )


async def run_to_the_end(
    settings: Settings,
    store: RunStore,
    agent: Agent,
    input: JSON,
    *,
    max_attempts: int = 5,
    **worker_options: Any,
) -> Run:
    """Serve ``agent`` in-process until a run of ``input`` has ended; return that run."""
    async with running_worker(settings, [agent], **worker_options):
        submitted = await store.submit(agent.name, input, max_attempts=max_attempts)
        return await wait_for_run(store, submitted.run.run_id, within=60)


async def migrate_database(settings: Settings) -> None:
    connection = await connect(settings)
    try:
        await migrate(connection)
    finally:
        await connection.close()


async def started_and_migrated(server: EmbeddedPostgres) -> Settings:
    """Start ``server``, bring its database to the latest schema, return settings that reach
    it."""
    settings = Settings(database_url=server.ensure_running().dsn())
    await migrate_database(settings)
    return settings


async def submit_all(settings: Settings, agent: str, inputs: Iterable[JSON]) -> list[str]:
    """Submit one run per input through a pool of its own (the caller may restart the server
    afterwards); return their ids."""
    pool = await create_pool(settings, application_name="test-submit")
    try:
        store = RunStore(pool)
        return [(await store.submit(agent, input)).run.run_id for input in inputs]
    finally:
        await pool.close()


class ServeProcess:
    """`orchestrator serve` (or another long-running command) in its own process; its JSON log
    lines are collected as they come."""

    def __init__(
        self,
        database_url: str | None,
        *args: str,
        name: str = "worker",
        env: dict[str, str] | None = None,
        command: Sequence[str] = ("serve",),
        python: str = sys.executable,
        cwd: Path | None = None,
    ) -> None:
        """``database_url`` None: the embedded server of ``env``'s ORCHESTRATOR_HOME.
        ``command``: the command line's words before the options (``serve``, given
        ``--worker-id name``; or ``effects dispatch``, whose id is one of ``args``).
        ``python``: the interpreter, e.g. one of an earlier release's virtualenv, run in
        ``cwd`` (``-m`` puts the working directory first on the import path)."""
        env = {
            **os.environ,
            **(env or {}),
            "PYTHONPATH": os.pathsep.join([str(TESTS_DIR), os.environ.get("PYTHONPATH", "")]),
        }
        if database_url is None:
            env.pop("ORCHESTRATOR_DATABASE_URL", None)
        else:
            env["ORCHESTRATOR_DATABASE_URL"] = database_url
        self.name = name
        self.lines: list[dict[str, Any]] = []
        self.raw: list[str] = []
        self.process = subprocess.Popen(
            [
                python,
                "-m",
                "orchestrator.cli",
                *command,
                "--log-json",
                *(["--worker-id", name] if tuple(command) == ("serve",) else []),
                *args,
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=cwd,
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            self.raw.append(line)
            try:
                self.lines.append(json.loads(line))
            except json.JSONDecodeError:
                continue

    def events(self, name: str) -> list[dict[str, Any]]:
        return [line for line in list(self.lines) if line.get("event") == name]

    async def wait_for_log(
        self, name: str, within: float = 30, where: Callable[[dict[str, Any]], bool] | None = None
    ) -> dict[str, Any]:
        """Wait (without blocking the event loop) for a log line with event ``name``."""
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            for line in self.events(name):
                if where is None or where(line):
                    return line
            if self.process.poll() is not None and not self._reader.is_alive():
                break
            await anyio.sleep(0.02)
        raise AssertionError(f"{self.name} never logged {name!r}; last lines:\n{self.tail()}")

    async def wait_for_text(self, text: str, within: float = 30) -> None:
        """Wait for a line of stderr that contains ``text`` (a line that is not a log line,
        e.g. "listening on")."""
        deadline = time.monotonic() + within
        while not any(text in line for line in list(self.raw)):
            if time.monotonic() > deadline or self.process.poll() is not None:
                raise AssertionError(
                    f"{self.name} never wrote {text!r}; last lines:\n{self.tail()}"
                )
            await anyio.sleep(0.05)

    def tail(self, count: int = 30) -> str:
        return "".join(self.raw[-count:])

    def signal(self, signum: int) -> None:
        self.process.send_signal(signum)

    def stop(self, timeout: float = 20) -> int:
        """SIGTERM, wait; SIGKILL if it does not exit in time."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGCONT)
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait(5)

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)

    def __enter__(self) -> ServeProcess:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.kill()
        self._reader.join(5)
        if self.process.stderr is not None:
            self.process.stderr.close()


COMMITS = ("checkpoint", "succeeded", "failed", "effect_accepted", "approval_requested")
"""Timeline events that only the run's current fence may write."""


def fenced_claims(events: Sequence[RunEvent]) -> list[RunEvent]:
    """Check one run's timeline against the fencing rules, whatever the scheduling was, and
    return its claims: every claim raises the fence by one (a cancel raises it too), and every
    commit carries the fence of the latest claim, never a stale one. How many claims there were
    depends on the machine (a slow heartbeat can lose a lease), so callers derive from the
    returned claims what they expect instead of assuming a number."""
    fence = 0
    claims = []
    for event in events:
        if event.kind == "claimed":
            assert event.fence == fence + 1, f"claim did not raise fence {fence}: {events}"
            claims.append(event)
        elif event.kind in COMMITS:
            assert event.fence == fence, f"{event.kind} by stale fence {event.fence}: {events}"
        if event.kind in ("claimed", "cancelled"):
            fence = event.fence or fence
    return claims


async def failed_attempts(store: RunStore, run_id: str) -> int:
    """How many of the run's attempts failed (its timeline's retries and dead-lettering): the
    run's ``attempt`` column cannot say, as every commit sets it back to 1."""
    kinds = [event.kind for event in await store.events(run_id)]
    return kinds.count("retry_scheduled") + kinds.count("dead_lettered")


def handed_from_a_to_b(events: list[RunEvent]) -> tuple[list[int | None], RunEvent]:
    """The fences A claimed and B's first claim, after checking the fencing rules and that the
    run went from A to B once. A short lease on a loaded machine may be lost and claimed again
    by the same worker, so the number of claims is not fixed."""
    claims = fenced_claims(events)
    owners = [c.worker_id or "" for c in claims]
    assert owners[0] == "A" and owners[-1] == "B" and owners == sorted(owners), events
    return [c.fence for c in claims if c.worker_id == "A"], claims[owners.index("B")]
