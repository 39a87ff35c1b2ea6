"""Tool agents and scripts the tool-loop tests share (importable by `serve` subprocesses).

``orders``: a read-only lookup, then an irreversible ``notify`` effect (an HTTP vendor, kind
``crm``), then a final answer. A lookup of order ``slow`` sleeps ``ORDERS_LOOKUP_SECONDS``
(environment), so a test can kill or stop the worker while a turn is between its model answer
and its commit.
"""

from __future__ import annotations

import os

import anyio

from orchestrator import Budget, EffectPolicy
from orchestrator.agent.tool_loop import ToolAgent
from orchestrator.agent.tools import Tool, ToolContext, tool
from orchestrator.testing.loopback import ScriptedCall, ScriptedTurn, turns


@tool.read_only(timeout=30)
async def lookup_order(ctx: ToolContext, order_id: str) -> dict[str, object]:
    """Look an order up by its id.

    Args:
        order_id: The order's id, such as o-17.
    """
    if order_id == "slow":  # a window between the turn's model answer and its commit
        await anyio.sleep(float(os.environ.get("ORDERS_LOOKUP_SECONDS", "0")))
    return {"order_id": order_id, "status": "shipped", "customer": "ana@example.com"}


@tool.effect("crm", policy=EffectPolicy.IRREVERSIBLE)
def notify(order_id: str, note: str) -> dict[str, object]:
    """Record a note on the order in the CRM (irreversible)."""
    return {"order_id": order_id, "note": note}


def looks_up_then(name: str, instructions: str, effect: Tool) -> ToolAgent:
    """A tool agent that looks an order up and acts on it through one effect tool."""
    return ToolAgent(name, instructions=instructions, tools=[lookup_order, effect], max_turns=6)


orders = looks_up_then(
    "orders", "You handle order questions. Look the order up, then note the answer.", notify
)


ORDERS_TURNS = turns(
    ScriptedTurn(calls=(ScriptedCall("lookup_order", {"order_id": "o-17"}),)),
    ScriptedTurn(calls=(ScriptedCall("notify", {"order_id": "o-17", "note": "shipped today"}),)),
    ScriptedTurn(content="Order o-17 has shipped; the CRM is noted."),
    replays={
        1: ScriptedTurn(
            calls=(ScriptedCall("notify", {"order_id": "o-17", "note": "REPLAYED: different"}),)
        )
    },
)
"""The orders conversation; a replayed turn 1 proposes different arguments."""


SLOW_TURN_1 = turns(
    ScriptedTurn(calls=(ScriptedCall("lookup_order", {"order_id": "o-17"}),)),
    ScriptedTurn(
        calls=(
            ScriptedCall("lookup_order", {"order_id": "slow"}),
            ScriptedCall("notify", {"order_id": "o-17", "note": "first answer"}),
        )
    ),
    ScriptedTurn(content="Done."),
    replays={
        1: ScriptedTurn(
            calls=(ScriptedCall("notify", {"order_id": "o-17", "note": "REPLAYED answer"}),)
        )
    },
)
"""Turn 1 holds a slow lookup beside its effect call; a replay of turn 1 proposes other
arguments (and no slow lookup)."""


@tool.effect("crm", approve=lambda amount, **_: amount > 100)
def refund(order_id: str, amount: float) -> dict[str, object]:
    """Refund an order (refunds above 100 wait for a person's approval).

    Args:
        order_id: The order's id.
        amount: How much to refund, in euros.
    """
    return {"order_id": order_id, "amount": amount}


refunds = looks_up_then(
    "refunds", "You handle refund requests. Look the order up, then refund it.", refund
)

REFUND_TURNS = turns(
    ScriptedTurn(
        calls=(
            ScriptedCall("lookup_order", {"order_id": "slow"}),
            ScriptedCall("refund", {"order_id": "o-17", "amount": 150}),
        )
    ),
    ScriptedTurn(content="The refund is done."),
    replays={0: ScriptedTurn(calls=(ScriptedCall("refund", {"order_id": "o-17", "amount": 180}),))},
)
"""Turn 0 holds a slow lookup beside a refund that needs approval; its replay asks for another
amount (and no slow lookup)."""


budgeted = ToolAgent(
    "budgeted",
    instructions="Look up every order you are asked about, one per turn.",
    tools=[lookup_order],
    max_turns=20,
    max_output_tokens=200,
    budget=Budget(turns=4, cost_usd="5.00"),
)

BUDGET_TURNS = turns(
    *(
        ScriptedTurn(calls=(ScriptedCall("lookup_order", {"order_id": f"o-{n}"}),))
        for n in range(6)
    ),
    ScriptedTurn(content="All six orders have shipped."),
)
"""Six lookups, one per turn, then an answer: seven turns, more than the budget's four."""
