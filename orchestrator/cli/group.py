"""The command groups: one-line errors, and subcommands imported only when they run.

``orchestrator --help`` and ``orchestrator runs list --help`` start in a fraction of the time the
whole package takes to import, because a command's module (and the database driver, the tables,
the worker) is loaded only once that command is named.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Mapping
from typing import Any

import click

from orchestrator.cli.consoles import print_error, stderr


class OneLineErrors(click.Group):
    """Every error on one line starting ``error:``: click's usage errors too (exit 2), which it
    would print as a usage block ending ``Error: ...``."""

    def main(self, *args: Any, **kwargs: Any) -> Any:
        kwargs["standalone_mode"] = False
        try:
            result = super().main(*args, **kwargs)
        except click.ClickException as error:
            hint = ""
            if isinstance(error, click.UsageError) and error.ctx is not None:
                hint = f" (see `{error.ctx.command_path} --help`)"
            print_error(Exception(error.format_message() + hint))
            sys.exit(error.exit_code)
        except click.Abort:
            stderr.print("interrupted")
            sys.exit(130)
        sys.exit(result if isinstance(result, int) else 0)  # --help and --version: 0


class LazyCommands(OneLineErrors):
    """A group whose subcommands are ``"module:attribute"`` paths, each imported on first use.

    ``summaries`` holds each command's one-line help, so that listing the commands imports
    none of them; a test keeps every summary equal to its command's own."""

    def __init__(
        self,
        *args: Any,
        lazy: Mapping[str, str],
        summaries: Mapping[str, str],
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.lazy = dict(lazy)
        self.summaries = dict(summaries)

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *self.lazy})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name in self.lazy and cmd_name not in self.commands:
            module, _, attribute = self.lazy[cmd_name].partition(":")
            command = getattr(importlib.import_module(module), attribute)
            assert isinstance(command, click.Command), self.lazy[cmd_name]
            self.add_command(command, cmd_name)
        return super().get_command(ctx, cmd_name)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = [
            (name, self.commands.get(name) or click.Command(name, help=self.summaries[name]))
            for name in self.list_commands(ctx)
        ]
        if not rows:
            return
        limit = formatter.width - 6 - max(len(name) for name, _ in rows)
        with formatter.section("Commands"):
            formatter.write_dl(
                [(name, command.get_short_help_str(limit)) for name, command in rows]
            )
