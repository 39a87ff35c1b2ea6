"""A real primary and streaming standby (``orchestrator.testing.ReplicatedPostgres``): replication,
a failover that loses what the standby never got (a plain ``fence + 1`` counter then issues a
fence twice: issue 21), the timeline a promotion starts, a second failover after the re-seed, and
the synchronous mode's cancelled wait that reports success with a WARNING.

One pair serves the module (starting one costs seconds); each test starts from a streaming,
asynchronous pair.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import anyio
import asyncpg
import pytest

from orchestrator.testing import ReplicatedPostgres
from orchestrator.testing.pair_node import refuses

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

CLAIM = "UPDATE fences SET fence = fence + 1 WHERE run_id = $1 RETURNING fence"
"""The claim as it was before issue 21: a counter, nothing more."""
SYNC_CANCEL_MESSAGE = "canceling wait for synchronous replication due to user request"
SYNC_CANCEL_DETAIL = (
    "The transaction has already committed locally, but might not have been replicated to the "
    "standby."
)


@pytest.fixture(scope="module")
def shared_pair() -> Iterator[ReplicatedPostgres]:
    with ReplicatedPostgres() as pair:
        yield pair


@pytest.fixture
async def pair(shared_pair: ReplicatedPostgres) -> ReplicatedPostgres:
    """The module's pair, asynchronous and streaming whatever the last test left."""
    await anyio.to_thread.run_sync(shared_pair.set_synchronous, False)
    await anyio.to_thread.run_sync(shared_pair.start_standby)
    return shared_pair


@pytest.fixture
async def client(pair: ReplicatedPostgres) -> AsyncIterator[asyncpg.Connection]:
    """A connection through the multi-host DSN, to whichever server is primary now."""
    connection = await asyncpg.connect(pair.dsn(), timeout=10)
    try:
        yield connection
    finally:
        connection.terminate()


async def fresh_run(connection: asyncpg.Connection, run_id: str) -> None:
    await connection.execute(
        "CREATE TABLE IF NOT EXISTS fences (run_id text PRIMARY KEY, fence bigint NOT NULL)"
    )
    await connection.execute("INSERT INTO fences VALUES ($1, 0)", run_id)


async def test_a_write_on_the_primary_reaches_the_standby_which_refuses_writes(
    pair: ReplicatedPostgres, client: asyncpg.Connection
) -> None:
    assert await client.fetchval("SELECT inet_server_port()") == pair.primary.port
    assert await client.fetchval("SELECT pg_is_in_recovery()") is False
    await fresh_run(client, "replicated")
    await anyio.to_thread.run_sync(pair.wait_replayed)
    standby = await asyncpg.connect(pair.standby_dsn(), timeout=10)
    try:
        assert await standby.fetchval("SELECT pg_is_in_recovery()") is True
        assert await standby.fetchval("SELECT fence FROM fences WHERE run_id = 'replicated'") == 0
        with pytest.raises(asyncpg.ReadOnlySQLTransactionError):
            await standby.execute("INSERT INTO fences VALUES ('on the standby', 0)")
    finally:
        await standby.close()


async def test_a_failover_loses_the_claims_the_standby_never_got_and_a_counter_reissues_them(
    pair: ReplicatedPostgres, client: asyncpg.Connection
) -> None:
    await fresh_run(client, "lost")
    replicated = [await client.fetchval(CLAIM, "lost") for _ in range(3)]
    await anyio.to_thread.run_sync(pair.wait_replayed)
    await anyio.to_thread.run_sync(pair.stop_standby)  # the partition: the primary goes on alone
    unreplicated = [await client.fetchval(CLAIM, "lost") for _ in range(2)]
    assert replicated + unreplicated == [1, 2, 3, 4, 5]
    timeline = await anyio.to_thread.run_sync(pair.timeline)

    await anyio.to_thread.run_sync(pair.kill_primary)
    await anyio.to_thread.run_sync(pair.promote)
    # At once, before any checkpoint: an epoch may be read from it right after promotion.
    assert await anyio.to_thread.run_sync(pair.timeline) == timeline + 1

    # The same DSN finds the promoted server; it never saw fences 4 and 5.
    after = await asyncpg.connect(pair.dsn(), timeout=10)
    try:
        assert await after.fetchval("SELECT inet_server_port()") == pair.primary.port
        assert await after.fetchval("SELECT fence FROM fences WHERE run_id = 'lost'") == 3
        reissued = await after.fetchval(CLAIM, "lost")
    finally:
        await after.close()
    assert reissued == 4 and reissued in unreplicated  # a fence handed out twice

    await anyio.to_thread.run_sync(pair.reseed)
    await anyio.to_thread.run_sync(pair.wait_replayed)  # a new standby streams from the new primary


async def test_a_second_failover_after_the_reseed_keeps_what_was_replicated(
    pair: ReplicatedPostgres, client: asyncpg.Connection
) -> None:
    await fresh_run(client, "kept")
    assert await client.fetchval(CLAIM, "kept") == 1
    await anyio.to_thread.run_sync(pair.wait_replayed)
    before = pair.primary.port
    failovers = len(pair.failovers)
    done = await anyio.to_thread.run_sync(pair.failover)
    assert done.new_timeline == done.old_timeline + 1
    assert pair.primary.port != before and pair.standby.port == before
    assert len(pair.failovers) == failovers + 1
    after = await asyncpg.connect(pair.dsn(), timeout=10)
    try:
        assert await after.fetchval("SELECT fence FROM fences WHERE run_id = 'kept'") == 1
        assert await after.fetchval(CLAIM, "kept") == 2
    finally:
        await after.close()
    await anyio.to_thread.run_sync(pair.wait_replayed)


async def test_in_synchronous_mode_a_cancelled_wait_reports_success_with_a_warning_and_is_lost(
    pair: ReplicatedPostgres, client: asyncpg.Connection
) -> None:
    await anyio.to_thread.run_sync(pair.set_synchronous, True)
    assert await client.fetchval("SHOW synchronous_standby_names") == "FIRST 1 (standby)"
    assert await client.fetchval("SHOW synchronous_commit") == "on"
    await fresh_run(client, "sync")
    assert await client.fetchval(CLAIM, "sync") == 1  # the standby acknowledged it
    notices: list[asyncpg.PostgresLogMessage] = []
    warned = anyio.Event()

    def listen(_: object, message: asyncpg.PostgresLogMessage) -> None:
        notices.append(message)
        warned.set()

    client.add_log_listener(listen)

    await anyio.to_thread.run_sync(pair.stop_standby)
    answers: list[int] = []

    async def claim() -> None:
        answers.append(await client.fetchval(CLAIM, "sync"))

    async with anyio.create_task_group() as group:
        group.start_soon(claim)
        for _ in range(400):  # 20 s
            if await anyio.to_thread.run_sync(pair.sync_waiters) == 1:
                break
            await anyio.sleep(0.05)
        else:
            pytest.fail("the claim never waited for the synchronous standby")
        await anyio.sleep(0.3)
        assert answers == []  # committed locally, waiting for the standby
        assert await anyio.to_thread.run_sync(pair.cancel_sync_waiters) == 1
    with anyio.fail_after(5):
        await warned.wait()

    assert answers == [2]  # a success, for a claim that exists on the primary alone
    [warning] = notices
    assert isinstance(warning, asyncpg.PostgresWarning)
    fields = warning.as_dict()
    assert fields["severity"] == "WARNING" and fields["severity_en"] == "WARNING"
    assert fields["sqlstate"] == "01000"
    assert fields["message"] == SYNC_CANCEL_MESSAGE
    assert fields["detail"] == SYNC_CANCEL_DETAIL

    await anyio.to_thread.run_sync(pair.failover)
    after = await asyncpg.connect(pair.dsn(), timeout=10)
    try:
        assert await after.fetchval("SELECT fence FROM fences WHERE run_id = 'sync'") == 1
    finally:
        await after.close()


def test_close_kills_both_servers_and_removes_the_directory_it_made() -> None:
    with ReplicatedPostgres(synchronous=True) as pair:
        assert pair.primary.sql("SHOW synchronous_standby_names") == "FIRST 1 (standby)"
        work_dir: Path = pair.work_dir
        assert work_dir.is_dir()
    assert all(refuses(port) for port in pair.ports)
    assert not work_dir.exists()
