"""The instants a schedule fires at, in UTC.

Cron expressions are read by croniter (the parser Airflow and many others rely on, kept up by
pallets-eco) over local wall-clock times; time zones come from the standard library's zoneinfo
with the ``tzdata`` package as its database where the system has none. croniter walks naive
local times and this module maps each to one instant, which is where daylight saving time is
decided (docs/schedules.md):

- a local time that does not exist (the clocks jump over it) fires once, at the first instant
  after the jump, so ``30 2 * * *`` fires at 03:00 on the day Berlin springs forward;
- a local time that happens twice (the clocks go back) fires once, at its first occurrence;
- several local times that land on one instant fire once.

An interval (``every``) is a fixed number of seconds since 1970-01-01 UTC, blind to time zones.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from croniter import CroniterBadDateError, croniter

from orchestrator.errors import InvalidInput

EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
MAX_EVERY = timedelta(days=366)
MAX_STEPS = 100_000
"""Local times a single question may walk past (a cron that matches almost never, a fold)."""
MAX_CRON_LENGTH = 200
FOLD_MARGIN = timedelta(hours=26)
"""Longer than any time a zone's clocks have gone back by."""


def check_zone(name: str) -> ZoneInfo:
    """The IANA time zone ``name`` names, or one line saying it is unknown."""
    if not isinstance(name, str) or not 1 <= len(name) <= 64:
        raise InvalidInput(f"a time zone is an IANA name such as Europe/Berlin, not {name!r}")
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError):
        raise InvalidInput(
            f"unknown time zone {name!r}: use an IANA name such as Europe/Berlin, "
            "America/New_York or UTC"
        ) from None


def check_cron(expression: str) -> str:
    """``expression`` if croniter reads it as five fields (minute hour day month weekday) or an
    alias such as ``@daily``; otherwise one line saying what is wrong."""
    if not isinstance(expression, str) or not 1 <= len(expression) <= MAX_CRON_LENGTH:
        raise InvalidInput(
            f"a cron expression is 1-{MAX_CRON_LENGTH} characters, not {expression!r}"
        )
    text = " ".join(expression.split())
    if not text.startswith("@") and len(text.split(" ")) != 5:
        raise InvalidInput(
            f"invalid cron expression {expression!r}: give five fields (minute hour day month "
            "weekday, such as '0 9 * * 1-5') or an alias such as @daily; "
            "for seconds use an interval (--every)"
        )
    if "\x00" in text or not croniter.is_valid(text):
        raise InvalidInput(
            f"invalid cron expression {expression!r}: give five fields (minute hour day month "
            "weekday, such as '0 9 * * 1-5') or an alias such as @daily"
        )
    return text


def check_every(every: timedelta) -> timedelta:
    if not isinstance(every, timedelta) or not timedelta(seconds=1) <= every <= MAX_EVERY:
        raise InvalidInput(f"an interval must be from 1 second to 366 days, not {every!r}")
    if every.microseconds:
        raise InvalidInput(f"an interval is a whole number of seconds, not {every!r}")
    return every


@dataclass(frozen=True)
class Calendar:
    """A cron expression in a time zone, or an interval: the slots a schedule has."""

    cron: str | None = None
    every: timedelta | None = None
    timezone: str = "UTC"

    def __post_init__(self) -> None:
        if (self.cron is None) == (self.every is None):
            raise InvalidInput("a schedule needs a cron expression or an interval (not both)")
        if self.cron is not None:
            object.__setattr__(self, "cron", check_cron(self.cron))
        if self.every is not None:
            check_every(self.every)
        check_zone(self.timezone)

    @property
    def zone(self) -> ZoneInfo:
        return ZoneInfo(self.timezone)

    def describe(self) -> str:
        if self.every is not None:
            return f"every {_seconds_text(self.every)}"
        return f"cron {self.cron!r} in {self.timezone}"

    # -- the questions a scheduler asks ----------------------------------------------------------
    def next_after(self, instant: datetime) -> datetime | None:
        """The first slot strictly after ``instant`` (None: the expression never matches)."""
        for slot in self.forward(instant):
            return slot
        return None

    def first_at_or_after(self, instant: datetime) -> datetime | None:
        return self.next_after(instant - timedelta(microseconds=1))

    def forward(self, after: datetime) -> Iterator[datetime]:
        """The slots strictly after ``after``, in order, each once."""
        _aware(after)
        if self.every is not None:
            step = int(self.every.total_seconds())
            k = (after - EPOCH) // timedelta(seconds=step) + 1
            while True:
                yield EPOCH + timedelta(seconds=k * step)
                k += 1
        local = after.astimezone(self.zone).replace(tzinfo=None)
        yield from self._cron(local, forward=True, keep=lambda slot, last: slot > (last or after))

    def backward(self, at_or_before: datetime) -> Iterator[datetime]:
        """The slots at or before ``at_or_before``, newest first, each once."""
        _aware(at_or_before)
        if self.every is not None:
            step = int(self.every.total_seconds())
            k = (at_or_before - EPOCH) // timedelta(seconds=step)
            while True:
                yield EPOCH + timedelta(seconds=k * step)
                k -= 1
        # Start a day later in local time: inside a repeated hour, local times after this one
        # (its first occurrence) are earlier instants still.
        local = at_or_before.astimezone(self.zone).replace(tzinfo=None) + FOLD_MARGIN
        yield from self._cron(
            local,
            forward=False,
            keep=lambda slot, last: slot <= at_or_before and (last is None or slot < last),
        )

    def _cron(
        self,
        local: datetime,
        *,
        forward: bool,
        keep: Callable[[datetime, datetime | None], bool],
    ) -> Iterator[datetime]:
        """The instants of the cron's local times from ``local`` on (or back), those ``keep``
        takes given the last one yielded: each local time's instant is decided by ``_instant``."""
        if self.cron is None:
            raise TypeError("an interval has no cron walk")
        zone = self.zone
        walk = croniter(self.cron, local)
        move = walk.get_next if forward else walk.get_prev
        last: datetime | None = None
        for _ in range(MAX_STEPS):
            try:
                naive = move(datetime)
            except CroniterBadDateError:
                return
            slot = _instant(naive, zone)
            if keep(slot, last):
                last = slot
                yield slot


def jitter(schedule_id: str, slot: datetime, most: timedelta) -> timedelta:
    """A delay below ``most``, the same every time for this schedule and slot, so that a retried
    fire or a backfill starts the run when the first try would have."""
    if most <= timedelta(0):
        return timedelta(0)
    digest = hashlib.sha256(f"{schedule_id}|{slot.isoformat()}".encode()).digest()
    fraction = int.from_bytes(digest[:8], "big") / 2**64
    return timedelta(seconds=round(fraction * most.total_seconds(), 3))


def _instant(naive: datetime, zone: ZoneInfo) -> datetime:
    """The instant a local wall-clock time fires at (the module's DST rule)."""
    first = naive.replace(tzinfo=zone, fold=0)
    utc = first.astimezone(UTC)
    if utc.astimezone(zone).replace(tzinfo=None) == naive:
        return utc  # exists (if it happens twice, fold=0 is its first occurrence)
    # Skipped: the jump lies between the two readings of the time; find its instant.
    low = naive.replace(tzinfo=zone, fold=1).astimezone(UTC)
    high = utc
    if low > high:
        low, high = high, low
    after = high.astimezone(zone).utcoffset()
    while high - low > timedelta(seconds=1):
        middle = low + (high - low) / 2
        if middle.astimezone(zone).utcoffset() == after:
            high = middle
        else:
            low = middle
    return high.replace(microsecond=0)  # jumps happen on whole seconds


def _aware(instant: datetime) -> None:
    if instant.tzinfo is None:
        raise InvalidInput(f"an instant needs a time zone, not the naive {instant.isoformat()}")


def _seconds_text(every: timedelta) -> str:
    seconds = int(every.total_seconds())
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds % size == 0:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"
