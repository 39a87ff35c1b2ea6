"""What a worker is told to do (``serve``'s options), checked before it starts."""

from __future__ import annotations

import os
import secrets
import socket
from dataclasses import dataclass, field
from datetime import timedelta

from orchestrator.agent.steps import AgentRegistry
from orchestrator.effects.adapters import Adapter
from orchestrator.telemetry import QueueGauges


def default_worker_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"


@dataclass
class WorkerConfig:
    agents: AgentRegistry
    worker_id: str = field(default_factory=default_worker_id)
    concurrency: int = 10
    lease_seconds: float = 45.0
    heartbeat_seconds: float = 15.0
    poll_seconds: float = 2.0
    claim_batch: int = 50
    grace_seconds: float = 30.0
    reap_seconds: float = 1.0
    status_seconds: float = 10.0
    dead_session_takeover: bool = True
    effect_adapters: dict[str, Adapter] = field(default_factory=dict)
    """Vendors this worker's built-in dispatcher sends effects to (none: no dispatching)."""
    dispatch_lease_seconds: float = 60.0
    """The built-in dispatcher's lease on an effect it sends (see ``serve --help``)."""
    start_retry_seconds: float = 0.0
    """How long ``run`` keeps trying to reach PostgreSQL at start (``serve`` sets 30 s)."""
    gauges: QueueGauges | None = None
    """Sampled from the database every ``QueueGauges.SAMPLE_SECONDS`` when set (``serve
    --metrics-listen``)."""
    retention: timedelta | None = None
    """Finished runs older than this are deleted in the background (``orchestrator.db.retention``);
    ``None`` keeps them."""
    schedules: bool = True
    """Fire the schedules whose slot has come, sharing them with every other such process."""

    def validate(self) -> None:
        if self.concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        if self.reap_seconds <= 0:
            raise ValueError("the reaper interval must be positive (it is a sleep between looks)")
        if self.heartbeat_seconds * 2 > self.lease_seconds:
            raise ValueError(
                f"heartbeat every {self.heartbeat_seconds}s is too slow for a "
                f"{self.lease_seconds}s lease: renew at least twice per lease (lease/3 is usual)"
            )
        for agent in (self.agents.get(name) for name in self.agents.names):
            for step in agent.steps.values():
                if (
                    step.lease_seconds is not None
                    and step.lease_seconds < 2 * self.heartbeat_seconds
                ):
                    raise ValueError(
                        f"step {agent.name}.{step.step_name()} asks for a {step.lease_seconds}s "
                        f"lease, shorter than two heartbeats ({self.heartbeat_seconds}s each)"
                    )
