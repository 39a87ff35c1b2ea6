"""Tool agents and scripts the tool-loop tests share (importable by `serve` subprocesses).

``orders``: a read-only lookup, then an irreversible ``notify`` effect (an HTTP vendor, kind
``crm``), then a final answer. A lookup of order ``slow`` sleeps ``ORDERS_LOOKUP_SECONDS``
(environment), so a test can kill or stop the worker while a turn is between its model answer
and its commit.
"""

from __future__ import annotations

import os

import anyio

from orchestrator import EffectPolicy
from orchestrator.loopback import ScriptedCall, ScriptedTurn, turns
from orchestrator.tool_agent import ToolAgent
from orchestrator.tools import ToolContext, tool


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


orders = ToolAgent(
    "orders",
    instructions="You handle order questions. Look the order up, then note the answer.",
    tools=[lookup_order, notify],
    max_turns=6,
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
