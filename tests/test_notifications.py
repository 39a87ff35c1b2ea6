"""LISTEN/NOTIFY: every channel the SQL sends on is one ``orchestrator.db.notifications`` names,
and its listener survives the death of its connection (real PostgreSQL)."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path

import anyio
import asyncpg
import pytest

from orchestrator.db import notifications
from orchestrator.db.connections import connect, create_pool
from orchestrator.db.notifications import (
    CANCEL_CHANNEL,
    CHANNELS,
    RUNS_CHANNEL,
    Listener,
)
from orchestrator.settings import Settings

SQL = Path(__file__).resolve().parent.parent / "sql"
NAME = "test-listener"
NOTIFIES = (
    re.compile(r"pg_notify\(\s*'([^']*)'", re.IGNORECASE),
    re.compile(r"\bNOTIFY\s+\"?([A-Za-z_][A-Za-z0-9_$]*)", re.IGNORECASE),
)


def notified_channels(text: str) -> set[str]:
    """The channels a SQL text sends on (comments left out: they name channels in prose)."""
    code = re.sub(r"--[^\n]*", "", text)
    return {channel for pattern in NOTIFIES for channel in pattern.findall(code)}


def test_every_channel_the_sql_notifies_is_a_known_constant() -> None:
    files = [SQL / "queries.sql", SQL / "schema.sql", *sorted((SQL / "migrations").glob("*.sql"))]
    sent: dict[str, set[str]] = {}
    for path in files:
        for channel in notified_channels(path.read_text("utf-8")):
            sent.setdefault(channel, set()).add(path.name)
    unknown = {channel: files for channel, files in sent.items() if channel not in CHANNELS}
    assert not unknown, f"channels not in orchestrator.db.notifications: {unknown}"
    # Each constant is sent by the current SQL (a stale name would listen for nothing).
    assert set(sent) == CHANNELS


def test_the_channel_scan_finds_both_spellings() -> None:
    assert notified_channels("SELECT pg_notify('a', x); NOTIFY b, 'y'; -- NOTIFY c") == {"a", "b"}


def test_the_module_names_every_channel_once() -> None:
    constants = {
        name: value for name, value in vars(notifications).items() if name.endswith("_CHANNEL")
    }
    assert set(constants.values()) == CHANNELS and len(constants) == len(CHANNELS)


def test_a_listener_refuses_an_unknown_channel() -> None:
    with pytest.raises(ValueError, match="unknown channels"):
        Listener(("orchestrator_nothing",), lambda channel, payload: None, connect=_never)


async def _never() -> asyncpg.Connection:
    raise AssertionError("not connected in this test")


async def eventually(condition: Callable[[], bool], *, within: float = 10.0) -> None:
    with anyio.fail_after(within):
        while not condition():  # noqa: ASYNC110 (what it waits for sets no event)
            await anyio.sleep(0.02)


@asynccontextmanager
async def source(settings: Settings, borrowed: bool) -> AsyncIterator[dict[str, object]]:
    """A dedicated connection's opener, or a pool of one connection (the dispatcher's way)."""
    if not borrowed:
        yield {"connect": partial(connect, settings, application_name=NAME)}
        return
    own = await create_pool(settings, application_name=NAME, min_size=1, max_size=1)
    try:
        yield {"pool": own}
    finally:
        await own.close()


@pytest.mark.parametrize("borrowed", [False, True], ids=["dedicated", "pooled"])
async def test_the_listener_reconnects_after_its_connection_is_killed(
    settings: Settings, pool: asyncpg.Pool, borrowed: bool
) -> None:
    heard: list[tuple[str, str]] = []
    listened = 0

    def on_listening() -> None:
        nonlocal listened
        listened += 1

    async with source(settings, borrowed) as opener:
        listener = Listener(
            (RUNS_CHANNEL, CANCEL_CHANNEL),
            lambda channel, payload: heard.append((channel, payload)),
            connect_seconds=10,
            check_seconds=0.1,
            statement_seconds=5,
            retry_seconds=0.05,
            max_retry_seconds=0.4,
            on_listening=on_listening,
            **opener,  # type: ignore[arg-type]
        )
        async with anyio.create_task_group() as group:
            await group.start(listener.run)
            assert listener.listening and listened == 1
            await pool.execute("SELECT pg_notify($1, 'before')", RUNS_CHANNEL)
            await eventually(lambda: heard == [(RUNS_CHANNEL, "before")])

            killed = await pool.fetchval(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
                " WHERE application_name = $1",
                NAME,
            )
            assert killed == 1
            await eventually(lambda: listened == 2)
            await pool.execute("SELECT pg_notify($1, 'after')", CANCEL_CHANNEL)
            await eventually(lambda: (CANCEL_CHANNEL, "after") in heard)
            group.cancel_scope.cancel()
        assert not listener.listening
        if borrowed:
            # Given back to its pool without its LISTENs: the next borrower hears nothing.
            own: asyncpg.Pool = opener["pool"]  # type: ignore[assignment]
            assert await own.fetchval("SELECT count(*) FROM pg_listening_channels()") == 0


async def test_listen_opens_only_when_not_listening(settings: Settings, pool: asyncpg.Pool) -> None:
    """``Client.wait``'s way: no task, the connection (re)opened by whoever needs it."""
    heard: list[str] = []
    listener = Listener(
        (RUNS_CHANNEL,),
        lambda channel, payload: heard.append(payload),
        connect=partial(connect, settings, application_name=NAME),
    )
    try:
        assert await listener.listen() is True
        assert await listener.listen() is False
        await pool.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = $1",
            NAME,
        )
        await eventually(lambda: not listener.listening)
        assert await listener.listen() is True
        await pool.execute("SELECT pg_notify($1, 'again')", RUNS_CHANNEL)
        await eventually(lambda: heard == ["again"])
    finally:
        await listener.close()
    assert not listener.listening
