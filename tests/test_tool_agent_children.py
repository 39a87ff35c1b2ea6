"""Agents as tools (docs/child-runs.md): a ToolAgent's ``@tool.agent`` call runs another agent
as a child run started by the turn's commit; the run waits for it without its lease, and the
model reads how it ended (its result, or its error), through the fence."""

from __future__ import annotations

import json
from typing import Any

import pytest

from orchestrator import Budget
from orchestrator.agent.steps import Agent, Fail, Finish, Outcome, Step, StepContext
from orchestrator.agent.tool_loop import ToolAgent
from orchestrator.agent.tools import AgentTool, tool
from orchestrator.db.store import RunStore
from orchestrator.errors import InvalidInput
from orchestrator.models import RunState
from orchestrator.settings import Settings
from orchestrator.testing import running_worker
from orchestrator.testing.loopback import ScriptedCall, ScriptedModelServer, ScriptedTurn, turns
from test_runtime import FAST
from test_upgrades import until_state


class Research(Step):
    async def run(self, ctx: StepContext) -> Outcome:
        if ctx.input["topic"] == "nothing":
            return Fail("nothing to research", details={"topic": "nothing"})
        return Finish(result={"summary": f"all about {ctx.input['topic']}"})


@tool.agent("researcher")
def research(topic: str) -> dict[str, Any]:
    """Have a researcher look a topic up; returns its summary.

    Args:
        topic: What to research.
    """
    return {"topic": topic}


researcher = Agent("researcher", first=Research)
desk = ToolAgent("desk", instructions="Answer with the researcher's help.", tools=[research])


@pytest.mark.parametrize(("topic", "state"), [("fences", "succeeded"), ("nothing", "failed")])
async def test_an_agent_tool_runs_a_child_and_the_model_reads_how_it_ended(
    settings: Settings,
    store: RunStore,
    monkeypatch: pytest.MonkeyPatch,
    topic: str,
    state: str,
) -> None:
    script = turns(
        ScriptedTurn(calls=(ScriptedCall("research", {"topic": topic}),)),
        ScriptedTurn(content="Here is what the researcher found."),
    )
    async with ScriptedModelServer(script) as model:
        monkeypatch.setenv("OPENAI_BASE_URL", model.base_url)
        monkeypatch.delenv("OPENAI_API_KEY", raising=False)
        run_id = (await store.submit("desk", {"prompt": f"Tell me about {topic}"})).run.run_id
        async with running_worker(settings, [desk, researcher], **FAST):
            done = await until_state(store, run_id, RunState.SUCCEEDED, RunState.DEAD)
    assert done.state is RunState.SUCCEEDED, done.error
    [child] = await store.list_runs(parent=run_id)
    assert child.agent == "researcher" and child.input == {"topic": topic}
    assert child.state.value == state
    waits = [e for e in await store.events(run_id) if e.kind == "waiting"]
    assert [w.details.get("reason") for w in waits] == ["children"]  # no lease while it ran
    transcript = await store.messages(run_id)
    [told] = [m for m in transcript if m.role == "tool"]
    content = json.loads(told.body["content"])
    assert content["state"] == state
    if state == "succeeded":
        assert content["result"] == {"summary": "all about fences"}
    else:
        assert content["error"]["message"] == "nothing to research"
    assert [r["turn"] for r in model.requests] == [0, 1]  # each turn asked once


def test_a_bad_agent_tool_is_one_line() -> None:
    with pytest.raises(InvalidInput, match="agent") as raised:
        tool.agent("bad agent!")(research.function)
    assert "\n" not in str(raised.value)
    with pytest.raises(InvalidInput, match="a Budget") as raised:
        AgentTool(research.function, agent="researcher", budget=5)  # type: ignore[arg-type]
    assert "\n" not in str(raised.value)
    carved = AgentTool(research.function, agent="researcher", budget=Budget(turns=3))
    assert carved.budget == Budget(turns=3)


async def test_a_pydantic_ai_agent_s_agent_tool_runs_a_child_and_returns_its_result(
    settings: Settings, store: RunStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pydantic_ai import Agent as PydanticAgent

    from orchestrator.integrations.pydantic_ai import PydanticAIAgent, child_agent
    from support.pydantic_ai_agents_for_tests import local_model

    helper = PydanticAgent(instructions="Answer with the researcher's help.")

    @helper.tool_plain
    def research_topic(topic: str) -> dict[str, object]:
        """Have a researcher look a topic up."""
        raise AssertionError("an agent tool never runs in the worker")

    agent = PydanticAIAgent(
        "pai_desk",
        helper,
        model=local_model,
        agents={"research_topic": child_agent("researcher")},
    )
    script = turns(
        ScriptedTurn(calls=(ScriptedCall("research_topic", {"topic": "fences"}),)),
        ScriptedTurn(content="The researcher says: all about fences."),
    )
    async with ScriptedModelServer(script) as model:
        monkeypatch.setenv("OPENAI_BASE_URL", model.base_url)
        monkeypatch.delenv("OPENAI_API_KEY", raising=False)
        run_id = (await store.submit("pai_desk", {"prompt": "Fences?"})).run.run_id
        async with running_worker(settings, [agent, researcher], **FAST):
            done = await until_state(store, run_id, RunState.SUCCEEDED, RunState.DEAD)
    assert done.state is RunState.SUCCEEDED, done.error
    [child] = await store.list_runs(parent=run_id)
    assert (child.agent, child.input, child.state) == (
        "researcher",
        {"topic": "fences"},
        RunState.SUCCEEDED,
    )
    # The call's return, as the model's second request carried it: the child's result.
    transcript = await store.messages(run_id)
    returned = [m for m in transcript if "all about fences" in json.dumps(m.body)]
    assert returned and returned[0].role == "tool", [(m.role, m.body) for m in transcript]
    assert [r["turn"] for r in model.requests] == [0, 1]
    waits = [e for e in await store.events(run_id) if e.kind == "waiting"]
    assert [w.details.get("reason") for w in waits] == ["children"]
