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
retry layer; a request the endpoint refuses (a 4xx other than 408, 409 and 429) raises
``ModelRefused``, which fails the run at once, since the same request would be refused again.
``complete`` builds a request's body once, from messages encoded one by one (``encode_message``;
a caller that keeps them across turns passes ``EncodedMessages``), and sends those bytes with the
client's own POST on every attempt. Each call is a span named
``chat MODEL`` with the OpenTelemetry gen_ai attributes; prompts and completions are not recorded
(they may hold customer data), only sizes and token counts.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import random
import time
from collections.abc import (
    AsyncIterable,
    Awaitable,
    Callable,
    Iterable,
    Iterator,
    Mapping,
    Sequence,
)
from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING, Any, overload

import anyio

from orchestrator.agent.output import OutputPart, current_output
from orchestrator.agent.rates import ModelCallRates, RateLimitWait
from orchestrator.backoff import retry_after_seconds
from orchestrator.errors import InvalidInput, OrchestratorError, PermanentFailure
from orchestrator.models import JSON, json_fields
from orchestrator.storable import storable_text
from orchestrator.telemetry import model_metrics, start_span

if TYPE_CHECKING:
    import openai
    from openai.types import CompletionUsage
    from openai.types.chat import ChatCompletionChunk

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


async def chat(
    messages: Sequence[Mapping[str, str]], *, max_tokens: int = 512, stream: bool = False
) -> Completion:
    """One chat completion. Cancellable: a lost lease cancels the HTTP request in flight. A
    request the endpoint refuses (``refused_status``) raises ``ModelRefused``. ``stream``: the
    answer is streamed, and in a worker's step published to the run's live output as it comes
    (docs/streaming.md)."""
    import openai

    client, model = model_client()
    rates = ModelCallRates(
        model, sum(len(str(m.get("content") or "")) for m in messages), max_tokens
    )
    await rates.before_attempt()
    with start_span(
        f"chat {model}",
        attributes={
            "gen_ai.operation.name": "chat",
            "gen_ai.provider.name": "openai",
            "gen_ai.request.model": model,
            "gen_ai.request.max_tokens": max_tokens,
        },
    ) as span:
        try:
            if stream:
                chunks = await client.chat.completions.create(  # type: ignore[call-overload]
                    model=model,
                    messages=[dict(message) for message in messages],
                    max_tokens=max_tokens,
                    stream=True,
                    stream_options={"include_usage": True},
                )
                output = current_output()
                part = output.part() if output is not None else None
                try:
                    reply = await _streamed(chunks, model, part)
                except Exception:  # a caller that tries again must not show this text twice
                    if part is not None:
                        part.withdraw("the model call failed midway")
                    raise
                if part is not None:
                    part.close()
                content, _, answered_by, _, input_tokens, output_tokens = reply
                completion = Completion(content or "", answered_by, input_tokens, output_tokens)
            else:
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
        except openai.APIStatusError as error:
            if error.status_code == 429:
                await rates.refused_for_rate(retry_after_of(error))
            if not refused_status(error.status_code):
                raise  # the step's retry may get past it
            message = refusal_message(error.status_code, model, str(client.base_url), error.body)
            raise ModelRefused(message, ()) from None
        await rates.answered(completion.input_tokens, completion.output_tokens)
        span.set_attribute("gen_ai.response.model", completion.model)
        if completion.input_tokens is not None:
            span.set_attribute("gen_ai.usage.input_tokens", completion.input_tokens)
        if completion.output_tokens is not None:
            span.set_attribute("gen_ai.usage.output_tokens", completion.output_tokens)
        return completion


# -- model turns with tools (ToolAgent) -----------------------------------------------------
@dataclass(frozen=True)
class ToolCall:
    """A tool call the model proposed: its id, the tool's name, its arguments as raw JSON text
    (the model does not always produce valid JSON; the caller validates)."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class ModelAttempt:
    """One HTTP request of a model call, and what it cost (each attempt is billed)."""

    outcome: str
    """``ok``, ``rate_limited``, ``server_error`` (a 5xx, 408 or 409), ``timeout``,
    ``connection_error``, ``unreadable`` (an answer that is not UTF-8 or not JSON: it may have
    been billed)
    or ``refused`` (any other 4xx)."""
    status: int | None
    input_tokens: int | None
    output_tokens: int | None
    seconds: float

    def as_json(self) -> dict[str, JSON]:
        return json_fields(self, seconds=round(self.seconds, 3))


@dataclass(frozen=True)
class ModelReply:
    """The model's answer to one turn: text, tool calls, and every attempt it took."""

    content: str | None
    tool_calls: tuple[ToolCall, ...]
    model: str
    finish_reason: str | None
    attempts: tuple[ModelAttempt, ...]

    @property
    def input_tokens(self) -> int:
        return sum(a.input_tokens or 0 for a in self.attempts)

    @property
    def output_tokens(self) -> int:
        return sum(a.output_tokens or 0 for a in self.attempts)

    def usage(self) -> dict[str, JSON]:
        """What the turn cost, for the transcript: totals and each attempt."""
        return {
            "model": self.model,
            "input_tokens": self.input_tokens,
            "output_tokens": self.output_tokens,
            "attempts": [attempt.as_json() for attempt in self.attempts],
        }


class ModelCallFailed(OrchestratorError):
    """The model could not be reached, or kept refusing, within the turn's attempts and time."""

    def __init__(self, message: str, attempts: Sequence[ModelAttempt]) -> None:
        super().__init__(message)
        self.attempts = tuple(attempts)


class ModelRefused(ModelCallFailed, PermanentFailure):
    """The model endpoint refused the request (400, 401, 403, 404, 413, 422...): the same
    request would be refused again, so the run fails at once instead of retrying it."""


MODEL_ATTEMPTS = 4
BACKOFF_SECONDS = (0.5, 1.0, 2.0, 4.0)
RETRIED_STATUSES = frozenset((408, 409, 429))
"""Besides any 5xx, the statuses a later request may get past (a timeout, a conflict, a rate
limit); every other 4xx refuses the request itself."""


def retryable_status(status: int) -> bool:
    """Whether a request the model endpoint answered with ``status`` may succeed if sent again."""
    return status in RETRIED_STATUSES or status >= 500


def refused_status(status: int) -> bool:
    """Whether ``status`` refuses the request itself: the same request would be refused again."""
    return 400 <= status < 500 and status not in RETRIED_STATUSES


_CHECK = {
    400: "the server could not use the request: check that this model takes the tools, "
    "response format and parameters the agent sends",
    401: "check OPENAI_API_KEY: the server did not accept the key",
    403: "check OPENAI_API_KEY: the key may not use this model",
    404: "check the model name (ORCHESTRATOR_MODEL, or the agent's model) and OPENAI_BASE_URL "
    "(an OpenAI-compatible server's usually ends in /v1): the server has no such model or path",
    413: "check the request's size: it is larger than the server takes (shorten the "
    "conversation or what the tools return)",
}
_CHECK[422] = _CHECK[400]


def refusal_message(status: int, model: str, base_url: str, body: object) -> str:
    """What a refused model request says: the status, the model, the endpoint, the server's
    own words (shortened), and what to check."""
    error = body.get("error", body) if isinstance(body, Mapping) else body
    said = error.get("message") if isinstance(error, Mapping) else error
    detail = storable_text(str(said))[:300] if said else ""
    check = _CHECK.get(status, "check the model name, OPENAI_BASE_URL and OPENAI_API_KEY")
    return (
        f"the model endpoint refused the request (HTTP {status}) for model {model!r} at "
        f"{base_url}{f': {detail}' if detail else ''}; {check}"
    )


def retry_after_of(error: BaseException) -> float | None:
    """The server's Retry-After, in seconds (a number or an HTTP date), if it gave one."""
    response = getattr(error, "response", None)
    return retry_after_seconds(
        response.headers.get("retry-after") if response is not None else None
    )


async def complete(
    messages: Sequence[Mapping[str, Any]] | EncodedMessages,
    *,
    tools: Sequence[Mapping[str, Any]] = (),
    model: str | None = None,
    stream: bool = False,
    budget_seconds: float | None = None,
    response_format: Mapping[str, Any] | None = None,
    span_attributes: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
    max_tokens: int | None = None,
    before_attempt: Callable[[str, Sequence[ModelAttempt]], Awaitable[None]] | None = None,
) -> ModelReply:
    """One model turn, with this layer as the only retry: 408, 409, 429, 5xx, timeouts,
    dropped connections and answers that are not UTF-8 are retried with backoff (honouring
    ``Retry-After``), up to ``MODEL_ATTEMPTS`` attempts and never past ``budget_seconds``; any
    other 4xx raises ``ModelRefused`` at once (a ``PermanentFailure``: the run fails without
    retrying the step, as the same request would be refused again). Each attempt is a
    ``chat MODEL`` span and is counted in the reply's usage. ``before_attempt(model, attempts so
    far)`` runs before each request (a budget's reservation; what it raises ends the call).
    Cancellable: a lost lease cancels the request in flight. Prompts and outputs are never put
    on spans.

    ``messages``: chat messages, or ``EncodedMessages`` (each message encoded already, as a
    caller that sends a growing conversation keeps them). The request body is built once, and
    every attempt sends the same bytes."""
    import openai

    client, default_model = model_client(environ)
    model = model or default_model
    options: dict[str, Any] = {"model": model}
    if max_tokens is not None:
        options["max_tokens"] = max_tokens
    if tools:
        options["tools"] = [t if isinstance(t, dict) else dict(t) for t in tools]
    if response_format is not None:
        options["response_format"] = dict(response_format)
    if stream:
        options["stream"] = True
        options["stream_options"] = {"include_usage": True}
    body: bytes | None = None
    started = time.monotonic()
    attempts: list[ModelAttempt] = []
    output = current_output() if stream else None
    rates = ModelCallRates(
        model, messages.array_size if isinstance(messages, EncodedMessages) else 0, max_tokens
    )
    for number in range(1, MODEL_ATTEMPTS + 1):
        remaining = (
            None if budget_seconds is None else budget_seconds - (time.monotonic() - started)
        )
        if remaining is not None and remaining <= 0.05:
            break
        try:  # the model's shared rate limit first: a budget is not reserved while waiting
            await rates.before_attempt(remaining)
        except RateLimitWait as waited_out:
            raise ModelCallFailed(str(waited_out), attempts) from None
        if before_attempt is not None:
            await before_attempt(model, tuple(attempts))
        attributes = {
            "gen_ai.operation.name": "chat",
            "gen_ai.provider.name": "openai",
            "gen_ai.request.model": model,
            "orchestrator.model.attempt": number,
            **(span_attributes or {}),
        }
        began = time.monotonic()
        delay: float | None = None
        # What this attempt streams to the step's output: withdrawn if it fails midway.
        part = output.part() if output is not None else None
        with start_span(f"chat {model}", attributes=attributes) as span:
            try:
                if body is None:  # encoding the request is part of the first attempt
                    encoded = (
                        messages
                        if isinstance(messages, EncodedMessages)
                        else EncodedMessages.of(messages)
                    )
                    body = _request_body(options, encoded)
                reply = await _request(client, body, model, stream, remaining, part)
            except openai.RateLimitError as error:
                attempt = ModelAttempt("rate_limited", 429, None, None, time.monotonic() - began)
                delay = retry_after_of(error)
                if await rates.refused_for_rate(delay):
                    delay = 0.0  # every process waits for the pause, this one in before_attempt
            except openai.InternalServerError as error:
                status = error.status_code
                attempt = ModelAttempt("server_error", status, None, None, time.monotonic() - began)
            except openai.APITimeoutError:
                attempt = ModelAttempt("timeout", None, None, None, time.monotonic() - began)
            except openai.APIConnectionError:
                attempt = ModelAttempt(
                    "connection_error", None, None, None, time.monotonic() - began
                )
            except (UnicodeDecodeError, json.JSONDecodeError):  # the next answer may be readable
                attempt = ModelAttempt("unreadable", 200, None, None, time.monotonic() - began)
            except openai.APIStatusError as error:
                status = error.status_code
                if refused_status(status):  # asking again will not help
                    attempts.append(
                        ModelAttempt("refused", status, None, None, time.monotonic() - began)
                    )
                    message = refusal_message(status, model, str(client.base_url), error.body)
                    raise ModelRefused(message, attempts) from None
                attempt = ModelAttempt("server_error", status, None, None, time.monotonic() - began)
            else:
                if part is not None:
                    part.close()
                content, calls, response_model, finish, input_tokens, output_tokens = reply
                await rates.answered(input_tokens, output_tokens)
                attempts.append(
                    ModelAttempt("ok", 200, input_tokens, output_tokens, time.monotonic() - began)
                )
                model_metrics().record(
                    model,
                    attempts[-1].seconds,
                    error=None,
                    input_tokens=input_tokens,
                    output_tokens=output_tokens,
                )
                span.set_attribute("gen_ai.response.model", response_model)
                if finish:
                    span.set_attribute("gen_ai.response.finish_reasons", [finish])
                if input_tokens is not None:
                    span.set_attribute("gen_ai.usage.input_tokens", input_tokens)
                if output_tokens is not None:
                    span.set_attribute("gen_ai.usage.output_tokens", output_tokens)
                return ModelReply(content, calls, response_model, finish, tuple(attempts))
            span.set_attribute("error.type", attempt.outcome)
            attempts.append(attempt)
            if part is not None:  # readers are told its text is not the answer
                part.withdraw(f"the model call failed midway ({attempt.outcome})")
            model_metrics().record(
                model, attempt.seconds, error=attempt.outcome, input_tokens=None, output_tokens=None
            )
        if number == MODEL_ATTEMPTS:
            break
        wait = delay if delay is not None else BACKOFF_SECONDS[number - 1] * random.uniform(0.5, 1)
        if budget_seconds is not None and time.monotonic() - started + wait >= budget_seconds:
            break
        await anyio.sleep(wait)
    raise ModelCallFailed(
        f"no answer from the model after {len(attempts)} attempts "
        f"({', '.join(a.outcome for a in attempts) or 'no time left'})",
        attempts,
    )


def _seconds(timeout: object) -> float:
    """The client's configured timeout in seconds (``model_client`` sets a plain number)."""
    return float(timeout) if isinstance(timeout, int | float) else math.inf


# -- the request body, encoded once ---------------------------------------------------------
def _dumps(value: object) -> bytes:
    """JSON as the ``openai`` client encodes a request body: UTF-8, no spaces, no NaN."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()


def encode_message(message: Mapping[str, Any]) -> bytes:
    """One chat message's JSON, byte for byte as the ``openai`` client would put it in a request
    body. A conversation's messages never change once written: each can be encoded once and
    sent on every later turn as it is (``EncodedMessages``)."""
    return _dumps(message if isinstance(message, dict) else dict(message))


class EncodedMessages(Sequence[bytes]):
    """A conversation's messages, each encoded already (``encode_message``), oldest first, and
    ``size``, their bytes added up. ``complete`` splices them into the request body as they are,
    so a caller that keeps one across turns (``ToolAgent`` does, per claim) encodes each message
    once, not once per turn."""

    __slots__ = ("_parts", "size")

    def __init__(self, parts: Iterable[bytes] = ()) -> None:
        self._parts: list[bytes] = list(parts)
        self.size = sum(len(part) for part in self._parts)

    @classmethod
    def of(cls, messages: Iterable[Mapping[str, Any]]) -> EncodedMessages:
        return cls(encode_message(message) for message in messages)

    def encode(self, messages: Iterable[Mapping[str, Any]]) -> None:
        """Encode ``messages`` and add them at the end."""
        for message in messages:
            self.append(encode_message(message))

    def append(self, part: bytes) -> None:
        """Add one message encoded already (by ``encode_message``) at the end."""
        self._parts.append(part)
        self.size += len(part)

    def __add__(self, other: EncodedMessages) -> EncodedMessages:
        """These messages, then ``other``'s (neither is changed; no message is encoded again)."""
        joined = EncodedMessages()
        joined._parts = self._parts + other._parts
        joined.size = self.size + other.size
        return joined

    @property
    def array_size(self) -> int:
        """The bytes of the messages as a JSON array in the body: with brackets and commas."""
        return self.size + max(1, len(self._parts)) + 1

    def __len__(self) -> int:
        return len(self._parts)

    @overload
    def __getitem__(self, index: int) -> bytes: ...

    @overload
    def __getitem__(self, index: slice) -> list[bytes]: ...

    def __getitem__(self, index: int | slice) -> bytes | list[bytes]:
        return self._parts[index]

    def __iter__(self) -> Iterator[bytes]:
        return iter(self._parts)

    def __repr__(self) -> str:
        return f"EncodedMessages({len(self._parts)} messages, {self.size:,} bytes)"


def _request_body(options: Mapping[str, Any], messages: EncodedMessages) -> bytes:
    """``{**options, "messages": [...]}`` as JSON: the options encoded, the messages' bytes
    spliced in as they are, in one copy (the messages are most of a long conversation's body)."""
    opening = _dumps(options)[:-1] + b',"messages":['  # options is never empty: it has "model"
    parts = messages._parts
    if not parts:
        return opening + b"]}"
    if len(parts) == 1:
        return b"".join((opening, parts[0], b"]}"))
    return b",".join(
        itertools.chain(
            (opening + parts[0],), itertools.islice(parts, 1, len(parts) - 1), (parts[-1] + b"]}",)
        )
    )


async def _request(
    client: openai.AsyncOpenAI,
    body: bytes,
    model: str,
    stream: bool,
    request_seconds: float | None,
    part: OutputPart | None = None,
) -> tuple[str | None, tuple[ToolCall, ...], str, str | None, int | None, int | None]:
    # The body is built once per call (``_request_body``) and sent as it is by each attempt,
    # through the client's own POST: its headers, authentication, base URL, timeout and errors,
    # without its typed transform and encoding of every message on every turn.
    from openai import AsyncStream
    from openai.types.chat import ChatCompletion, ChatCompletionChunk

    options: openai.RequestOptions = {
        "headers": {"Content-Type": "application/json"},
        "security": {"bearer_auth": True},
    }
    # The client's own per-request timeout (its connection pool is aborted cleanly on it): the
    # model timeout, or what is left of the caller's budget when that is shorter.
    if request_seconds is not None and request_seconds < _seconds(client.timeout):
        options["timeout"] = request_seconds
    if not stream:
        response = await client.post(
            "/chat/completions", cast_to=ChatCompletion, content=body, options=options
        )
        answer = response.choices[0]
        calls = tuple(
            ToolCall(call.id, call.function.name, call.function.arguments or "")
            for call in answer.message.tool_calls or ()
            if call.type == "function"
        )
        usage = response.usage
        return (
            answer.message.content,
            calls,
            response.model,
            answer.finish_reason,
            usage.prompt_tokens if usage else None,
            usage.completion_tokens if usage else None,
        )
    chunks = await client.post(
        "/chat/completions",
        cast_to=ChatCompletion,
        content=body,
        options=options,
        stream=True,
        stream_cls=AsyncStream[ChatCompletionChunk],
    )
    return await _streamed(chunks, model, part)


async def _streamed(
    chunks: AsyncIterable[ChatCompletionChunk], model: str, part: OutputPart | None = None
) -> tuple[str | None, tuple[ToolCall, ...], str, str | None, int | None, int | None]:
    """A streamed answer, put together by the ``openai`` client's own accumulator (its
    snapshot: nothing parsed, so an answer cut short or with malformed arguments is kept as it
    came); the text is published as it comes to ``part`` of the step's live output, if any."""
    from openai.lib.streaming.chat import ChatCompletionStreamState

    state: ChatCompletionStreamState[object] = ChatCompletionStreamState()
    seen = False
    async for chunk in chunks:
        state.handle_chunk(chunk)
        seen = True
        if part is not None:
            for choice in chunk.choices:
                if choice.index == 0 and choice.delta.content:
                    part.text(storable_text(choice.delta.content))
    if not seen:
        return None, (), model, None, None, None
    snapshot = state.current_completion_snapshot
    usage = snapshot.usage
    if not snapshot.choices:
        return None, (), snapshot.model or model, None, *_tokens(usage)
    answer = snapshot.choices[0]
    calls = tuple(
        ToolCall(call.id or "", call.function.name or "", call.function.arguments or "")
        for call in answer.message.tool_calls or ()
        if call.type == "function"
    )
    return (
        answer.message.content or None,
        calls,
        snapshot.model or model,
        answer.finish_reason,
        *_tokens(usage),
    )


def _tokens(usage: CompletionUsage | None) -> tuple[int | None, int | None]:
    return (usage.prompt_tokens, usage.completion_tokens) if usage else (None, None)
