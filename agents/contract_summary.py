"""``contract_summary``: the seed's example as a tool agent. The model reads the contract,
drafts a summary, emails it (an irreversible effect) and updates the CRM (a replaceable one).

Input: ``{"contract_id": "c-1001", "to": "legal@acme.test", "account": "ACME"}``; a contract may
also come inline as ``"contract"``. The email and the CRM update are tool calls the model chose:
the commit records them, fenced, and the dispatcher (vendors for the kinds ``email`` and
``crm``) sends each once, however many workers wake up stale.

Offline, the local scripted model answers for it (``orchestrator.testing.local_scripts``):
``orchestrator demo`` uses that when no model is configured.
"""

from __future__ import annotations

from orchestrator import EffectPolicy, ToolAgent, ToolContext, tool

CONTRACTS = {
    "c-1001": (
        "Master services agreement between ACME Corp and Northwind Ltd. Term: 24 months from "
        "1 January, renewing yearly unless cancelled 60 days ahead. Fees: 12,000 per month, "
        "payable within 30 days. Liability capped at 12 months of fees. Governing law: England."
    ),
}


@tool.read_only(timeout=10)
def read_contract(ctx: ToolContext, contract_id: str) -> dict[str, str]:
    """Read a contract's full text by its id.

    Args:
        contract_id: The contract's id, such as c-1001.
    """
    inline = ctx.input.get("contract") if isinstance(ctx.input, dict) else None
    text = inline if isinstance(inline, str) else CONTRACTS.get(contract_id)
    if text is None:
        raise LookupError(f"no contract {contract_id!r}")
    return {"contract_id": contract_id, "text": text}


@tool.effect("email", policy=EffectPolicy.IRREVERSIBLE)
def send_summary(to: str, subject: str, body: str) -> dict[str, str]:
    """Email the contract summary (sent once, never resent).

    Args:
        to: The recipient's address.
        subject: The email's subject line.
        body: The summary itself.
    """
    return {"to": to, "subject": subject, "body": body}


@tool.effect("crm", policy=EffectPolicy.REPLACEABLE)
def update_crm(account: str, status: str, summary: str) -> dict[str, str]:
    """Set the account's contract status and summary in the CRM (a newer update may replace an
    unsent one).

    Args:
        account: The account's name.
        status: The contract's status, such as summarised.
        summary: The summary, as a line.
    """
    return {"account": account, "status": status, "summary": summary}


contract_summary = ToolAgent(
    "contract_summary",
    instructions=(
        "You summarise contracts for the legal team. Read the contract with read_contract, "
        "then email a summary of at most three sentences with send_summary and record it with "
        "update_crm (status 'summarised'), then answer with the summary."
    ),
    tools=[read_contract, send_summary, update_crm],
    max_turns=6,
    description="Reads a contract, emails its summary and updates the CRM.",
)
