"""What agent authors import: one place, pinned (a name leaving it breaks their code)."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

import orchestrator

AUTHOR_API = {
    "Agent",
    "RunningLimit",
    "take_rate",
    "Step",
    "StepContext",
    "Next",
    "Finish",
    "Fail",
    "Outcome",
    "Effect",
    "EffectPolicy",
    "chat",
    "Settings",
    "ToolAgent",
    "ToolContext",
    "tool",
    "Message",
    "Wait",
    "WaitState",
    "Signal",
    "Budget",
    "Child",
    "ChildOutcome",
}
APPLICATION_API = {"Client", "SyncClient"}
ERRORS = {
    "OrchestratorError",
    "InvalidInput",
    "InvalidTransition",
    "IdempotencyConflict",
    "RunAlreadyExists",
    "RunNotFound",
    "DatabaseError",
    "DatabaseUnavailable",
    "PermissionDenied",
    "SchemaTooNew",
    "ModelNotConfigured",
    "UnknownAgent",
    "UnknownStep",
    "BudgetExhausted",
    "DecisionRefused",
    "PermanentFailure",
    "StandbyNotReached",
    "RateLimitWait",
}


def test_the_top_level_exports_exactly_the_author_and_application_api_and_its_errors() -> None:
    assert set(orchestrator.__all__) == AUTHOR_API | APPLICATION_API | ERRORS | {"__version__"}
    for name in orchestrator.__all__:
        assert getattr(orchestrator, name) is not None, name
    for name in ERRORS:
        assert issubclass(getattr(orchestrator, name), orchestrator.OrchestratorError), name


def test_store_internals_are_not_in_the_top_level() -> None:
    for name in ("RunStore", "ClaimedRun", "Lease", "ClaimBatch", "CommitResult", "StepEvent"):
        assert name not in orchestrator.__all__


def loaded_by(module: str) -> list[str]:
    """Every module a fresh interpreter has loaded once it imported ``module``, sorted."""
    code = f"import sys, {module}; print(' '.join(sorted(sys.modules)))"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    return result.stdout.split()


def test_importing_orchestrator_is_cheap() -> None:
    """`from orchestrator import ...` must not load the OpenAI client (about a second)."""
    assert "openai" not in loaded_by("orchestrator")


def test_importing_one_module_loads_neither_the_worker_the_console_nor_the_client() -> None:
    """The package root imports its public names on first use, so a library that catches
    ``orchestrator.errors.RunNotFound`` does not pay for the runtime."""
    ours = [m for m in loaded_by("orchestrator.errors") if m.startswith("orchestrator")]
    assert ours == ["orchestrator", "orchestrator.errors", "orchestrator.lazy"]


def test_a_name_the_package_does_not_export_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'RunStore'"):
        _ = orchestrator.RunStore  # type: ignore[attr-defined]
    assert set(orchestrator.__all__) <= set(dir(orchestrator))


def test_the_version_is_the_distribution_s() -> None:
    from importlib.metadata import version

    assert orchestrator.__version__ == version("fenced-orchestrator")


def test_the_wheel_lists_every_package() -> None:
    """setuptools is given the packages one by one: a new subpackage missing from the list
    installs fine in editable mode and is absent from the wheel."""
    import tomllib

    root = Path(__file__).parent.parent
    listed = set(
        tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    )
    found = {
        ".".join(path.parent.relative_to(root).parts)
        for path in (root / "orchestrator").rglob("__init__.py")
        if "__pycache__" not in path.parts
    }
    assert found <= listed, f"add {sorted(found - listed)} to [tool.setuptools] packages"


@pytest.mark.parametrize("package", ["orchestrator.db", "orchestrator.worker"])
def test_the_database_and_worker_faces_resolve_every_name_they_list(package: str) -> None:
    face = importlib.import_module(package)
    for name in face.__all__:
        assert getattr(face, name) is not None, name
    assert set(face.__all__) <= set(dir(face))


def test_one_database_module_loads_neither_the_run_store_nor_the_worker() -> None:
    loaded = loaded_by("orchestrator.db.executor")
    assert "orchestrator.db.executor" in loaded
    assert not [m for m in loaded if m.startswith(("orchestrator.db.store", "orchestrator.worker"))]


def test_the_action_proxy_does_not_load_the_terminal_renderer() -> None:
    assert "orchestrator.cli.presentation" not in loaded_by("orchestrator.effects.proxy")


@pytest.mark.parametrize("old", sorted(orchestrator.MOVED))
def test_a_moved_module_still_imports_from_its_old_path_with_a_warning(old: str) -> None:
    """Code written before the move keeps running; the warning names where to import from."""
    new = orchestrator.MOVED[old]
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=f"{old} moved to {new}"):
        module = importlib.import_module(old)
    assert module is importlib.import_module(new)


def test_a_module_that_never_existed_is_still_not_found() -> None:
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("orchestrator.no_such_module")
