"""Flow control: concurrency keys, priorities and the limits on how many runs hold a lease at
once (docs/flow-control.md).

A run counts against a limit exactly while it holds a lease, so a slot cannot outlive the lease
that holds it: nothing is counted but the runs table. Operators set limits at run time
(``orchestrator limits set``), each an audited decision; a claim reads them every time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any, Literal

from orchestrator.access import Actor
from orchestrator.db.audit import decide
from orchestrator.db.queries import query
from orchestrator.errors import InvalidInput
from orchestrator.ids import validate_agent_name
from orchestrator.models import Row, json_fields
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


def check_max_running(value: Any) -> int:
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value != int(value)
        or not 0 <= value <= MAX_RUNNING
    ):
        raise InvalidInput(f"a limit must be a whole number from 0 to {MAX_RUNNING}, not {value!r}")
    return int(value)


@dataclass(frozen=True)
class Limit:
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
        )

    def as_json(self) -> dict[str, Any]:
        return json_fields(self)


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
        row = await self._decided(
            "limit_set", "set_limit", actor, agent, key_pattern, per, max_running
        )
        assert row is not None
        return None if row["previous"] is None else int(row["previous"])

    async def clear(
        self, agent: str, *, key_pattern: str = "*", per: Per = "all", actor: Actor | None = None
    ) -> int:
        """Remove a limit; returns the limit it was. ``InvalidInput`` when there is none."""
        agent, key_pattern, per = _limit_of(agent, key_pattern, per)
        row = await self._decided("limit_cleared", "clear_limit", actor, agent, key_pattern, per)
        if row is None or row["cleared"] is None:
            raise InvalidInput(
                f"no limit of {agent} for keys {key_pattern!r} ({per}): "
                "`orchestrator limits list` shows the limits there are"
            )
        return int(row["cleared"])

    async def _decided(
        self, action: str, statement: str, actor: Actor | None, *arguments: object
    ) -> Row | None:
        """A limit's change by ``actor`` (None: the database role that connected), audited."""
        return await decide(
            self.db, action, Actor.acting(actor, None), query(statement), *arguments
        )


def _limit_of(agent: str, key_pattern: str, per: str) -> tuple[str, str, Per]:
    validate_agent_name(agent)
    check_concurrency_key(key_pattern, "a key pattern")
    if per not in ("all", "key"):
        raise InvalidInput(f'a limit counts runs "all" together or per "key", not {per!r}')
    return agent, key_pattern, "all" if per == "all" else "key"
