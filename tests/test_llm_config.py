"""Model configuration from the worker's environment, through the real OpenAI client over real
HTTP to a loopback OpenAI-compatible server (the usual vLLM/Ollama setup: a base URL, no key)."""

from __future__ import annotations

import os
import time
from typing import Any

import openai
import pytest

from orchestrator.agent import llm
from orchestrator.agent.llm import ModelNotConfigured, chat, model_client
from orchestrator.errors import InvalidInput
from orchestrator.testing import LocalModelServer, capture_spans

CONTRACT = "The supplier shall deliver 40 units per month at 12 EUR each until 2027."
MESSAGES = [{"role": "user", "content": CONTRACT}]
NOWHERE = {"OPENAI_API_KEY": "sk-test", "OPENAI_BASE_URL": "http://127.0.0.1:9/v1"}
"""A configuration with an endpoint nothing is asked of: only the client is built."""


class RecordingModelServer(LocalModelServer):
    """``LocalModelServer`` that also keeps each request's headers and can answer with an error."""

    def __init__(self, *, status: int = 200, delay: float = 0.0) -> None:
        super().__init__(delay=delay)
        self.status = status
        self.headers: list[dict[str, str]] = []
        self.attempts = 0

    async def respond(
        self, method: str, path: str, headers: dict[str, str], body: bytes
    ) -> tuple[int, Any]:
        self.attempts += 1
        self.headers.append(headers)
        if self.status != 200:
            return self.status, {"error": {"message": "the model is overloaded"}}
        return await super().respond(method, path, headers, body)


@pytest.fixture(autouse=True)
def no_model_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only what each test sets: the OpenAI client reads OPENAI_* variables on its own too."""
    for name in list(os.environ):
        if name.startswith(("OPENAI_", "ORCHESTRATOR_MODEL")):
            monkeypatch.delenv(name)


async def test_openai_base_url_without_a_key_reaches_a_local_server(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with RecordingModelServer() as server:
        monkeypatch.setenv("OPENAI_BASE_URL", server.base_url)
        monkeypatch.setenv("ORCHESTRATOR_MODEL", "llama3.1:8b")
        completion = await chat(MESSAGES)
    assert (
        completion.text == "Summary: The supplier shall deliver 40 units per month at 12 EUR each"
    )
    assert completion.model == "llama3.1:8b"
    assert completion.input_tokens is not None and completion.output_tokens is not None
    assert [request["model"] for request in server.requests] == ["llama3.1:8b"]
    assert server.headers[0]["authorization"] == f"Bearer {llm.PLACEHOLDER_API_KEY}"


async def test_a_key_set_beside_the_base_url_is_sent(monkeypatch: pytest.MonkeyPatch) -> None:
    async with RecordingModelServer() as server:
        monkeypatch.setenv("OPENAI_BASE_URL", server.base_url)
        monkeypatch.setenv("OPENAI_API_KEY", "sk-gateway")
        await chat(MESSAGES)
    assert server.headers[0]["authorization"] == "Bearer sk-gateway"


async def test_the_orchestrator_alias_works_and_openai_base_url_wins_over_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with RecordingModelServer() as standard, RecordingModelServer() as alias:
        monkeypatch.setenv("ORCHESTRATOR_MODEL_BASE_URL", alias.base_url)
        await chat(MESSAGES)
        assert (standard.attempts, alias.attempts) == (0, 1)
        monkeypatch.setenv("OPENAI_BASE_URL", standard.base_url)
        await chat(MESSAGES)
        assert (standard.attempts, alias.attempts) == (1, 1)


def test_a_valid_timeout_is_the_clients() -> None:
    client, model = model_client({**NOWHERE, "ORCHESTRATOR_MODEL_TIMEOUT_SECONDS": "2.5"})
    assert (client.timeout, client.max_retries, model) == (2.5, 0, "gpt-4o-mini")


def test_no_key_and_no_base_url_names_both_variables() -> None:
    with pytest.raises(ModelNotConfigured) as raised:
        model_client({})
    assert "OPENAI_API_KEY" in str(raised.value) and "OPENAI_BASE_URL" in str(raised.value)


@pytest.mark.parametrize("value", ["sixty", "60s", "nan", "inf", "0", "-5"])
def test_a_bad_timeout_is_refused_on_one_line(value: str) -> None:
    with pytest.raises(InvalidInput) as raised:
        model_client({**NOWHERE, "ORCHESTRATOR_MODEL_TIMEOUT_SECONDS": value})
    message = str(raised.value)
    assert "\n" not in message
    assert f"ORCHESTRATOR_MODEL_TIMEOUT_SECONDS={value!r} is not a number of seconds" in message


async def test_the_timeout_applies_and_the_client_does_not_retry_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with RecordingModelServer(delay=5) as server:
        # With a key the client reads OPENAI_BASE_URL itself, so only its retries are compared.
        monkeypatch.setenv("OPENAI_BASE_URL", server.base_url)
        monkeypatch.setenv("OPENAI_API_KEY", "sk-local")
        monkeypatch.setenv("ORCHESTRATOR_MODEL_TIMEOUT_SECONDS", " 0.3 ")
        started = time.monotonic()
        with pytest.raises(openai.APITimeoutError):
            await chat(MESSAGES)
        elapsed = time.monotonic() - started
    assert server.attempts == 1
    assert elapsed < 4  # cut off at the timeout, not after the server's 5 s answer


async def test_a_server_error_is_not_retried_by_the_client(monkeypatch: pytest.MonkeyPatch) -> None:
    async with RecordingModelServer(status=503) as server:
        monkeypatch.setenv("OPENAI_BASE_URL", server.base_url)
        monkeypatch.setenv("OPENAI_API_KEY", "sk-local")
        with pytest.raises(openai.InternalServerError):
            await chat(MESSAGES)
    assert server.attempts == 1  # the step's retry policy is the one retry layer


async def test_the_chat_span_names_the_provider(monkeypatch: pytest.MonkeyPatch) -> None:
    exporter = capture_spans()
    assert exporter is not None
    exporter.clear()
    async with RecordingModelServer() as server:
        monkeypatch.setenv("ORCHESTRATOR_MODEL_BASE_URL", server.base_url)  # the alias, traced too
        monkeypatch.setenv("ORCHESTRATOR_MODEL", "llama3.1:8b")
        completion = await chat(MESSAGES, max_tokens=64)
    [span] = [span for span in exporter.get_finished_spans() if span.name == "chat llama3.1:8b"]
    assert span.attributes is not None
    attributes = dict(span.attributes)
    assert attributes["gen_ai.provider.name"] == "openai"
    assert "gen_ai.system" not in attributes  # deprecated for gen_ai.provider.name
    assert attributes["gen_ai.operation.name"] == "chat"
    assert attributes["gen_ai.request.max_tokens"] == 64
    assert attributes["gen_ai.usage.output_tokens"] == completion.output_tokens
