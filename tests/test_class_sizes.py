"""A house rule kept by a test: no class of the package is over 450 lines (split by concept long
before that; docs/architecture.md)."""

from __future__ import annotations

import ast

from test_import_graph import modules

MAX_CLASS_LINES = 450


def test_no_class_is_over_450_lines() -> None:
    too_long = []
    for name, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef):
                assert node.end_lineno is not None
                length = node.end_lineno - node.lineno + 1
                if length > MAX_CLASS_LINES:
                    too_long.append(f"{name}.{node.name}: {length} lines")
    assert not too_long, too_long
