"""Budgets in the database: what a run may spend on models, reserved before it is spent.

An agent declares its limits (``Budget(turns=..., cost_usd=...)``); a run's budget row is created
with them at its first reservation. Before each model call the worst case is reserved by a fenced
statement that refuses when spent + reserved + asked would pass a limit, and the step's commit
settles the reservation to what was actually spent, in the same transaction. A reservation that
was never settled (its attempt crashed or lost its lease) is counted as spent when the next
attempt reserves: that call may have been billed. ``orchestrator runs budget RUN --add-usd X``
raises the limits and wakes a run that waits for budget.

Prices per model come from the operator (``ORCHESTRATOR_PRICES``: a JSON object, or the path of
a JSON file, mapping a model name to ``{"input_per_million": USD, "output_per_million": USD}``),
never from agent code.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime
from decimal import Decimal
from pathlib import Path
from typing import Literal, NamedTuple, TypedDict, Unpack

import asyncpg
import pydantic

from orchestrator.access import Actor
from orchestrator.db.audit import decide
from orchestrator.db.deadlines import pooled
from orchestrator.db.executor import Executor
from orchestrator.db.queries import query
from orchestrator.errors import InvalidInput, InvalidTransition, OrchestratorError
from orchestrator.ids import validate_run_id
from orchestrator.models import JSON, Lease, Row

DIMENSIONS = ("turns", "tool_calls", "input_tokens", "output_tokens", "cost_usd")
MAX_AMOUNT = 2**62
"""The largest limit or top-up of a count (turns, tokens): far from bigint's end, so sums stay
in range."""
MAX_USD = Decimal(10**12)
USD_STEP = Decimal("1e-12")
PRICES_VARIABLE = "ORCHESTRATOR_PRICES"
_MILLION = Decimal(1_000_000)


@dataclass(frozen=True)
class Budget:
    """An agent's limits per run; ``None`` leaves a dimension unlimited."""

    turns: int | None = None
    tool_calls: int | None = None
    input_tokens: int | None = None
    output_tokens: int | None = None
    cost_usd: Decimal | float | str | None = None
    on_exhausted: Literal["wait", "fail"] = "wait"
    """``wait``: the run waits (reason ``budget``) until an operator tops it up; ``fail``: the
    run fails."""

    def __post_init__(self) -> None:
        for name in ("turns", "tool_calls", "input_tokens", "output_tokens"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise InvalidInput(f"Budget {name} must be a whole number, not {value!r}")
            if value is not None and not 0 <= value <= MAX_AMOUNT:
                raise InvalidInput(f"Budget {name} must be between 0 and {MAX_AMOUNT:,}")
        if self.cost_usd is not None:
            cost = _decimal(self.cost_usd, "Budget cost_usd")
            object.__setattr__(self, "cost_usd", cost)
        if self.on_exhausted not in ("wait", "fail"):
            raise InvalidInput(
                f"Budget on_exhausted must be 'wait' or 'fail', not {self.on_exhausted!r}"
            )
        if all(getattr(self, name) is None for name in DIMENSIONS):
            raise InvalidInput("a Budget needs at least one limit (turns, tokens or cost_usd)")

    def limits(self) -> dict[str, JSON]:
        """The limits as the budget row is created with (numbers as JSON)."""
        return {
            name: (str(value) if isinstance(value, Decimal) else value)
            for name in DIMENSIONS
            if (value := getattr(self, name)) is not None
        }


def _decimal(value: object, what: str, *, exact: bool = True, positive: bool = False) -> Decimal:
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


def _count(value: object, what: str, *, minimum: int = 0) -> int:
    """A count that changes a budget (turns, tool calls, tokens): a whole number from
    ``minimum`` to ``MAX_AMOUNT``; a negative one would give back what was spent."""
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= MAX_AMOUNT:
        raise InvalidInput(
            f"{what} must be a whole number from {minimum} to {MAX_AMOUNT:,}, not {value!r}"
        )
    return value


class BudgetExhausted(OrchestratorError):
    """A reservation was refused: the run's limit on ``dimension`` would be passed."""

    def __init__(self, run_id: str, dimension: str) -> None:
        super().__init__(
            f"run {run_id} has exhausted its {dimension} budget; `orchestrator runs budget "
            f"{run_id} --add-...` raises the limit"
        )
        self.run_id = run_id
        self.dimension = dimension


class NotOwner(OrchestratorError):
    """A reservation was refused: the attempt does not own the run any more."""


# -- prices ---------------------------------------------------------------------------------
class ModelPrice(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid", frozen=True)
    input_per_million: Decimal = pydantic.Field(ge=0, allow_inf_nan=False)
    output_per_million: Decimal = pydantic.Field(ge=0, allow_inf_nan=False)


_PRICE_TABLE = pydantic.TypeAdapter(dict[str, ModelPrice])


@dataclass(frozen=True)
class Prices:
    """US dollars per million input and output tokens, per model, from the operator."""

    models: Mapping[str, ModelPrice] = field(default_factory=dict)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Prices:
        raw = (os.environ if environ is None else environ).get(PRICES_VARIABLE, "").strip()
        if not raw:
            return cls()
        text = raw
        if not raw.startswith("{"):
            try:
                text = Path(raw).read_text(encoding="utf-8")
            except OSError as error:
                raise InvalidInput(
                    f"{PRICES_VARIABLE}={raw!r} is neither a JSON object nor a readable file "
                    f"({error.strerror})"
                ) from None
        try:
            return cls(_PRICE_TABLE.validate_json(text))
        except pydantic.ValidationError as error:
            first = error.errors(include_url=False)[0]
            where = ".".join(str(part) for part in first["loc"])
            raise InvalidInput(
                f"{PRICES_VARIABLE}: {where or 'value'}: {first['msg']}; expected "
                '{"MODEL": {"input_per_million": USD, "output_per_million": USD}}'
            ) from None

    def cost(self, model: str, input_tokens: int, output_tokens: int) -> Decimal:
        price = self.models.get(model)
        if price is None:
            raise InvalidInput(
                f"no price for model {model!r} in {PRICES_VARIABLE} (it prices: "
                f"{', '.join(sorted(self.models)) or 'nothing'}); a cost budget needs one"
            )
        return (
            price.input_per_million * input_tokens + price.output_per_million * output_tokens
        ) / _MILLION


# -- a step's view: ctx.budget --------------------------------------------------------------
class Spend(NamedTuple):
    """What a step spent, settled in its commit in place of its reservation."""

    fence: int
    turns: int
    tool_calls: int
    input_tokens: int
    output_tokens: int
    cost: Decimal


class RunBudget:
    """``ctx.budget``: reserve before spending, record what was spent; both fenced."""

    __slots__ = (
        "_cost",
        "_pool",
        "_reserved",
        "_spent",
        "_statement_seconds",
        "lease",
        "limits",
        "prices",
        "tool_calls_left",
    )

    def __init__(
        self,
        limits: Budget,
        lease: Lease,
        pool: asyncpg.Pool,
        prices: Prices,
        *,
        statement_seconds: float = 30.0,
    ) -> None:
        self.limits = limits
        self.lease = lease
        self.prices = prices
        self.tool_calls_left: int | None = None
        """After a reservation: how many tool calls the run may still make (None: no limit)."""
        self._pool = pool
        self._statement_seconds = statement_seconds
        self._reserved = False
        self._spent = [0, 0, 0, 0]
        self._cost = Decimal(0)

    async def reserve(
        self,
        *,
        turns: int = 0,
        input_tokens: int = 0,
        output_tokens: int = 0,
        cost_usd: Decimal = Decimal(0),
    ) -> None:
        """Reserve a worst case before spending it; ``BudgetExhausted`` when a limit would be
        passed, ``NotOwner`` when this attempt no longer owns the run. Amounts are 0 or more,
        at least one of them above 0 (``InvalidInput`` otherwise: a negative one would let the
        run spend past its limits)."""
        counts = [
            _count(value, f"ctx.budget.reserve({name}=...)")
            for name, value in (
                ("turns", turns),
                ("input_tokens", input_tokens),
                ("output_tokens", output_tokens),
            )
        ]
        cost = _decimal(cost_usd, "ctx.budget.reserve(cost_usd=...)", exact=False)
        if not (any(counts) or cost):
            raise InvalidInput(
                "ctx.budget.reserve() reserves nothing: give turns, input_tokens, output_tokens "
                "or cost_usd above 0"
            )
        lease = self.lease
        async with pooled(self._pool, within=self._statement_seconds) as db:
            reservation = await BudgetStore(db).reserve(lease, self.limits, counts, cost)
        if reservation.outcome == "not_owner":
            raise NotOwner(f"run {lease.run_id}: fence {lease.fence} no longer owns the run")
        self._reserved = True
        if reservation.outcome == "exhausted":
            raise BudgetExhausted(lease.run_id, reservation.exhausted_by or "unknown")
        self.tool_calls_left = reservation.tool_calls_left

    def spend(
        self,
        *,
        turns: int = 0,
        tool_calls: int = 0,
        input_tokens: int = 0,
        output_tokens: int = 0,
        cost_usd: Decimal = Decimal(0),
    ) -> None:
        """Record what was actually spent; the step's commit settles it in place of what this
        step reserved (spending without a reservation would pass a limit unchecked)."""
        if not self._reserved:
            raise InvalidTransition(
                "ctx.budget.spend() before ctx.budget.reserve(): reserve the worst case first"
            )
        amounts = (
            ("turns", turns),
            ("tool_calls", tool_calls),
            ("input_tokens", input_tokens),
            ("output_tokens", output_tokens),
        )
        # All checked before any is added: a refused call records nothing.
        counts = [_count(value, f"ctx.budget.spend({name}=...)") for name, value in amounts]
        cost = _decimal(cost_usd, "ctx.budget.spend(cost_usd=...)", exact=False)
        totals = [total + count for total, count in zip(self._spent, counts, strict=True)]
        for (name, _), total in zip(amounts, totals, strict=True):
            if total > MAX_AMOUNT:  # the step's commit would carry it to the database
                raise InvalidInput(
                    f"ctx.budget.spend({name}=...) brings this step's {name} to {total:,}, over "
                    f"{MAX_AMOUNT:,}"
                )
        self._spent = totals
        self._cost += cost

    def settlement(self) -> Spend | None:
        """What the step's commit settles (``None``: this step neither reserved nor spent)."""
        if not (self._reserved or any(self._spent) or self._cost):
            return None
        turns, tool_calls, input_tokens, output_tokens = self._spent
        return Spend(self.lease.fence, turns, tool_calls, input_tokens, output_tokens, self._cost)

    def reset(self) -> None:
        """A new step starts: nothing reserved or spent by it yet."""
        self._reserved = False
        self._spent = [0, 0, 0, 0]
        self._cost = Decimal(0)


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
        self, lease: Lease, limits: Budget, counts: Sequence[int], cost: Decimal
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
                added[name] = _count(value, "--add-" + name.replace("_", "-"), minimum=1)
        cost_usd = amounts.get("cost_usd")
        if cost_usd is not None:
            # Positional notation: str() writes 1E+3 or 1E-7, which the database refuses.
            added["cost_usd"] = format(_decimal(cost_usd, "--add-usd", positive=True), "f")
        if not added:
            raise InvalidInput(
                "nothing to add: give --add-usd, --add-turns, --add-tool-calls, "
                "--add-input-tokens or --add-output-tokens, each above 0"
            )
        record = await decide(
            self.db,
            "top_up",
            Actor.acting(actor, None),
            query("top_up_budget"),
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
    "Budget",
    "BudgetExhausted",
    "BudgetState",
    "BudgetStore",
    "LedgerEntry",
    "ModelPrice",
    "NotOwner",
    "Prices",
    "RunBudget",
    "Spend",
    "TopUp",
]
