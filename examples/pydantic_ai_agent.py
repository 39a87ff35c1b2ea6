"""Run an existing Pydantic AI agent on orchestrator: its read-only tool runs in the worker, its
effectful tool becomes a fenced effect sent once by the dispatcher, and each model turn is one
fenced commit. Needs the pydantic-ai extra: ``pip install -e '.[pydantic-ai]'`` from a checkout
(``pip install 'fenced-orchestrator[pydantic-ai]'`` from an index that has the package).

    python examples/pydantic_ai_agent.py                    # embedded PostgreSQL, ./.orchestrator
    ORCHESTRATOR_DATABASE_URL=postgresql://... python examples/pydantic_ai_agent.py

No model provider and no vendor account are needed: the scripted model server
(``ScriptedModelServer``) answers the OpenAI chat completions API on 127.0.0.1 for Pydantic AI's
``OpenAIChatModel``, and ``LocalVendor`` stands in for the CRM. It prints, as one JSON line: the
run's state and result, what the model answered to each request, and how many requests the
vendor saw per idempotency key (one). See docs/pydantic-ai.md.
"""

from __future__ import annotations

import json
import os

import anyio
from pydantic_ai import Agent
from pydantic_ai.models.openai import OpenAIChatModel
from pydantic_ai.providers.openai import OpenAIProvider

from orchestrator import Settings
from orchestrator.effects.http import HttpAdapter
from orchestrator.integrations.pydantic_ai import PydanticAIAgent, effect
from orchestrator.testing import (
    LocalVendor,
    ScriptedCall,
    ScriptedModelServer,
    ScriptedTurn,
    run_agent,
    turns,
)

# -- an ordinary Pydantic AI agent ------------------------------------------------------------
support = Agent(instructions="Look the order up, then note on it in the CRM where it is.")


@support.tool_plain
def find_order(order_id: str) -> dict[str, str]:
    """Look an order up by id."""
    return {"order_id": order_id, "status": "shipped"}


@support.tool_plain
def note_order(order_id: str, note: str) -> dict[str, str]:
    """Write a note on the order in the CRM."""
    raise NotImplementedError("on orchestrator the dispatcher sends this, never the worker")


def model() -> OpenAIChatModel:
    """The worker's model: any OpenAI-compatible endpoint, here the scripted server."""
    return OpenAIChatModel(
        "gpt-4o-mini",
        provider=OpenAIProvider(base_url=os.environ["OPENAI_BASE_URL"], api_key="unused"),
    )


# -- the same agent on orchestrator -----------------------------------------------------------
orders = PydanticAIAgent(
    "pydantic_ai_example",
    support,
    model=model,
    read_only=["find_order"],  # runs in the worker, inline
    effects={"note_order": effect("crm")},  # a fenced effect of kind crm, sent once
    max_turns=5,
)

SCRIPT = turns(
    ScriptedTurn(calls=(ScriptedCall("find_order", {"order_id": "o-17"}),)),
    ScriptedTurn(calls=(ScriptedCall("note_order", {"order_id": "o-17", "note": "shipped"}),)),
    ScriptedTurn(content="Order o-17 has shipped; the CRM is noted."),
)


async def main() -> None:
    async with ScriptedModelServer(SCRIPT) as server, LocalVendor() as crm:
        os.environ["OPENAI_BASE_URL"] = server.base_url
        run, _timeline = await run_agent(
            Settings.from_env(),
            orders,
            {"prompt": "Where is order o-17?"},
            poll_seconds=0.1,
            effect_adapters={"crm": HttpAdapter("crm", url=crm.send_url, reconcile="replay")},
        )
        print(
            json.dumps(
                {
                    "state": run.state.value,
                    "result": run.result,
                    "model_answered": [request["answer"] for request in server.requests],
                    "vendor_requests_per_key": sorted(crm.requests_by_key.values()),
                }
            )
        )


if __name__ == "__main__":
    anyio.run(main)
