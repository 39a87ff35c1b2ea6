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

    @property
    def settled(self) -> bool:
        return self in (EffectStatus.CONFIRMED, EffectStatus.FAILED, EffectStatus.REJECTED)


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

    def __post_init__(self) -> None:
        if not _KEY.fullmatch(self.key):
            raise InvalidInput(
                f"malformed effect key {self.key!r}: 1-200 characters, letters, digits, _ . : / -"
            )
        if not _KEY.fullmatch(self.kind):
            raise InvalidInput(f"malformed effect kind {self.kind!r}")


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

    @classmethod
    def from_record(cls, record: Row) -> EffectRecord:
        values: dict[str, Any] = {name: record[name] for name in cls.__dataclass_fields__}
        values["policy"] = EffectPolicy(values["policy"])
        values["status"] = EffectStatus(values["status"])
        return cls(**values)


@dataclass(frozen=True)
class Acceptance:
    """The boundary's answer to one request."""

    outcome: str
    """accepted, replaced, existing, stale or conflict."""
    accepted_fence: int
    status: EffectStatus | None
