"""``--metrics-listen HOST:PORT``: Prometheus text on ``/metrics`` (the OpenTelemetry Prometheus
exporter, reading orchestrator's meter provider) and readiness on ``/ready``, served from a daemon
thread so that a scrape never waits for the event loop and a busy loop never stalls a scrape.

The HTTP glue is ``wsgiref`` plus ``prometheus_client``'s WSGI app: the readiness route and the
loop hand-off are all it adds, which no library offers for an asyncio process.
"""

from __future__ import annotations

import asyncio
import json
import socketserver
import threading
from collections.abc import Awaitable, Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import anyio
import asyncpg
from prometheus_client import REGISTRY, make_wsgi_app

from orchestrator.db.deadlines import DATABASE_ERRORS
from orchestrator.db.limits import LimitStore
from orchestrator.db.outages import DatabaseOutage
from orchestrator.db.rates import RateLimitStore
from orchestrator.db.run_reads import RunReads
from orchestrator.db.standby_wait import StandbyGate
from orchestrator.db.sync_standby import SyncStandbyRequirement
from orchestrator.db.workers import AgentVersion, WorkerRegistry
from orchestrator.effects.store import EffectStore
from orchestrator.errors import InvalidInput
from orchestrator.telemetry import QueueGauges, install_sdk_from_env, shutdown_sdk

READINESS_TIMEOUT_SECONDS = 5.0


class Probe(NamedTuple):
    ready: bool
    reason: str


def parse_listen(raw: str, option: str = "--metrics-listen") -> tuple[str, int]:
    host, _, port = raw.rpartition(":")
    host = host.strip("[]")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise InvalidInput(f"{option} takes HOST:PORT, such as 127.0.0.1:9464, not {raw!r}")
    return host, int(port)


class _ThreadingServer(socketserver.ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # scrapes are not news
        return


class MetricsEndpoint:
    """Serve ``/metrics`` and ``/ready`` until ``close()``. ``probe`` is a coroutine function run
    on ``loop`` for each readiness request."""

    def __init__(
        self,
        listen: str,
        probe: Callable[[], Awaitable[Probe]],
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        self.host, self.port = parse_listen(listen)
        self._probe = probe
        self._loop = loop
        self._metrics = make_wsgi_app(REGISTRY)
        self._scrape_lock = threading.Lock()
        try:
            self._server = make_server(
                self.host, self.port, self._app, _ThreadingServer, handler_class=_QuietHandler
            )
        except OSError as error:
            raise InvalidInput(
                f"cannot listen on {listen} for metrics: {error.strerror or error}"
            ) from None
        self.port = int(self._server.server_address[1])
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="metrics-endpoint", daemon=True
        )
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _app(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if path == "/ready":
            probe = self._ready()
            body = json.dumps({"ready": probe.ready, "reason": probe.reason}).encode()
            start_response(
                "200 OK" if probe.ready else "503 Service Unavailable",
                [("Content-Type", "application/json"), ("Content-Length", str(len(body)))],
            )
            return [body]
        if path == "/metrics":
            with self._scrape_lock:  # the exporter's collector is not safe for two at once
                result: Iterable[bytes] = list(self._metrics(environ, start_response))
            return result
        start_response("404 Not Found", [("Content-Type", "text/plain")])
        return [b"/metrics or /ready\n"]

    def _ready(self) -> Probe:
        try:
            future = asyncio.run_coroutine_threadsafe(self._call_probe(), self._loop)
            return future.result(READINESS_TIMEOUT_SECONDS)
        except Exception as error:  # a stopped loop, a timeout: not ready, and why
            return Probe(False, f"no answer from the worker: {str(error) or type(error).__name__}")

    async def _call_probe(self) -> Probe:
        return await self._probe()


async def sample_gauges(
    pool: asyncpg.Pool,
    gauges: QueueGauges,
    outage: DatabaseOutage,
    *,
    limits: bool = True,
    versions: WorkerRegistry | None = None,
) -> None:
    """Refresh the queue and effect gauges (and with ``limits``, the limit gauges: a worker's
    role reads limits, a dispatcher's does not; with ``versions``, the stranded runs per agent)
    from the database, now and then every ``QueueGauges.SAMPLE_SECONDS``; a failure is the
    process's ``outage`` to tell."""
    while True:
        try:
            with anyio.fail_after(QueueGauges.SAMPLE_SECONDS):
                gauges.queue = await RunReads(pool).queue_stats()
                counts = await EffectStore(pool).needing_people()
                if counts:
                    gauges.effects = counts
                if limits:
                    gauges.limits, gauges.rates = await _limit_rows(pool)
                if versions is not None:
                    gauges.stranded = stranded_runs(await versions.agent_versions(pool))
        except DATABASE_ERRORS as error:
            # No series rather than stale ones.
            gauges.queue, gauges.effects, gauges.limits, gauges.rates = [], {}, [], []
            gauges.stranded = []
            outage.failed(error, otherwise="cannot sample the queue gauges")
        await anyio.sleep(QueueGauges.SAMPLE_SECONDS)


def stranded_runs(versions: list[AgentVersion]) -> list[dict[str, Any]]:
    """Per agent, its unfinished runs that no live worker may claim (docs/upgrades.md)."""
    per_agent: dict[str, int] = {}
    for version in versions:
        per_agent.setdefault(version.agent, 0)
        if version.stranded:
            per_agent[version.agent] += version.unfinished_runs
    return [{"agent": agent, "runs": runs} for agent, runs in sorted(per_agent.items())]


async def _limit_rows(pool: asyncpg.Pool) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The limit and rate-limit gauges' rows: per agent and limit name, never per key."""
    limits = [
        {
            "agent": limit.agent,
            "limit": limit.name,
            "running": limit.running,
            "backlog": limit.backlog,
            "max_running": limit.max_running,
        }
        for limit in await LimitStore(pool).list()
    ]
    rates = [
        {"limit": rate.name, "paused": int(rate.paused_until is not None), "waiting": rate.waiting}
        for rate in await RateLimitStore(pool).list()
    ]
    return limits, rates


def pool_probe(
    pool: asyncpg.Pool,
    sync_standby: SyncStandbyRequirement | None = None,
    standby: StandbyGate | None = None,
) -> Callable[[], Awaitable[Probe]]:
    """Readiness of a process whose only dependency is the database (dispatcher, proxy), and,
    with ``--require-sync-standby``, the primary's synchronous standby; a dispatcher holding
    its effects for want of a standby (``--without-standby hold``) is not ready either."""

    async def probe() -> Probe:
        try:
            with anyio.fail_after(2.0):
                await pool.fetchval("SELECT 1")
                problem = None if sync_standby is None else await sync_standby.check(pool)
        except DATABASE_ERRORS as error:
            return Probe(False, f"database unreachable: {str(error) or type(error).__name__}")
        if problem is not None:
            return Probe(False, f"--require-sync-standby: {problem}")
        if standby is not None and (held := standby.holding):
            return Probe(False, held)
        return Probe(True, "ready")

    return probe


@contextmanager
def serving_metrics(
    listen: str | None,
    pool: asyncpg.Pool,
    *,
    gauges: bool = True,
    sync_standby: SyncStandbyRequirement | None = None,
    standby: StandbyGate | None = None,
) -> Iterator[QueueGauges | None]:
    """With ``listen``: the Prometheus reader installed, the endpoint serving (readiness: the
    database answers), and, with ``gauges``, the queue gauges to sample; torn down after."""
    if listen is None:
        yield None
        return
    install_sdk_from_env(prometheus=True)
    sampled = QueueGauges() if gauges else None
    endpoint = MetricsEndpoint(
        listen, pool_probe(pool, sync_standby, standby), asyncio.get_running_loop()
    )
    try:
        yield sampled
    finally:
        endpoint.close()
        shutdown_sdk()
