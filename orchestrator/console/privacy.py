"""What the console may show of a value: by default its size, never its contents.

Run inputs, results, checkpoints, errors, messages, effect payloads and free-text notes may hold
customers' data and secrets; the console is read by more people than the database is, so
contents appear only when the operator opted in with ``--show-payloads``, and then capped in
size. Not even a hash of a hidden value is shown: a short value (an amount, a yes/no) could be
recovered from it by trying them all. Timeline details are shown by an allowlist of bookkeeping
keys, so a key added later is hidden until someone decides it is safe.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from orchestrator.jsontext import jsonable

MAX_SHOWN_BYTES = 4096
"""The most of one value's JSON text a page shows with ``--show-payloads``."""

BOOKKEEPING_KEYS = frozenset(
    {
        "agent",
        "max_attempts",
        "idempotency_key",
        "not_before",
        "lease_until",
        "attempt",
        "checkpoint_version",
        "version",
        "step",
        "previous_owner",
        "previous_lease_until",
        "lost_at",
        "previous_state",
        "effect_key",
        "effect_keys",
        "kind",
        "policy",
        "accepted_fence",
        "current_fence",
        "by_fence",
        "run_state",
        "payload_sha256",
        "expires_at",
        "expired_at",
        "due_at",
        "decision",
        "by",
        "via",
        "typed_by",
        "resolved_by",
        "external_id",
        "seq",
        "seqs",
        "name",
        "type",
        "exhausted_by",
        "woke_the_run",
    }
)
"""Keys of timeline event details that are bookkeeping (ids, fences, times, states), shown."""

SYSTEM_REASON_KINDS = frozenset(
    {
        "lease_lost",
        "released",
        "owner_session_gone",
        "lease_abandoned",
        "dead_lettered",
        "stale_fence_rejected",
        "effect_refused",
    }
)
"""Events whose ``reason`` the runtime wrote itself; elsewhere (a cancel's, a wait's) it is
free text a person or a step wrote, and hidden."""


@dataclass(frozen=True)
class Shown:
    """One value as a page renders it: always its size, its text only if allowed."""

    size: int
    text: str | None
    truncated: bool

    @property
    def empty(self) -> bool:
        return self.size == 0


def text_of(value: Any) -> str:
    """The value's compact JSON text (a string is shown as itself, not quoted)."""
    if isinstance(value, str):
        return value
    return json.dumps(jsonable(value), separators=(",", ":"), sort_keys=True, ensure_ascii=False)


def readable(text: str) -> str:
    """A message that is JSON text (a tool's answer, a model's call arguments) as a person reads
    it: escapes such as \\u2026 shown as the characters they stand for. Anything else, or text
    whose escapes stand for no storable character, is shown as it is."""
    if "\\u" not in text:
        return text
    try:
        value = json.loads(text)
        shown = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
        shown.encode()  # a lone surrogate's escape stays an escape
    except (ValueError, UnicodeEncodeError, RecursionError):
        return text
    return shown


def show(value: Any, *, reveal: bool) -> Shown:
    if value is None:
        return Shown(0, None, False)
    encoded = text_of(value).encode()
    if not reveal:
        return Shown(len(encoded), None, False)
    cut = encoded[:MAX_SHOWN_BYTES].decode(errors="ignore")
    return Shown(len(encoded), cut, len(encoded) > MAX_SHOWN_BYTES)


def _bookkeeping(kind: str, key: str, value: Any) -> bool:
    if key == "reason":
        return kind in SYSTEM_REASON_KINDS and isinstance(value, str)
    if key not in BOOKKEEPING_KEYS:
        return False
    scalars = (str, int, float, bool)
    return isinstance(value, scalars) or (
        isinstance(value, list) and all(isinstance(item, scalars) for item in value)
    )


def event_details(kind: str, details: Any, *, reveal: bool) -> list[tuple[str, str | Shown]]:
    """An event's details as (key, value) pairs; anything but bookkeeping becomes ``Shown``
    (hidden by default)."""
    if not isinstance(details, dict):
        return [] if details is None else [("details", show(details, reveal=reveal))]
    pairs: list[tuple[str, str | Shown]] = []
    for key, value in details.items():
        if value is None:
            continue
        if _bookkeeping(kind, key, value):
            pairs.append((key, text_of(value)))
        else:
            pairs.append((key, show(value, reveal=reveal)))
    return pairs
