"""The ids and attributes an execution's spans, logs and metrics carry, built once or only when
something reads them (a busy worker starts thousands of runs a second)."""

from __future__ import annotations

from opentelemetry.trace import INVALID_SPAN, Span

from orchestrator.agent.steps import Fail, Finish, Next, Outcome, Step, Wait
from orchestrator.models import ClaimedRun
from orchestrator.telemetry import (
    ATTEMPT,
    CHECKPOINT_VERSION,
    LEASE_UNTIL,
    RUN_FENCE,
    RUN_ID,
    WORKER_ID,
    open_span,
    tracing_enabled,
)
from orchestrator.worker.heartbeat import LeaseHandle

COMMITTED = "orchestrator.committed"
"""On every step's span: whether the step's commit took effect (a refused or replayed step is
labelled, not hidden)."""

_OUTCOME_ATTRIBUTES: dict[type, dict[str, str]] = {
    kind: {"outcome": kind.__name__.lower()} for kind in (Next, Finish, Fail, Wait)
}
"""Metric attributes per outcome type, built once."""

STEP_OUTCOMES = (*(attributes["outcome"] for attributes in _OUTCOME_ATTRIBUTES.values()), "error")
"""The ``outcome`` label values of the steps counter (``error``: the step raised)."""


def outcome_attributes(outcome: Outcome) -> dict[str, str]:
    attributes = _OUTCOME_ATTRIBUTES.get(type(outcome))
    if attributes is not None:
        return attributes
    for kind, attributes in _OUTCOME_ATTRIBUTES.items():  # a subclass counts as its outcome
        if isinstance(outcome, kind):
            return attributes
    return {"outcome": type(outcome).__name__.lower()}


def run_ids(claimed: ClaimedRun, worker_id: str) -> dict[str, str | int]:
    """The ids every span and log line about this run carries."""
    return {RUN_ID: claimed.run_id, RUN_FENCE: claimed.fence, WORKER_ID: worker_id}


def log_context(claimed: ClaimedRun, worker_id: str) -> dict[str, str | int]:
    return {**run_ids(claimed, worker_id), "agent": claimed.agent}


def run_attributes(claimed: ClaimedRun, worker_id: str) -> dict[str, str | int]:
    """The attempt's span attributes."""
    return {
        **run_ids(claimed, worker_id),
        LEASE_UNTIL: claimed.lease_until.isoformat(),
        ATTEMPT: claimed.attempt,
        CHECKPOINT_VERSION: claimed.checkpoint_version,
    }


def open_step_span(
    claimed: ClaimedRun,
    worker_id: str,
    handle: LeaseHandle,
    version: int,
    step: str,
    step_class: type[Step],
    agent: str,
) -> Span:
    """A step's span, ended by its owner, with its lease as it stood when the step started;
    while nothing records spans, not even its name and attributes are built (once per step)."""
    if not tracing_enabled():
        return INVALID_SPAN
    attributes = {
        **run_ids(claimed, worker_id),
        CHECKPOINT_VERSION: version,
        "orchestrator.step.name": step,
        ATTEMPT: claimed.attempt,
        LEASE_UNTIL: handle.lease_until.isoformat(),
        **step_class.span_attributes(agent),
    }
    return open_span(step_class.span(agent), attributes=lambda: attributes)
