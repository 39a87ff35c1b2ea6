"""What the checker finds (``checker.py``, ``deploy_checks.py``, ``tree_checks.py``,
``schedule_checks.py``, ``output_checks.py``, ``limits.py``): each broken promise as a violation,
and the counts the report shows beside them."""

from __future__ import annotations

import collections
import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import asyncpg

TERMINAL = ("succeeded", "failed", "cancelled", "dead")
COMMITTED = ("checkpoint", "succeeded", "failed")
"""The events a worker's fenced commit writes: a step's checkpoint, or the run's final commit."""
CLOCK_TOLERANCE_SECONDS = 0.25
"""Transaction timestamps against claim times: a claim's transaction is this short at most."""
Row = asyncpg.Record | Mapping[str, Any]
"""A row of ``runs`` or ``run_events``, or one made up for a test."""


@dataclass(frozen=True)
class Violation:
    rule: str
    subject: str
    detail: str

    def __str__(self) -> str:
        return f"{self.rule}: {self.subject}: {self.detail}"


@dataclass
class Findings:
    violations: list[Violation] = field(default_factory=list)
    runs_by_state: dict[str, int] = field(default_factory=dict)
    """Every run of the workload, children too, by its state after quiescence (the runs the
    schedules started: ``scheduled_runs_by_state``)."""
    deliveries: int = 0
    """Idempotency keys the vendor delivered."""
    mcp_deliveries: int = 0
    """Deliveries made by an MCP tool call (the dispatcher's ``mcp`` adapter)."""
    duplicate_posts: int = 0
    """Raw POSTs that reached the vendor after the first for their key (must be 0)."""
    lost_runs: int = 0
    """Runs submitted but missing, or not finished after quiescence (must be 0)."""
    stale_fence_rejections: int = 0
    """The boundary's ``stale_fence_rejected`` events."""
    lost_leases: int = 0
    """The timelines' ``lease_lost`` events."""
    takeovers: int = 0
    """Claims that took a run from another owner (``previous_owner``)."""
    grants_recorded: int = 0
    """The workers' own records of the (run, fence) they ran under (``grants.py``)."""
    fences_granted_twice: int = 0
    """(run, fence) two processes ran under, or one ran under twice (must be 0)."""
    claims_lost_with_a_timeline: int = 0
    """(run, fence) a worker ran under that the database has no claim of: a failover took the
    claim back (on one server: 0)."""
    effects_by_status: dict[str, int] = field(default_factory=dict)
    limit_samples: int = 0
    """Samples of the runs holding a lease against the limits (``limits.LimitSampler``)."""
    limit_samples_skipped: int = 0
    """Samples a fault on the database made fail."""
    limit_peaks: dict[str, int] = field(default_factory=dict)
    """The most runs each limit (per key) was seen to count."""
    cutovers: int = 0
    """Cutovers of an agent to a new version (the ``deploy`` fault), from the audit log."""
    runs_cut_over: int = 0
    """Runs those cutovers took from workers of an older version."""
    runs_upgraded: int = 0
    """Runs whose latest checkpoint a newer version wrote than the one that started them."""
    runs_by_version: dict[str, int] = field(default_factory=dict)
    """Runs by the version of the agent's code that wrote their latest checkpoint."""
    trees: int = 0
    """Runs that started children and have no parent (``tree_checks.py``)."""
    children: int = 0
    """Runs a parent started."""
    cascading_cancels: int = 0
    """Cancels that reached runs below the cancelled one."""
    descendants_cancelled: int = 0
    """Runs cancelled by an ancestor's cancel."""
    schedules: int = 0
    """Schedules the campaign created (``schedules.py``, ``schedule_checks.py``)."""
    scheduled_runs: int = 0
    """Runs a schedule started."""
    scheduled_runs_by_state: dict[str, int] = field(default_factory=dict)
    slots_by_outcome: dict[str, int] = field(default_factory=dict)
    """The schedules' slot records by outcome: fired, skipped, buffered, backfilled."""
    slots_missed: int = 0
    """Slots without a record that a schedule's ``missed`` accounts for (its catch-up policy
    skipped them)."""
    schedule_claims: int = 0
    """Claims of the schedules (their fences, summed: each claim raised one by one)."""
    schedule_fires_refused: int = 0
    """Fires the database refused because their scheduler's lease had moved on, as the
    schedulers logged them (a count, not evidence)."""
    runs_with_output: int = 0
    """Runs with live output (``output_checks.py``)."""
    output_events: int = 0
    """Text and progress events the runs published (current or retracted)."""
    output_retractions: int = 0
    """Retractions: of a lost attempt's unfinished output, or a publisher's own withdrawal."""
    output_retracted: int = 0
    """Text and progress events a retraction took back."""
    output_steps_retracted: int = 0
    """Steps (run, fence, checkpoint version) whose output was retracted and which their fence
    never committed: the attempts that lost the run mid-step."""

    def add(self, rule: str, subject: str, detail: str) -> None:
        self.violations.append(Violation(rule, subject, detail))

    def as_json(self) -> dict[str, Any]:
        return {
            "violations": [
                {"rule": v.rule, "subject": v.subject, "detail": v.detail} for v in self.violations
            ],
            "runs_by_state": self.runs_by_state,
            "effects_by_status": self.effects_by_status,
            "deliveries": self.deliveries,
            "mcp_deliveries": self.mcp_deliveries,
            "duplicate_posts": self.duplicate_posts,
            "lost_runs": self.lost_runs,
            "stale_fence_rejections": self.stale_fence_rejections,
            "lost_leases": self.lost_leases,
            "takeovers": self.takeovers,
            "grants_recorded": self.grants_recorded,
            "fences_granted_twice": self.fences_granted_twice,
            "claims_lost_with_a_timeline": self.claims_lost_with_a_timeline,
            "limit_samples": self.limit_samples,
            "limit_samples_skipped": self.limit_samples_skipped,
            "limit_peaks": self.limit_peaks,
            "cutovers": self.cutovers,
            "runs_cut_over": self.runs_cut_over,
            "runs_upgraded": self.runs_upgraded,
            "runs_by_version": self.runs_by_version,
            "trees": self.trees,
            "children": self.children,
            "cascading_cancels": self.cascading_cancels,
            "descendants_cancelled": self.descendants_cancelled,
            "schedules": self.schedules,
            "scheduled_runs": self.scheduled_runs,
            "scheduled_runs_by_state": self.scheduled_runs_by_state,
            "slots_by_outcome": self.slots_by_outcome,
            "slots_missed": self.slots_missed,
            "schedule_claims": self.schedule_claims,
            "schedule_fires_refused": self.schedule_fires_refused,
            "runs_with_output": self.runs_with_output,
            "output_events": self.output_events,
            "output_retractions": self.output_retractions,
            "output_retracted": self.output_retracted,
            "output_steps_retracted": self.output_steps_retracted,
        }


def repeated(
    rows: Iterable[Row], key: Callable[[Row], tuple[Any, ...]]
) -> list[tuple[tuple[Any, ...], list[str]]]:
    """The keys more than one row has, in order, each with its rows' run ids, sorted: a child
    spawned twice, a slot started twice."""
    by_key: dict[tuple[Any, ...], list[str]] = collections.defaultdict(list)
    for row in rows:
        by_key[key(row)].append(row["run_id"])
    return [(k, sorted(ids)) for k, ids in sorted(by_key.items()) if len(ids) > 1]


def event_details(event: Row) -> dict[str, Any]:
    value = json_value(event["details"])
    return value if isinstance(value, dict) else {}


def json_value(value: Any) -> Any:
    return json.loads(value) if isinstance(value, str) else value


def as_text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def seconds_between(later: datetime, earlier: datetime) -> float:
    return (later - earlier).total_seconds()
