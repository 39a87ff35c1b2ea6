"""The optional extras (``[project.optional-dependencies]`` in pyproject.toml) and how to
install one: the one place that turns a missing optional package into the command that adds it.

A module that imports ``pydantic_ai`` without the ``pydantic-ai`` extra fails with "No module
named 'pydantic_ai'"; what the user needs to read is the extra to install, from the package index
or from a checkout (the project may not be published where they look)."""

from __future__ import annotations

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
