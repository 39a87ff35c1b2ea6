"""Effect requests and records: what a step asks for, and what the boundary keeps."""

from __future__ import annotations

import enum
import hashlib
import re
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from orchestrator.errors import InvalidInput
from orchestrator.models import JSON, Row

_KEY = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:/-]{0,199}$")
DEFAULT_APPROVAL_SECONDS = 24 * 3600.0
"""How long an approval request waits for a person before it is denied by expiry."""
MAX_APPROVAL_SECONDS = 366 * 24 * 3600.0


class EffectPolicy(enum.StrEnum):
    IRREVERSIBLE = "irreversible"
    """The first fence to reach dispatch wins; later fences get the existing outcome."""
    REPLACEABLE = "replaceable"
    """A newer fence replaces an accepted record that was never handed to the vendor."""


class EffectStatus(enum.StrEnum):
    ACCEPTED = "accepted"
    DISPATCHING = "dispatching"
    UNCERTAIN = "uncertain"
    CONFIRMED = "confirmed"
    FAILED = "failed"
    REJECTED = "rejected"
    PARKED = "parked"
    AWAITING_APPROVAL = "awaiting_approval"
    """Recorded, not sendable: a person must approve this very payload first."""

    @property
    def settled(self) -> bool:
        return self in (EffectStatus.CONFIRMED, EffectStatus.FAILED, EffectStatus.REJECTED)


def validate_effect_key(effect_key: str) -> str:
    if not _KEY.fullmatch(effect_key):
        raise InvalidInput(
            f"malformed effect key {effect_key!r}: 1-200 characters, letters, digits, _ . : / -"
        )
    return effect_key


def idempotency_key(run_id: str, effect_key: str) -> str:
    """One stable key per (run, effect key): never per fence or attempt (invariant 5)."""
    digest = hashlib.sha256(f"{run_id}\x00{effect_key}".encode()).hexdigest()
    return f"orch-{digest[:40]}"


@dataclass(frozen=True)
class Effect:
    """A side effect a step asks for; recorded with the step's commit, sent by the dispatcher.

    ``kind`` names a vendor configured in the dispatcher (e.g. ``email``, ``crm``); the payload is
    what that vendor needs, never credentials.
    """

    key: str
    kind: str
    payload: JSON
    policy: EffectPolicy = EffectPolicy.IRREVERSIBLE
    requires_approval: bool = False
    """Recorded ``awaiting_approval`` with its payload's hash; sent only once a person approves
    that payload (``orchestrator approvals approve``)."""
    approval_seconds: float = DEFAULT_APPROVAL_SECONDS
    """How long the approval may wait; then it is denied by expiry."""

    def __post_init__(self) -> None:
        validate_effect_key(self.key)
        if not _KEY.fullmatch(self.kind):
            raise InvalidInput(f"malformed effect kind {self.kind!r}")
        if self.payload is None:
            raise InvalidInput(f"effect {self.key!r} has no payload: give the vendor a JSON value")
        if not 0 < self.approval_seconds <= MAX_APPROVAL_SECONDS:
            raise InvalidInput(
                f"effect {self.key!r}: approval_seconds must be above 0 and at most a year"
            )


@dataclass(frozen=True)
class EffectRecord:
    run_id: str
    effect_key: str
    kind: str
    policy: EffectPolicy
    fence: int
    status: EffectStatus
    payload: JSON
    idempotency_key: str
    external_id: str | None
    result: JSON
    error: JSON
    attempts: int
    available_at: datetime
    created_at: datetime
    updated_at: datetime
    settled_at: datetime | None
    payload_sha256: str | None = None
    """The SHA-256 of the payload as stored: what an approval is bound to."""
    requires_approval: bool = False
    approval_expires_at: datetime | None = None
    approved_sha256: str | None = None
    decided_by: str | None = None
    decided_at: datetime | None = None
    decision_note: str | None = None

    @classmethod
    def from_record(cls, record: Row) -> EffectRecord:
        values: dict[str, Any] = {name: record[name] for name in cls.__dataclass_fields__}
        values["policy"] = EffectPolicy(values["policy"])
        values["status"] = EffectStatus(values["status"])
        return cls(**values)


class AcceptOutcome(enum.StrEnum):
    """The boundary's answer to one effect request (``orchestrator_accept_effect``)."""

    ACCEPTED = "accepted"
    """A new record, to be sent by the dispatcher."""
    REPLACED = "replaced"
    """A replaceable, never-dispatched record now carries the newer fence and payload."""
    EXISTING = "existing"
    """The record stays as it is; its status is the answer (never a second send)."""
    STALE = "stale"
    """The fence is older than the run's current one: another claim or a cancel replaced it."""
    FUTURE_FENCE = "future_fence"
    """The fence is above the run's current one: no claim ever granted it."""
    NOT_RUNNING = "not_running"
    """The fence is current but the run is not running (queued, waiting or finished)."""
    UNKNOWN_RUN = "unknown_run"
    """No run has this id."""
    CONFLICT = "conflict"
    """The key is already used by this run with another kind or policy."""

    @property
    def refused(self) -> bool:
        return self not in _RECORDED


_RECORDED = frozenset((AcceptOutcome.ACCEPTED, AcceptOutcome.REPLACED, AcceptOutcome.EXISTING))


@dataclass(frozen=True)
class Acceptance:
    """The boundary's answer to one request, with what is true of the run now."""

    outcome: AcceptOutcome
    accepted_fence: int | None
    """The fence the boundary holds for the run now (None: no such run)."""
    status: EffectStatus | None
    """The record's status, when there is a record."""
    run_state: str | None = None
    fence: int | None = None
    """The fence the request presented."""

    def explain(self, run_id: str, effect_key: str) -> str:
        """Why a refused request was refused, in one true sentence."""
        outcome, current = self.outcome, self.accepted_fence
        if outcome is AcceptOutcome.UNKNOWN_RUN:
            return f"no run with id {run_id!r}: effects are accepted only for existing runs"
        if outcome is AcceptOutcome.CONFLICT:
            return (
                f"effect key {effect_key!r} of run {run_id} is already used with another kind "
                "or policy; use another key for a different effect"
            )
        if self.run_state == "cancelled":
            return f"run {run_id} was cancelled (its fence is now {current}): nothing is accepted"
        if self.run_state in ("succeeded", "failed", "dead"):
            return f"run {run_id} has already ended ({self.run_state}): nothing is accepted"
        if outcome is AcceptOutcome.STALE:
            older = f"fence {self.fence} is older than the run's current fence {current}"
            if self.run_state == "running":
                return f"{older}: another worker owns this run now"
            return (
                f"{older}: the run is {self.run_state} now, held by no worker; its next claim "
                "gets a new fence"
            )
        if outcome is AcceptOutcome.FUTURE_FENCE:
            return (
                f"fence {self.fence} was never granted: run {run_id}'s current fence is "
                f"{current}; present the fence your claim returned"
            )
        return (
            f"run {run_id} is {self.run_state}, not running: only its owner's claim may request "
            "effects"
        )
