"""The example agent end to end, its model calls going to a local OpenAI-compatible server."""

from __future__ import annotations

import anyio
import pytest

from orchestrator.agents.contract_review import contract_review
from orchestrator.db.store import RunStore
from orchestrator.models import RunState
from orchestrator.settings import Settings
from orchestrator.testing import LocalModelServer, run_agent, running_worker, wait_for_run

CONTRACT = "The supplier shall deliver 40 units per month at 12 EUR each until 2027."


async def test_contract_review_summarises_reviews_and_delivers(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with LocalModelServer() as model:
        monkeypatch.setenv("ORCHESTRATOR_MODEL_BASE_URL", model.base_url)
        monkeypatch.setenv("ORCHESTRATOR_MODEL", "local-test-model")
        run, events = await run_agent(
            settings,
            contract_review,
            {"contract": CONTRACT, "recipient": "legal@acme.test"},
            lease_seconds=30,
            heartbeat_seconds=5,
            poll_seconds=0.1,
        )
    assert run.state is RunState.SUCCEEDED
    assert run.result == {
        "to": "legal@acme.test",
        "summary": "Summary: The supplier shall deliver 40 units per month at 12 EUR each",
    }
    assert [e.details.get("step") for e in events if e.kind == "checkpoint"] == [
        "Review",
        "Deliver",
    ]
    assert len(model.requests) == 1
    request = model.requests[0]
    assert request["model"] == "local-test-model"
    assert request["messages"][-1] == {"role": "user", "content": CONTRACT}


async def test_bad_input_fails_the_run_without_calling_the_model(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with LocalModelServer() as model:
        monkeypatch.setenv("ORCHESTRATOR_MODEL_BASE_URL", model.base_url)
        run, _ = await run_agent(settings, contract_review, {"contract": ""}, poll_seconds=0.1)
    assert run.state is RunState.FAILED
    assert run.error == {"type": "Fail", "message": "input.contract must be the contract's text"}
    assert model.requests == []


async def test_cancel_during_a_slow_model_call_commits_nothing(
    settings: Settings, store: RunStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with LocalModelServer(delay=5) as model:
        monkeypatch.setenv("ORCHESTRATOR_MODEL_BASE_URL", model.base_url)
        async with running_worker(
            settings, [contract_review], lease_seconds=30, heartbeat_seconds=5, poll_seconds=0.1
        ) as worker:
            run_id = (await store.submit("contract_review", {"contract": CONTRACT})).run.run_id
            with anyio.fail_after(60):
                while not model.requests:  # noqa: ASYNC110 - the server offers no event to await
                    await anyio.sleep(0.02)
            await store.cancel(run_id)
            with anyio.fail_after(4):  # before the model's answer (5 s) would have come
                while run_id in worker.active:  # noqa: ASYNC110 - worker state, polled
                    await anyio.sleep(0.01)
        run = await wait_for_run(store, run_id)
    assert run.state is RunState.CANCELLED
    assert run.checkpoint_version == 0
    assert "checkpoint" not in [e.kind for e in await store.events(run_id)]
