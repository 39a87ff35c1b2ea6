"""Compact, strict JSON text in and out, through the C parts of ``json`` called directly.

``json.dumps`` with any non-default argument builds a new encoder on every call, and
``json.loads`` wraps its C scanner in Python-level checks; for the small documents a worker
moves for every run (a run's input, a step's result) that wrapping is most of the cost
(docs/performance.md). So one C encoder and one C scanner are built once and called directly,
and every use falls back to ``json`` itself when the interpreter has no C accelerator (tested in
tests/test_jsontext.py).

Strict: NaN and infinities are refused, as PostgreSQL's jsonb refuses them too, so the error
comes early and names the value's owner.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import json.scanner
from datetime import datetime
from json import encoder as _encoder
from typing import Any, cast

_REFERENCE = json.JSONEncoder(separators=(",", ":"), allow_nan=False)
_ENCODE: Any = getattr(_encoder, "c_make_encoder", None)
if _ENCODE is not None:
    # (markers, default, string encoder, indent, key separator, item separator, sort_keys,
    # skipkeys, allow_nan), as JSONEncoder.iterencode passes them. No markers dict: circular
    # structures end in RecursionError, reported below as what they are.
    _ENCODE = _ENCODE(
        None,
        _REFERENCE.default,
        _encoder.encode_basestring_ascii,
        None,
        ":",
        ",",
        False,
        False,
        False,
    )
_SCAN: Any = json.scanner.make_scanner(cast(Any, json.JSONDecoder()))


def compact(value: Any) -> str:
    """``value`` as compact JSON; ``TypeError``/``ValueError`` if it is not JSON."""
    if _ENCODE is None:  # an interpreter without the C accelerator
        return _REFERENCE.encode(value)
    try:
        return "".join(_ENCODE(value, 0))
    except RecursionError:
        raise ValueError("circular reference detected (or nesting too deep)") from None


def parse(text: str) -> Any:
    """The value of the JSON document ``text`` (``json.JSONDecodeError`` if it is not one)."""
    try:
        value, end = _SCAN(text, 0)
    except StopIteration:
        return json.loads(text)  # raises the usual, precise error
    return value if end == len(text) else json.loads(text)


def utf8_size(text: str) -> int:
    """Bytes of ``text`` in UTF-8, without encoding it when it is ASCII (the usual case)."""
    return len(text) if text.isascii() else len(text.encode("utf-8"))


def jsonable(value: Any) -> Any:
    """Dataclasses, enums and datetimes as plain JSON values (datetimes in ISO 8601): what the
    CLI's ``--json``, the action proxy and the console answer with."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {
            field.name: jsonable(getattr(value, field.name)) for field in dataclasses.fields(value)
        }
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, dict):
        return {str(key): jsonable(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(item) for item in value]
    return value
