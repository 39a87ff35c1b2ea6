"""Traces carry the ids an incident review needs: run, fence, worker, lease, checkpoint."""

from __future__ import annotations

from orchestrator.agents.sleepy import sleepy
from orchestrator.settings import Settings
from orchestrator.testing import capture_spans, run_agent


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
    assert run_span.attributes["run.id"] == run.run_id
    assert run_span.attributes["run.fence"] == 1
    assert run_span.attributes["worker.id"] == "w-telemetry"
    assert "lease.until" in run_span.attributes
    assert run_span.attributes["run.disposition"] == "succeeded"
    step = spans["step sleepy.Nap"]
    assert step.attributes is not None
    assert step.attributes["run.id"] == run.run_id
    assert "checkpoint.version" in step.attributes
    assert step.parent is not None and step.parent.span_id == run_span.context.span_id
    assert spans["claim"].attributes is not None
    assert spans["claim"].attributes["worker.id"] == "w-telemetry"
