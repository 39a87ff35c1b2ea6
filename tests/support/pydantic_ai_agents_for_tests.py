"""Pydantic AI agents on orchestrator that the tests share (importable by `serve` subprocesses).

Each is a plain ``pydantic_ai.Agent`` with an ``OpenAIChatModel`` that reaches the worker's
``OPENAI_BASE_URL`` (the scripted model server in tests), wrapped by ``PydanticAIAgent``:

``pai_orders``: a read-only ``lookup_order`` (an order ``slow`` sleeps ``ORDERS_LOOKUP_SECONDS``)
and an irreversible ``notify`` effect of kind ``crm``. ``pai_refunds``: the same lookup and a
``refund`` effect that a person approves above 100.
"""

from __future__ import annotations

import os
from functools import cache

import anyio
from pydantic import BaseModel
from pydantic_ai import Agent
from pydantic_ai.models.openai import OpenAIChatModel
from pydantic_ai.providers.openai import OpenAIProvider

from orchestrator import Budget, EffectPolicy
from orchestrator.integrations.pydantic_ai import PydanticAIAgent, effect
from orchestrator.testing.loopback import ScriptedCall, ScriptedTurn, turns


@cache
def _model(base_url: str) -> OpenAIChatModel:
    return OpenAIChatModel(
        "gpt-4o-mini", provider=OpenAIProvider(base_url=base_url, api_key="unused")
    )


def local_model() -> OpenAIChatModel:
    """The worker's model: an OpenAI-compatible server at ``OPENAI_BASE_URL``."""
    return _model(os.environ["OPENAI_BASE_URL"])


orders_agent = Agent(instructions="You handle order questions. Look the order up, then note it.")


@orders_agent.tool_plain
async def lookup_order(order_id: str) -> dict[str, object]:
    """Look an order up by its id.

    Args:
        order_id: The order's id, such as o-17.
    """
    if order_id == "slow":  # a window between the turn's model answer and its commit
        await anyio.sleep(float(os.environ.get("ORDERS_LOOKUP_SECONDS", "0")))
    return {"order_id": order_id, "status": "shipped", "customer": "ana@example.com"}


@orders_agent.tool_plain
def notify(order_id: str, note: str) -> dict[str, object]:
    """Record a note on the order in the CRM (irreversible)."""
    raise AssertionError("an effect tool never runs in the worker")


pai_orders = PydanticAIAgent(
    "pai_orders",
    orders_agent,
    model=local_model,
    read_only=["lookup_order"],
    effects={"notify": effect("crm", policy=EffectPolicy.IRREVERSIBLE)},
    max_turns=6,
)

refunds_agent = Agent(instructions="You handle refund requests. Look the order up, then refund.")
refunds_agent.tool_plain(lookup_order)


@refunds_agent.tool_plain
def refund(order_id: str, amount: float) -> dict[str, object]:
    """Refund an order (refunds above 100 wait for a person's approval)."""
    raise AssertionError("an effect tool never runs in the worker")


pai_refunds = PydanticAIAgent(
    "pai_refunds",
    refunds_agent,
    model=local_model,
    read_only=["lookup_order"],
    effects={"refund": effect("crm", approve=lambda amount, **_: amount > 100)},
    max_turns=6,
)

pai_budgeted = PydanticAIAgent(
    "pai_budgeted",
    orders_agent,
    model=local_model,
    read_only=["lookup_order"],
    effects={"notify": effect("crm")},
    max_output_tokens=200,
    budget=Budget(turns=2),
)

ORDERS_TURNS = turns(
    ScriptedTurn(calls=(ScriptedCall("lookup_order", {"order_id": "o-17"}),)),
    ScriptedTurn(calls=(ScriptedCall("notify", {"order_id": "o-17", "note": "shipped today"}),)),
    ScriptedTurn(content="Order o-17 has shipped; the CRM is noted."),
)
"""A lookup, an effect, an answer."""

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
"""Turn 1 holds a slow lookup beside its effect call; its replay proposes other arguments."""

REFUND_TURNS = turns(
    ScriptedTurn(
        calls=(
            ScriptedCall("lookup_order", {"order_id": "o-17"}),
            ScriptedCall("refund", {"order_id": "o-17", "amount": 150}),
        )
    ),
    ScriptedTurn(content="The refund is handled."),
)
"""A lookup beside a refund that needs approval, then an answer."""


class OrderAnswer(BaseModel):
    order_id: str
    status: str


structured_agent = Agent(output_type=OrderAnswer, instructions="Answer with the order's status.")
structured_agent.tool_plain(lookup_order)


@structured_agent.tool_plain
def delete_everything() -> str:
    """A tool nobody classified: hidden from the model, refused if called."""
    raise AssertionError("an unclassified tool never runs")


pai_structured = PydanticAIAgent(
    "pai_structured", structured_agent, model=local_model, read_only=["lookup_order"], max_turns=4
)

STRUCTURED_TURNS = turns(
    ScriptedTurn(
        calls=(
            ScriptedCall("lookup_order", {"order_id": "o-17"}),
            ScriptedCall("delete_everything", {}),
        )
    ),
    ScriptedTurn(calls=(ScriptedCall("final_result", {"order_id": "o-17", "status": "shipped"}),)),
)
"""A lookup beside a call of a tool the model was never offered, then a structured answer."""

pai_frugal = PydanticAIAgent(
    "pai_frugal",
    orders_agent,
    model=local_model,
    read_only=["lookup_order"],
    effects={"notify": effect("crm")},
    budget=Budget(tool_calls=1),
)

TWO_LOOKUPS = turns(
    ScriptedTurn(
        calls=(
            ScriptedCall("lookup_order", {"order_id": "o-1"}),
            ScriptedCall("lookup_order", {"order_id": "o-2"}),
        )
    ),
    ScriptedTurn(content="done"),
)
"""Two calls in one turn, against a budget of one."""

pai_impatient = PydanticAIAgent(
    "pai_impatient",
    orders_agent,
    model=local_model,
    read_only=["lookup_order"],
    tool_timeout_seconds=0.5,
)

pai_hurried = PydanticAIAgent(
    "pai_hurried",
    refunds_agent,
    model=local_model,
    read_only=["lookup_order"],
    effects={"refund": effect("crm", approve=True)},
    deadline_seconds=1.5,
)

pai_streamer = PydanticAIAgent(
    "pai_streamer",
    orders_agent,
    model=local_model,
    read_only=["lookup_order"],
    max_turns=6,
    stream=True,
)
"""The orders agent (its lookup only) whose turns stream their text to the run's live output."""

STREAMED_ANSWER = (
    "Order o-17 shipped this morning; it should reach the customer within two working days."
)
STREAMED_TURNS = turns(
    ScriptedTurn(calls=(ScriptedCall("lookup_order", {"order_id": "o-17"}),)),
    ScriptedTurn(content=STREAMED_ANSWER),
)
"""A lookup, then an answer long enough to stream in many pieces."""
