"""The ``orchestrator`` command line.

Exit codes: 0 ok, 1 a user error (one line on stderr saying what was wrong and what to do),
2 usage (click's own), 130 interrupted. Data goes to stdout, messages and logs to stderr.
"""

from __future__ import annotations

import sys
from pathlib import Path

import click

from orchestrator.cli.consoles import print_error
from orchestrator.cli.group import LazyCommands
from orchestrator.errors import OrchestratorError
from orchestrator.lazy import DISTRIBUTION
from orchestrator.settings import Settings

COMMANDS = {
    "agents": "orchestrator.cli.agents:agents",
    "approvals": "orchestrator.cli.approvals:approvals",
    "audit": "orchestrator.cli.audit:audit",
    "chaos": "orchestrator.cli.chaos:chaos",
    "console": "orchestrator.cli.console:console",
    "db": "orchestrator.cli.db:db",
    "demo": "orchestrator.cli.demo:demo",
    "effects": "orchestrator.cli.effects:effects",
    "limits": "orchestrator.cli.limits:limits",
    "mcp": "orchestrator.cli.mcp_servers:mcp",
    "queue": "orchestrator.cli.queue:queue",
    "rates": "orchestrator.cli.rates:rates",
    "runs": "orchestrator.cli.runs:runs",
    "schedules": "orchestrator.cli.schedules:schedules",
    "serve": "orchestrator.cli.serve:serve",
    "submit": "orchestrator.cli.submit:submit",
    "users": "orchestrator.cli.users:users",
    "workers": "orchestrator.cli.workers:workers",
}
"""Each command and where it lives: imported only when that command runs."""

SUMMARIES = {
    "agents": "The versions of each agent's code: who runs them and the runs that wait for them.",
    "approvals": "Effects waiting for a person's decision: list, show, approve, deny.",
    "audit": "The audit trail: list its rows, verify its hash chain.",
    "chaos": (
        "Start a cluster on its own embedded PostgreSQL (a primary and a standby with "
        "--replicated or failovers), inject faults from the seeded schedule, heal, wait for "
        "quiescence and check every promise; exit 1 on any violation or on a fault that did "
        "not fire."
    ),
    "console": (
        "Serve the web console: runs, attempts, timelines, effects, approvals, workers, queue."
    ),
    "db": "Database: migrate, grant roles, show the DSN in use, stop the embedded server.",
    "demo": "Two workers, a paused one, real vendors: each effect still happens exactly once.",
    "effects": (
        "Effect records at the fenced boundary: list, inspect, resolve parked ones, dispatch."
    ),
    "limits": "How many runs of an agent may hold a lease at once: list, set, clear.",
    "mcp": "MCP servers whose tools a tool agent offers its model.",
    "queue": "Queue depth per agent.",
    "rates": "Requests and tokens per interval, shared by every process: list, set, clear.",
    "runs": "List, inspect, cancel, retry and signal runs; show and top up their budgets.",
    "schedules": (
        "Cron and interval schedules: each slot starts one run, whichever serve process fires it."
    ),
    "serve": "Claim and run agent runs until SIGTERM/SIGINT (a second signal exits at once).",
    "submit": "Queue a run of AGENT (now, --at a time or after --delay) and print its run id.",
    "users": "People and services: add, list, disable, and their tokens.",
    "workers": "Workers registered with the database: alive or dead, and the runs they hold.",
}
"""Each command's help as ``orchestrator --help`` lists it (the command's own docstring)."""


@click.group(
    cls=LazyCommands,
    lazy=COMMANDS,
    summaries=SUMMARIES,
    context_settings={"help_option_names": ["-h", "--help"]},
)
@click.version_option(package_name=DISTRIBUTION, prog_name="orchestrator")
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
