"""Model calls for steps: the OpenAI client (or any OpenAI-compatible server), traced.

Configuration comes from the environment of the worker, never from run input: ``OPENAI_API_KEY``,
``ORCHESTRATOR_MODEL_BASE_URL`` (an OpenAI-compatible endpoint; unset means OpenAI's) and
``ORCHESTRATOR_MODEL`` (default ``gpt-4o-mini``). Each call is a span named ``chat MODEL`` with
the OpenTelemetry gen_ai attributes; prompts and completions are not recorded (they may hold
customer data), only sizes and token counts.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cache

import openai

from orchestrator.errors import OrchestratorError
from orchestrator.telemetry import start_span

DEFAULT_MODEL = "gpt-4o-mini"


class ModelNotConfigured(OrchestratorError):
    """No credentials or endpoint for model calls in this worker's environment."""


@dataclass(frozen=True)
class Completion:
    text: str
    model: str
    input_tokens: int | None
    output_tokens: int | None


@cache
def _client(base_url: str | None, api_key: str, timeout: float) -> openai.AsyncOpenAI:
    # One client per configuration and process: it pools its HTTP connections.
    return openai.AsyncOpenAI(base_url=base_url, api_key=api_key, timeout=timeout, max_retries=1)


def model_client(environ: Mapping[str, str] | None = None) -> tuple[openai.AsyncOpenAI, str]:
    env = os.environ if environ is None else environ
    base_url = env.get("ORCHESTRATOR_MODEL_BASE_URL") or None
    api_key = env.get("OPENAI_API_KEY") or ("local" if base_url else None)
    if api_key is None:
        raise ModelNotConfigured(
            "no model configured for this worker: set OPENAI_API_KEY, or "
            "ORCHESTRATOR_MODEL_BASE_URL for an OpenAI-compatible server"
        )
    timeout = float(env.get("ORCHESTRATOR_MODEL_TIMEOUT_SECONDS") or 60)
    return _client(base_url, api_key, timeout), env.get("ORCHESTRATOR_MODEL") or DEFAULT_MODEL


async def chat(messages: Sequence[Mapping[str, str]], *, max_tokens: int = 512) -> Completion:
    """One chat completion. Cancellable: a lost lease cancels the HTTP request in flight."""
    client, model = model_client()
    with start_span(
        f"chat {model}",
        attributes={
            "gen_ai.operation.name": "chat",
            "gen_ai.system": "openai",
            "gen_ai.request.model": model,
            "gen_ai.request.max_tokens": max_tokens,
        },
    ) as span:
        response = await client.chat.completions.create(
            model=model,
            messages=[dict(message) for message in messages],  # type: ignore[misc]
            max_tokens=max_tokens,
        )
        usage = response.usage
        completion = Completion(
            text=response.choices[0].message.content or "",
            model=response.model,
            input_tokens=usage.prompt_tokens if usage else None,
            output_tokens=usage.completion_tokens if usage else None,
        )
        span.set_attribute("gen_ai.response.model", completion.model)
        if completion.input_tokens is not None:
            span.set_attribute("gen_ai.usage.input_tokens", completion.input_tokens)
        if completion.output_tokens is not None:
            span.set_attribute("gen_ai.usage.output_tokens", completion.output_tokens)
        return completion
