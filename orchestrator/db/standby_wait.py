"""Waiting for a streaming standby: what was acted on must survive a failover.

On an asynchronous standby a promotion takes back whatever the standby had not yet flushed. A
dispatcher therefore sends an effect only once a standby holds the claim that allows the send
(and, written before it, the step that asked for it); a client that asks for it is told that a
submission or a decision is done only once a standby holds it. Nothing else waits: claims,
renewals and step commits keep their asynchronous speed (docs/high-availability.md).

The positions come from ``orchestrator_standby_positions()`` (migration 0020), a definer
function, so no orchestrator role needs ``pg_read_all_stats``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio
import structlog

from orchestrator.db.rechecks import Rechecked
from orchestrator.errors import InvalidInput, OrchestratorError
from orchestrator.settings import StandbyPolicy, StandbyPosition, StandbyWait, WithoutStandby

if TYPE_CHECKING:
    from orchestrator.db.executor import Executor

log = structlog.get_logger("orchestrator.standby")

POSITIONS = "SELECT * FROM orchestrator_standby_positions()"
RECHECK_SECONDS = 1.0
"""How stale the last look at the standbys may be before a claim looks again."""
FIRST_POLL_SECONDS = 0.0002
LAST_POLL_SECONDS = 0.02
STANDBY_ACK_SECONDS = 30.0
"""How long a client waits for a standby to hold its commit before it says none did."""
"""A wait polls often at first (a standby on a nearby network flushes within a millisecond),
then backs off to this, so that a lagging standby costs the primary little."""


class StandbyNotReached(OrchestratorError):
    """A client asked to hear of a commit only once a standby holds it, and none did in time."""


@dataclass(frozen=True)
class StandbyPositions:
    """One look at the primary's physical standbys (``orchestrator_standby_positions()``)."""

    wal_end: int | None
    """Where the WAL holding every commit made before this look ends."""
    wal_flushed: int | None
    """Where the WAL flushed on the primary ends (enough after a commit that was flushed)."""
    in_recovery: bool
    physical_slots: int
    idle_slots: int
    standbys: int
    hidden: int
    least_flushed: int | None
    most_flushed: int | None
    least_replayed: int | None
    most_replayed: int | None

    @classmethod
    def from_record(cls, record: Any) -> StandbyPositions:
        return cls(**{name: record[name] for name in cls.__dataclass_fields__})

    def position(self, policy: StandbyPolicy) -> int | None:
        """How far the standbys that count have the WAL (``None``: none is connected)."""
        flushed = policy.position is StandbyPosition.FLUSH
        if policy.wait is StandbyWait.ALL:
            return self.least_flushed if flushed else self.least_replayed
        return self.most_flushed if flushed else self.most_replayed

    def holds(self, policy: StandbyPolicy, target: int) -> bool:
        reached = self.position(policy)
        return reached is not None and reached >= target

    def problem(self, policy: StandbyPolicy, *, seen: bool) -> str | None:
        """Why a standby that is expected cannot be waited for now, or ``None``; a primary
        that has none and expects none (no physical slot, none seen) has no problem."""
        if self.in_recovery:
            return "the server is a standby: connect to the primary"
        if self.hidden and not self.standbys:
            return (
                f"{self.hidden} standby(s) stream but their positions are hidden from the "
                "schema's owner: GRANT pg_read_all_stats TO the owner"
            )
        expected = seen or self.physical_slots > 0
        if self.standbys == 0 and expected:
            return (
                "no standby is connected (a physical replication slot exists or one was "
                "connected before)"
            )
        if policy.wait is StandbyWait.ALL and self.idle_slots:
            return f"{self.idle_slots} physical replication slot(s) have no standby streaming"
        return None


async def standby_positions(db: Executor) -> StandbyPositions:
    record = await db.fetchrow(POSITIONS)
    assert record is not None
    return StandbyPositions.from_record(record)


async def until_held(
    db: Executor,
    policy: StandbyPolicy,
    *,
    within: float,
    first: StandbyPositions | None = None,
    flushed: bool = False,
) -> StandbyPositions | None:
    """Wait until the standbys that count hold everything committed before this call (on
    ``db``'s connection, no transaction open); the last look, or ``None`` past ``within``.

    ``first``: a look taken after those commits (its WAL end is the target). ``flushed``: the
    commits were flushed at commit (whatever the session's ``synchronous_commit``).
    """
    positions = first or await standby_positions(db)
    target = positions.wal_flushed if flushed else positions.wal_end
    if target is None:
        return None  # a standby: nothing to wait for here
    began = time.monotonic()
    delay = FIRST_POLL_SECONDS
    while not positions.holds(policy, target):
        if time.monotonic() - began + delay > within or positions.problem(policy, seen=True):
            return None  # past the time, or the standbys that count went away
        await anyio.sleep(delay)
        delay = min(delay * 2, LAST_POLL_SECONDS)
        positions = await standby_positions(db)
    return positions


def acknowledgement_seconds(wait_for_standby: bool | float | None) -> float | None:
    """A caller's ``wait_for_standby``: ``False`` or ``None`` no wait (``None``), ``True`` waits
    ``STANDBY_ACK_SECONDS``, a number that many seconds (above 0, at most an hour)."""
    if wait_for_standby is False or wait_for_standby is None:
        return None
    if wait_for_standby is True:
        return STANDBY_ACK_SECONDS
    if (
        isinstance(wait_for_standby, bool)
        or not isinstance(wait_for_standby, int | float)
        or not 0 < wait_for_standby <= 3600
    ):
        raise InvalidInput(
            "wait_for_standby is True or a number of seconds above 0 and at most 3600, "
            f"not {wait_for_standby!r}"
        )
    return float(wait_for_standby)


async def wait_for_standby(db: Executor, policy: StandbyPolicy, *, within: float) -> None:
    """A client's wait after its commit: return once a standby holds it, or raise
    ``StandbyNotReached`` saying so (the commit itself stands on the primary). A primary
    with no standby (none connected, no physical slot) has nothing to wait for."""
    positions = await standby_positions(db)
    if positions.standbys == 0 and positions.physical_slots == 0 and not positions.hidden:
        return
    problem = positions.problem(policy, seen=False)
    if problem is None and await until_held(db, policy, within=within, first=positions):
        return
    raise StandbyNotReached(
        f"committed on the primary, but no standby held it within {within:g}s"
        + (f" ({problem})" if problem else "")
        + ": a failover now could take it back; check `orchestrator runs show` after one"
    )


class StandbyGate(Rechecked):
    """A dispatcher's view of its standbys: whether it may claim now (``may_claim``), whether
    a claim must wait for them (``waits``), and the wait itself (``held``).

    ``lone``: no standby is connected, none ever was (to this process) and no physical slot
    exists: a primary without replication, whose sends wait for nothing.
    """

    def __init__(self, policy: StandbyPolicy, *, recheck_seconds: float = RECHECK_SECONDS) -> None:
        self.policy = policy
        self.recheck_seconds = recheck_seconds
        self.seen = False
        """A standby streamed from this primary since the process started."""
        self.problem: str | None = None
        self.lone = True
        self._checked_at: float | None = None
        self._said: tuple[bool, str | None] | None = None

    @property
    def active(self) -> bool:
        return self.policy.wait is not StandbyWait.OFF

    @property
    def trusted(self) -> bool:
        """Every send of this primary's lost timelines waited for its standby, so no effect a
        promoted server has as never claimed was sent: no lookup for the failover's sake."""
        return self.active and self.policy.without is WithoutStandby.HOLD

    @property
    def holding(self) -> str | None:
        """Why effects are held now (the process is not ready), or ``None``."""
        if self.active and self.problem and self.policy.without is WithoutStandby.HOLD:
            return f"effects held: {self.problem} (--without-standby hold)"
        return None

    @property
    def waits(self) -> bool:
        """A claim must be held by a standby before its sends."""
        return self.active and not self.lone and self.problem is None

    async def check(self, db: Executor) -> str | None:
        """Look now; log when what the dispatcher does changes."""
        if not self.active:
            return None
        positions = await standby_positions(db)
        self.observe(positions)
        return self.problem

    def observe(self, positions: StandbyPositions) -> None:
        self.seen = self.seen or positions.standbys > 0
        self.problem = positions.problem(self.policy, seen=self.seen)
        self.lone = self.problem is None and not self.seen and positions.physical_slots == 0
        self._checked_at = time.monotonic()
        said = (self.lone, self.problem)
        if said != self._said:
            self._say()
            self._said = said

    def _say(self) -> None:
        if self.problem is None:
            if self.lone:
                log.info("no standby replicates this primary: effects are sent once claimed")
            else:
                log.info(
                    "effects wait for a standby",
                    standbys=self.policy.wait.value,
                    position=self.policy.position.value,
                )
        elif self.policy.without is WithoutStandby.HOLD:
            log.error(
                "effects held: no standby holds their records",
                problem=self.problem,
                choice="--without-standby hold (send: send as a lone primary)",
            )
        else:
            log.warning(
                "effects sent without a standby: a failover may take back what they were sent for",
                problem=self.problem,
                choice="--without-standby send",
            )

    async def may_claim(self, db: Executor) -> bool:
        """Whether to claim now, looking again when the last look is stale."""
        if not self.active:
            return True
        problem = await self.current_problem(db)
        return problem is None or self.policy.without is WithoutStandby.SEND

    def sends_unwaited(self) -> bool:
        """Whether a claim may be sent without waiting (``waits`` is false): no wait is asked
        for, the primary is a lone one, or an expected standby is away and the choice is to
        send."""
        return not self.active or self.problem is None or self.policy.without is WithoutStandby.SEND

    async def held(self, db: Executor, *, within: float) -> bool:
        """After a claim committed, while ``waits``: whether a standby holds it within
        ``within`` seconds (or, if the standbys went since the last look, whether it may be
        sent unwaited)."""
        first = await standby_positions(db)
        self.observe(first)
        if not self.waits:
            return self.sends_unwaited()
        held = await until_held(db, self.policy, within=within, first=first, flushed=True)
        return held is not None
