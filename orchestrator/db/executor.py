"""What a statement runs on: its own module, so that the stores of every feature can name it
without importing the run store (and the run store without importing them)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, TypeAlias

import asyncpg

if TYPE_CHECKING:
    from asyncpg.pool import PoolConnectionProxy

Executor: TypeAlias = "asyncpg.Pool | asyncpg.Connection | PoolConnectionProxy[asyncpg.Record]"
"""Where a statement runs: the store's pool by default, or a caller's connection that carries
its own deadline (the runtime aborts a connection that overruns, rather than wait on it)."""

TransactionConnection: TypeAlias = "asyncpg.Connection | PoolConnectionProxy[asyncpg.Record]"
"""A connection a caller holds a transaction on."""


@asynccontextmanager
async def in_transaction(db: Executor) -> AsyncIterator[TransactionConnection]:
    """A connection in a transaction: a pool's, or the caller's own (a savepoint if it already
    holds one), so that a decision and its audit row commit or roll back together."""
    if isinstance(db, asyncpg.Pool):
        async with db.acquire() as connection, connection.transaction():
            yield connection
    else:
        async with db.transaction():
            yield db
