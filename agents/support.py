"""``support``: read-only lookups, then an irreversible ticket in an HTTP ticket system and an
email reply to the customer that cites the ticket's id.

Input: ``{"customer": "ana@example.com", "order_id": "o-17", "message": "..."}``. The ticket
(kind ``tickets``) and the reply (kind ``email``) are effects: the model is told each one's
settled record, so the reply can quote the id the ticket system gave.

``LOCAL_SCRIPT`` is what the local scripted model answers (see ``orchestrator.loopback``).
"""

from __future__ import annotations

import json

from orchestrator import EffectPolicy, ToolAgent, ToolContext, tool
from orchestrator.loopback import ScriptedCall, ScriptedTurn, ScriptRequest

CUSTOMERS = {"ana@example.com": {"name": "Ana", "plan": "pro", "since": "2023"}}
ORDERS = {"o-17": {"status": "delayed", "carrier": "Post", "eta_days": 3}}


@tool.read_only(timeout=10)
def lookup_customer(ctx: ToolContext, email: str) -> dict[str, object]:
    """Look a customer up by email address.

    Args:
        email: The customer's email address.
    """
    return {"email": email, **CUSTOMERS.get(email, {"name": None})}


@tool.read_only(timeout=10)
def lookup_order(ctx: ToolContext, order_id: str) -> dict[str, object]:
    """Look an order up by id.

    Args:
        order_id: The order's id, such as o-17.
    """
    return {"order_id": order_id, **ORDERS.get(order_id, {"status": "unknown"})}


@tool.effect("tickets", policy=EffectPolicy.IRREVERSIBLE)
def open_ticket(customer: str, summary: str, priority: str = "normal") -> dict[str, str]:
    """Open a ticket in the ticket system (once; its id comes back when it is created).

    Args:
        customer: The customer's email address.
        summary: What the ticket is about.
        priority: low, normal or high.
    """
    return {"customer": customer, "summary": summary, "priority": priority}


@tool.effect("email", policy=EffectPolicy.IRREVERSIBLE)
def reply_to_customer(to: str, subject: str, body: str) -> dict[str, str]:
    """Email the customer a reply (sent once, never resent).

    Args:
        to: The customer's email address.
        subject: The subject line.
        body: The reply.
    """
    return {"to": to, "subject": subject, "body": body}


support = ToolAgent(
    "support",
    instructions=(
        "You answer customer support requests. Look up the customer and the order first. "
        "Open a ticket for anything not resolved at once, then reply to the customer quoting "
        "the ticket's id, then answer with a one-line resolution."
    ),
    tools=[lookup_customer, lookup_order, open_ticket, reply_to_customer],
    max_turns=8,
    description="Looks up a customer and an order, opens a ticket, replies by email.",
)


def _fields(request: ScriptRequest) -> dict[str, str]:
    try:
        fields = json.loads(request.conversation)
    except ValueError:
        return {}
    return fields if isinstance(fields, dict) else {}


def _ticket_id(request: ScriptRequest) -> str:
    for message in reversed(request.messages):
        if message.get("role") == "tool":
            try:
                told = json.loads(message.get("content") or "{}")
            except ValueError:
                continue
            if isinstance(told, dict) and told.get("external_id"):
                return str(told["external_id"])
    return "unknown"


def LOCAL_SCRIPT(request: ScriptRequest) -> ScriptedTurn:
    """Lookups in one turn, then the ticket, then the reply quoting it, then the answer."""
    fields = _fields(request)
    customer = fields.get("customer", "ana@example.com")
    order_id = fields.get("order_id", "o-17")
    if request.turn == 0:
        return ScriptedTurn(
            calls=(
                ScriptedCall("lookup_customer", {"email": customer}),
                ScriptedCall("lookup_order", {"order_id": order_id}),
            )
        )
    if request.turn == 1:
        return ScriptedTurn(
            calls=(
                ScriptedCall(
                    "open_ticket",
                    {"customer": customer, "summary": f"{order_id} is delayed", "priority": "high"},
                ),
            )
        )
    if request.turn == 2:
        ticket = _ticket_id(request)
        return ScriptedTurn(
            calls=(
                ScriptedCall(
                    "reply_to_customer",
                    {
                        "to": customer,
                        "subject": f"Your order {order_id} (ticket {ticket})",
                        "body": f"Your order is delayed by about 3 days. Ticket {ticket}.",
                    },
                ),
            )
        )
    return ScriptedTurn(content=f"{order_id}: delayed; ticket opened and customer told.")
