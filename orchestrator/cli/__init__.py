"""The ``orchestrator`` command line.

Exit codes: 0 ok, 1 a user error (one line on stderr saying what was wrong and what to do),
2 usage (click's own), 130 interrupted. Data goes to stdout, messages and logs to stderr.
"""

from __future__ import annotations

import sys
from pathlib import Path

import click

from orchestrator import __version__
from orchestrator.cli import (
    approvals,
    audit,
    chaos,
    console,
    db,
    demo,
    effects,
    mcp_servers,
    queue,
    runs,
    serve,
    submit,
    users,
    workers,
)
from orchestrator.cli.support import OneLineErrors, print_error
from orchestrator.errors import OrchestratorError
from orchestrator.settings import Settings


@click.group(cls=OneLineErrors, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "--version", prog_name="orchestrator")
@click.option(
    "--database-url",
    envvar="ORCHESTRATOR_DATABASE_URL",
    help="PostgreSQL DSN. Unset: the embedded server under --home.",
)
@click.option(
    "--home",
    envvar="ORCHESTRATOR_HOME",
    type=click.Path(file_okay=False, path_type=Path),
    help="Directory for the embedded server's data (default ./.orchestrator).",
)
@click.pass_context
def main(ctx: click.Context, database_url: str | None, home: Path | None) -> None:
    """Long-running AI agent runs with run leases and fencing tokens on PostgreSQL."""
    try:
        settings = Settings.from_env().with_overrides(database_url=database_url or None, home=home)
    except OrchestratorError as error:
        print_error(error)
        sys.exit(1)
    ctx.obj = settings


for command in (
    approvals.approvals,
    audit.audit,
    chaos.chaos,
    console.console,
    db.db,
    demo.demo,
    effects.effects,
    mcp_servers.mcp,
    queue.queue,
    runs.runs,
    serve.serve,
    submit.submit,
    users.users,
    workers.workers,
):
    main.add_command(command)
