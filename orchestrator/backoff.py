"""Retry backoff parameters.

The delay itself is drawn in the database (``fail_attempt`` in ``sql/queries.sql``), from the
attempt number stored there: ``min(max, base * 2**(attempt-1))`` times a uniform draw in
[0.1, 1). Full jitter spreads retries of runs that failed together, so a vendor outage does not
come back as a synchronized wave; the 0.1 floor keeps jitter from becoming a hot loop.
"""

from __future__ import annotations

import email.utils
from dataclasses import dataclass
from datetime import UTC, datetime


@dataclass(frozen=True)
class Backoff:
    base_seconds: float = 1.0
    max_seconds: float = 300.0

    def ceiling(self, attempt: int) -> float:
        """The longest delay after ``attempt`` failed (the shortest is a tenth of it)."""
        return float(min(self.max_seconds, self.base_seconds * 2 ** max(attempt - 1, 0)))


def retry_after_seconds(value: str | None) -> float | None:
    """An HTTP ``Retry-After`` (a number of seconds or an HTTP date) in seconds from now."""
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        return None
    return max(0.0, (when - datetime.now(UTC)).total_seconds())
