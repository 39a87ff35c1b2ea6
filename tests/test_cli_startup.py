"""The command line starts fast: a command's module, the database driver and the terminal
renderer are imported only when a command that needs them runs (``orchestrator/cli/group.py``)."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys

import click
import pytest

from orchestrator.cli import main
from orchestrator.cli.group import LazyCommands

HEAVY = ("asyncpg", "rich", "structlog", "opentelemetry", "pydantic", "anyio", "starlette")
"""What no --help needs: each costs a command's start tens of milliseconds."""


def imported_by(*arguments: str) -> set[str]:
    """The modules a fresh interpreter has loaded once ``orchestrator ARGUMENTS`` returned."""
    script = (
        "import json, sys\n"
        "from orchestrator.cli import main\n"
        "try:\n"
        f"    main({list(arguments)!r})\n"
        "except SystemExit as exit:\n"
        "    assert exit.code in (0, None), exit.code\n"
        "print(json.dumps(sorted(sys.modules)), file=sys.stderr)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True
    )
    return set(json.loads(done.stderr.strip().splitlines()[-1]))


def loaded(modules: set[str], prefixes: tuple[str, ...]) -> list[str]:
    return sorted(m for m in modules if m.split(".")[0] in prefixes)


def test_the_top_level_help_imports_no_command_and_no_heavy_library() -> None:
    modules = imported_by("--help")

    assert loaded(modules, HEAVY) == []
    assert sorted(m for m in modules if m.startswith("orchestrator.cli.")) == [
        "orchestrator.cli.consoles",
        "orchestrator.cli.group",
    ]
    assert not any(m.startswith(("orchestrator.db", "orchestrator.worker")) for m in modules)


def test_one_command_s_help_imports_that_command_alone() -> None:
    modules = imported_by("runs", "list", "--help")

    assert "orchestrator.cli.runs" in modules
    assert loaded(modules, HEAVY) == []
    assert {
        f"orchestrator.cli.{name}" for name in ("serve", "console", "demo", "chaos")
    }.isdisjoint(modules)
    assert not any(
        m.startswith(("orchestrator.worker", "orchestrator.console", "orchestrator.effects"))
        for m in modules
    )
    assert {"orchestrator.db.store", "orchestrator.client.stores"}.isdisjoint(modules)


def lazy_groups() -> list[LazyCommands]:
    """The root group and every lazy group under it (``runs``)."""
    from orchestrator.cli.runs import runs

    assert isinstance(runs, LazyCommands)
    return [main, runs]


@pytest.mark.parametrize("width", [60, 80, 120, 200])
def test_each_listing_says_what_each_command_s_own_help_says(width: int) -> None:
    def listing(group: click.Group) -> str:
        context = click.Context(group, info_name=group.name, terminal_width=width)
        formatter = context.make_formatter()
        group.format_commands(context, formatter)
        return formatter.getvalue()

    for group in lazy_groups():
        loaded_group = click.Group(group.name)
        for name, command in group.commands.items():
            loaded_group.add_command(command, name)
        for name, path in group.lazy.items():
            module, _, attribute = path.partition(":")
            loaded_group.add_command(getattr(importlib.import_module(module), attribute), name)

        assert set(group.summaries) == set(group.lazy)
        assert listing(group) == listing(loaded_group), group.name


def test_every_command_is_where_the_map_says() -> None:
    for group in lazy_groups():
        for name, path in group.lazy.items():
            module, _, attribute = path.partition(":")
            command = getattr(importlib.import_module(module), attribute)
            assert isinstance(command, click.Command) and command.name == name


def test_a_worker_with_no_vendor_configured_imports_no_vendor_client() -> None:
    # `serve` without --effects-config sends nothing: aiohttp, smtplib and the mcp SDK are
    # imported by the vendors that use them, when a kind is configured.
    script = (
        "import json, sys\n"
        "import orchestrator.cli.serve, orchestrator.worker.worker\n"
        "import orchestrator.effects.dispatcher\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True
    )
    modules = set(json.loads(done.stdout.strip().splitlines()[-1]))
    assert loaded(modules, ("aiohttp", "smtplib", "mcp")) == []


def test_the_vendors_still_import_by_their_earlier_path() -> None:
    from orchestrator.effects import adapters
    from orchestrator.effects.http import HttpAdapter
    from orchestrator.effects.smtp import SmtpAdapter

    assert (adapters.HttpAdapter, adapters.SmtpAdapter) == (HttpAdapter, SmtpAdapter)
    with pytest.raises(AttributeError, match="no attribute 'Nothing'"):
        adapters.Nothing  # noqa: B018
