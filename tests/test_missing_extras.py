"""`serve --agents` on a module that needs an extra which is not installed (issue 37): the error
names the extra and how to install it (from the index and from a checkout), not "pass a module
path importable from here". Real `orchestrator serve` processes; the extra's package is made
absent by the interpreter's own import machinery (``sys.modules[NAME] = None`` makes importing
NAME fail with ModuleNotFoundError, as an uninstalled package does)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

SERVE_WITHOUT = """
    import sys

    for name in sys.argv[1].split(","):  # as if these packages were not installed
        sys.modules[name] = None
    del sys.argv[1]
    from orchestrator.cli import main

    main(prog_name="orchestrator")
"""
NOWHERE = "postgresql://orchestrator@127.0.0.1:9/nowhere"
"""A database no test reaches: the agents are imported before any connection."""

MODULES = {
    # module: (its code, the packages made absent, the extra named)
    "uses_pydantic_ai": ("import pydantic_ai\n", "pydantic_ai", "pydantic-ai"),
    "uses_the_integration": (
        "from orchestrator.integrations.pydantic_ai import PydanticAIAgent\n",
        "pydantic_ai",
        "pydantic-ai",
    ),
    "uses_mcp": ("from mcp import ClientSession\n", "mcp", "mcp"),
    "uses_otlp": (
        "from opentelemetry.exporter.otlp.proto.http import trace_exporter\n",
        "opentelemetry.exporter.otlp.proto.http",
        "otel",
    ),
}


def serve(tmp_path: Path, module: str, absent: str) -> str:
    """``orchestrator serve --agents MODULE`` run from ``tmp_path``; the one line it printed."""
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(SERVE_WITHOUT), absent, "serve", "--agents", module],
        cwd=tmp_path,
        env={**os.environ, "ORCHESTRATOR_DATABASE_URL": NOWHERE},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 1, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


@pytest.mark.parametrize(
    ("module", "code", "absent", "extra"), [(m, *v) for m, v in MODULES.items()]
)
def test_a_module_that_needs_a_missing_extra_names_the_extra(
    tmp_path: Path, module: str, code: str, absent: str, extra: str
) -> None:
    (tmp_path / f"{module}.py").write_text(code)
    line = serve(tmp_path, module, absent)
    assert f"cannot import agent module {module!r}: it imports {absent}, " in line
    assert "which is not installed" in line
    assert f"pip install 'fenced-orchestrator[{extra}]'" in line
    assert f"(or from a checkout: pip install -e '.[{extra}]')" in line
    assert "importable from here" not in line


def test_a_module_that_needs_another_missing_package_is_told_as_before(tmp_path: Path) -> None:
    (tmp_path / "uses_something_else.py").write_text("import no_such_package_anywhere\n")
    line = serve(tmp_path, "uses_something_else", "nothing_of_ours")
    assert "No module named 'no_such_package_anywhere'" in line
    assert "importable from here" in line and "pip install" not in line
