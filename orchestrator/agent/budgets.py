"""Budgets: what a run may spend on models, reserved before it is spent.

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
from collections.abc import Mapping
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Literal

import asyncpg
import pydantic

from orchestrator.db.budgets import (
    DIMENSIONS,
    MAX_AMOUNT,
    BudgetStore,
    Spend,
    budget_count,
    usd,
)
from orchestrator.db.deadlines import pooled
from orchestrator.errors import InvalidInput, InvalidTransition, OrchestratorError
from orchestrator.models import JSON, Lease

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
            cost = usd(self.cost_usd, "Budget cost_usd")
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
            budget_count(value, f"ctx.budget.reserve({name}=...)")
            for name, value in (
                ("turns", turns),
                ("input_tokens", input_tokens),
                ("output_tokens", output_tokens),
            )
        ]
        cost = usd(cost_usd, "ctx.budget.reserve(cost_usd=...)", exact=False)
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
        counts = [budget_count(value, f"ctx.budget.spend({name}=...)") for name, value in amounts]
        cost = usd(cost_usd, "ctx.budget.spend(cost_usd=...)", exact=False)
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


__all__ = [
    "Budget",
    "BudgetExhausted",
    "ModelPrice",
    "NotOwner",
    "Prices",
    "RunBudget",
]
