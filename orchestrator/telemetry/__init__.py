"""Traces, metrics and logs, with the ids an incident review needs on every record.

Library code uses only the OpenTelemetry API (no-ops until a provider is installed). Only the
``serve`` entry point installs SDK providers, from the standard ``OTEL_*`` variables, and never
replaces a provider the host application already set.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
from collections.abc import Callable, Iterable, Mapping, MutableMapping
from contextlib import AbstractContextManager, nullcontext
from functools import partial
from typing import Any

import structlog
from opentelemetry import metrics, trace
from opentelemetry.context import Context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from orchestrator.errors import InvalidInput

TRACER_NAME = "orchestrator"

# Attribute names carried by every span and log line about a run, in orchestrator's namespace
# (as OpenTelemetry asks of attributes outside its semantic conventions).
RUN_ID = "orchestrator.run.id"
RUN_FENCE = "orchestrator.run.fence"
WORKER_ID = "orchestrator.worker.id"
LEASE_UNTIL = "orchestrator.lease.until"
CHECKPOINT_VERSION = "orchestrator.checkpoint.version"
DISPOSITION = "orchestrator.run.disposition"
ATTEMPT = "orchestrator.attempt"
EFFECT_KEY = "orchestrator.effect.key"
IDEMPOTENCY_KEY = "orchestrator.effect.idempotency_key"
EXTERNAL_ID = "orchestrator.effect.external_id"
EFFECT_DISPOSITION = "orchestrator.effect.disposition"
LINK_KIND = "orchestrator.link"
DECISION = "orchestrator.decision"
"""On a decision's span (approve, cancel, sign_in, ...), with its principal and how it was known."""
PRINCIPAL = "orchestrator.principal"
PRINCIPAL_VIA = "orchestrator.principal.via"
AUDIT_SEQ = "orchestrator.audit.seq"
"""On a span link: ``submitted`` (the submitter's span) or ``earlier_attempt``."""


def tracer() -> trace.Tracer:
    """The orchestrator tracer. ``get_tracer`` returns a proxy that follows a provider installed
    later, so one instance serves the process (creating one per span is measurably slower).
    """
    global _TRACER
    if _TRACER is None:
        _TRACER = trace.get_tracer(TRACER_NAME)
    return _TRACER


_TRACER: trace.Tracer | None = None


def start_span(
    name: str,
    *,
    attributes: Mapping[str, Any] | Callable[[], Mapping[str, Any]] | None = None,
    context: Context | None = None,
) -> AbstractContextManager[trace.Span]:
    """``tracer().start_as_current_span``, or nothing at all while no provider is installed.

    With only the API present every span is a no-op, yet creating and entering one per run and
    per step is a visible share of a saturated worker's time; returning nothing is free. Checked on
    every call, so a provider installed later (``serve``, ``capture_spans``) takes effect.
    ``attributes`` may be a function, called only when there is a span to carry them;
    ``context`` parents the span elsewhere than the current span (see ``parent_from``).
    """
    if not tracing_enabled():
        return NO_SPAN
    if callable(attributes):
        attributes = attributes()  # built only when there is a span to carry them
    return tracer().start_as_current_span(name, context=context, attributes=attributes)


NO_SPAN: AbstractContextManager[trace.Span] = nullcontext(trace.INVALID_SPAN)
"""What ``start_span`` returns without a provider; reusable."""


def open_span(
    name: str,
    *,
    attributes: Callable[[], Mapping[str, Any]] | None = None,
    root: bool = False,
    start_time: int | None = None,
) -> trace.Span:
    """A span its owner ends itself (``span.end()``), possibly long after the code that opened
    it has returned; ``trace.INVALID_SPAN`` (every call a no-op) while no provider is installed.
    Enter ``as_current(span)`` around the work it covers so that child spans nest under it.
    ``root`` starts a new trace whatever span is current; ``start_time`` is in ns since the epoch.
    """
    if not tracing_enabled():
        return trace.INVALID_SPAN
    return tracer().start_span(
        name,
        context=Context() if root else None,
        attributes=attributes() if attributes else None,
        start_time=start_time,
    )


def as_current(span: trace.Span) -> AbstractContextManager[Any]:
    """``span`` as the current span, not ended on exit; an exception leaving the block is
    recorded on it and sets its status, as ``start_as_current_span`` does."""
    if span is trace.INVALID_SPAN:
        return NO_SPAN
    return trace.use_span(span, end_on_exit=False)


_PROPAGATOR = TraceContextTextMapPropagator()


def current_traceparent() -> str | None:
    """The W3C ``traceparent`` of the current span, or ``None`` outside a sampled, valid one."""
    if not tracing_enabled():
        return None
    return traceparent_of(trace.get_current_span())


def traceparent_of(span: trace.Span) -> str | None:
    """``span``'s W3C ``traceparent``, ``None`` if it is not a valid span."""
    if not span.get_span_context().is_valid:
        return None
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(span))
    return carrier.get("traceparent")


def span_context_from(traceparent: str) -> trace.SpanContext | None:
    """The span context a stored ``traceparent`` names; ``None`` if it is not a valid one."""
    context = _PROPAGATOR.extract({"traceparent": traceparent})
    span_context = trace.get_current_span(context).get_span_context()
    return span_context if span_context.is_valid else None


def parent_from(traceparent: str | None) -> Context | None:
    """A context whose current span is the stored ``traceparent`` (for a span started under it);
    ``None`` when there is none or it is not valid."""
    if traceparent is None or span_context_from(traceparent) is None:
        return None
    return _PROPAGATOR.extract({"traceparent": traceparent})


def trace_id_of(traceparent: str) -> str | None:
    """The trace id a stored ``traceparent`` names, as tracing UIs show it (32 hex digits)."""
    span_context = span_context_from(traceparent)
    return None if span_context is None else trace.format_trace_id(span_context.trace_id)


_UNKNOWN = object()
_ENVIRONMENT_CHECKED = False
_PROVIDER_GLOBAL = "_TRACER_PROVIDER"
"""The API's private global holding the installed tracer provider, ``None`` until one is set."""


def tracing_enabled() -> bool:
    """Whether a tracer provider is installed (spans are recorded).

    Hot paths use it to skip even formatting a span's name when nothing would record it.
    """
    global _ENVIRONMENT_CHECKED
    if not _ENVIRONMENT_CHECKED:
        # Once, so that the API loads a provider named by OTEL_PYTHON_TRACER_PROVIDER.
        _ENVIRONMENT_CHECKED = True
        trace.get_tracer_provider()
    # The private global is read because get_tracer_provider() looks an environment variable up
    # on every call until a provider is set, too slow for a check made per step; the public check
    # serves should a future API rename it (tests/test_telemetry.py pins both).
    installed = getattr(trace, _PROVIDER_GLOBAL, _UNKNOWN)
    if installed is _UNKNOWN:
        return not isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)
    return installed is not None


class Metrics:
    """Orchestrator's counters (docs/architecture.md, observability); created from whatever meter
    provider is installed."""

    def __init__(self, meter: metrics.Meter | None = None) -> None:
        meter = meter or metrics.get_meter(TRACER_NAME)
        self.claims = meter.create_counter("orchestrator.claims", description="runs claimed")
        self.lost_leases = meter.create_counter(
            "orchestrator.lease.lost", description="runs whose ownership was lost or unprovable"
        )
        self.renewal_failures = meter.create_counter(
            "orchestrator.lease.renewal_failures",
            description="renewal statements that failed or timed out",
        )
        self.steps = meter.create_counter("orchestrator.steps", description="step executions")
        self.step_seconds = meter.create_histogram(
            "orchestrator.step.duration", unit="s", description="step run time, commit included"
        )
        self.recovery_seconds = meter.create_histogram(
            "orchestrator.recovery.duration",
            unit="s",
            description="from a previous owner's lease end (or takeover) to the next claim",
        )
        self.runs_finished = meter.create_counter(
            "orchestrator.runs.finished", unit="{run}", description="runs ended, by disposition"
        )
        self.stale_rejections = meter.create_counter(
            "orchestrator.effects.stale_rejections",
            unit="{request}",
            description="effect requests refused at the boundary: a newer fence owns the run",
        )

    def start_at_zero(
        self, *, agents: Iterable[str], dispositions: Iterable[str], step_outcomes: Iterable[str]
    ) -> None:
        """Every series known up front at 0, so that ``increase()`` and ``rate()`` alerts have a
        series before the first event (Prometheus' advice: avoid missing metrics). Call once the
        meter provider is installed: an add before it is lost."""
        for counter in (self.lost_leases, self.renewal_failures, self.stale_rejections):
            counter.add(0)
        for agent in agents:
            self.claims.add(0, {"agent": agent})
        for disposition in dispositions:
            self.runs_finished.add(0, {DISPOSITION: disposition})
        for outcome in step_outcomes:
            self.steps.add(0, {"outcome": outcome})


class EffectMetrics:
    """The dispatcher's: what each dispatch left the record as (confirmed, failed, rejected,
    uncertain, parked, accepted to retry, lost_claim, unknown), how long a dispatch took, and
    how long its claim waited for a standby."""

    def __init__(self, meter: metrics.Meter | None = None) -> None:
        meter = meter or metrics.get_meter(TRACER_NAME)
        self.outcomes = meter.create_counter(
            "orchestrator.effects.outcomes",
            unit="{effect}",
            description="vendor calls' outcomes, by kind and outcome",
        )
        self.send_seconds = meter.create_histogram(
            "orchestrator.effects.send.duration", unit="s", description="vendor call time"
        )
        self.standby_wait = meter.create_histogram(
            "orchestrator.effects.standby_wait.duration",
            unit="s",
            description="from a claim's commit until a standby held it (--standby-wait)",
        )
        self.sent_without_standby = meter.create_counter(
            "orchestrator.effects.sent_without_standby",
            unit="{effect}",
            description="effects claimed to send while an expected standby was away "
            "(--without-standby send): a failover may repeat them",
        )

    def start_at_zero(self, kinds: Iterable[str]) -> None:
        """Each kind's outcomes at 0 (see ``Metrics.start_at_zero``)."""
        self.sent_without_standby.add(0)
        for kind in kinds:
            for outcome in DISPATCH_OUTCOMES:
                self.outcomes.add(0, {"kind": kind, "outcome": outcome})


DISPATCH_OUTCOMES = (
    "confirmed",
    "failed",
    "rejected",
    "uncertain",
    "parked",
    "accepted",
    "lost_claim",
    "unknown",
)
"""What a dispatch can leave an effect as (``EffectMetrics.outcomes``' ``outcome`` label)."""


class ModelMetrics:
    """The GenAI semantic conventions' client metrics: operation duration and token usage."""

    def __init__(self, meter: metrics.Meter | None = None) -> None:
        meter = meter or metrics.get_meter(TRACER_NAME)
        self.duration = meter.create_histogram(
            "gen_ai.client.operation.duration", unit="s", description="model call time"
        )
        self.tokens = meter.create_histogram(
            "gen_ai.client.token.usage", unit="{token}", description="tokens per model call"
        )

    def record(
        self,
        model: str,
        seconds: float,
        *,
        error: str | None,
        input_tokens: int | None,
        output_tokens: int | None,
    ) -> None:
        attributes: dict[str, str] = {
            "gen_ai.operation.name": "chat",
            "gen_ai.provider.name": "openai",
            "gen_ai.request.model": model,
        }
        if error is not None:
            attributes["error.type"] = error
        self.duration.record(seconds, attributes)
        if input_tokens is not None:
            self.tokens.record(input_tokens, {**attributes, "gen_ai.token.type": "input"})
        if output_tokens is not None:
            self.tokens.record(output_tokens, {**attributes, "gen_ai.token.type": "output"})


_MODEL_METRICS: list[ModelMetrics] = []


def model_metrics() -> ModelMetrics:
    """One set per process (the API's meters follow a provider installed later)."""
    if not _MODEL_METRICS:
        _MODEL_METRICS.append(ModelMetrics())
    return _MODEL_METRICS[0]


class FlowMetrics:
    """Flow control's counters (docs/flow-control.md): runs a claim passed over for a full
    limit, and waits for a rate limit's capacity, by limit name (never by key: unbounded)."""

    def __init__(self, meter: metrics.Meter | None = None) -> None:
        meter = meter or metrics.get_meter(TRACER_NAME)
        self.held_back = meter.create_counter(
            "orchestrator.claims.held_back",
            unit="{run}",
            description="due runs a claim passed over because a limit they are under was full",
        )
        self.rate_waits = meter.create_counter(
            "orchestrator.rate_limit.waits",
            unit="{wait}",
            description="calls and sends that waited for a rate limit's capacity, per limit",
        )
        self.rate_wait_seconds = meter.create_histogram(
            "orchestrator.rate_limit.wait_duration",
            unit="s",
            description="how long a call waited for a rate limit's capacity, per limit",
        )


_FLOW_METRICS: list[FlowMetrics] = []


def flow_metrics() -> FlowMetrics:
    """One set per process, as ``model_metrics``."""
    if not _FLOW_METRICS:
        _FLOW_METRICS.append(FlowMetrics())
    return _FLOW_METRICS[0]


class QueueGauges:
    """Gauges read from the database by a sampler every ``SAMPLE_SECONDS`` (a scrape cannot wait
    for a query): runs queued, due, running, waiting and the oldest due age per agent; effects
    parked for a person or awaiting approval."""

    SAMPLE_SECONDS = 10.0

    def __init__(self, meter: metrics.Meter | None = None) -> None:
        meter = meter or metrics.get_meter(TRACER_NAME)
        self.queue: list[dict[str, Any]] = []
        self.effects: dict[str, int] = {}
        self.limits: list[dict[str, Any]] = []
        """Each limit's agent, name, running, backlog and max_running (docs/flow-control.md)."""
        self.rates: list[dict[str, Any]] = []
        """Each rate limit's name, whether it is paused, and the runs waiting for it."""
        self.stranded: list[dict[str, Any]] = []
        """Per agent, the unfinished runs no live worker may claim (docs/upgrades.md)."""
        for state in ("queued", "due", "running", "waiting"):
            meter.create_observable_gauge(
                f"orchestrator.runs.{state}",
                callbacks=[self._per_agent(state)],
                unit="{run}",
                description=f"runs {state}, per agent",
            )
        meter.create_observable_gauge(
            "orchestrator.runs.oldest_due_age",
            callbacks=[self._per_agent("oldest_due_seconds")],
            unit="s",
            description="how long the oldest due run has waited to be claimed, per agent",
        )
        for status in ("parked", "awaiting_approval"):
            meter.create_observable_gauge(
                f"orchestrator.effects.{status}",
                callbacks=[self._effects(status)],
                unit="{effect}",
                description=f"effects {status.replace('_', ' ')}: a person must act",
            )

        for column, description in (
            ("running", "runs a limit counts now (a per-key limit: its fullest key)"),
            ("backlog", "due runs a limit covers, claimable or held back"),
            ("max_running", "the most runs a limit allows at once"),
        ):
            meter.create_observable_gauge(
                f"orchestrator.limit.{column}",
                callbacks=[self._rows("limits", column, ("agent", "limit"))],
                unit="{run}",
                description=f"{description}, per agent and limit",
            )
        meter.create_observable_gauge(
            "orchestrator.runs.stranded",
            callbacks=[self._rows("stranded", "runs", ("agent",))],
            unit="{run}",
            description="unfinished runs whose agent version no live worker may claim, per agent",
        )
        for column, description in (
            ("paused", "1 while a provider's 429 pauses the rate limit for every process"),
            ("waiting", "runs waiting for the rate limit's capacity"),
        ):
            meter.create_observable_gauge(
                f"orchestrator.rate_limit.{column}",
                callbacks=[self._rows("rates", column, ("limit",))],
                description=f"{description}, per rate limit",
            )

    def _rows(
        self, attribute: str, column: str, labels: tuple[str, ...]
    ) -> Callable[[Any], Iterable[metrics.Observation]]:
        def observe(options: Any) -> Iterable[metrics.Observation]:
            return [
                metrics.Observation(row[column], {label: row[label] for label in labels})
                for row in getattr(self, attribute)
            ]

        return observe

    def _per_agent(self, column: str) -> Callable[[Any], Iterable[metrics.Observation]]:
        def observe(options: Any) -> Iterable[metrics.Observation]:
            return [
                metrics.Observation(row[column] or 0, {"agent": row["agent"]}) for row in self.queue
            ]

        return observe

    def _effects(self, status: str) -> Callable[[Any], Iterable[metrics.Observation]]:
        def observe(options: Any) -> Iterable[metrics.Observation]:
            return [metrics.Observation(self.effects.get(status, 0))]

        return observe


def _add_trace_ids(
    logger: Any, method: str, event: MutableMapping[str, Any]
) -> MutableMapping[str, Any]:
    context = trace.get_current_span().get_span_context()
    if context.is_valid:
        event["trace_id"] = format(context.trace_id, "032x")
        event["span_id"] = format(context.span_id, "016x")
    return event


_MIN_LEVEL: int | None = None
"""The level ``configure_logging`` set; ``None``: structlog's defaults, which log everything."""


def debug_enabled() -> bool:
    """Whether debug lines are logged: hot paths skip building their fields otherwise."""
    return _MIN_LEVEL is None or _MIN_LEVEL <= logging.DEBUG


class RunLogger:
    """A structlog logger for one run, bound only when something is logged.

    A busy worker starts thousands of runs a second and logs nothing about most of them, so the
    ids are kept here and bound to a structlog logger (not free) only on first use. Debug lines
    below the configured level cost nothing.
    """

    __slots__ = ("_bound", "_context", "_more", "_name")

    def __init__(
        self,
        name: str,
        context: Mapping[str, Any] | Callable[[], Mapping[str, Any]],
        more: dict[str, Any] | None = None,
    ) -> None:
        self._name = name
        self._context = context
        self._more = more
        self._bound: Any = None

    def bind(self, **more: Any) -> RunLogger:
        if self._more:
            more = {**self._more, **more}
        return RunLogger(self._name, self._context, more)

    def debug(self, event: str, **fields: Any) -> None:
        if debug_enabled():
            self._logger().debug(event, **fields)

    def _logger(self) -> Any:
        if self._bound is None:
            context = self._context() if callable(self._context) else self._context
            self._bound = structlog.get_logger(self._name).bind(**context, **(self._more or {}))
        return self._bound

    def __getattr__(self, method: str) -> Any:
        return getattr(self._logger(), method)


def configure_logging(*, json_logs: bool | None = None, level: str | None = None) -> None:
    """structlog to stderr: JSON when not on a terminal (or when asked), readable otherwise.

    Libraries' own ``logging`` records (asyncpg's pool, uvicorn, asyncio) are rendered the same
    way through the root logger, so with JSON logs on, every line on stderr is one JSON object,
    a traceback included (as the ``exception`` field).
    """
    global _MIN_LEVEL
    if json_logs is None:
        json_logs = not sys.stderr.isatty()
    level_name = (level or os.environ.get("ORCHESTRATOR_LOG_LEVEL") or "info").upper()
    _MIN_LEVEL = logging.getLevelNamesMapping().get(level_name, logging.INFO)
    renderer: Any = (
        structlog.processors.JSONRenderer()
        if json_logs
        else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    )
    shared: list[Any] = [
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        _add_trace_ids,
    ]
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            *shared,
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(_MIN_LEVEL),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=[*shared, structlog.stdlib.add_logger_name],
            processors=[
                structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                structlog.processors.format_exc_info if json_logs else _keep,
                renderer,
            ],
        )
    )
    root = logging.getLogger()
    root.handlers = [handler]
    root.setLevel(max(_MIN_LEVEL, logging.INFO))
    pool_logger = logging.getLogger("asyncpg.pool")
    if not any(isinstance(f, _PoolFloorRetries) for f in pool_logger.filters):
        pool_logger.addFilter(_PoolFloorRetries())


class _PoolFloorRetries(logging.Filter):
    """Drops asyncpg's "Failed to restore the pool connection floor; retrying" (asyncpg 0.32+),
    a warning with a full traceback on every reconnect attempt while PostgreSQL is down: the
    process's own ``database unavailable`` line says it once per outage, and ``database reachable
    again`` when it is over (``orchestrator.db.outages``). Kept at the debug level."""

    def filter(self, record: logging.LogRecord) -> bool:
        return debug_enabled() or not record.getMessage().startswith(
            "Failed to restore the pool connection floor"
        )


def _keep(logger: Any, method: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """The console renderer formats ``exc_info`` itself (readable, with colours)."""
    return event


EXPORTERS = ("none", "console", "otlp")
"""The values ``OTEL_TRACES_EXPORTER`` and ``OTEL_METRICS_EXPORTER`` accept."""

_INSTALLED: list[Any] = []
"""The SDK providers ``install_sdk_from_env`` installed, the only ones ``shutdown_sdk`` ends."""


def install_sdk_from_env(*, prometheus: bool = False) -> None:
    """Install SDK tracer/meter providers as the ``OTEL_*`` variables ask, unless one is set.

    ``OTEL_TRACES_EXPORTER``/``OTEL_METRICS_EXPORTER``: ``none`` (or unset: nothing is
    installed), ``console`` (stderr) or ``otlp`` (OTLP/HTTP protobuf to
    ``OTEL_EXPORTER_OTLP_ENDPOINT``, which needs the ``otel`` extra). The service name comes
    from ``OTEL_SERVICE_NAME`` or ``service.name`` in ``OTEL_RESOURCE_ATTRIBUTES``, else
    ``orchestrator``. A provider the host already installed is left alone. ``prometheus``
    (``--metrics-listen``) adds the OpenTelemetry Prometheus reader to the meter provider.
    Raises ``InvalidInput`` for any other value or a missing exporter, before installing
    anything.
    """
    traces = _exporter_setting("OTEL_TRACES_EXPORTER")
    exported_metrics = _exporter_setting("OTEL_METRICS_EXPORTER")
    # Exporters are built first so that a missing package fails before anything is installed.
    span_exporter = None
    if traces != "none" and isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider):
        span_exporter = _span_exporter(traces)
    metric_exporter = None
    if exported_metrics != "none" and not _meter_provider_set():
        metric_exporter = _metric_exporter(exported_metrics)
    if prometheus and _meter_provider_set():
        raise InvalidInput(
            "--metrics-listen needs orchestrator's own meter provider, and this process has "
            "one installed already: export its metrics the host's way instead"
        )
    if span_exporter is None and metric_exporter is None and not prometheus:
        return

    from opentelemetry.sdk.resources import SERVICE_NAME, OTELResourceDetector, Resource

    # Resource.create() reads OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES, but an attribute
    # passed to it overrides them, so the default name is passed only when they give none.
    named = OTELResourceDetector().detect().attributes.get(SERVICE_NAME)
    resource = Resource.create(None if named else {SERVICE_NAME: TRACER_NAME})
    if span_exporter is not None:
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        tracer_provider = TracerProvider(resource=resource)
        tracer_provider.add_span_processor(BatchSpanProcessor(span_exporter))
        trace.set_tracer_provider(tracer_provider)
        _INSTALLED.append(tracer_provider)
    if metric_exporter is not None or prometheus:
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.metrics.export import MetricReader, PeriodicExportingMetricReader

        readers: list[MetricReader] = []
        if metric_exporter is not None:
            readers.append(PeriodicExportingMetricReader(metric_exporter))
        if prometheus:
            from opentelemetry.exporter.prometheus import PrometheusMetricReader

            readers.append(PrometheusMetricReader())
        meter_provider = MeterProvider(resource=resource, metric_readers=readers)
        metrics.set_meter_provider(meter_provider)
        if metrics.get_meter_provider() is meter_provider:
            _INSTALLED.append(meter_provider)
        else:  # a host's, which _meter_provider_set could not see: the API kept it
            meter_provider.shutdown()


def _exporter_setting(variable: str) -> str:
    raw = os.environ.get(variable, "")
    value = raw.strip().lower() or "none"
    if value not in EXPORTERS:
        raise InvalidInput(
            f"{variable}={raw!r} is not supported: use one of {', '.join(EXPORTERS)}"
        )
    return value


def _span_exporter(kind: str) -> Any:
    from opentelemetry.sdk.trace.export import ConsoleSpanExporter

    # One JSON line per span, on stderr with the logs: the default is indented JSON, which
    # breaks a JSON-lines log into fragments no log shipper can parse.
    console = partial(ConsoleSpanExporter, out=sys.stderr, formatter=_one_json_line)
    return _exporter(kind, console, "OTEL_TRACES_EXPORTER", "trace_exporter.OTLPSpanExporter")


def _metric_exporter(kind: str) -> Any:
    from opentelemetry.sdk.metrics.export import ConsoleMetricExporter

    console = partial(ConsoleMetricExporter, out=sys.stderr, formatter=_one_json_line)
    return _exporter(kind, console, "OTEL_METRICS_EXPORTER", "metric_exporter.OTLPMetricExporter")


def _exporter(kind: str, console: Callable[[], Any], variable: str, otlp: str) -> Any:
    """The console exporter, or ``otlp`` (module.Class under the OTLP/HTTP package), imported
    only when asked for: the otel extra that ships it is optional."""
    if kind == "console":
        return console()
    module, _, name = otlp.rpartition(".")
    try:
        exporters = importlib.import_module(f"opentelemetry.exporter.otlp.proto.http.{module}")
    except ModuleNotFoundError as error:
        raise _exporter_missing(variable, error) from None
    return getattr(exporters, name)()


def _one_json_line(exported: Any) -> str:
    """A span or a batch of metrics as one line of JSON (both have ``to_json(indent)``)."""
    return f"{exported.to_json(indent=None)}\n"


def _exporter_missing(variable: str, error: ModuleNotFoundError) -> InvalidInput:
    from orchestrator.lazy import install_hint

    return InvalidInput(
        f"{variable}=otlp needs the OTLP/HTTP exporter, which is not installed (no module "
        f"{error.name!r}): install the otel extra, {install_hint('otel')}"
    )


def _meter_provider_set() -> bool:
    """Whether a meter provider is installed.

    The API's stand-in for none has no public class (unlike ``trace.ProxyTracerProvider``), so
    its private one is compared; without it, a host's provider is still kept because the API
    sets one only once, which ``install_sdk_from_env`` checks afterwards.
    """
    from opentelemetry.metrics import _internal

    proxy = getattr(_internal, "_ProxyMeterProvider", None)
    return isinstance(proxy, type) and not isinstance(metrics.get_meter_provider(), proxy)


def shutdown_sdk() -> None:
    """Flush and end the providers ``install_sdk_from_env`` installed; a host's are its own."""
    while _INSTALLED:
        _INSTALLED.pop().shutdown()
