"""Compact, strict JSON text from one shared encoder.

``json.dumps`` with any non-default argument (``separators``, ``allow_nan``) builds a new
``JSONEncoder`` on every call; four such calls per run were 14% of a saturated worker's time
(benchmarks/README.md, throughput.py). Strict: NaN and infinities are refused, as PostgreSQL's
jsonb refuses them too, so the error comes early and names the value's owner.
"""

from __future__ import annotations

import json
from typing import Any

_COMPACT = json.JSONEncoder(separators=(",", ":"), allow_nan=False)


def compact(value: Any) -> str:
    """``value`` as compact JSON; ``TypeError``/``ValueError`` if it is not JSON."""
    return _COMPACT.encode(value)


def utf8_size(text: str) -> int:
    """Bytes of ``text`` in UTF-8, without encoding it when it is ASCII (the usual case)."""
    return len(text) if text.isascii() else len(text.encode("utf-8"))
