"""The stale-worker story, read back from its traces and metrics: one trace per attempt, each
with its own fence and worker, linked to the submitter and to the earlier attempt; the refused
effects say so with both fences, in the stale attempt's trace; the dispatcher's spans join the
trace of the attempt that requested the effect; the counters move by exactly what happened; and
a canary secret appears nowhere.

Worker A runs on an event loop of its own, in a thread, and its step blocks that loop (a
stop-the-world pause, as a long GC or SIGSTOP): no heartbeat, no commit. Its lease expires, B
claims the run with fence 2 and the email goes out; then A wakes up and commits its step, effects
included, as if it still owned the run.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from collections.abc import Generator
from typing import Any

import anyio
import pytest
from opentelemetry import trace

from orchestrator.agent.steps import Agent, Next, Outcome, Step, StepContext
from orchestrator.agents.contract_notice import Confirm
from orchestrator.db.store import RunStore
from orchestrator.effect_model import Effect, EffectPolicy
from orchestrator.effects.http import HttpAdapter
from orchestrator.effects.smtp import SmtpAdapter
from orchestrator.models import RunState
from orchestrator.settings import Settings
from orchestrator.testing import capture_metrics, capture_spans, running_worker, wait_for_run
from orchestrator.testing.loopback import LocalVendor, SmtpSink

CANARY = "canary-7d1e4b20"
RELEASE = threading.Event()
"""Set to end worker A's pause."""
PAUSED = threading.Event()
"""Set by worker A's step as its pause begins."""


class PausingPrepare(Step):
    async def run(self, ctx: StepContext) -> Outcome:
        if ctx.fence == 1:
            PAUSED.set()
            RELEASE.wait(60)  # blocks the whole event loop of worker A, on purpose
        return Next(
            Confirm,
            checkpoint={"drafted_by_fence": ctx.fence},
            effects=[
                Effect(
                    "notice-email",
                    "email",
                    {"to": "legal@acme.test", "subject": "Renewal", "body": f"note {CANARY}"},
                ),
                Effect(
                    "crm-status",
                    "crm",
                    {"status": "notice-sent", "note": CANARY},
                    EffectPolicy.REPLACEABLE,
                ),
            ],
        )


paused_notice = Agent("paused_notice", first=PausingPrepare, steps=[Confirm])
TIMING: dict[str, Any] = {"lease_seconds": 3.0, "heartbeat_seconds": 0.5, "poll_seconds": 0.05}
"""A lease long enough that a loaded machine still starts A's step before its deadline."""


def points(reader: Any, name: str) -> list[Any]:
    """Every data point the reader holds for the instrument ``name``."""
    data = reader.get_metrics_data()
    return [
        point
        for resource in (data.resource_metrics if data else ())
        for scope in resource.scope_metrics
        for metric in scope.metrics
        if metric.name == name
        for point in metric.data.data_points
    ]


def counter_total(reader: Any, name: str) -> float:
    return float(sum(point.value for point in points(reader, name)))


def histogram_count(reader: Any, name: str) -> int:
    return sum(point.count for point in points(reader, name))


def worker_a_in_a_thread(
    settings: Settings, adapters: dict[str, Any]
) -> Generator[None, None, None]:
    """Worker A on its own event loop in a thread, until the generator is closed."""
    stop = threading.Event()
    failure: list[BaseException] = []

    async def main() -> None:
        async with running_worker(
            settings, [paused_notice], worker_id="A", effect_adapters=adapters, **TIMING
        ):
            while not stop.is_set():  # noqa: ASYNC110 - a thread's event, polled
                await anyio.sleep(0.05)

    def target() -> None:
        try:
            anyio.run(main)
        except BaseException as error:  # reported to the test below
            failure.append(error)

    thread = threading.Thread(target=target, name="worker-A", daemon=True)
    thread.start()
    try:
        yield
    finally:
        RELEASE.set()
        stop.set()
        thread.join(30)
    assert not thread.is_alive(), "worker A did not stop"
    assert not failure, f"worker A failed: {failure[0]!r}"


async def kinds_of(store: RunStore, run_id: str) -> list[str]:
    return [event.kind for event in await store.events(run_id)]


def attributes(span: Any) -> dict[str, Any]:
    return dict(span.attributes or {})


async def test_the_stale_worker_story_in_traces_and_metrics(
    settings: Settings, store: RunStore, capfd: pytest.CaptureFixture[str]
) -> None:
    spans = capture_spans()
    reader = capture_metrics()
    assert spans is not None and reader is not None
    spans.clear()
    PAUSED.clear()
    RELEASE.clear()
    lost_before = counter_total(reader, "orchestrator.lease.lost")
    stale_before = counter_total(reader, "orchestrator.effects.stale_rejections")
    recoveries_before = histogram_count(reader, "orchestrator.recovery.duration")

    with trace.get_tracer("an application").start_as_current_span("handle request") as submitter:
        run_id = (await store.submit("paused_notice", {"customer": f"ACME {CANARY}"})).run.run_id

    async with LocalVendor() as vendor:
        with SmtpSink() as sink:
            adapters = {
                "crm": HttpAdapter("crm", url=vendor.send_url, reconcile="replay"),
                "email": SmtpAdapter("email", host="127.0.0.1", port=sink.port, sender="a@o.test"),
            }
            worker_a = worker_a_in_a_thread(settings, adapters)
            next(worker_a)
            try:
                assert await anyio.to_thread.run_sync(PAUSED.wait, 20), "A never started"
                async with running_worker(
                    settings, [paused_notice], worker_id="B", effect_adapters=adapters, **TIMING
                ):
                    run = await wait_for_run(store, run_id, within=40)
                    RELEASE.set()  # A wakes up, believing it still owns the run
                    with anyio.fail_after(60):
                        while "lease_lost" not in await kinds_of(store, run_id):  # noqa: ASYNC110
                            await anyio.sleep(0.05)
            finally:
                worker_a.close()

    assert run.state is RunState.SUCCEEDED, run.error
    assert len(sink.messages) == 1 and len(vendor.deliveries) == 1
    events = await store.events(run_id)
    (stale,) = [e for e in events if e.kind == "stale_fence_rejected"]
    assert (stale.fence, stale.worker_id) == (1, "A")
    assert isinstance(stale.details, dict) and stale.details["accepted_fence"] == 2

    finished = spans.get_finished_spans()
    attempts = {
        attributes(s)["orchestrator.run.fence"]: s
        for s in finished
        if s.name == "run paused_notice" and attributes(s)["orchestrator.run.id"] == run_id
    }
    assert set(attempts) == {1, 2}
    a, b = attempts[1], attempts[2]
    # One trace per attempt, each carrying its own fence and worker.
    assert a.context.trace_id != b.context.trace_id
    assert a.parent is None and b.parent is None
    assert attributes(a)["orchestrator.worker.id"] == "A"
    assert attributes(b)["orchestrator.worker.id"] == "B"
    assert attributes(a)["orchestrator.run.disposition"] == "lost"
    assert attributes(b)["orchestrator.run.disposition"] == "succeeded"
    for span in (a, b):
        assert {"orchestrator.lease.until", "orchestrator.checkpoint.version"} <= set(
            attributes(span)
        )
    # Linked: both to the submitter, B to A.
    links_of_b = {
        (link.context.span_id, dict(link.attributes or {})["orchestrator.link"]) for link in b.links
    }
    assert (submitter.get_span_context().span_id, "submitted") in links_of_b
    assert (a.context.span_id, "earlier_attempt") in links_of_b
    assert [dict(link.attributes or {})["orchestrator.link"] for link in a.links] == ["submitted"]
    # The refusal, in A's trace, with both fences.
    (refusal,) = [s for s in finished if s.name == "stale_fence_rejected"]
    assert refusal.context.trace_id == a.context.trace_id
    assert attributes(refusal)["orchestrator.run.fence"] == 1
    assert attributes(refusal)["orchestrator.effect.accepted_fence"] == 2
    assert attributes(refusal)["orchestrator.worker.id"] == "A"
    assert set(attributes(refusal)["orchestrator.effect.keys"]) == {"notice-email", "crm-status"}
    # The dispatcher's spans are in the trace of B, which requested the effects.
    dispatches = {
        attributes(s)["orchestrator.effect.key"]: s
        for s in finished
        if s.name.startswith("dispatch ") and attributes(s)["orchestrator.run.id"] == run_id
    }
    assert set(dispatches) == {"notice-email", "crm-status"}
    for key, span in dispatches.items():
        assert span.context.trace_id == b.context.trace_id, key
        assert attributes(span)["orchestrator.run.fence"] == 2
        assert attributes(span)["orchestrator.effect.disposition"] == "confirmed"
        assert attributes(span)["orchestrator.effect.idempotency_key"]
        assert attributes(span)["orchestrator.effect.external_id"]
    sends = [
        s
        for s in finished
        if s.name.startswith("send ") and s.context.trace_id == b.context.trace_id
    ]
    assert len(sends) == 2
    # The counters moved by exactly what happened.
    assert counter_total(reader, "orchestrator.lease.lost") - lost_before == 1
    assert counter_total(reader, "orchestrator.effects.stale_rejections") - stale_before == 2
    assert histogram_count(reader, "orchestrator.recovery.duration") - recoveries_before == 1
    # `runs show --json` gives each attempt's trace id, as a tracing UI shows it.
    shown = await anyio.run_process(
        [sys.executable, "-m", "orchestrator.cli", "runs", "show", run_id, "--json"],
        env={**os.environ, "ORCHESTRATOR_DATABASE_URL": str(settings.database_url)},
    )
    shown_attempts = json.loads(shown.stdout.decode())["attempts"]
    assert [(x["fence"], x["worker_id"], x["trace_id"]) for x in shown_attempts] == [
        (1, "A", trace.format_trace_id(a.context.trace_id)),
        (2, "B", trace.format_trace_id(b.context.trace_id)),
    ]
    # The canary went to the vendors and nowhere else.
    assert CANARY in json.dumps([d["payload"] for d in vendor.deliveries.values()])
    logs = capfd.readouterr()
    telemetry = [s.to_json() for s in finished] + [reader.get_metrics_data().to_json()]
    for where, text in (("spans and metrics", "\n".join(telemetry)), ("logs", logs.out + logs.err)):
        assert CANARY not in text, f"the canary leaked into {where}"


async def test_an_idle_worker_leaves_no_claim_spans(settings: Settings) -> None:
    spans = capture_spans()
    assert spans is not None
    spans.clear()
    async with running_worker(settings, [paused_notice], worker_id="idle", **TIMING):
        await anyio.sleep(1.0)  # some twenty polls
    assert not [s for s in spans.get_finished_spans() if s.name == "claim"]
