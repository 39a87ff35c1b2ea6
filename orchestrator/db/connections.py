"""Connections to PostgreSQL: DSN resolution, pool set-up, and clear errors when it is down."""

from __future__ import annotations

import socket
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import asyncpg

from orchestrator.db.embedded import EmbeddedPostgres
from orchestrator.db.guarded import GuardedConnection
from orchestrator.errors import DatabaseError, DatabaseUnavailable, InvalidInput, PermissionDenied
from orchestrator.jsontext import compact, parse
from orchestrator.settings import Settings

Pool = asyncpg.Pool
Connection = asyncpg.Connection


def resolve_dsn(settings: Settings) -> str:
    """The DSN in use: ``ORCHESTRATOR_DATABASE_URL``, or the embedded server (started if needed)."""
    if settings.database_url:
        return settings.database_url
    return EmbeddedPostgres(settings.home).ensure_running().dsn()


def current_dsn(settings: Settings, known: str) -> str:
    """Where to connect now: ``known``, or for the embedded server the address its data
    directory gives, should it have come back on another port (never starts it)."""
    if settings.database_url:
        return known
    running = EmbeddedPostgres(settings.home).running()
    if running is None:
        return known
    parts = urlsplit(known)
    if parts.port == running.port:
        return known
    userinfo = parts.netloc.rpartition("@")[0]
    netloc = f"{userinfo}@127.0.0.1:{running.port}" if userinfo else f"127.0.0.1:{running.port}"
    return urlunsplit(parts._replace(netloc=netloc))


def dsn_user(dsn: str) -> str | None:
    """The role a URL-style DSN logs in as, if it names one."""
    try:
        return urlsplit(dsn).username or None
    except ValueError:
        return None


def redact_dsn(dsn: str) -> str:
    """The DSN without its password, safe to print in errors and logs."""
    try:
        parts = urlsplit(dsn)
    except ValueError:
        return "<unparseable DSN>"
    if parts.password is None:
        return dsn
    netloc = parts.netloc.rsplit("@", 1)[1]
    user = parts.username or ""
    return urlunsplit(parts._replace(netloc=f"{user}:***@{netloc}"))


async def _init_connection(connection: asyncpg.Connection) -> None:
    # jsonb in and out as Python values; compact separators keep stored payloads small.
    await connection.set_type_codec(
        "jsonb",
        encoder=compact,
        decoder=parse,
        schema="pg_catalog",
    )


async def _keep_session(connection: asyncpg.Connection) -> None:
    """A no-op pool reset (asyncpg still rolls back any open transaction itself)."""


GENERIC_PLANS = {"plan_cache_mode": "force_generic_plan"}
"""Session settings for a connection that runs only statements with one good plan whatever
their parameters (the claim statement: tests/test_store.py checks its generic plan). PostgreSQL
then plans each prepared statement once per connection; left to choose, it planned the claim
afresh on every execution (docs/performance.md)."""


def server_settings(settings: Settings, application_name: str) -> dict[str, str]:
    """Per-connection settings: a bounded statement, a bounded idle transaction, and a name.

    ``application_name`` carries the worker id, so ``pg_stat_activity`` shows which worker holds
    which connection during an incident.
    """
    statement_ms = int(settings.statement_timeout_seconds * 1000)
    return {
        "application_name": application_name[:63],
        # Every statement names its tables unqualified: they live in this schema.
        "search_path": settings.schema,
        "statement_timeout": str(statement_ms),
        "idle_in_transaction_session_timeout": str(max(statement_ms * 2, 1000)),
    }


_UNAVAILABLE_ERRORS: tuple[type[BaseException], ...] = (
    OSError,
    socket.gaierror,
    TimeoutError,
    asyncpg.PostgresConnectionError,
    asyncpg.CannotConnectNowError,
    asyncpg.InvalidCatalogNameError,
    asyncpg.InvalidAuthorizationSpecificationError,
    asyncpg.InvalidPasswordError,
)


_CONFIGURATION_ERRORS: tuple[type[BaseException], ...] = (
    ValueError,
    asyncpg.ClientConfigurationError,
)
"""What asyncpg raises for a DSN it cannot use (a bad option value, an unparseable part)."""


def misconfigured(dsn: str, error: BaseException) -> InvalidInput:
    reason = str(error).strip() or type(error).__name__
    password = urlsplit(dsn).password if "://" in dsn else None
    if password:
        reason = reason.replace(password, "***")
    return InvalidInput(
        f"the database URL {redact_dsn(dsn)} cannot be used: {reason}. Fix "
        "ORCHESTRATOR_DATABASE_URL (unset it to use the embedded server)."
    )


def unavailable(dsn: str, error: BaseException) -> DatabaseUnavailable:
    reason = str(error).strip() or type(error).__name__
    return DatabaseUnavailable(
        f"cannot reach PostgreSQL at {redact_dsn(dsn)}: {reason}. Check that the server runs "
        "and ORCHESTRATOR_DATABASE_URL is right (unset it to use the embedded server)."
    )


DRIVER_ERRORS: tuple[type[BaseException], ...] = (
    asyncpg.PostgresError,
    asyncpg.InterfaceError,
    asyncpg.InternalClientError,
    OSError,
)
"""What asyncpg and the socket under it raise mid-statement; ``database_failed`` turns each
into the project's ``DatabaseError`` (a ``TimeoutError`` is an ``OSError``: callers that use it
for their own deadlines let it through first)."""

_LOST_CONNECTION: tuple[type[BaseException], ...] = (
    OSError,
    asyncpg.InterfaceError,
    asyncpg.PostgresConnectionError,
    asyncpg.OperatorInterventionError,  # pg_terminate_backend, a shutdown, a crash
)


def database_failed(error: BaseException) -> DatabaseError | PermissionDenied | InvalidInput:
    """A driver error as the project's: ``PermissionDenied`` when the role lacked a privilege,
    ``InvalidInput`` when a database function refused an argument (nothing changed, either
    way), ``DatabaseUnavailable`` when the connection was lost, ``DatabaseError`` otherwise;
    one line, saying that the outcome is unknown."""
    if isinstance(error, asyncpg.InsufficientPrivilegeError):
        return PermissionDenied(error.message, hint=error.hint)
    if isinstance(error, asyncpg.InvalidParameterValueError):  # a database function's refusal
        return InvalidInput(f"{error.message}; nothing changed")
    detail = str(error).splitlines()[0] if str(error).strip() else type(error).__name__
    kind = DatabaseUnavailable if isinstance(error, _LOST_CONNECTION) else DatabaseError
    return kind(
        f"the database failed mid-command ({detail}); check it is up, then run the command "
        "again (with the same idempotency key, a retried submit or signal is not repeated)"
    )


async def create_pool(
    settings: Settings,
    *,
    application_name: str = "orchestrator",
    min_size: int = 1,
    max_size: int = 10,
    dsn: str | None = None,
    keep_session_state: bool = False,
    session_settings: Mapping[str, str] | None = None,
    **pool_options: Any,
) -> asyncpg.Pool:
    """Open a pool, or raise ``DatabaseUnavailable`` naming the (redacted) DSN.

    ``keep_session_state`` skips asyncpg's reset query on every release (a round trip per
    use). Only for code that never leaves session state behind: the runtime holds its advisory
    locks and LISTENs on dedicated connections, never on pooled ones. ``session_settings``: more
    server settings, for this pool's connections only (for example ``GENERIC_PLANS``).
    """
    dsn = dsn or resolve_dsn(settings)
    if keep_session_state:
        pool_options["reset"] = _keep_session
    if not settings.database_url:

        async def reconnect(known: str, **options: Any) -> asyncpg.Connection:
            return await asyncpg.connect(current_dsn(settings, known), **options)

        pool_options["connect"] = reconnect
    try:
        pool = await asyncpg.create_pool(
            dsn,
            min_size=min_size,
            max_size=max_size,
            timeout=settings.connect_timeout_seconds,
            server_settings={
                **server_settings(settings, application_name),
                **(session_settings or {}),
            },
            init=_init_connection,
            connection_class=GuardedConnection,
            **pool_options,
        )
    except _UNAVAILABLE_ERRORS as error:
        raise unavailable(dsn, error) from None
    except _CONFIGURATION_ERRORS as error:
        raise misconfigured(dsn, error) from None
    assert pool is not None
    return pool


async def connect(
    settings: Settings, *, application_name: str = "orchestrator", dsn: str | None = None
) -> asyncpg.Connection:
    """One dedicated connection (for LISTEN, advisory locks, migrations)."""
    dsn = current_dsn(settings, dsn) if dsn else resolve_dsn(settings)
    try:
        connection = await asyncpg.connect(
            dsn,
            timeout=settings.connect_timeout_seconds,
            server_settings=server_settings(settings, application_name),
            connection_class=GuardedConnection,
        )
    except _UNAVAILABLE_ERRORS as error:
        raise unavailable(dsn, error) from None
    except _CONFIGURATION_ERRORS as error:
        raise misconfigured(dsn, error) from None
    await _init_connection(connection)
    return connection
