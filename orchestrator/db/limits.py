"""Flow control: concurrency keys, priorities and the limits on how many runs hold a lease at
once (docs/flow-control.md).

A run counts against a limit exactly while it holds a lease, so a slot cannot outlive the lease
that holds it: nothing is counted but the runs table. Operators set limits at run time
(``orchestrator limits set``), each an audited decision; a claim reads them every time.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any, Literal

from orchestrator.access import Actor
from orchestrator.db.audit import decided
from orchestrator.db.queries import query
from orchestrator.errors import InvalidInput
from orchestrator.ids import validate_agent_name
from orchestrator.models import JsonFields, Row
from orchestrator.storable import check_text

if TYPE_CHECKING:
    from orchestrator.db.executor import Executor

MAX_KEY_LENGTH = 200
PRIORITY_RANGE = (-1000, 1000)
MAX_RUNNING = 1_000_000
Per = Literal["all", "key"]


def check_concurrency_key(key: str | None, what: str = "a concurrency key") -> str | None:
    """``key`` if a run may carry it: text of 1-200 characters PostgreSQL can store."""
    if key is None:
        return None
    if not isinstance(key, str) or not 1 <= len(key) <= MAX_KEY_LENGTH:
        raise InvalidInput(f"{what} must be text of 1-{MAX_KEY_LENGTH} characters, not {key!r}")
    return check_text(key, what)


def check_priority(priority: int) -> int:
    low, high = PRIORITY_RANGE
    if isinstance(priority, bool) or not isinstance(priority, int) or not low <= priority <= high:
        raise InvalidInput(
            f"a priority must be a whole number from {low} to {high}, not {priority!r}"
        )
    return priority


def check_flow(concurrency_key: str | None, priority: int) -> None:
    """Refuse a submission's key or priority that the database would refuse, in one line."""
    check_concurrency_key(concurrency_key)
    check_priority(priority)


def whole_number(value: Any, what: str, low: int, high: int) -> int:
    """``value`` if it is a whole number from ``low`` to ``high`` (a float such as 3.0 too), or
    one line saying what is wrong."""
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value != int(value)
        or not low <= value <= high
    ):
        raise InvalidInput(f"{what} must be a whole number from {low:,} to {high:,}, not {value!r}")
    return int(value)


def check_max_running(value: Any) -> int:
    return whole_number(value, "a limit", 0, MAX_RUNNING)


@dataclass(frozen=True)
class Limit(JsonFields):
    """At most ``max_running`` runs of ``agent`` whose key matches ``key_pattern`` hold a lease
    at once: all together (``per`` "all"), or each key apart (``per`` "key")."""

    agent: str
    key_pattern: str
    per: Per
    max_running: int
    set_by: str
    set_at: datetime
    running: int
    """How many it counts now (per key: the key with the most)."""
    backlog: int
    """Due runs it covers, claimable or held back."""
    declared: bool = False
    """Declared by the agent's code (``Agent(limits=...)``), not set by an operator."""

    @classmethod
    def from_record(cls, record: Row) -> Limit:
        return cls(
            record["agent"],
            record["key_pattern"],
            record["per"],
            record["max_running"],
            record["set_by"],
            record["set_at"],
            int(record["running"]),
            int(record["backlog"]),
            bool(record["declared"]),
        )

    @property
    def name(self) -> str:
        """The limit's name in metrics and holds: agent, per and keys, never one key."""
        return (
            f"{self.agent} {'per key' if self.per == 'key' else 'in all'}, keys {self.key_pattern}"
        )


@dataclass(frozen=True)
class RunningLimit:
    """A limit an agent declares in its code: ``Agent(..., limits=[RunningLimit(20),
    RunningLimit(3, per="key")])``. Each ``serve`` process that runs the agent writes them at
    start; an operator's ``limits set`` for the same keys and per replaces one and is kept."""

    max_running: int
    per: Per = "all"
    keys: str = "*"
    """A glob of the concurrency keys the limit counts (``*``: all)."""

    def __post_init__(self) -> None:
        check_max_running(self.max_running)
        _limit_of("agent", self.keys, self.per)

    def as_json(self) -> dict[str, Any]:
        return {"key_pattern": self.keys, "per": self.per, "max_running": self.max_running}


class LimitStore:
    """The operators' limits: list, set, clear (each change audited)."""

    def __init__(self, db: Executor) -> None:
        self.db = db

    async def list(self, agent: str | None = None) -> list[Limit]:
        if agent is not None:
            validate_agent_name(agent)
        return [Limit.from_record(r) for r in await self.db.fetch(query("list_limits"), agent)]

    async def set(
        self,
        agent: str,
        max_running: int,
        *,
        key_pattern: str = "*",
        per: Per = "all",
        actor: Actor | None = None,
    ) -> int | None:
        """Set a limit (raise or lower it); returns the one it replaced, if any."""
        agent, key_pattern, per = _limit_of(agent, key_pattern, per)
        max_running = check_max_running(max_running)
        row = await decided(
            self.db, "limit_set", actor, "set_limit", agent, key_pattern, per, max_running
        )
        assert row is not None
        return None if row["previous"] is None else int(row["previous"])

    async def clear(
        self, agent: str, *, key_pattern: str = "*", per: Per = "all", actor: Actor | None = None
    ) -> int:
        """Remove a limit; returns the limit it was. ``InvalidInput`` when there is none."""
        agent, key_pattern, per = _limit_of(agent, key_pattern, per)
        row = await decided(self.db, "limit_cleared", actor, "clear_limit", agent, key_pattern, per)
        if row is None or row["cleared"] is None:
            raise InvalidInput(
                f"no limit of {agent} for keys {key_pattern!r} ({per}): "
                "`orchestrator limits list` shows the limits there are"
            )
        return int(row["cleared"])

    async def declare(self, agent: str, limits: Sequence[RunningLimit], by: str) -> int:
        """Write the limits ``agent``'s code declares (removing those it no longer does);
        returns how many changed. An operator's limit for the same keys and per is kept."""
        validate_agent_name(agent)
        declared = [limit.as_json() for limit in limits]
        changed = await self.db.fetchval(query("declare_limits"), agent, declared, by)
        return int(changed or 0)


def _limit_of(agent: str, key_pattern: str, per: str) -> tuple[str, str, Per]:
    validate_agent_name(agent)
    check_concurrency_key(key_pattern, "a key pattern")
    if per not in ("all", "key"):
        raise InvalidInput(f'a limit counts runs "all" together or per "key", not {per!r}')
    return agent, key_pattern, "all" if per == "all" else "key"
