"""The package's modules import one another without a circle: counting imports only type
checkers read (``if TYPE_CHECKING:``), since a circle there still ties the modules together.
Imports inside functions, the deliberate way to defer a heavy module, are left out."""

from __future__ import annotations

import ast
import graphlib
from pathlib import Path

ROOT = Path(__file__).parent.parent
PACKAGES = {
    "orchestrator": "orchestrator",
    "effects": "orchestrator.effects",
    "agents": "orchestrator.agents",
}
"""Source folders and the package each installs as (pyproject.toml's package-dir)."""


def modules() -> dict[str, Path]:
    found = {}
    for folder, package in PACKAGES.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join([package, *parts])] = path
    return found


def imported(statements: list[ast.stmt]) -> list[str]:
    """Module-level imports, in classes and under ``if`` and ``try`` too; not in functions."""
    names: list[str] = []
    for node in statements:
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names += [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
        elif isinstance(node, ast.ClassDef):
            names += imported(node.body)
        elif isinstance(node, ast.If):
            names += imported(node.body) + imported(node.orelse)
        elif isinstance(node, ast.Try):
            names += imported(node.body) + imported(node.orelse) + imported(node.finalbody)
            for handler in node.handlers:
                names += imported(handler.body)
    return names


def test_no_module_imports_itself_through_others() -> None:
    known = modules()
    graph = {
        name: {dep for dep in imported(ast.parse(path.read_text()).body) if dep in known} - {name}
        for name, path in known.items()
    }
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as error:
        raise AssertionError(f"an import circle: {' -> '.join(error.args[1])}") from None
