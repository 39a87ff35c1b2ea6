"""orchestrator: long-running AI agent runs on PostgreSQL with run leases and fencing tokens."""

from __future__ import annotations

from orchestrator.db.store import FailOutcome, RunStore, StepEvent
from orchestrator.errors import (
    DatabaseUnavailable,
    IdempotencyConflict,
    InvalidInput,
    InvalidTransition,
    OrchestratorError,
    RunAlreadyExists,
    RunNotFound,
    SchemaTooNew,
)
from orchestrator.models import ClaimBatch, ClaimedRun, CommitResult, Lease, Run, RunEvent, RunState
from orchestrator.settings import Settings

__all__ = [
    "ClaimBatch",
    "ClaimedRun",
    "CommitResult",
    "DatabaseUnavailable",
    "FailOutcome",
    "IdempotencyConflict",
    "InvalidInput",
    "InvalidTransition",
    "Lease",
    "OrchestratorError",
    "Run",
    "RunAlreadyExists",
    "RunEvent",
    "RunNotFound",
    "RunState",
    "RunStore",
    "SchemaTooNew",
    "Settings",
    "StepEvent",
]
