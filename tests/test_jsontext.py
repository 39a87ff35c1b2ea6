"""The JSON text codec every jsonb value goes through, and its fallback (no database here)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from orchestrator import jsontext

DOCUMENTS: list[Any] = [
    {},
    {"ok": True},
    {"nested": [1, 2.5, None, {"ü": "ünïcode", "emoji": "😀"}], "big": 10**30},
    [],
    'text with "quotes" and \\ backslashes\n',
    None,
]


@pytest.mark.parametrize("document", DOCUMENTS)
def test_compact_and_parse_agree_with_json(document: Any) -> None:
    text = jsontext.compact(document)
    assert text == json.dumps(document, separators=(",", ":"))
    assert text.isascii()
    assert jsontext.parse(text) == document == json.loads(text)


def test_non_finite_numbers_are_refused() -> None:
    for value in (float("nan"), float("inf"), -float("inf")):
        with pytest.raises(ValueError, match="Out of range float values"):
            jsontext.compact({"x": value})


def test_a_circular_structure_is_refused_as_what_it_is() -> None:
    loop: list[Any] = []
    loop.append(loop)
    with pytest.raises(ValueError, match="circular reference"):
        jsontext.compact(loop)


def test_parse_gives_json_s_own_errors_for_bad_text() -> None:
    for text in ("", "{", '{"a": 1} trailing', "[1,]"):
        with pytest.raises(json.JSONDecodeError):
            jsontext.parse(text)


def test_without_the_c_accelerator_the_results_are_the_same(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    expected = [jsontext.compact(document) for document in DOCUMENTS]
    monkeypatch.setattr(jsontext, "_ENCODE", None)
    assert [jsontext.compact(document) for document in DOCUMENTS] == expected
    with pytest.raises(ValueError, match="Out of range float values"):
        jsontext.compact(float("nan"))


def test_utf8_size_counts_bytes() -> None:
    assert jsontext.utf8_size("abc") == 3
    assert jsontext.utf8_size("ü😀") == 2 + 4
