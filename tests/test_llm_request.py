"""The request ``llm.complete`` sends: its body built once from pre-encoded messages
(``encode_message``, ``EncodedMessages``), posted by the official ``openai`` client over real HTTP
to the scripted model server on loopback, which keeps every request's bytes. The stock client
(``client.chat.completions.create``) is the reference: same JSON, same headers."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import AsyncIterator
from types import MappingProxyType
from typing import Any

import pytest

from orchestrator.agent import llm
from orchestrator.agent.llm import EncodedMessages, ModelCallFailed, complete, encode_message
from orchestrator.testing.loopback import (
    RateLimited,
    RawRequest,
    ScriptedCall,
    ScriptedModelServer,
    ScriptedTurn,
    ServerError,
    Slow,
    turns,
)

TRICKY = 'Grüße — 東京 🚀 \u2028 \u0000\u001f "quoted" back\\slash </script> \ud7ff'
MESSAGES: list[Any] = [
    {"role": "system", "content": "You look orders up."},
    {"role": "user", "content": TRICKY, "name": "ana"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "lookup_order", "arguments": '{"order_id": "o-17 é"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": json.dumps({"status": "shipped ✓"})},
    MappingProxyType({"role": "user", "content": [{"type": "text", "text": "and o-18?"}]}),
    {"role": "assistant", "content": "", "refusal": None, "numbers": [1, 2.5, -0.0, 10**20]},
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup_order",
            "description": "Look an order up — by its id.",
            "parameters": {"type": "object", "properties": {"order_id": {"type": "string"}}},
        },
    }
]
RESPONSE_FORMAT = {
    "type": "json_schema",
    "json_schema": {"name": "output", "schema": {"type": "object"}},
}
SCRIPT = turns(
    ScriptedTurn(
        content="Looking it up…",
        calls=(
            ScriptedCall("lookup_order", {"order_id": "o-18"}, id="call_2"),
            ScriptedCall("lookup_order", '{"order_id": "o-19"', id="call_3"),
        ),
    )
)
VOLATILE_HEADERS = {"content-length", "x-stainless-read-timeout"}
"""Headers that differ between two requests for reasons other than the body's encoding."""


@pytest.fixture(autouse=True)
def model_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith(("OPENAI_", "ORCHESTRATOR_MODEL")):
            monkeypatch.delenv(name)


@contextlib.asynccontextmanager
async def serving(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[ScriptedModelServer]:
    """The scripted model server, keeping every request's bytes, as the worker's model."""
    async with ScriptedModelServer(SCRIPT, keep_raw=True) as model:
        monkeypatch.setenv("OPENAI_BASE_URL", model.base_url)
        yield model


def counting_encodes(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Every message ``llm`` encodes from now on."""
    encoded: list[Any] = []
    real = llm.encode_message

    def encode(message: Any) -> bytes:
        encoded.append(message)
        return real(message)

    monkeypatch.setattr(llm, "encode_message", encode)
    return encoded


def plain(message: Any) -> dict[str, Any]:
    return dict(message)


async def stock_request(server: ScriptedModelServer, *, stream: bool) -> RawRequest:
    """What the unmodified client sends for ``MESSAGES`` (the reference)."""
    client, model = llm.model_client()
    options: dict[str, Any] = {
        "model": model,
        "messages": [plain(m) for m in MESSAGES],
        "tools": TOOLS,
        "max_tokens": 300,
        "response_format": RESPONSE_FORMAT,
    }
    if stream:
        chunks = await client.chat.completions.create(
            **options, stream=True, stream_options={"include_usage": True}
        )
        async for _ in chunks:
            pass
    else:
        await client.chat.completions.create(**options)
    return server.raw[-1]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_the_body_is_the_stock_clients_for_the_same_messages(
    monkeypatch: pytest.MonkeyPatch, stream: bool
) -> None:
    async with serving(monkeypatch) as server:
        reference = await stock_request(server, stream=stream)
        await complete(
            MESSAGES, tools=TOOLS, max_tokens=300, response_format=RESPONSE_FORMAT, stream=stream
        )
        ours = server.raw[-1]
        assert json.loads(ours.body) == json.loads(reference.body)
        # Each message's bytes are exactly the stock client's (its encoding, not just its meaning).
        for message in MESSAGES:
            assert encode_message(message) in reference.body
        assert (ours.method, ours.path) == (reference.method, reference.path)
        assert {k: v for k, v in ours.headers.items() if k not in VOLATILE_HEADERS} == {
            k: v for k, v in reference.headers.items() if k not in VOLATILE_HEADERS
        }
        assert ours.headers["content-type"] == "application/json"
        assert ours.headers["authorization"] == f"Bearer {llm.PLACEHOLDER_API_KEY}"
        assert int(ours.headers["content-length"]) == len(ours.body)
        assert "transfer-encoding" not in ours.headers


async def test_pre_encoded_messages_send_the_same_bytes_as_plain_ones(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with serving(monkeypatch) as server:
        await complete(MESSAGES, tools=TOOLS, max_tokens=300)
        encoded = EncodedMessages.of(MESSAGES)
        assert len(encoded) == len(MESSAGES)
        assert encoded.size == sum(len(encode_message(m)) for m in MESSAGES)
        assert encoded.array_size == len(b"[" + b",".join(encoded) + b"]")
        assert EncodedMessages().array_size == len(b"[]")
        seen = counting_encodes(monkeypatch)
        await complete(encoded, tools=TOOLS, max_tokens=300)
        assert seen == []  # nothing encoded again
        first, second = server.raw[-2:]
        assert first.body == second.body
        halves = EncodedMessages.of(MESSAGES[:2]) + EncodedMessages.of(MESSAGES[2:])
        assert list(halves) == list(encoded) and halves.size == encoded.size
        await complete(EncodedMessages(), max_tokens=1)
        assert json.loads(server.raw[-1].body)["messages"] == []
        await complete(EncodedMessages.of(MESSAGES[:1]), max_tokens=1)
        assert json.loads(server.raw[-1].body)["messages"] == [MESSAGES[0]]


async def test_streamed_and_whole_answers_are_the_same_reply(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with serving(monkeypatch) as server:
        whole = await complete(MESSAGES, tools=TOOLS)
        streamed = await complete(MESSAGES, tools=TOOLS, stream=True)
        assert whole.content == streamed.content == "Looking it up…"
        assert whole.tool_calls == streamed.tool_calls
        assert [(c.id, c.name, c.arguments) for c in whole.tool_calls] == [
            ("call_2", "lookup_order", '{"order_id": "o-18"}'),
            ("call_3", "lookup_order", '{"order_id": "o-19"'),
        ]
        assert whole.finish_reason == streamed.finish_reason == "tool_calls"
        assert whole.output_tokens == streamed.output_tokens > 0
        # The server counts a token per four bytes of the body it received.
        for reply, raw in zip((whole, streamed), server.raw[-2:], strict=True):
            assert reply.input_tokens == len(raw.body) // 4
            assert [a.outcome for a in reply.attempts] == ["ok"]
        body = json.loads(server.raw[-1].body)
        assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
        assert "stream" not in json.loads(server.raw[-2].body)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_a_retried_request_sends_the_same_bytes_encoded_once(
    monkeypatch: pytest.MonkeyPatch, stream: bool
) -> None:
    async with serving(monkeypatch) as server:
        monkeypatch.setattr(llm, "BACKOFF_SECONDS", (0.0, 0.0, 0.0, 0.0))
        server.fail_next(RateLimited(retry_after=0))
        server.fail_next(ServerError(503))
        seen = counting_encodes(monkeypatch)
        reply = await complete(MESSAGES, tools=TOOLS, max_tokens=300, stream=stream)
        assert [a.outcome for a in reply.attempts] == ["rate_limited", "server_error", "ok"]
        assert [a.status for a in reply.attempts] == [429, 503, 200]
        assert reply.input_tokens == len(server.raw[-1].body) // 4  # only the answered attempt
        assert len(seen) == len(MESSAGES)  # each message encoded once, for all three attempts
        bodies = [raw.body for raw in server.raw[-3:]]
        assert bodies[0] == bodies[1] == bodies[2]
        assert reply.content == "Looking it up…"


async def test_errors_are_reported_as_before(monkeypatch: pytest.MonkeyPatch) -> None:
    async with serving(monkeypatch) as server:
        monkeypatch.setattr(llm, "BACKOFF_SECONDS", (0.0, 0.0, 0.0, 0.0))
        server.fail_next(ServerError(400))
        with pytest.raises(ModelCallFailed, match=r"refused the request \(HTTP 400\)") as refused:
            await complete(MESSAGES, stream=True)
        assert [(a.outcome, a.status) for a in refused.value.attempts] == [("refused", 400)]
        server.fail_next(ServerError(500), times=llm.MODEL_ATTEMPTS)
        with pytest.raises(ModelCallFailed, match="after 4 attempts") as failed:
            await complete(MESSAGES)
        assert [a.outcome for a in failed.value.attempts] == ["server_error"] * 4
        # The budget bounds each request: a slow answer is a timeout, and no time is left after it.
        server.fail_next(Slow(5.0))
        with pytest.raises(ModelCallFailed, match="timeout") as slow:
            await complete(MESSAGES, budget_seconds=0.5)
        assert [a.outcome for a in slow.value.attempts] == ["timeout"]
        assert slow.value.attempts[0].seconds < 2.0
