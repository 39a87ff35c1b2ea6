"""Run a tool agent on your own machine with no model provider: the scripted model server
(``orchestrator.testing.ScriptedModelServer``) answers the OpenAI chat completions API on
127.0.0.1 from a script, so a run, a test or a CI job is deterministic and costs nothing.

    python examples/scripted_model.py                       # embedded PostgreSQL, ./.orchestrator
    ORCHESTRATOR_DATABASE_URL=postgresql://... python examples/scripted_model.py

It prints, as one JSON line: the run's state and result, and what the model server answered to
each request (a 429 first, injected with ``fail_next``, which the turn retries; then the tool
call; then the answer). See docs/scripted-model.md.
"""

from __future__ import annotations

import json
import os
from typing import Any

import anyio

from orchestrator import Settings, ToolAgent, ToolContext, tool
from orchestrator.testing import (
    RateLimited,
    ScriptedCall,
    ScriptedModelServer,
    ScriptedTurn,
    run_agent,
    turns,
)


@tool.read_only(timeout=5)
async def find_order(ctx: ToolContext, order_id: str) -> dict[str, Any]:
    """Look an order up by id.

    Args:
        order_id: The order's id, such as o-17.
    """
    return {"order_id": order_id, "status": "shipped"}


orders = ToolAgent(
    "orders_example",
    instructions="Look the order up, then tell the customer where it is.",
    tools=[find_order],
    max_turns=4,
)

# Turn 0: the model calls find_order; turn 1 (after the tool result): it answers in text.
SCRIPT = turns(
    ScriptedTurn(calls=(ScriptedCall("find_order", {"order_id": "o-17"}),)),
    ScriptedTurn(content="Order o-17 has shipped."),
)


async def main() -> None:
    async with ScriptedModelServer(SCRIPT) as model:
        model.fail_next(RateLimited(retry_after=0.2))  # the first request meets a 429
        # The worker's model client reads the OpenAI client's own variables.
        os.environ["OPENAI_BASE_URL"] = model.base_url
        os.environ["OPENAI_API_KEY"] = ""  # never send a real key to a local server
        run, _timeline = await run_agent(
            Settings.from_env(), orders, {"prompt": "Where is order o-17?"}, poll_seconds=0.1
        )
    print(
        json.dumps(
            {
                "state": run.state.value,
                "result": run.result,
                "model_answered": [request["answer"] for request in model.requests],
            }
        )
    )


if __name__ == "__main__":
    anyio.run(main)
