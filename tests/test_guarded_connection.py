"""Every orchestrator connection: no cancel request ever reaches the server, and an answer that
carries the "committed locally, not replicated" warning is an unknown outcome, not a success.

These pin two private asyncpg hooks (``Connection._cancel``, ``_process_log_message``) against
the installed asyncpg: if an upgrade renames them, these tests fail rather than the guarantee
quietly lapsing. tests/test_failover.py meets the real warning from a real synchronous standby.
"""

from __future__ import annotations

import anyio
import asyncpg
import pytest

from orchestrator.db.connections import connect, create_pool
from orchestrator.db.guarded import GuardedConnection
from orchestrator.errors import DatabaseUnavailable, OutcomeUnknown
from orchestrator.settings import Settings

UNREPLICATED = (
    "DO $$ BEGIN RAISE WARNING 'canceling wait for synchronous replication due to user request'"
    " USING ERRCODE = '{code}', DETAIL = 'The transaction has already committed locally, but"
    " might not have been replicated to the standby.'; END $$"
)


async def _backend(admin: asyncpg.Connection, pid: int) -> asyncpg.Record | None:
    return await admin.fetchrow("SELECT state, query FROM pg_stat_activity WHERE pid = $1", pid)


async def test_a_statement_given_up_on_is_never_cancelled_on_the_server(settings: Settings) -> None:
    connection = await connect(settings, application_name="guarded-test")
    admin = await asyncpg.connect(settings.database_url)
    pid = connection.get_server_pid()
    try:
        assert isinstance(connection, GuardedConnection)
        with anyio.move_on_after(0.3):
            await connection.execute("SELECT pg_sleep(30)")
        # The client gave up: it aborted its connection rather than ask the server to cancel.
        for _ in range(20):
            await anyio.sleep(0.05)
            if connection.is_closed():
                break
        assert connection.is_closed()
        # The statement still runs on the server a second later: no cancel request was sent
        # (with one, the backend would be idle or gone within milliseconds).
        await anyio.sleep(1.0)
        backend = await _backend(admin, pid)
        assert backend is not None and backend["state"] == "active"
        assert "pg_sleep" in backend["query"]
    finally:
        await admin.execute("SELECT pg_terminate_backend($1)", pid)
        await admin.close()
        connection.terminate()


async def test_a_client_timeout_aborts_the_connection_too(settings: Settings) -> None:
    pool = await create_pool(settings, application_name="guarded-test", max_size=1)
    admin = await asyncpg.connect(settings.database_url)
    try:
        async with pool.acquire() as connection:
            pid = connection.get_server_pid()
            with pytest.raises(TimeoutError):
                await connection.fetchval("SELECT pg_sleep(30)", timeout=0.3)
        await anyio.sleep(1.0)
        backend = await _backend(admin, pid)
        assert backend is not None and backend["state"] == "active"
        # The pool replaced the aborted connection: the next statement works.
        assert await pool.fetchval("SELECT 1") == 1
    finally:
        await admin.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE query LIKE "
            "'SELECT pg_sleep(30)%'"
        )
        await admin.close()
        await pool.close()


@pytest.mark.parametrize("code", ["01000", "57P01"])
async def test_the_unreplicated_commit_warning_is_an_unknown_outcome(
    settings: Settings, code: str
) -> None:
    pool = await create_pool(settings, application_name="guarded-test", max_size=2)
    try:
        with pytest.raises(OutcomeUnknown, match="synchronous standby") as raised:
            await pool.execute(UNREPLICATED.format(code=code))
        assert isinstance(raised.value, DatabaseUnavailable)  # handled as a lost connection
        async with pool.acquire() as connection:
            # The real warning answers the COMMIT: a deferred trigger warns at commit time.
            await connection.execute(
                "CREATE TEMP TABLE written (x int);"
                "CREATE FUNCTION pg_temp.warn() RETURNS trigger LANGUAGE plpgsql AS $f$ BEGIN "
                + UNREPLICATED.format(code=code)[len("DO $$ BEGIN ") : -len(" END $$")]
                + " RETURN NULL; END $f$;"
                "CREATE CONSTRAINT TRIGGER at_commit AFTER INSERT ON written DEFERRABLE "
                "INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION pg_temp.warn()"
            )
            with pytest.raises(OutcomeUnknown):
                async with connection.transaction():
                    await connection.execute("INSERT INTO written VALUES (1)")
            # Committed locally, as PostgreSQL does when the wait is cancelled.
            assert await connection.fetchval("SELECT count(*) FROM written") == 1
        # Every later statement gets an answer of its own.
        assert await pool.fetchval("SELECT 2") == 2
    finally:
        await pool.close()


async def test_other_warnings_are_answers_as_usual(settings: Settings) -> None:
    connection = await connect(settings, application_name="guarded-test")
    try:
        await connection.execute(
            "DO $$ BEGIN RAISE WARNING 'deprecated' USING ERRCODE = '01P01'; END $$"
        )
        assert await connection.fetchval("SELECT 3") == 3
        assert not connection.is_closed()
    finally:
        await connection.close()


async def test_a_read_only_server_aborts_the_connection(settings: Settings) -> None:
    """A standby, or a primary demoted by a failover, refuses writes: the connection is dropped
    so that a pool reconnects (through a multi-host DSN, to the new primary)."""
    connection = await connect(settings, application_name="guarded-test")
    try:
        await connection.execute("SET default_transaction_read_only = on")
        with pytest.raises(asyncpg.ReadOnlySQLTransactionError):
            await connection.execute("CREATE TEMP TABLE t (x int)")
        assert connection.is_closed()
    finally:
        connection.terminate()
