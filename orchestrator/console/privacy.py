"""What the console may show of a value: by default its size and SHA-256, never its contents.

Run inputs, results, checkpoints, errors, messages and effect payloads may hold customers'
data and secrets; the console is read by more people than the database is, so contents appear
only when the operator opted in with ``--show-payloads``, and then capped in size.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from orchestrator.presentation import jsonable

MAX_SHOWN_BYTES = 4096
"""The most of one value's JSON text a page shows with ``--show-payloads``."""

CONTENT_KEYS = frozenset(
    {
        "input",
        "result",
        "checkpoint",
        "payload",
        "superseded_payload",
        "data",
        "error",
        "previous_error",
        "message",
        "content",
        "arguments",
        "note",
        "details",
    }
)
"""Keys of timeline event details whose values are contents, not bookkeeping."""


@dataclass(frozen=True)
class Shown:
    """One value as a page renders it: always its size and hash, its text only if allowed."""

    size: int
    sha256: str
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


def show(value: Any, *, reveal: bool) -> Shown:
    if value is None:
        return Shown(0, "", None, False)
    encoded = text_of(value).encode()
    digest = hashlib.sha256(encoded).hexdigest()
    if not reveal:
        return Shown(len(encoded), digest, None, False)
    cut = encoded[:MAX_SHOWN_BYTES].decode(errors="ignore")
    return Shown(len(encoded), digest, cut, len(encoded) > MAX_SHOWN_BYTES)


def event_details(details: Any, *, reveal: bool) -> list[tuple[str, str | Shown]]:
    """An event's details as (key, value) pairs; contents become ``Shown`` (hidden by default)."""
    if not isinstance(details, dict):
        return [] if details is None else [("details", show(details, reveal=reveal))]
    pairs: list[tuple[str, str | Shown]] = []
    for key, value in details.items():
        if value is None:
            continue
        if key in CONTENT_KEYS:
            pairs.append((key, show(value, reveal=reveal)))
        else:
            pairs.append((key, text_of(value)))
    return pairs
