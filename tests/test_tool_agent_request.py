"""What a ``ToolAgent`` turn encodes and sends: each committed message is encoded once per claim
(the turn encodes only what was committed since the previous turn, and its own new messages),
and the model still gets the whole conversation on every turn, on a new claim too. Real
PostgreSQL, a real worker, the real ``openai`` client over real HTTP to the scripted model
server."""

from __future__ import annotations

import json
from typing import Any

import anyio
import pytest

from orchestrator.agent import llm
from orchestrator.agent.tool_loop import ToolAgent
from orchestrator.client import Client
from orchestrator.db.store import RunStore
from orchestrator.effects.http import HttpAdapter
from orchestrator.models import RunState
from orchestrator.settings import Settings
from orchestrator.testing import running_worker, wait_for_run
from orchestrator.testing.loopback import (
    LocalVendor,
    ScriptedCall,
    ScriptedModelServer,
    ScriptedTurn,
    ScriptRequest,
    turns,
)
from support.tool_agents_for_tests import lookup_order, refunds
from test_runtime import FAST

TURNS = 8
reader = ToolAgent(
    "reader",
    instructions="Look up every order you are asked about, one per turn.",
    tools=[lookup_order],
    max_turns=TURNS + 2,
)


def lookups(request: ScriptRequest) -> ScriptedTurn:
    """``TURNS`` lookups, one per turn, then an answer."""
    if request.turn < TURNS:
        order = f"{request.conversation}-{request.turn}"
        return ScriptedTurn(calls=(ScriptedCall("lookup_order", {"order_id": order}),))
    return ScriptedTurn(content=f"All {TURNS} orders of {request.conversation} have shipped.")


LOOKUP_THEN_REFUND = turns(
    ScriptedTurn(calls=(ScriptedCall("lookup_order", {"order_id": "o-17"}),)),
    ScriptedTurn(calls=(ScriptedCall("refund", {"order_id": "o-17", "amount": 150}),)),
    ScriptedTurn(content="The refund is done."),
)
"""A lookup, then a refund that waits for a person's approval, then the answer."""


class Encodes:
    """Every message ``llm`` encodes, and how many had been encoded when each request of each
    conversation reached the model server."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.encoded: list[dict[str, Any]] = []
        self.at_request: dict[str, list[int]] = {}
        real = llm.encode_message

        def encode(message: Any) -> bytes:
            self.encoded.append(message)
            return real(message)

        monkeypatch.setattr(llm, "encode_message", encode)

    def script(self, script: Any) -> Any:
        def answer(request: ScriptRequest) -> ScriptedTurn:
            self.at_request.setdefault(request.conversation, []).append(len(self.encoded))
            return script(request)  # type: ignore[no-any-return]

        return answer

    def per_request(self, conversation: str) -> list[list[dict[str, Any]]]:
        """The messages encoded for each request of one conversation (run alone)."""
        ends = self.at_request[conversation]
        return [self.encoded[a:b] for a, b in zip([0, *ends], ends, strict=False)]


def before_each_assistant(bodies: list[dict[str, Any]]) -> list[int]:
    """Where each turn's request ends in the transcript: at that turn's assistant message."""
    return [i for i, body in enumerate(bodies) if body["role"] == "assistant"]


async def test_each_turn_encodes_only_the_messages_committed_since_the_last_one(
    settings: Settings, store: RunStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    encodes = Encodes(monkeypatch)
    seen: list[list[dict[str, Any]]] = []

    def script(request: ScriptRequest) -> ScriptedTurn:
        seen.append(request.messages)
        return lookups(request)

    async with ScriptedModelServer(encodes.script(script)) as model:
        monkeypatch.setenv("OPENAI_BASE_URL", model.base_url)
        monkeypatch.delenv("OPENAI_API_KEY", raising=False)
        run_id = (await store.submit(reader.name, {"prompt": "solo"})).run.run_id
        async with running_worker(settings, [reader], **FAST):
            await wait_for_run(store, run_id, within=60)
    run = await store.get(run_id)
    assert run.state is RunState.SUCCEEDED, run.error
    assert run.fence == 1  # one claim
    bodies = [m.body for m in await store.messages(run_id)]
    ends = before_each_assistant(bodies)
    assert len(ends) == TURNS + 1
    # The model got the whole conversation each turn...
    assert seen == [bodies[:end] for end in ends]
    # ...and each turn encoded only the messages committed since the previous turn's request:
    # the system prompt and the question first, then the previous assistant message and its
    # tool result. Each message of the transcript was encoded once.
    assert encodes.per_request("solo") == [
        bodies[start:end] for start, end in zip([0, *ends], ends, strict=False)
    ]
    assert [len(batch) for batch in encodes.per_request("solo")] == [2] + [2] * TURNS
    assert len(encodes.encoded) == ends[-1]


async def test_runs_in_one_worker_never_share_what_they_encoded(
    settings: Settings, store: RunStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: dict[str, list[list[dict[str, Any]]]] = {}

    def script(request: ScriptRequest) -> ScriptedTurn:
        seen.setdefault(request.conversation, []).append(request.messages)
        return lookups(request)

    async with ScriptedModelServer(script) as model:
        monkeypatch.setenv("OPENAI_BASE_URL", model.base_url)
        monkeypatch.delenv("OPENAI_API_KEY", raising=False)
        run_ids = {
            name: (await store.submit(reader.name, {"prompt": name})).run.run_id
            for name in ("ana", "bo", "cy")
        }
        async with running_worker(settings, [reader], **FAST):
            for run_id in run_ids.values():
                await wait_for_run(store, run_id, within=60)
    for name, run_id in run_ids.items():
        run = await store.get(run_id)
        assert run.state is RunState.SUCCEEDED, run.error
        assert run.result is not None and name in str(run.result["output"])
        bodies = [m.body for m in await store.messages(run_id)]
        assert seen[name] == [bodies[:end] for end in before_each_assistant(bodies)]


async def test_a_new_claim_encodes_and_sends_the_transcript_as_the_database_holds_it(
    settings: Settings, store: RunStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Turn 0 looks the order up; turn 1 asks for a refund that waits for a person: its commit
    parks the run, and the approval wakes it on a new claim. Meanwhile the lookup's result, which
    the first claim encoded for turn 1, is rewritten in the database (as a failover that took a
    commit back and replayed it differently would): the new claim reads the transcript afresh,
    encodes all of it, and sends what the database holds, never bytes an earlier claim kept."""
    encodes = Encodes(monkeypatch)
    seen: list[list[dict[str, Any]]] = []

    def script(request: ScriptRequest) -> ScriptedTurn:
        seen.append(request.messages)
        return LOOKUP_THEN_REFUND(request)

    prompt = "Refund order o-17, please."
    async with (
        ScriptedModelServer(encodes.script(script)) as model,
        LocalVendor() as vendor,
    ):
        monkeypatch.setenv("OPENAI_BASE_URL", model.base_url)
        monkeypatch.delenv("OPENAI_API_KEY", raising=False)
        adapters = {"crm": HttpAdapter("crm", url=vendor.send_url, reconcile="none")}
        run_id = (await store.submit(refunds.name, {"prompt": prompt})).run.run_id
        async with (
            running_worker(settings, [refunds], effect_adapters=adapters, **FAST),
            await Client.connect(settings) as client,
        ):
            with anyio.fail_after(60):
                while not (pending := await client.approvals.list(run_id=run_id)):  # noqa: ASYNC110
                    await anyio.sleep(0.05)
            [waiting] = pending
            assert waiting.payload_sha256 is not None
            assert len(seen) == 2
            [lookup] = [m for m in await store.messages(run_id) if m.role == "tool"]
            rewritten = {**lookup.body, "content": json.dumps({"status": "lost in transit ✗"})}
            await store.pool.execute(
                "UPDATE run_messages SET body = $3::jsonb WHERE run_id = $1 AND seq = $2",
                run_id,
                lookup.seq,
                rewritten,
            )
            await client.approvals.approve(
                run_id, waiting.effect_key, by="ana", payload_sha256=waiting.payload_sha256
            )
            await wait_for_run(store, run_id, within=60)
    run = await store.get(run_id)
    assert run.state is RunState.SUCCEEDED, run.error
    assert run.fence == 2  # a second claim ran turn 2
    bodies = [m.body for m in await store.messages(run_id)]
    assert bodies[lookup.seq] == rewritten
    before = [lookup.body if m == rewritten else m for m in bodies]  # as the first claim saw it
    ends = before_each_assistant(bodies)
    assert seen == [before[: ends[0]], before[: ends[1]], bodies[: ends[2]]]
    # The first claim encoded each message once; the second encoded every message of its
    # request: the five committed before the park (as the database holds them now) and the
    # refund's outcome, new in that turn.
    first, second, third = encodes.per_request(prompt)
    assert first == before[: ends[0]] and second == before[ends[0] : ends[1]]
    assert third == bodies[: ends[2]] and len(third) == 6
