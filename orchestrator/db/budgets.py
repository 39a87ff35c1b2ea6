"""Budgets in the database: the budget row, its ledger, the fenced reservation and top-ups.

Before each model call the worst case is reserved by a fenced statement that refuses when spent +
reserved + asked would pass a limit, and the step's commit settles the reservation to what was
actually spent (``Spend``), in the same transaction. A reservation that was never settled (its
attempt crashed or lost its lease) is counted as spent when the next attempt reserves: that call
may have been billed. ``orchestrator runs budget RUN --add-usd X`` raises the limits and wakes a
run that waits for budget. A step's view of its budget is ``orchestrator.agent.budgets``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from datetime import datetime
from decimal import Decimal
from typing import NamedTuple, Protocol, TypedDict, Unpack

from orchestrator.access import Actor
from orchestrator.db.audit import decided
from orchestrator.db.executor import Executor
from orchestrator.db.queries import query
from orchestrator.errors import InvalidInput, InvalidTransition
from orchestrator.ids import validate_run_id
from orchestrator.models import JSON, Lease, Row

DIMENSIONS = ("turns", "tool_calls", "input_tokens", "output_tokens", "cost_usd")
MAX_AMOUNT = 2**62
"""The largest limit or top-up of a count (turns, tokens): far from bigint's end, so sums stay
in range."""
MAX_USD = Decimal(10**12)
USD_STEP = Decimal("1e-12")


def usd(value: object, what: str, *, exact: bool = True, positive: bool = False) -> Decimal:
    """US dollars from 0 (``positive``: above 0) to ``MAX_USD``; ``exact``: at most 12 decimal
    places (what the budget row keeps; a price times tokens may have more, rounded where it is
    stored)."""
    try:
        number = Decimal(str(value))
    except ArithmeticError:
        raise InvalidInput(f"{what} must be a number of US dollars, not {value!r}") from None
    if not number.is_finite() or not 0 <= number <= MAX_USD or (positive and not number):
        lowest = "above 0" if positive else "from 0"
        raise InvalidInput(
            f"{what} must be a number of US dollars {lowest} to {MAX_USD:,}, not {value!r}"
        )
    if exact and number != number.quantize(USD_STEP):
        raise InvalidInput(f"{what} has more than 12 decimal places")
    return number


def budget_count(value: object, what: str, *, minimum: int = 0) -> int:
    """A count that changes a budget (turns, tool calls, tokens): a whole number from
    ``minimum`` to ``MAX_AMOUNT``; a negative one would give back what was spent."""
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= MAX_AMOUNT:
        raise InvalidInput(
            f"{what} must be a whole number from {minimum} to {MAX_AMOUNT:,}, not {value!r}"
        )
    return value


# -- what a step spent, settled in its commit ------------------------------------------------
class Spend(NamedTuple):
    """What a step spent, settled in its commit in place of its reservation."""

    fence: int
    turns: int
    tool_calls: int
    input_tokens: int
    output_tokens: int
    cost: Decimal


class Limits(Protocol):
    """What a reservation needs of an agent's ``Budget``: its limits, as the row keeps them."""

    def limits(self) -> dict[str, JSON]: ...


# -- reading and topping up -----------------------------------------------------------------
@dataclass(frozen=True)
class BudgetState:
    """A run's budget: per dimension its limit (None: unlimited), spent and reserved."""

    run_id: str
    limit: dict[str, JSON]
    spent: dict[str, JSON]
    reserved: dict[str, JSON]
    reserved_fence: int | None
    updated_at: datetime

    @classmethod
    def from_record(cls, record: Row) -> BudgetState:
        def column(name: str, suffix: str) -> JSON:
            key = ("cost" if name == "cost_usd" else name) + suffix
            try:
                value = record[key]
            except KeyError:
                return None
            return str(value) if isinstance(value, Decimal) else value

        return cls(
            record["run_id"],
            {name: column(name, "_limit") for name in DIMENSIONS},
            {name: column(name, "_spent") for name in DIMENSIONS},
            {name: column(name, "_reserved") for name in DIMENSIONS if name != "tool_calls"},
            record["reserved_fence"],
            record["updated_at"],
        )

    def as_json(self) -> dict[str, JSON]:
        """Every field but the run id, in order, the time as ISO 8601."""
        fields: dict[str, JSON] = asdict(self)
        del fields["run_id"]
        return {**fields, "updated_at": self.updated_at.isoformat()}


@dataclass(frozen=True)
class LedgerEntry:
    entry: int
    kind: str
    fence: int | None
    amounts: dict[str, JSON]
    details: JSON
    at: datetime

    def as_json(self) -> dict[str, JSON]:
        return {
            "entry": self.entry,
            "kind": self.kind,
            "fence": self.fence,
            **self.amounts,
            "details": self.details,
            "at": self.at.isoformat(),
        }


class Reservation(NamedTuple):
    """What the fenced reservation statement answered."""

    outcome: str
    """``exhausted``, ``not_owner``, or the reservation was made."""
    exhausted_by: str | None
    """The dimension whose limit would be passed (``exhausted``)."""
    tool_calls_left: int | None


class TopUp(TypedDict, total=False):
    """What a top-up adds to a run's limits; ``None`` (or left out) adds nothing there."""

    turns: int | None
    tool_calls: int | None
    input_tokens: int | None
    output_tokens: int | None
    cost_usd: Decimal | float | str | None


class BudgetStore:
    def __init__(self, db: Executor) -> None:
        self.db = db

    async def reserve(
        self, lease: Lease, limits: Limits, counts: Sequence[int], cost: Decimal
    ) -> Reservation:
        """Reserve ``counts`` (turns, input and output tokens) and ``cost`` for ``lease``'s
        attempt, creating the run's budget row with ``limits`` at its first reservation."""
        record = await self.db.fetchrow(
            query("reserve_budget"),
            lease.run_id,
            lease.worker_id,
            lease.fence,
            limits.limits(),
            *counts,
            cost,
        )
        assert record is not None
        return Reservation(record["outcome"], record["exhausted_by"], record["tool_calls_left"])

    async def get(self, run_id: str) -> BudgetState | None:
        validate_run_id(run_id)
        record = await self.db.fetchrow(query("get_budget"), run_id)
        return None if record is None else BudgetState.from_record(record)

    async def ledger(self, run_id: str) -> list[LedgerEntry]:
        validate_run_id(run_id)
        return [
            LedgerEntry(
                r["entry"],
                r["kind"],
                r["fence"],
                {
                    "turns": r["turns"],
                    "tool_calls": r["tool_calls"],
                    "input_tokens": r["input_tokens"],
                    "output_tokens": r["output_tokens"],
                    "cost_usd": str(r["cost"]),
                },
                r["details"],
                r["at"],
            )
            for r in await self.db.fetch(query("budget_ledger"), run_id)
        ]

    async def settle(self, spends: Sequence[tuple[str, Spend]]) -> None:
        """In a commit's transaction (``db`` is its connection): each step's reservation
        becomes what it spent."""
        await self.db.execute(
            query("settle_budgets"),
            [run_id for run_id, _ in spends],
            [spend.fence for _, spend in spends],
            [spend.turns for _, spend in spends],
            [spend.tool_calls for _, spend in spends],
            [spend.input_tokens for _, spend in spends],
            [spend.output_tokens for _, spend in spends],
            [spend.cost for _, spend in spends],
        )

    async def top_up(
        self, run_id: str, *, actor: Actor | None = None, **amounts: Unpack[TopUp]
    ) -> BudgetState:
        """Raise the run's limits (and wake it if it waits for budget), by ``actor`` (None: the
        database role that connected) as the audit trail records. Each amount given must be
        above 0 (``InvalidInput`` otherwise: a top-up of nothing, or a negative one that would
        lower a limit, is a mistake), and at least one must be given."""
        validate_run_id(run_id)
        unknown = sorted(set(amounts) - set(TopUp.__annotations__))
        if unknown:  # as a keyword-only signature would refuse them
            raise TypeError(f"top_up() got unexpected keyword arguments: {', '.join(unknown)}")
        added: dict[str, JSON] = {}
        for name in ("turns", "tool_calls", "input_tokens", "output_tokens"):
            value = amounts.get(name)
            if value is not None:
                added[name] = budget_count(value, "--add-" + name.replace("_", "-"), minimum=1)
        cost_usd = amounts.get("cost_usd")
        if cost_usd is not None:
            # Positional notation: str() writes 1E+3 or 1E-7, which the database refuses.
            added["cost_usd"] = format(usd(cost_usd, "--add-usd", positive=True), "f")
        if not added:
            raise InvalidInput(
                "nothing to add: give --add-usd, --add-turns, --add-tool-calls, "
                "--add-input-tokens or --add-output-tokens, each above 0"
            )
        record = await decided(
            self.db,
            "top_up",
            actor,
            "top_up_budget",
            run_id,
            added,
            run_id=run_id,
        )
        if record is None:
            raise InvalidTransition(
                f"run {run_id} has no budget (its agent declares none, or it has not made a "
                "model call yet); nothing to top up"
            )
        state = await self.get(run_id)
        assert state is not None
        return state


__all__ = [
    "BudgetState",
    "BudgetStore",
    "LedgerEntry",
    "Limits",
    "Reservation",
    "Spend",
    "TopUp",
]
