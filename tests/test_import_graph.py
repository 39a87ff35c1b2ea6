"""The package's modules and packages import one another without a circle.

Every import counts: relative ones, those only type checkers read (``if TYPE_CHECKING:``), and
those inside functions (the deliberate way to defer a heavy module), since a circle through any
of them still ties the modules together and breaks whichever is imported first.
"""

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


def modules(root: Path = ROOT, packages: dict[str, str] = PACKAGES) -> dict[str, Path]:
    found = {}
    for folder, package in packages.items():
        for path in (root / folder).rglob("*.py"):
            parts = list(path.relative_to(root / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join([package, *parts])] = path
    return found


def imported(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The known modules that ``name`` imports anywhere in its file, relative imports resolved.

    ``from package import module`` depends on that module, not on the package's face."""
    here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    targets: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(here[: len(here) - node.level + 1] + ([base] if base else []))
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                targets.add(submodule if submodule in known else base)
    found = set()
    for target in targets:
        while target and target not in known:
            target = target.rpartition(".")[0]
        if target and target != name:
            found.add(target)
    return found


def module_graph(known: dict[str, Path]) -> dict[str, set[str]]:
    return {name: imported(name, path, known) for name, path in known.items()}


def package_of(name: str, known: dict[str, Path]) -> str:
    """A module's room: its first-level package, ``orchestrator`` for the ground floor, and
    ``orchestrator (face)`` for the root's lazy face, which names every room by design."""
    if name == "orchestrator":
        return "orchestrator (face)"
    room = ".".join(name.split(".")[:2])
    return room if known[room].name == "__init__.py" else "orchestrator"


def package_graph(known: dict[str, Path]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for name, targets in module_graph(known).items():
        room = package_of(name, known)
        graph.setdefault(room, set()).update(
            package_of(target, known) for target in targets if package_of(target, known) != room
        )
    return graph


def circle(graph: dict[str, set[str]]) -> str | None:
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as error:
        return " -> ".join(error.args[1])
    return None


def test_no_module_imports_itself_through_others() -> None:
    found = circle(module_graph(modules()))
    assert found is None, f"an import circle: {found}"


def test_no_package_imports_itself_through_others() -> None:
    found = circle(package_graph(modules()))
    assert found is None, f"an import circle between packages: {found}"


def test_the_ground_floor_leans_on_no_room() -> None:
    """The root's modules (values and rules without I/O) import no package of the project: every
    room may use them, so that none of them can be pulled into a circle."""
    graph = package_graph(modules())

    assert graph["orchestrator"] == set()


def test_the_root_holds_the_ground_floor_alone() -> None:
    root = sorted(path.name for path in (ROOT / "orchestrator").glob("*.py"))

    assert len(root) <= 12, f"the root has {len(root)} modules: {root}; give the new one a room"


def test_a_circle_through_a_relative_import_in_a_function_is_seen(tmp_path: Path) -> None:
    """The circle the old version of this test missed: ``effects/adapters.py`` imported
    ``.mcp`` inside a function while ``effects/mcp.py`` imported ``.adapters`` at the top."""
    package = tmp_path / "effects"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "adapters.py").write_text("def build():\n    from .mcp import McpAdapter\n")
    (package / "mcp.py").write_text("from .adapters import build\n")
    known = modules(tmp_path, {"effects": "orchestrator.effects"})

    found = circle(module_graph(known))

    assert found is not None and "orchestrator.effects.mcp" in found


def test_a_circle_between_rooms_is_seen(tmp_path: Path) -> None:
    """Two rooms that lean on each other through different modules: no module circle, but
    neither room can be understood, tested or moved without the other."""
    (tmp_path / "orchestrator").mkdir()
    (tmp_path / "orchestrator" / "__init__.py").write_text("")
    for room, other in (("db", "effects"), ("effects", "db")):
        (tmp_path / "orchestrator" / room).mkdir()
        (tmp_path / "orchestrator" / room / "__init__.py").write_text("")
        (tmp_path / "orchestrator" / room / "low.py").write_text("")
        (tmp_path / "orchestrator" / room / "high.py").write_text(
            f"from orchestrator.{other}.low import x\n"
        )
    known = modules(tmp_path, {"orchestrator": "orchestrator"})

    assert circle(module_graph(known)) is None
    assert circle(package_graph(known)) is not None
