"""``orchestrator db``: migrate, status, least-privilege roles, the DSN in use, stopping the
embedded server."""

from __future__ import annotations

from collections.abc import Callable

import click

from orchestrator.cli.consoles import stderr, stdout
from orchestrator.cli.presentation import dump_json
from orchestrator.cli.support import F, async_command, json_option
from orchestrator.db.connections import connect, redact_dsn, resolve_dsn
from orchestrator.db.embedded import EmbeddedPostgres
from orchestrator.db.grants import RoleNames, apply_grants, plan_grants
from orchestrator.db.migrations import (
    available_migrations,
    current_version,
    latest_version,
    migrate,
)
from orchestrator.errors import InvalidInput
from orchestrator.settings import Settings


@click.group()
def db() -> None:
    """Database: migrate, grant roles, show the DSN in use, stop the embedded server."""


@db.command("migrate")
@async_command
async def db_migrate(settings: Settings) -> None:
    """Apply pending schema migrations (safe to run from several processes at once)."""
    dsn = resolve_dsn(settings)
    stderr.print(f"migrating {redact_dsn(dsn)}")
    connection = await connect(settings, dsn=dsn, application_name="orchestrator-migrate")
    try:
        applied = await migrate(connection)
    finally:
        await connection.close()
    for migration in applied:
        stderr.print(f"  applied {migration.version:04d}_{migration.name}")
    stdout.print(f"schema at version {latest_version()}" + ("" if applied else " (no change)"))


def _role(kind: str, does: str) -> Callable[[F], F]:
    """``--KIND NAME``: the role of one kind, by default ``RoleNames``' name for it."""
    return click.option(
        f"--{kind}", default=getattr(RoleNames(), kind), show_default=True, help=f"The role {does}."
    )


@db.command("grant")
@_role("worker", "`orchestrator serve` connects as")
@_role("dispatcher", "`orchestrator effects dispatch` connects as")
@_role("proxy", "the action proxy (`orchestrator effects serve`) connects as")
@_role("console", "the web console connects as (it vouches for the people it signs in)")
@_role("migrator", "that owns the schema: runs migrations and the admin commands")
@_role("client", "applications' clients and operators' CLI connect as")
@click.option("--dry-run", is_flag=True, help="Print the SQL it would run, and run nothing.")
@json_option("What it did: the roles, those created, how many owner changes and statements.")
@async_command
async def db_grant(
    settings: Settings,
    worker: str,
    dispatcher: str,
    proxy: str,
    console: str,
    migrator: str,
    client: str,
    dry_run: bool,
    as_json: bool,
) -> None:
    """Create or update the least-privilege roles (docs/database-roles.md): missing roles are
    created NOLOGIN (grant them to login roles), the migrator role is made the schema's owner,
    and the other five get exactly their grants. Rerun it after every `db migrate`."""
    roles = RoleNames(worker, dispatcher, proxy, console, migrator, client)
    dsn = resolve_dsn(settings)
    connection = await connect(settings, dsn=dsn, application_name="orchestrator-grant")
    try:
        plan = await plan_grants(connection, settings.schema, roles)
        if dry_run:
            stdout.print(plan.sql(), markup=False)
            return
        await apply_grants(connection, plan)
    finally:
        await connection.close()
    if as_json:
        stdout.print_json(dump_json(plan.summary()))
        return
    for name in plan.created:
        stderr.print(f"  created role {name} (NOLOGIN)", markup=False)
    stdout.print(
        f"granted schema {settings.schema} to "
        + ", ".join(f"{kind} {name}" for kind, name in roles.by_kind().items())
        + f" ({len(plan.owner_changes)} owner changes)",
        markup=False,
    )


@db.command("url")
@click.option("--show-password", is_flag=True, help="Print the password instead of ***.")
@async_command
async def db_url(settings: Settings, show_password: bool) -> None:
    """Print the DSN in use (starting the embedded server if it is the default)."""
    dsn = resolve_dsn(settings)
    stdout.print(dsn if show_password else redact_dsn(dsn), markup=False)


@db.command("stop")
@click.option(
    "--force", is_flag=True, help="Stop it even while other processes are connected to it."
)
@async_command
async def db_stop(settings: Settings, force: bool) -> None:
    """Stop the embedded PostgreSQL server (no effect with ORCHESTRATOR_DATABASE_URL set).

    Refused while other processes (workers, consoles, psql) are connected, unless --force."""
    if settings.database_url:
        raise InvalidInput("ORCHESTRATOR_DATABASE_URL is set: there is no embedded server")
    server = EmbeddedPostgres(settings.home)
    running = server.running()
    if running is not None and not force:
        _refuse_while_connected(await _other_sessions(settings, running.dsn("postgres")))
    stopped = server.stop()
    stderr.print("embedded PostgreSQL stopped" if stopped else "embedded PostgreSQL not running")


async def _other_sessions(settings: Settings, dsn: str) -> dict[str, int]:
    """Client sessions of other processes on the server, by application_name."""
    connection = await connect(settings, dsn=dsn, application_name="orchestrator-db-stop")
    try:
        rows = await connection.fetch(
            "SELECT coalesce(nullif(application_name, ''), 'unnamed') AS name, count(*) AS n "
            "FROM pg_stat_activity WHERE backend_type = 'client backend' "
            "AND pid <> pg_backend_pid() GROUP BY 1 ORDER BY 2 DESC, 1"
        )
    finally:
        await connection.close()
    return {row["name"]: row["n"] for row in rows}


def _refuse_while_connected(sessions: dict[str, int]) -> None:
    """Stopping the server under running workers and consoles leaves them failing every
    second: say who is connected and let the operator decide."""
    if not sessions:
        return
    total = sum(sessions.values())
    shown = [f"{count} {name!r}" for name, count in list(sessions.items())[:5]]
    if len(sessions) > 5:
        shown.append(f"{len(sessions) - 5} more application names")
    raise InvalidInput(
        f"{total} session{'s' if total != 1 else ''} of other processes "
        f"{'are' if total != 1 else 'is'} connected to the embedded PostgreSQL "
        f"({', '.join(shown)}): stop them first, or pass --force to stop it under them"
    )


@db.command("status")
@json_option()
@async_command
async def db_status(settings: Settings, as_json: bool) -> None:
    """The database in use, its schema version, and the migrations not yet applied."""
    dsn = resolve_dsn(settings)
    connection = await connect(settings, dsn=dsn, application_name="orchestrator-status")
    try:
        version = await current_version(connection)
        server = await connection.fetchval("SHOW server_version")
    finally:
        await connection.close()
    pending = [m for m in available_migrations() if m.version > version]
    status = {
        "database": redact_dsn(dsn),
        "server_version": server,
        "schema": settings.schema,
        "schema_version": version,
        "known_version": latest_version(),
        "pending": [f"{m.version:04d}_{m.name}" for m in pending],
    }
    if as_json:
        stdout.print_json(dump_json(status))
        return
    stdout.print(f"database {status['database']} (PostgreSQL {server})", markup=False)
    stdout.print(f"schema {settings.schema} at version {version} of {latest_version()}")
    if version > latest_version():
        stdout.print("migrated by a newer release: upgrade orchestrator on this machine")
    for name in status["pending"]:
        stdout.print(f"  pending {name} (orchestrator db migrate)", markup=False)
