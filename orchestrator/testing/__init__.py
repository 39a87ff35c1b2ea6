"""Test support for orchestrator and for agent authors' own tests: real PostgreSQL, fast.

- ``DatabaseFactory``: a freshly migrated database per test;
- ``running_worker`` / ``run_agent``: run a worker (or one input through an agent) in a test;
- ``FaultProxy``: a loopback TCP proxy that partitions a worker from PostgreSQL on demand;
- ``ReplicatedPostgres``: a primary and a streaming standby (asynchronous or synchronous) from
  the embedded binaries, with ``failover()`` (the primary killed, the standby promoted, a new
  standby seeded) and a multi-host ``dsn()`` that follows the primary;
- ``LocalModelServer``: an OpenAI-compatible model server on loopback;
- ``ScriptedModelServer`` (with ``turns``, ``ScriptedTurn``, ``ScriptedCall`` and the faults
  ``RateLimited``, ``ServerError``, ``Slow``, ``Garbled``): an OpenAI-compatible server
  answering tool calls from a script (docs/scripted-model.md);
- ``LocalVendor``: an HTTP vendor that honours idempotency keys and can misbehave on demand;
- ``SmtpSink``: a real SMTP server on loopback;
- ``capture_spans``: an in-memory span exporter.

The loopback servers live in ``orchestrator.testing.loopback`` (the demo uses them too).

``DatabaseFactory`` migrates a template database once per test session and gives each test a
fresh copy through ``CREATE DATABASE ... TEMPLATE`` (a file copy: tens of milliseconds), so
tests are isolated without paying for migrations each time. With no server given it starts an
embedded PostgreSQL in a temporary directory, tuned for tests (no fsync).
"""

from __future__ import annotations

import itertools
import os
import shutil
import tempfile
from collections.abc import AsyncIterator, Iterable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import anyio
import anyio.abc
import anyio.streams.buffered
import asyncpg

from orchestrator.agent.steps import Agent, AgentRegistry
from orchestrator.db.connections import connect, create_pool
from orchestrator.db.embedded import EmbeddedPostgres
from orchestrator.db.migrations import migrate
from orchestrator.db.store import RunStore
from orchestrator.models import JSON, TERMINAL_STATES, Run, RunEvent, RunState
from orchestrator.settings import Settings
from orchestrator.testing.loopback import (
    FaultProxy,
    Garbled,
    LocalModelServer,
    LocalVendor,
    LoopbackHttpServer,
    LoopbackService,
    RateLimited,
    ScriptedCall,
    ScriptedModelServer,
    ScriptedTurn,
    ScriptRequest,
    ServerError,
    Slow,
    SmtpSink,
    turns,
)
from orchestrator.testing.replicated import Failover, ReplicatedPostgres, ReplicationError
from orchestrator.worker.worker import Worker, WorkerConfig

__all__ = [
    "TEST_SERVER_SETTINGS",
    "DatabaseFactory",
    "Failover",
    "FaultProxy",
    "Garbled",
    "LocalModelServer",
    "LocalVendor",
    "LoopbackHttpServer",
    "LoopbackService",
    "RateLimited",
    "ReplicatedPostgres",
    "ReplicationError",
    "ScriptRequest",
    "ScriptedCall",
    "ScriptedModelServer",
    "ScriptedTurn",
    "ServerError",
    "Slow",
    "SmtpSink",
    "capture_metrics",
    "capture_spans",
    "run_agent",
    "running_worker",
    "turns",
    "wait_for_run",
    "with_database",
]

TEST_SERVER_SETTINGS = {
    # Durability is not under test and fsync dominates small transactions on CI disks.
    "fsync": "off",
    "synchronous_commit": "off",
    "full_page_writes": "off",
}


def with_database(dsn: str, database: str) -> str:
    parts = urlsplit(dsn)
    return urlunsplit(parts._replace(path="/" + database))


class DatabaseFactory:
    """Hands out freshly migrated databases on one server."""

    def __init__(self, server_dsn: str | None = None) -> None:
        self._home: Path | None = None
        self.embedded: EmbeddedPostgres | None = None
        if server_dsn is None:
            self._home = Path(tempfile.mkdtemp(prefix="orchestrator-test-"))
            self.embedded = EmbeddedPostgres(self._home, server_settings=TEST_SERVER_SETTINGS)
            server_dsn = self.embedded.ensure_running().dsn()
        self.server_dsn = server_dsn
        self.template = f"orchestrator_template_{os.getpid()}"
        self._counter = itertools.count(1)
        self._ready = False

    @property
    def settings(self) -> Settings:
        return Settings(database_url=self.server_dsn)

    async def _admin(self) -> asyncpg.Connection:
        return await connect(self.settings, application_name="orchestrator-tests")

    async def prepare(self) -> None:
        if self._ready:
            return
        admin = await self._admin()
        try:
            await admin.execute(f'DROP DATABASE IF EXISTS "{self.template}" WITH (FORCE)')
            await admin.execute(f'CREATE DATABASE "{self.template}"')
        finally:
            await admin.close()
        migrator = await connect(self.settings, dsn=with_database(self.server_dsn, self.template))
        try:
            await migrate(migrator)
        finally:
            await migrator.close()
        self._ready = True

    async def create(self) -> str:
        """A new, migrated, empty database; returns its DSN."""
        await self.prepare()
        name = f"orchestrator_test_{os.getpid()}_{next(self._counter)}"
        admin = await self._admin()
        try:
            await admin.execute(f'CREATE DATABASE "{name}" TEMPLATE "{self.template}"')
        finally:
            await admin.close()
        return with_database(self.server_dsn, name)

    async def drop(self, dsn: str) -> None:
        name = urlsplit(dsn).path.lstrip("/")
        admin = await self._admin()
        try:
            await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        finally:
            await admin.close()

    def close(self) -> None:
        """Stop the embedded server (if this factory started one) and delete its files."""
        if self.embedded is not None:
            self.embedded.stop(mode="immediate")
        if self._home is not None:
            shutil.rmtree(self._home, ignore_errors=True)


# -- running a worker inside a test ------------------------------------------------------------
@asynccontextmanager
async def running_worker(
    settings: Settings,
    agents: Sequence[Agent] | AgentRegistry,
    **options: Any,
) -> AsyncIterator[Worker]:
    """Run a worker for the body of an ``async with``, then drain it.

    Start it inside the test body, not across an async fixture's ``yield``: a task group (and
    its cancel scope) must begin and end in the same task.
    """
    registry = agents if isinstance(agents, AgentRegistry) else AgentRegistry(agents)
    options.setdefault("status_seconds", 3600.0)
    worker = Worker(settings, WorkerConfig(agents=registry, **options))
    async with anyio.create_task_group() as group:
        group.start_soon(worker.run)
        with anyio.fail_after(30):
            await worker.ready.wait()
        try:
            yield worker
        finally:
            worker.request_stop()


async def wait_for_run(
    store: RunStore,
    run_id: str,
    *,
    states: Iterable[RunState] = TERMINAL_STATES,
    within: float = 30,
) -> Run:
    """Poll until the run reaches one of ``states`` (terminal by default)."""
    wanted = set(states)
    with anyio.fail_after(within):
        while True:
            run = await store.get(run_id)
            if run.state in wanted:
                return run
            await anyio.sleep(0.05)


async def run_agent(
    settings: Settings, agent: Agent, input: JSON, *, within: float = 60, **options: Any
) -> tuple[Run, list[RunEvent]]:
    """The step harness for agent authors: run one input through ``agent`` on a real database
    and return the finished run and its timeline."""
    pool = await create_pool(settings, application_name="orchestrator-harness")
    try:
        store = RunStore(pool)
        async with running_worker(settings, [agent], **options):
            run_id = (await store.submit(agent.name, input)).run.run_id
            run = await wait_for_run(store, run_id, within=within)
        return run, await store.events(run_id)
    finally:
        await pool.close()


# -- capturing spans -------------------------------------------------------------------------
_SPAN_EXPORTER: Any = None


def capture_spans() -> Any:
    """An in-memory span exporter installed once as the global tracer provider's sink.

    OpenTelemetry allows one global provider per process: the first call installs an SDK
    provider with this exporter (unless the host already has one, which is then left alone and
    ``None`` is returned). Call ``exporter.clear()`` between tests.
    """
    global _SPAN_EXPORTER
    if _SPAN_EXPORTER is not None:
        return _SPAN_EXPORTER
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    if not isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider):
        return None
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    _SPAN_EXPORTER = exporter
    return exporter


_METRIC_READER: Any = None


def capture_metrics() -> Any:
    """An in-memory metric reader on a global SDK meter provider, installed once per process
    (as ``capture_spans``): ``reader.get_metrics_data()`` holds every instrument's points.
    ``None`` when the host already installed a meter provider."""
    global _METRIC_READER
    if _METRIC_READER is not None:
        return _METRIC_READER
    from opentelemetry import metrics
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    metrics.set_meter_provider(provider)
    if metrics.get_meter_provider() is not provider:
        provider.shutdown()
        return None
    _METRIC_READER = reader
    return reader
