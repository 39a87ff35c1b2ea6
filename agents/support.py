"""``support``: read-only lookups, then an irreversible ticket in an HTTP ticket system and an
email reply to the customer that cites the ticket's id.

Input: ``{"customer": "ana@example.com", "order_id": "o-17", "message": "..."}``. The ticket
(kind ``tickets``) and the reply (kind ``email``) are effects: the model is told each one's
settled record, so the reply can quote the id the ticket system gave.

Offline, the local scripted model answers for it (``orchestrator.testing.local_scripts``).
"""

from __future__ import annotations

from orchestrator import EffectPolicy, ToolAgent, ToolContext, tool

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
