"""Flow control under chaos: the campaign's keyed runs and limits, and the checker's two rules on
them, judged from samples taken while the campaign runs (a slot exists only while a lease does,
so nothing is left to count after quiescence).

A run holds a slot of a limit exactly as ``orchestrator_running`` counts it
(docs/flow-control.md): its state is ``running``, it has a lease owner, and its lease has not
ended more than ``GRACE`` ago. Each sample reads the runs and the limits in one snapshot, counts
that independently of the database's functions, and also asks ``orchestrator_running`` itself,
so that the rules catch an overfilled limit and a counter that counts what holds no lease.
"""

from __future__ import annotations

import math
import random
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta

import anyio
import asyncpg

from orchestrator.chaos.checker import LIMIT_EXCEEDED, SLOT_WITHOUT_LEASE
from orchestrator.chaos.findings import Findings, Violation
from orchestrator.chaos.statements import CAMPAIGN_ERRORS, STATEMENT_SECONDS
from orchestrator.db.limits import LimitStore, Per

KEYS = ("acme", "bolt", "cove", "dune")
KEY_WEIGHTS = (6, 3, 2, 1)
"""Skewed, as tenants are: the busiest key meets its limit, the quietest rarely has two runs."""
KEYED_SHARE = 0.6
GRACE = timedelta(seconds=1)
"""``orchestrator_running``'s: a lease that ended this recently still holds its slot."""
SAMPLE_SECONDS = 0.075


@dataclass(frozen=True)
class CampaignLimit:
    """A limit the campaign sets on each of its agents before the workers start."""

    max_running: int
    key_pattern: str = "*"
    per: Per = "all"


CAMPAIGN_LIMITS = (CampaignLimit(2, per="key"), CampaignLimit(5))
"""Tight enough that faults holding leases (a stopped or killed worker keeps its slots until its
leases end) meet full limits, loose enough that the workload still finishes in its window."""


def concurrency_key(rng: random.Random, share: float) -> str | None:
    """A run's key: one of ``KEYS`` (skewed) for ``share`` of the runs, none for the rest."""
    if rng.random() >= share:
        return None
    return rng.choices(KEYS, KEY_WEIGHTS)[0]


async def set_limits(
    pool: asyncpg.Pool, limits: Sequence[CampaignLimit], agents: Sequence[str]
) -> None:
    store = LimitStore(pool)
    for agent in agents:
        for limit in limits:
            await store.set(agent, limit.max_running, key_pattern=limit.key_pattern, per=limit.per)


_RUNS = """
SELECT run_id, agent, concurrency_key, state, lease_owner, lease_until
FROM orchestrator.runs
WHERE state = 'running' OR lease_owner IS NOT NULL OR lease_until IS NOT NULL
"""
"""Every run a counter could count: one holding a lease, or with any lease column set."""

_SLOTS = """
SELECT l.agent, l.key_pattern, l.per, l.max_running, k.key,
       orchestrator.orchestrator_running(l.agent, l.key_pattern, l.per, k.key) AS counted
FROM orchestrator.flow_limits AS l
CROSS JOIN LATERAL (
    SELECT NULL::text AS key WHERE l.per = 'all'
    UNION
    SELECT r.concurrency_key FROM orchestrator.runs AS r
    WHERE l.per = 'key' AND r.agent = l.agent AND r.concurrency_key IS NOT NULL
      AND orchestrator.orchestrator_key_matches(r.concurrency_key, l.key_pattern, 'key')
) AS k
"""
"""Each limit in force, per key for a per-key limit, with what the claims' counter counts."""


@dataclass
class _Episode:
    detail: str
    first: float
    samples: int = 1


@dataclass
class LimitSampler:
    """Samples the runs holding a lease against the limits in force, skipping a sample the
    database fails (a fault restarting or terminating it), and keeps each broken rule once per
    subject, with how many samples saw it."""

    pool: asyncpg.Pool
    taken: int = 0
    skipped: int = 0
    peaks: dict[str, int] = field(default_factory=dict)
    """The most runs each limit (per key) was seen to count: whether the limits were met."""
    started: float = field(default_factory=time.monotonic)
    _seen: dict[tuple[str, str], _Episode] = field(default_factory=dict)

    async def run(self, within: float, every: float = SAMPLE_SECONDS) -> None:
        """Sample every ``every`` seconds until cancelled or ``within`` seconds of samples."""
        for _ in range(max(1, math.ceil(within / every))):
            began = time.monotonic()
            await self.sample()
            await anyio.sleep(max(0.0, every - (time.monotonic() - began)))

    async def sample(self) -> bool:
        """One sample; False when the database failed it."""
        try:
            with anyio.fail_after(STATEMENT_SECONDS):
                async with (
                    self.pool.acquire() as connection,
                    connection.transaction(isolation="repeatable_read", readonly=True),
                ):
                    # The snapshot starts here: leases are judged at this instant.
                    now = await connection.fetchval("SELECT clock_timestamp()")
                    runs = await connection.fetch(_RUNS)
                    slots = await connection.fetch(_SLOTS)
        except CAMPAIGN_ERRORS:
            self.skipped += 1
            return False
        self.taken += 1
        self._judge(runs, slots, now)
        return True

    def _judge(
        self, runs: list[asyncpg.Record], slots: list[asyncpg.Record], now: datetime
    ) -> None:
        edge = now - GRACE
        for run in runs:
            if counted(run, edge) and not holds_lease(run, edge):
                self._note(
                    SLOT_WITHOUT_LEASE,
                    run["run_id"],
                    f"{run['state']} with lease owner {run['lease_owner']} until "
                    f"{run['lease_until']} is counted against its limits",
                )
        for slot in slots:
            subject = limit_subject(slot)
            holding = sum(1 for run in runs if under(run, slot) and holds_lease(run, edge))
            self.peaks[subject] = max(self.peaks.get(subject, 0), holding)
            if holding > slot["max_running"]:
                self._note(
                    LIMIT_EXCEEDED,
                    subject,
                    f"{holding} runs hold a lease, at most {slot['max_running']} may",
                )
            if slot["counted"] > holding:
                self._note(
                    SLOT_WITHOUT_LEASE,
                    subject,
                    f"orchestrator_running counts {slot['counted']}, {holding} hold a lease",
                )

    def _note(self, rule: str, subject: str, detail: str) -> None:
        episode = self._seen.get((rule, subject))
        if episode is None:
            self._seen[rule, subject] = _Episode(detail, time.monotonic() - self.started)
        else:
            episode.samples += 1

    def violations(self) -> list[Violation]:
        return [
            Violation(
                rule,
                subject,
                f"{episode.detail} (first {episode.first:.1f}s in, in {episode.samples} samples)",
            )
            for (rule, subject), episode in self._seen.items()
        ]

    def report(self, found: Findings) -> None:
        """Add what the samples found to the checker's findings."""
        found.violations.extend(self.violations())
        found.limit_samples = self.taken
        found.limit_samples_skipped = self.skipped
        found.limit_peaks = dict(sorted(self.peaks.items()))


def holds_lease(run: asyncpg.Record, edge: datetime) -> bool:
    """Whether ``run`` holds its lease, by the lease columns alone."""
    return (
        run["state"] == "running"
        and run["lease_owner"] is not None
        and run["lease_until"] is not None
        and run["lease_until"] > edge
    )


def counted(run: asyncpg.Record, edge: datetime) -> bool:
    """Whether a counter's predicate counts ``run``: the per-key count names the owner (the
    ``runs_leased_keyed`` index), the count in all names the state."""
    unexpired = run["lease_until"] is not None and run["lease_until"] > edge
    return unexpired and (run["lease_owner"] is not None or run["state"] == "running")


def under(run: asyncpg.Record, slot: asyncpg.Record) -> bool:
    """Whether ``run`` counts against ``slot`` (a limit, and for a per-key limit its key)."""
    if run["agent"] != slot["agent"]:
        return False
    if slot["per"] == "key":
        return run["concurrency_key"] is not None and run["concurrency_key"] == slot["key"]
    return key_matches(run["concurrency_key"], slot["key_pattern"])


def key_matches(key: str | None, pattern: str) -> bool:
    """A limit's glob, as docs/flow-control.md says: ``*`` any characters, and in all, ``*``
    alone also matches the runs without a key."""
    if key is None:
        return pattern == "*"
    glob = ".*".join(re.escape(part) for part in pattern.split("*"))
    return re.fullmatch(glob, key, flags=re.DOTALL) is not None


def limit_subject(slot: asyncpg.Record) -> str:
    if slot["per"] == "key":
        return f"{slot['agent']}/{slot['key']} (per key {slot['key_pattern']})"
    return f"{slot['agent']} (keys {slot['key_pattern']} in all)"
