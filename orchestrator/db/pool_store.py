"""The base of the run store's parts: statements run on the pool unless the caller hands over
its own connection (``db=``), so one transaction can span several stores."""

from __future__ import annotations

import asyncpg


class PoolStore:
    def __init__(self, pool: asyncpg.Pool) -> None:
        self.pool = pool
