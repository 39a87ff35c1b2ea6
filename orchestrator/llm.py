"""Model calls for steps: the OpenAI client (or any OpenAI-compatible server), traced.

Configuration comes from the environment of the worker, never from run input:

- ``OPENAI_BASE_URL``: an OpenAI-compatible endpoint (vLLM, Ollama, a gateway), the variable the
  OpenAI SDK itself reads; unset means OpenAI's. ``ORCHESTRATOR_MODEL_BASE_URL`` is an alias
  kept for existing setups; when both are set, ``OPENAI_BASE_URL`` wins, as the standard name.
- ``OPENAI_API_KEY``: required for OpenAI's own endpoint; with a base URL and no key, a
  placeholder key is sent (the client requires one and local servers ignore it).
- ``ORCHESTRATOR_MODEL`` (default ``gpt-4o-mini``) and ``ORCHESTRATOR_MODEL_TIMEOUT_SECONDS``
  (default 60, per request).

The client does not retry: a failed call fails its step, and the step's retry policy is the one
retry layer. Each call is a span named ``chat MODEL`` with the OpenTelemetry gen_ai attributes;
prompts and completions are not recorded (they may hold customer data), only sizes and token
counts.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING

from orchestrator.errors import InvalidInput, OrchestratorError
from orchestrator.telemetry import start_span

if TYPE_CHECKING:
    import openai

DEFAULT_MODEL = "gpt-4o-mini"
DEFAULT_TIMEOUT_SECONDS = 60.0
PLACEHOLDER_API_KEY = "unused"
"""Sent to an OpenAI-compatible server when no key is set: the client refuses to start without."""


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
    # One client per configuration and process: it pools its HTTP connections. No retries of
    # its own, since the step's retry policy already retries a failed call. Imported here:
    # loading the client is slow, and `import orchestrator` must not pay for it.
    import openai

    return openai.AsyncOpenAI(base_url=base_url, api_key=api_key, timeout=timeout, max_retries=0)


def model_client(environ: Mapping[str, str] | None = None) -> tuple[openai.AsyncOpenAI, str]:
    """The client and model name this worker's environment configures (see the module doc)."""
    env = os.environ if environ is None else environ
    base_url = env.get("OPENAI_BASE_URL") or env.get("ORCHESTRATOR_MODEL_BASE_URL") or None
    api_key = env.get("OPENAI_API_KEY") or (PLACEHOLDER_API_KEY if base_url else None)
    if api_key is None:
        raise ModelNotConfigured(
            "no model configured for this worker: set OPENAI_API_KEY, or OPENAI_BASE_URL "
            "for an OpenAI-compatible server (vLLM, Ollama)"
        )
    return _client(base_url, api_key, _timeout(env)), env.get("ORCHESTRATOR_MODEL") or DEFAULT_MODEL


def _timeout(env: Mapping[str, str]) -> float:
    raw = env.get("ORCHESTRATOR_MODEL_TIMEOUT_SECONDS", "")
    if not raw.strip():
        return DEFAULT_TIMEOUT_SECONDS
    try:
        seconds = float(raw)
    except ValueError:
        seconds = math.nan
    if not (math.isfinite(seconds) and seconds > 0):
        raise InvalidInput(
            f"ORCHESTRATOR_MODEL_TIMEOUT_SECONDS={raw!r} is not a number of seconds above 0; "
            f"set it to e.g. {DEFAULT_TIMEOUT_SECONDS:g} or unset it"
        )
    return seconds


async def chat(messages: Sequence[Mapping[str, str]], *, max_tokens: int = 512) -> Completion:
    """One chat completion. Cancellable: a lost lease cancels the HTTP request in flight."""
    client, model = model_client()
    with start_span(
        f"chat {model}",
        attributes={
            "gen_ai.operation.name": "chat",
            "gen_ai.provider.name": "openai",
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
