"""Named SQL queries, read once from ``sql/queries.sql``.

The file holds blocks that start with a ``-- name --`` header, then comment lines that say what
the query does, then the statement. Only the stores refer to query names (tests/test_query_owners.py
lists them, with the tables each owns).
"""

from __future__ import annotations

import re
from functools import cache
from importlib import resources

_HEADER = re.compile(r"^-- ([a-z_]+) --$", re.MULTILINE)


def parse_queries(text: str) -> dict[str, str]:
    queries: dict[str, str] = {}
    headers = list(_HEADER.finditer(text))
    for index, header in enumerate(headers):
        end = headers[index + 1].start() if index + 1 < len(headers) else len(text)
        body = [
            line
            for line in text[header.end() : end].strip().splitlines()
            if not line.lstrip().startswith("--")
        ]
        name = header.group(1)
        if name in queries:
            raise ValueError(f"query {name!r} is defined twice")
        queries[name] = "\n".join(body).strip().rstrip(";")
    return queries


@cache
def queries() -> dict[str, str]:
    text = resources.files("orchestrator.sql").joinpath("queries.sql").read_text("utf-8")
    return parse_queries(text)


def query(name: str) -> str:
    return queries()[name]
