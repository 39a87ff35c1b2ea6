"""What a statement runs on: its own module, so that the stores of every feature can name it
without importing the run store (and the run store without importing them)."""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeAlias

import asyncpg

if TYPE_CHECKING:
    from asyncpg.pool import PoolConnectionProxy

Executor: TypeAlias = "asyncpg.Pool | asyncpg.Connection | PoolConnectionProxy[asyncpg.Record]"
"""Where a statement runs: the store's pool by default, or a caller's connection that carries
its own deadline (the runtime aborts a connection that overruns, rather than wait on it)."""

TransactionConnection: TypeAlias = "asyncpg.Connection | PoolConnectionProxy[asyncpg.Record]"
"""A connection a caller holds a transaction on."""
