"""People's decisions on effects that need approval, bound to the payload they saw.

An effect requested with ``requires_approval`` (or by a ``@tool.effect(..., approve=...)`` call
whose arguments the predicate flags) is recorded ``awaiting_approval`` with the SHA-256 of its
payload as stored. A decision names that hash (the CLI passes the hash of the payload it printed,
a web page the one it showed) and, optionally, the run's fence at the time; it is refused when
the payload or the fence has moved on, when it was already decided, withdrawn by a cancel, or
expired. Approved, the effect becomes sendable for that hash only; denied or expired, it is
rejected and the model is told "denied by reviewer: NOTE". Every decision is in the run's
timeline with who decided and when.
"""

from __future__ import annotations

import enum
from datetime import datetime

from orchestrator.access import Actor
from orchestrator.db.audit import decide
from orchestrator.db.executor import Executor
from orchestrator.db.queries import query
from orchestrator.effect_model import EffectRecord, validate_effect_key
from orchestrator.effects.store import EffectNotFound
from orchestrator.errors import InvalidInput, InvalidTransition
from orchestrator.ids import validate_run_id
from orchestrator.models import Row
from orchestrator.storable import check_text

MAX_LIST = 10_000
_HASH_LENGTH = 64


class Decision(enum.StrEnum):
    APPROVED = "approved"
    DENIED = "denied"


_VERB = {Decision.APPROVED: "approve", Decision.DENIED: "deny"}


class DecisionRefused(InvalidTransition):
    """The decision was not recorded; the message says why and what to do."""


class ApprovalStore:
    def __init__(self, db: Executor) -> None:
        self.db = db

    async def pending(self, *, run_id: str | None = None, limit: int = 100) -> list[EffectRecord]:
        """Effects awaiting a decision, oldest first."""
        if run_id is not None:
            validate_run_id(run_id)
        if not 1 <= limit <= MAX_LIST:
            raise InvalidInput(f"limit must be between 1 and {MAX_LIST}")
        records = await self.db.fetch(query("list_approvals"), run_id, limit)
        return [EffectRecord.from_record(record) for record in records]

    async def decide(
        self,
        run_id: str,
        effect_key: str,
        decision: Decision,
        *,
        by: str | None = None,
        note: str | None = None,
        payload_sha256: str | None = None,
        run_fence: int | None = None,
        actor: Actor | None = None,
    ) -> EffectRecord:
        """Record a decision by ``actor`` (None: the database role that connected; ``by``, a
        typed name, is kept as a note) with its audit row; ``DecisionRefused`` says why it
        could not be."""
        validate_run_id(run_id)
        validate_effect_key(effect_key)
        acting = Actor.acting(actor, by)
        if note is not None:
            check_text(note, "--note")
            if len(note) > 2000:
                raise InvalidInput("--note must be at most 2000 characters")
        if payload_sha256 is not None and (
            len(payload_sha256) != _HASH_LENGTH or payload_sha256.strip("0123456789abcdef") != ""
        ):
            raise InvalidInput(
                "--hash must be the 64 lower-case hex digits of the payload's SHA-256, as "
                "`orchestrator approvals show` prints it"
            )
        record = await decide(
            self.db,
            _VERB[decision],
            acting,
            query("decide_approval"),
            run_id,
            effect_key,
            decision.value,
            note,
            payload_sha256,
            run_fence,
            run_id=run_id,
            effect_key=effect_key,
        )
        if record is None:
            raise EffectNotFound(run_id, effect_key)
        if not record["decided"]:
            raise DecisionRefused(_refusal(record, effect_key, decision, payload_sha256, run_fence))
        row = await self.db.fetchrow(query("get_effect"), run_id, effect_key)
        assert row is not None
        return EffectRecord.from_record(row)

    async def expire(self, *, limit: int = 100) -> int:
        """Deny (by expiry) approvals nobody gave in time; returns how many."""
        return len(await self.db.fetch(query("expire_approvals"), limit))


def _refusal(
    row: Row,
    effect_key: str,
    decision: Decision,
    payload_sha256: str | None,
    run_fence: int | None,
) -> str:
    """One true sentence: why this decision was refused, and what to do."""
    run_id, status, now = row["run_id"], row["status"], row["now"]
    what = f"effect {effect_key!r} of run {run_id}"
    if status != "awaiting_approval":
        if row["decided_at"] is not None:
            return (
                f"{what} was already decided by {row['decided_by']} at "
                f"{_when(row['decided_at'])} (it is {status} now); a decision is final"
            )
        if status == "rejected" and row["requires_approval"]:
            return f"{what} was withdrawn (its run was cancelled); there is nothing to decide"
        return f"{what} is {status}: it does not wait for approval"
    if row["run_state"] not in ("queued", "running", "waiting"):
        return f"run {run_id} is {row['run_state']}: its approvals can no longer be decided"
    expires: datetime | None = row["approval_expires_at"]
    if expires is not None and expires <= now:
        return f"the approval of {what} expired at {_when(expires)}; it is denied"
    if payload_sha256 is not None and payload_sha256 != row["payload_sha256"]:
        # The current hash is not echoed: with it, a client could approve unseen in two calls.
        return (
            f"the payload of {what} is not the one you saw (its sha256 is not {payload_sha256}): "
            f"look at it with `orchestrator approvals show {run_id} {effect_key}` or on the "
            "console's Needs a person page, and decide on what it shows"
        )
    if run_fence is not None and run_fence > row["run_fence"]:
        return (
            f"fence {run_fence} was never granted for run {run_id} (the run's current fence is "
            f"{row['run_fence']}); show it again and decide with the fence it shows"
        )
    if run_fence is not None and run_fence != row["run_fence"]:
        return (
            f"run {run_id} has moved on from fence {run_fence} to {row['run_fence']} since you "
            f"looked (another attempt owns it); show it again before you {_VERB[decision]}"
        )
    return f"{what} could not be decided; show it again"


def _when(moment: datetime) -> str:
    return moment.isoformat(timespec="seconds")


__all__ = ["ApprovalStore", "Decision", "DecisionRefused"]
