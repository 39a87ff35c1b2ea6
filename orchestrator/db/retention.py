"""Retention's rules: how old a finished run must be before it is deleted, and how ages are
written (``2h``, ``30d``). The deleting itself is ``orchestrator.db.purges``."""

from __future__ import annotations

import re
from datetime import timedelta

from orchestrator.errors import InvalidInput

DEFAULT_RETENTION = "off"
"""``serve`` keeps finished runs unless told otherwise (``--retention 30d``): a purged run's
idempotency key is gone with it, so a late resubmission would start a new run."""
PURGE_BATCH = 500
"""Runs per delete statement: a batch's transaction stays short and its locks few."""
PURGE_INTERVAL_SECONDS = 60.0
"""How often a worker looks for runs past their retention."""
PURGE_BATCHES_PER_ROUND = 20
"""A worker's round deletes at most this many batches, then waits for the next round."""
PURGE_PAUSE_RATIO = 1.0
"""After each batch a purge pauses this many times as long as the batch took, so that it takes
at most half of the database's time from the workers running beside it."""

AGE_PATTERN = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|m|h|d|w)\s*$")
_UNIT_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86_400, "w": 604_800}
MAX_AGE = timedelta(days=36_500)
MIN_SERVE_RETENTION = timedelta(hours=1)
"""A worker purges only runs that finished at least this long ago (the database refuses
younger ones from any role but the schema's owner): a client may still be reading a run that
finished seconds earlier."""


def parse_age(text: str, what: str = "--older-than") -> timedelta:
    """``30d``, ``12h``, ``90m``, ``3600s`` or ``2w``."""
    matched = AGE_PATTERN.fullmatch(text)
    if matched is None:
        raise InvalidInput(f"{what} takes an age such as 30d, 12h, 90m or 3600s, not {text!r}")
    seconds = float(matched.group(1)) * _UNIT_SECONDS[matched.group(2)]
    # Bounded before a timedelta is built: a huge count overflows it (OverflowError).
    age = timedelta(seconds=seconds) if seconds <= MAX_AGE.total_seconds() else MAX_AGE * 2
    if not timedelta(0) < age <= MAX_AGE:  # 0.0000001s rounds to nothing: "purge everything"
        raise InvalidInput(f"{what} must be above 0 and at most 100 years (36500d), not {text!r}")
    return age


def parse_retention(text: str) -> timedelta | None:
    """``serve --retention``: an age, or ``off`` to keep finished runs forever."""
    if text.strip().lower() in ("off", "none", "forever"):
        return None
    age = parse_age(text, "--retention")
    if age < MIN_SERVE_RETENTION:
        raise InvalidInput(
            f"--retention must be at least 1h, not {text!r}: a client may still be reading a run "
            "that just finished (`orchestrator runs purge --older-than` purges younger runs on "
            "demand)"
        )
    return age
