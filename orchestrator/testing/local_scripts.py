"""What the local scripted model (``orchestrator.testing.loopback.ScriptedModelServer``) answers for
the shipped agents, so that they run offline: ``orchestrator demo`` serves
``contract_summary_script`` when no model is configured. Kept out of ``agents/``, which show agents
as their authors write them, against a real model.
"""

from __future__ import annotations

import json

from orchestrator.testing.loopback import ScriptedCall, ScriptedTurn, ScriptRequest


def _fields(request: ScriptRequest) -> dict[str, str]:
    """The run's input, which the shipped agents' prompt is: its JSON fields."""
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


def support_script(request: ScriptRequest) -> ScriptedTurn:
    """``support``: lookups in one turn, then the ticket, then the reply quoting it, then the
    answer."""
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


def _contract_text(request: ScriptRequest) -> str:
    for message in request.messages:
        if message.get("role") == "tool":
            try:
                found = json.loads(message.get("content") or "{}")
            except ValueError:
                continue
            if isinstance(found, dict) and "text" in found:
                return str(found["text"])
    return ""


def contract_summary_script(request: ScriptRequest) -> ScriptedTurn:
    """``contract_summary``: read, then email and update, then the summary."""
    fields = _fields(request)
    if request.turn == 0:
        contract_id = fields.get("contract_id", "c-1001")
        return ScriptedTurn(calls=(ScriptedCall("read_contract", {"contract_id": contract_id}),))
    summary = " ".join(_contract_text(request).split()[:20]) + " …"
    if request.turn == 1:
        return ScriptedTurn(
            calls=(
                ScriptedCall(
                    "send_summary",
                    {
                        "to": fields.get("to", "legal@example.com"),
                        "subject": f"Summary of {fields.get('contract_id', 'the contract')}",
                        "body": summary,
                    },
                ),
                ScriptedCall(
                    "update_crm",
                    {
                        "account": fields.get("account", "ACME"),
                        "status": "summarised",
                        "summary": summary,
                    },
                ),
            )
        )
    return ScriptedTurn(content=summary)
