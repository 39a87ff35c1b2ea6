"""The named-query file: how it is parsed, and the conventions every block keeps."""

from __future__ import annotations

import re
from importlib import resources

import pytest

from orchestrator.db.queries import parse_queries, queries


def test_blocks_are_split_at_their_headers_and_comments_dropped() -> None:
    text = """-- first --
-- params: $1 x int
-- What it does.
SELECT $1;

-- second --
-- params: none
SELECT 2
"""
    assert parse_queries(text) == {"first": "SELECT $1", "second": "SELECT 2"}


def test_a_name_defined_twice_is_refused() -> None:
    with pytest.raises(ValueError, match="defined twice"):
        parse_queries("-- a --\nSELECT 1\n-- a --\nSELECT 2\n")


def test_every_query_has_a_params_line_naming_the_parameters_it_uses() -> None:
    text = resources.files("orchestrator.sql").joinpath("queries.sql").read_text("utf-8")
    blocks = re.split(r"^-- ([a-z_]+) --$", text, flags=re.MULTILINE)[1:]
    named = dict(zip(blocks[::2], blocks[1::2], strict=True))
    assert set(named) == set(queries())
    for name, block in named.items():
        lines = block.strip().splitlines()
        assert lines[0].startswith("-- params: "), name
        params = " ".join(
            line.removeprefix("--") for line in lines if line.startswith("-- ") and "$" in line
        )
        used = set(re.findall(r"\$(\d+)", queries()[name]))
        declared = set(re.findall(r"\$(\d+)", params))
        assert used == declared or (not used and "none" in lines[0]), (name, used, declared)
