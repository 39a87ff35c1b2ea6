"""How one execution of a run ended, as its worker saw it: the one vocabulary the execution, the
worker's counts and the metrics share (the run's state is in its row)."""

from __future__ import annotations

import enum

from orchestrator.models import RunState
from orchestrator.telemetry import DISPOSITION

NOT_THE_OWNER = "refused: not the owner any more"
"""Ends the reason a lease was lost when the database refused a fenced write (a stale fence),
as opposed to the worker's own lease check (a refused renewal, the local deadline)."""


class Disposition(enum.StrEnum):
    """How one execution of a run ended, as this worker saw it (the run's state is in the row)."""

    SUCCEEDED = "succeeded"
    FAILED = "failed"
    """The step returned ``Fail``: failed for good."""
    RETRY_SCHEDULED = "retry_scheduled"
    """The step raised: the run waits for its retry's backoff."""
    DEAD = "dead"
    """The step raised on its last attempt: dead-lettered."""
    WAITING = "waiting"
    """The step returned ``Wait``: committed, lease and slot given back until woken."""
    RELEASED = "released"
    """Given back at shutdown or after a drained cutover's last step, fence unchanged, attempt
    not counted."""
    LOST = "lost"
    """Ownership was lost or could not be proven: nothing more was committed."""
    CANCELLED = "cancelled"
    """The run was cancelled while this worker held it: nothing more was committed."""
    CRASHED = "crashed"
    """A bug in the runtime ended the execution (logged); the lease is left to expire."""


FINAL_DISPOSITIONS = {
    RunState.SUCCEEDED: Disposition.SUCCEEDED,
    RunState.FAILED: Disposition.FAILED,
}
"""The disposition of a run its final commit finished, by the state that commit wrote."""

DISPOSITION_ATTRIBUTES = {
    disposition: {DISPOSITION: disposition.value} for disposition in Disposition
}
"""Metric attributes per disposition, built once."""
