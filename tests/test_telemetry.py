"""Telemetry: spans carry the ids an incident review needs (run, fence, worker, lease,
checkpoint); `serve` exports them and its metrics as the OTEL_* variables ask, to a real OTLP/HTTP
receiver on loopback, refuses what cannot work on one line, and leaves a host's providers alone.

OpenTelemetry's providers can be set once per process, so most tests run a fresh interpreter.
"""

from __future__ import annotations

import gzip
import importlib
import json
import os
import subprocess
import sys
import textwrap
import threading
from collections.abc import Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from subprocess import CompletedProcess
from typing import Any

import pytest

from orchestrator.agents.sleepy import sleepy
from orchestrator.db.store import RunStore
from orchestrator.errors import error_fields
from orchestrator.models import RunState
from orchestrator.settings import Settings
from orchestrator.testing import capture_spans, run_agent, wait_for_run
from support import ServeProcess


async def test_spans_for_claim_run_and_steps_carry_the_ids(settings: Settings) -> None:
    exporter = capture_spans()
    assert exporter is not None
    exporter.clear()
    run, _ = await run_agent(
        settings, sleepy, {"steps": 2, "seconds": 0}, worker_id="w-telemetry", poll_seconds=0.1
    )
    spans = {span.name: span for span in exporter.get_finished_spans()}
    run_span = spans["run sleepy"]
    assert run_span.attributes is not None
    assert run_span.attributes["orchestrator.run.id"] == run.run_id
    assert run_span.attributes["orchestrator.run.fence"] == 1
    assert run_span.attributes["orchestrator.worker.id"] == "w-telemetry"
    assert "orchestrator.lease.until" in run_span.attributes
    assert run_span.attributes["orchestrator.run.disposition"] == "succeeded"
    step = spans["step sleepy.Nap"]
    assert step.attributes is not None
    assert step.attributes["orchestrator.run.id"] == run.run_id
    assert "orchestrator.checkpoint.version" in step.attributes
    assert step.parent is not None and step.parent.span_id == run_span.context.span_id
    assert spans["claim"].attributes is not None
    assert spans["claim"].attributes["orchestrator.worker.id"] == "w-telemetry"


# -- `serve` exporting over OTLP/HTTP to a real loopback collector ------------------------------
CLEAN_ENV = {"NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost"}
"""Loopback traffic never goes through a proxy the environment may name."""


def python(code: str, *args: str, env: Mapping[str, str] | None = None) -> CompletedProcess[str]:
    """``code`` in a fresh interpreter (OpenTelemetry's providers are set once per process),
    with none of this process's ``OTEL_*`` variables, only those of ``env``."""
    environment = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    environment.update({**CLEAN_ENV, **(env or {})})
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        env=environment,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def printed_json(result: CompletedProcess[str]) -> Any:
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


class OtlpCollector:
    """An OTLP/HTTP receiver on 127.0.0.1 (stdlib ``http.server`` in a thread) that keeps every
    POST, answering 200 with an empty protobuf message as a collector does."""

    def __init__(self) -> None:
        self.posts: list[tuple[str, str, bytes]] = []
        posts = self.posts

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length") or 0))
                if self.headers.get("content-encoding") == "gzip":
                    body = gzip.decompress(body)
                posts.append((self.path, self.headers.get("content-type", ""), body))
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:
                pass  # the test reads what arrived, not an access log

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def __enter__(self) -> OtlpCollector:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)

    def bodies(self, path: str) -> list[bytes]:
        found = [body for at, kind, body in self.posts if at == path]
        assert all(kind == "application/x-protobuf" for at, kind, _ in self.posts if at == path)
        return found

    def spans(self) -> list[tuple[dict[str, Any], str, dict[str, Any]]]:
        """(resource attributes, span name, span attributes) for every span received."""
        service = importlib.import_module(
            "opentelemetry.proto.collector.trace.v1.trace_service_pb2"
        )
        spans: list[tuple[dict[str, Any], str, dict[str, Any]]] = []
        for body in self.bodies("/v1/traces"):
            request = service.ExportTraceServiceRequest.FromString(body)
            for resource_spans in request.resource_spans:
                resource = attributes_of(resource_spans.resource.attributes)
                for scope_spans in resource_spans.scope_spans:
                    for span in scope_spans.spans:
                        spans.append((resource, span.name, attributes_of(span.attributes)))
        return spans

    def metrics(self) -> list[tuple[dict[str, Any], str]]:
        """(resource attributes, metric name) for every metric received."""
        service = importlib.import_module(
            "opentelemetry.proto.collector.metrics.v1.metrics_service_pb2"
        )
        found: list[tuple[dict[str, Any], str]] = []
        for body in self.bodies("/v1/metrics"):
            request = service.ExportMetricsServiceRequest.FromString(body)
            for resource_metrics in request.resource_metrics:
                resource = attributes_of(resource_metrics.resource.attributes)
                for scope_metrics in resource_metrics.scope_metrics:
                    found.extend((resource, metric.name) for metric in scope_metrics.metrics)
        return found


def attributes_of(key_values: Any) -> dict[str, Any]:
    return {kv.key: getattr(kv.value, kv.value.WhichOneof("value")) for kv in key_values}


@pytest.mark.slow
async def test_serve_exports_spans_and_metrics_over_otlp_http(
    database_url: str, store: RunStore
) -> None:
    pytest.importorskip(
        "opentelemetry.exporter.otlp.proto.http",
        reason="the otel extra (opentelemetry-exporter-otlp-proto-http) is not installed",
    )
    with OtlpCollector() as collector:
        env = {
            **{name: "" for name in os.environ if name.startswith("OTEL_")},
            **CLEAN_ENV,
            "OTEL_TRACES_EXPORTER": "otlp",
            "OTEL_METRICS_EXPORTER": "otlp",
            "OTEL_EXPORTER_OTLP_ENDPOINT": collector.endpoint,
            "OTEL_RESOURCE_ATTRIBUTES": "deployment.environment=test",
        }
        args = ["--agents", "orchestrator.agents.sleepy", "--poll-seconds", "0.2"]
        with ServeProcess(database_url, *args, name="w-otlp", env=env) as worker:
            await worker.wait_for_log("serving")
            run_id = (await store.submit("sleepy", {"steps": 2, "seconds": 0})).run.run_id
            run = await wait_for_run(store, run_id)
            assert worker.stop() == 0, worker.tail()  # shutdown_sdk flushes both exporters
    assert run.state is RunState.SUCCEEDED
    spans = collector.spans()
    names = {name for _, name, _ in spans}
    assert {"claim", "run sleepy", "step sleepy.Nap"} <= names, names
    run_span = next(attributes for _, name, attributes in spans if name == "run sleepy")
    assert (
        run_span["orchestrator.run.id"] == run_id and run_span["orchestrator.worker.id"] == "w-otlp"
    )
    for resource, _, _ in spans:
        assert resource["service.name"] == "orchestrator"
        assert resource["deployment.environment"] == "test"
    exported = collector.metrics()
    assert "orchestrator.claims" in {name for _, name in exported}, exported
    assert {resource["service.name"] for resource, _ in exported} == {"orchestrator"}


# -- refusing what cannot work, on one line, before anything is installed ---------------------
WITHOUT_THE_OTEL_EXTRA = """
    import sys

    # As if the otel extra were not installed: importing the exporter package fails.
    sys.modules["opentelemetry.exporter.otlp.proto.http"] = None
    from orchestrator.cli import main

    main(prog_name="orchestrator")
"""
NOWHERE = "postgresql://orchestrator@127.0.0.1:9/nowhere"
"""A database no test reaches: `serve` must refuse its configuration before connecting."""


def serve_error(result: CompletedProcess[str]) -> str:
    """The one line `serve` printed before exiting 1."""
    assert result.returncode == 1, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


@pytest.mark.parametrize("variable", ["OTEL_TRACES_EXPORTER", "OTEL_METRICS_EXPORTER"])
def test_otlp_without_the_exporter_package_names_the_otel_extra(variable: str) -> None:
    result = python(
        WITHOUT_THE_OTEL_EXTRA,
        *["serve", "--agents", "orchestrator.agents.sleepy"],
        env={variable: "otlp", "ORCHESTRATOR_DATABASE_URL": NOWHERE},
    )
    line = serve_error(result)
    assert f"{variable}=otlp needs the OTLP/HTTP exporter" in line
    assert "(no module 'opentelemetry.exporter.otlp.proto.http." in line
    assert "install the otel extra" in line and "[otel]'" in line


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("OTEL_TRACES_EXPORTER", "jaeger"),
        ("OTEL_TRACES_EXPORTER", "console,otlp"),
        ("OTEL_METRICS_EXPORTER", "prometheus"),
    ],
)
def test_unknown_exporters_are_refused_with_the_accepted_values(variable: str, value: str) -> None:
    result = python(
        "from orchestrator.cli import main; main(prog_name='orchestrator')",
        *["serve", "--agents", "orchestrator.agents.sleepy"],
        env={variable: value, "ORCHESTRATOR_DATABASE_URL": NOWHERE},
    )
    line = serve_error(result)
    assert f"{variable}={value!r} is not supported: use one of none, console, otlp" in line


# -- the service name and providers the host already has --------------------------------------
INSTALL_AND_REPORT = """
    import json

    from opentelemetry import metrics, trace
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.trace import TracerProvider
    from orchestrator.telemetry import install_sdk_from_env

    install_sdk_from_env()
    tracers, meters = trace.get_tracer_provider(), metrics.get_meter_provider()
    assert isinstance(tracers, TracerProvider) and isinstance(meters, MeterProvider)
    print(json.dumps(dict(tracers.resource.attributes)))
"""


@pytest.mark.parametrize(
    ("env", "service"),
    [
        ({}, "orchestrator"),
        ({"OTEL_SERVICE_NAME": "billing"}, "billing"),
        ({"OTEL_RESOURCE_ATTRIBUTES": "service.name=billing,team=payments"}, "billing"),
        ({"OTEL_SERVICE_NAME": "billing", "OTEL_RESOURCE_ATTRIBUTES": "service.name=x"}, "billing"),
    ],
)
def test_the_service_name_comes_from_the_environment(env: dict[str, str], service: str) -> None:
    exporters = {"OTEL_TRACES_EXPORTER": "console", "OTEL_METRICS_EXPORTER": "console"}
    resource = printed_json(python(INSTALL_AND_REPORT, env={**exporters, **env}))
    assert resource["service.name"] == service
    if "team=payments" in env.get("OTEL_RESOURCE_ATTRIBUTES", ""):
        assert resource["team"] == "payments"


CONSOLE_EXPORT_BESIDE_LOGS = """
    import structlog

    from orchestrator import telemetry

    telemetry.configure_logging(json_logs=True)
    telemetry.install_sdk_from_env()
    structlog.get_logger().info("before the span")
    with telemetry.start_span("a span", attributes={"orchestrator.run.id": "r_x"}):
        telemetry.Metrics().claims.add(1)
    structlog.get_logger().info("after the span")
    telemetry.shutdown_sdk()
"""


def test_console_export_writes_one_json_line_per_span_among_the_json_log_lines() -> None:
    exporters = {"OTEL_TRACES_EXPORTER": "console", "OTEL_METRICS_EXPORTER": "console"}
    result = python(CONSOLE_EXPORT_BESIDE_LOGS, env=exporters)
    assert result.returncode == 0, result.stderr
    lines = [json.loads(line) for line in result.stderr.splitlines() if line.strip()]
    assert [line["name"] for line in lines if "context" in line] == ["a span"]
    assert [line["event"] for line in lines if "event" in line] == [
        "before the span",
        "after the span",
    ]
    assert any("resource_metrics" in line for line in lines)


HOST_PROVIDERS = """
    import json
    import sys
    import threading

    from opentelemetry import metrics, trace
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from orchestrator import telemetry

    if sys.argv[1] == "without the private proxy class":
        from opentelemetry.metrics import _internal

        del _internal._ProxyMeterProvider  # as a future API might rename it
    reader = InMemoryMetricReader()
    host_meters = MeterProvider(metric_readers=[reader])
    metrics.set_meter_provider(host_meters)
    spans = InMemorySpanExporter()
    host_tracers = TracerProvider()
    host_tracers.add_span_processor(SimpleSpanProcessor(spans))
    trace.set_tracer_provider(host_tracers)

    telemetry.install_sdk_from_env()
    readers = [t.name for t in threading.enumerate() if "PeriodicExporting" in t.name]
    telemetry.Metrics().claims.add(3)
    with telemetry.start_span("before shutdown_sdk"):
        pass
    telemetry.shutdown_sdk()
    with telemetry.start_span("after shutdown_sdk"):
        pass
    telemetry.Metrics().claims.add(4)
    claims = [
        point.value
        for resource in reader.get_metrics_data().resource_metrics
        for scope in resource.scope_metrics
        for metric in scope.metrics
        if metric.name == "orchestrator.claims"
        for point in metric.data.data_points
    ]
    kept = [metrics.get_meter_provider() is host_meters]
    kept.append(trace.get_tracer_provider() is host_tracers)
    print(json.dumps({
        "kept": kept,
        "our_metric_readers": readers,
        "spans": [span.name for span in spans.get_finished_spans()],
        "claims": claims,
    }))
"""


@pytest.mark.parametrize("api", ["as installed", "without the private proxy class"])
def test_providers_the_host_installed_are_kept_and_not_shut_down(api: str) -> None:
    exporters = {"OTEL_TRACES_EXPORTER": "console", "OTEL_METRICS_EXPORTER": "console"}
    result = python(HOST_PROVIDERS, api, env=exporters)
    assert printed_json(result) == {
        "kept": [True, True],
        "our_metric_readers": [],
        "spans": ["before shutdown_sdk", "after shutdown_sdk"],
        "claims": [7],
    }
    if api == "as installed":  # seen before trying, so the API has nothing to warn about
        assert "Overriding" not in result.stderr, result.stderr


# -- tracing_enabled(): the private fast check, its public fallback ---------------------------
TRACING_ENABLED = """
    import json
    import sys

    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from orchestrator import telemetry

    seen = {"private global": hasattr(trace, telemetry._PROVIDER_GLOBAL)}
    if sys.argv[1] == "public fallback":
        telemetry._PROVIDER_GLOBAL = "_RENAMED_BY_A_FUTURE_API"
    seen["no provider"] = telemetry.tracing_enabled()
    seen["stand-in is a ProxyTracerProvider"] = isinstance(
        trace.get_tracer_provider(), trace.ProxyTracerProvider
    )
    seen["no span"] = telemetry.start_span("unseen") is telemetry.NO_SPAN
    early = telemetry.tracer()  # obtained from the ProxyTracerProvider, before any SDK
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    seen["sdk installed later"] = telemetry.tracing_enabled()
    with telemetry.start_span("late"):
        pass
    with early.start_as_current_span("through the early proxy tracer"):
        pass
    seen["spans"] = [span.name for span in exporter.get_finished_spans()]
    print(json.dumps(seen))
"""


@pytest.mark.parametrize("check", ["private fast check", "public fallback"])
def test_tracing_enabled_follows_the_installed_provider(check: str) -> None:
    assert printed_json(python(TRACING_ENABLED, check)) == {
        # The fast check reads this private name; were it gone, only the fallback would serve.
        "private global": True,
        "no provider": False,
        "stand-in is a ProxyTracerProvider": True,
        "no span": True,
        "sdk installed later": True,
        "spans": ["late", "through the early proxy tracer"],
    }


@pytest.mark.parametrize("check", ["private fast check", "public fallback"])
def test_tracing_enabled_loads_a_provider_named_by_the_environment(check: str) -> None:
    code = """
        import sys

        from opentelemetry import trace
        from orchestrator import telemetry

        if sys.argv[1] == "public fallback":
            telemetry._PROVIDER_GLOBAL = "_RENAMED_BY_A_FUTURE_API"
        print(telemetry.tracing_enabled(), type(trace.get_tracer_provider()).__module__)
    """
    result = python(code, check, env={"OTEL_PYTHON_TRACER_PROVIDER": "sdk_tracer_provider"})
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["True", "opentelemetry.sdk.trace"]


def test_an_error_without_text_is_logged_by_its_type_and_repr() -> None:
    """A deadline's ``TimeoutError`` has no text: a log line must still say what failed."""
    assert error_fields(TimeoutError()) == {"error": "TimeoutError()", "error_type": "TimeoutError"}
    assert error_fields(OSError("refused")) == {"error": "refused", "error_type": "OSError"}
