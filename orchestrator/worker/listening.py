"""The worker's LISTEN connection: what each notification means to a worker, in one place."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from orchestrator.db.connections import connect
from orchestrator.db.notifications import (
    CANCEL_CHANNEL,
    RUNS_CHANNEL,
    SETTLED_CHANNEL,
    SIGNALS_CHANNEL,
    Listener,
)
from orchestrator.effects.waiting import EffectWaiters
from orchestrator.settings import Settings
from orchestrator.worker.config import WorkerConfig
from orchestrator.worker.execution import RunExecution
from orchestrator.worker.running import Running


def worker_listener(
    settings: Settings,
    config: WorkerConfig,
    running: Running,
    active: dict[str, RunExecution],
    effect_waiters: EffectWaiters,
    wake_for_expired: Callable[[], None],
) -> Listener:
    """Wake on submits and due runs; cut a run's execution short when it is cancelled.

    Its ``run`` reports started after its first attempt to listen, whether that succeeded or
    not (a worker that cannot listen still claims, by polling). While not listening, a cancel
    reaches the owner at its next heartbeat instead: the renewal is refused.
    """
    agents = set(config.agents.names)

    def on_notify(channel: str, payload: str) -> None:
        if channel == RUNS_CHANNEL and payload in agents:
            # A submit, a release, or another worker's reaper ending leases: the channel
            # does not say which, so the next claim also looks for expired leases.
            wake_for_expired()
        elif channel == SETTLED_CHANNEL:
            effect_waiters.notify(payload)
        elif channel == SIGNALS_CHANNEL:
            signalled = active.get(payload)
            if signalled is not None:
                signalled.signalled = True
        elif channel == CANCEL_CHANNEL:
            execution = active.get(payload)
            if execution is not None:
                execution.handle.lose("the run was cancelled")

    return Listener(
        (RUNS_CHANNEL, CANCEL_CHANNEL, SETTLED_CHANNEL, SIGNALS_CHANNEL),
        on_notify,
        connect=partial(
            connect, settings, dsn=running.dsn, application_name=config.worker_id + ":listen"
        ),
        connect_seconds=running.statement_seconds,
        check_seconds=config.poll_seconds,
        statement_seconds=running.statement_seconds,
        retry_seconds=config.poll_seconds,
        # Whatever happened while not listening: look for it now.
        on_listening=wake_for_expired,
    )
