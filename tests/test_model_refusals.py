"""A model endpoint that refuses the request (issue 37): 400, 401, 403, 404, 413 and 422 are
answered again to the same request, so the run fails at once, after one request, with a message
naming the status, the model and the endpoint, instead of spending its attempts (each a
request) on it. 408, 409, 429 and 5xx are retried. The real openai client (and Pydantic AI's)
over real HTTP to the scripted model server, a real worker and PostgreSQL."""

from __future__ import annotations

import pytest
from pydantic_ai import Agent as PydanticAgent

from orchestrator.agent.llm import DEFAULT_MODEL
from orchestrator.agent.steps import Agent
from orchestrator.agent.tool_loop import ToolAgent
from orchestrator.agents.contract_review import contract_review
from orchestrator.db.store import RunStore
from orchestrator.integrations.pydantic_ai import PydanticAIAgent
from orchestrator.models import RunState
from orchestrator.settings import Settings
from orchestrator.testing import running_worker, wait_for_run
from orchestrator.testing.loopback import ScriptedModelServer, ScriptedTurn, ServerError, turns
from support import failed_attempts
from support.pydantic_ai_agents_for_tests import pai_orders
from test_runtime import FAST
from test_tool_agent import serve_one

REFUSED = [400, 401, 403, 404, 413, 422]
RETRIED = [408, 409]
ANSWER = turns(ScriptedTurn(content="All done."))

plain = ToolAgent("plain", instructions="Answer.")
responses_api = PydanticAIAgent("pai_responses", PydanticAgent(), model="openai:gpt-4o-mini")
"""Pydantic AI's ``openai:`` models speak the Responses API (``/responses``), which a chat
completions server (the scripted one, vLLM, Ollama) does not have: a real 404."""


@pytest.mark.parametrize("status", [*REFUSED, *RETRIED])
@pytest.mark.parametrize("agent", [plain, pai_orders, contract_review], ids=lambda a: a.name)
async def test_a_refused_model_request_fails_the_run_at_once_naming_what_to_check(
    settings: Settings,
    store: RunStore,
    monkeypatch: pytest.MonkeyPatch,
    agent: Agent,
    status: int,
) -> None:
    async with ScriptedModelServer(ANSWER) as model:
        model.fail_next(ServerError(status), times=1 if status in RETRIED else 10)
        run_id, _ = await serve_one(
            settings, store, agent, model, monkeypatch, {"contract": "c", "prompt": "p"}
        )
    run = await store.get(run_id)
    if status in RETRIED:
        # A later request may get past it: asked again, within the turn (a plain step that
        # calls chat() is retried as a step).
        assert run.state is RunState.SUCCEEDED, run.error
        assert [r["answer"] for r in model.requests] == [str(status), "text"]
        assert await failed_attempts(store, run_id) == (1 if agent is contract_review else 0)
        return
    assert run.state is RunState.FAILED and run.error is not None
    assert await failed_attempts(store, run_id) == 0  # the same request is refused again
    assert len(model.requests) == 1
    message = run.error["message"]
    assert f"HTTP {status}" in message and "scripted failure" in message  # the server's words
    assert DEFAULT_MODEL in message and f"127.0.0.1:{model.port}" in message
    assert "check " in message


async def test_a_pydantic_ai_openai_model_against_a_chat_completions_server_fails_at_once(
    settings: Settings, store: RunStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with ScriptedModelServer(ANSWER) as model:
        monkeypatch.setenv("OPENAI_BASE_URL", model.base_url)
        monkeypatch.setenv("OPENAI_API_KEY", "unused")  # Pydantic AI's provider wants one
        run_id = (await store.submit(responses_api.name, {"prompt": "p"})).run.run_id
        async with running_worker(settings, [responses_api], **FAST):
            run = await wait_for_run(store, run_id, within=60)
    assert run.state is RunState.FAILED and run.error is not None
    assert await failed_attempts(store, run_id) == 0
    message = run.error["message"]
    assert "HTTP 404" in message and "no route POST /v1/responses" in message
    assert "use openai-chat:NAME" in message
