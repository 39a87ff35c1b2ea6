"""Imports on first use, and what to install when one fails.

Package faces import their public names on first use (PEP 562), so that importing one module of a
package does not load the rest of it (``orchestrator.errors`` without the worker). A module that
imports ``pydantic_ai`` without the ``pydantic-ai`` extra fails with "No module named
'pydantic_ai'"; what the user needs to read is the extra to install (``[project.optional-
dependencies]`` in pyproject.toml), from the package index or from a checkout (the project may not
be published where they look): ``install_hint`` is the one place that says so."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from collections.abc import Callable, Mapping, Sequence
from types import ModuleType


def lazy_exports(
    package: str, exports: Mapping[str, str]
) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """A package's ``__getattr__`` and ``__dir__`` for ``exports`` (name -> defining module)."""

    def __getattr__(name: str) -> object:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        setattr(sys.modules[package], name, value)  # later lookups skip this function
        return value

    def __dir__() -> list[str]:
        return sorted({*vars(sys.modules[package]), *exports})

    return __getattr__, __dir__


class MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Old module paths that still import, as the module's new home, with a warning naming it:
    code written against a release before a move keeps running while its imports are updated."""

    def __init__(self, moved: Mapping[str, str]) -> None:
        self.moved = dict(moved)

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in self.moved:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        new = self.moved[spec.name]
        warnings.warn(
            f"{spec.name} moved to {new}: import it from there ({spec.name} goes in a later "
            "release)",
            DeprecationWarning,
            stacklevel=2,
        )
        return importlib.import_module(new)

    def exec_module(self, module: ModuleType) -> None:
        """The new module ran when it was imported; nothing is left to run."""


def install_moved_modules(moved: Mapping[str, str]) -> None:
    if not any(isinstance(finder, MovedModules) for finder in sys.meta_path):
        sys.meta_path.append(MovedModules(moved))


DISTRIBUTION = "fenced-orchestrator"

EXTRA_MODULES = {
    "pydantic_ai": "pydantic-ai",
    "pydantic_graph": "pydantic-ai",
    "mcp": "mcp",
    "opentelemetry.exporter.otlp": "otel",
}
"""The top modules each extra brings, by the name an import of them fails with."""


def extra_for(module: str | None) -> str | None:
    """The extra that installs ``module`` (the name a ``ModuleNotFoundError`` carries: the
    module itself, or a parent of it, or one of its submodules), or ``None``."""
    if not module:
        return None
    for name, extra in EXTRA_MODULES.items():
        if module == name or module.startswith(f"{name}.") or name.startswith(f"{module}."):
            return extra
    return None


def missing_extra(error: BaseException) -> tuple[str, str] | None:
    """The missing module and the extra that installs it, when ``error`` (or what caused it:
    a module that re-raises the import error in its own words) is a missing extra's module."""
    seen: BaseException | None = error
    for _ in range(8):  # a chain of causes is short; a cycle must not loop forever
        if seen is None:
            break
        if isinstance(seen, ModuleNotFoundError) and (extra := extra_for(seen.name)):
            assert seen.name is not None
            return seen.name, extra
        seen = seen.__cause__ or seen.__context__
    return None


def install_hint(extra: str) -> str:
    """How to install ``extra``: from the package index and from a checkout."""
    from importlib.metadata import packages_distributions

    # Named as installed (the distribution's name may differ from the package's).
    installed = packages_distributions().get(__name__.partition(".")[0]) or [DISTRIBUTION]
    return (
        f"pip install '{installed[0]}[{extra}]' (or from a checkout: pip install -e '.[{extra}]')"
    )
