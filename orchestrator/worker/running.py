"""What a running worker built (``Worker._started``), in one place its tasks share."""

from __future__ import annotations

from dataclasses import dataclass

import asyncpg

from orchestrator.db.store import RunStore
from orchestrator.effects.dispatcher import Dispatcher
from orchestrator.effects.store import EffectStore
from orchestrator.worker.execution import RunServices
from orchestrator.worker.group_commit import GroupCommitter
from orchestrator.worker.heartbeat import LeaseKeeper
from orchestrator.worker.liveness import Liveness


@dataclass(frozen=True, slots=True)
class Running:
    """Built together and torn down together, so no task outlives what it uses."""

    dsn: str
    store: RunStore
    claim_pool: asyncpg.Pool
    keeper: LeaseKeeper
    committer: GroupCommitter
    dispatcher: Dispatcher
    liveness: Liveness
    effect_store: EffectStore
    services: RunServices
    statement_seconds: float
