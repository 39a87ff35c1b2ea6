"""House rules kept by tests: no class of the package is over 450 lines and no function over 150
(split by concept long before that; docs/architecture.md). A function is counted from its ``def``
to its last line; a command's click decorators are its options, not its body."""

from __future__ import annotations

import ast

from test_import_graph import modules

MAX_CLASS_LINES = 450
MAX_FUNCTION_LINES = 150


def too_long(kinds: tuple[type[ast.AST], ...], limit: int) -> list[str]:
    found = []
    for name, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, kinds):
                assert isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
                assert node.end_lineno is not None
                length = node.end_lineno - node.lineno + 1
                if length > limit:
                    found.append(f"{name}.{node.name}: {length} lines")
    return found


def test_no_class_is_over_450_lines() -> None:
    assert not too_long((ast.ClassDef,), MAX_CLASS_LINES)


def test_no_function_is_over_150_lines() -> None:
    assert not too_long((ast.FunctionDef, ast.AsyncFunctionDef), MAX_FUNCTION_LINES)
