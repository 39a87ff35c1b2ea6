"""The deadlines and size limits every execution of one worker runs under, set once."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from orchestrator.agent.steps import DEFAULT_MAX_CHECKPOINT_BYTES
from orchestrator.models import DEFAULT_MAX_MESSAGE_BYTES
from orchestrator.worker.outcomes import Limits


@dataclass
class RunnerConfig:
    worker_id: str
    lease_seconds: float
    statement_seconds: float
    cleanup_seconds: float = 5.0
    max_checkpoint_bytes: int = DEFAULT_MAX_CHECKPOINT_BYTES
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES

    @functools.cached_property
    def limits(self) -> Limits:
        """The size limits every step's outcome is checked against (built once)."""
        return Limits(self.max_checkpoint_bytes, self.max_message_bytes)
