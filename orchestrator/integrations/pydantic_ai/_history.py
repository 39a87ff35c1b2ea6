"""The run's Pydantic AI messages in its transcript: each message's JSON under ``pydantic_ai``,
a chat-API view beside it (for ``runs show`` and the console), and back again on resume."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from pydantic_ai.messages import (
    ModelMessage,
    ModelMessagesTypeAdapter,
    ModelRequest,
    ModelResponse,
    TextPart,
    ToolCallPart,
    ToolReturnPart,
    UserPromptPart,
)
from pydantic_core import to_jsonable_python

from orchestrator.agent.stored_replies import stored_json
from orchestrator.errors import InvalidInput
from orchestrator.jsontext import compact
from orchestrator.models import DEFAULT_MAX_MESSAGE_BYTES, JSON, Message, Role
from orchestrator.storable import storable_text

STATE_KEY = "pydantic_ai"
"""The key of a message's Pydantic AI JSON in the transcript, and of the turn loop's own state
in the checkpoint."""


def raw_arguments(call: ToolCallPart) -> str:
    """The call's arguments as the model sent them (a JSON text, usually)."""
    if isinstance(call.args, str):
        return call.args
    return compact(call.args or {})


def arguments_text(call: ToolCallPart) -> str:
    """The call's arguments as a JSON text: what its effect key and its chat view are made of."""
    try:
        return call.args_as_json_str()
    except ValueError:  # a lone surrogate: that call is refused, its key only has to exist
        return storable_text(raw_arguments(call))


def _chat_call(call: ToolCallPart) -> dict[str, Any]:
    return {
        "id": call.tool_call_id,
        "type": "function",
        "function": {"name": call.tool_name, "arguments": arguments_text(call)},
    }


def from_transcript(committed: Sequence[Message]) -> list[ModelMessage]:
    """The Pydantic AI messages of the committed transcript."""
    stored = [m.body[STATE_KEY] for m in committed if STATE_KEY in m.body]
    if len(stored) != len(committed):
        raise InvalidInput(
            "this run's transcript holds messages not written by PydanticAIAgent; "
            "was the agent's code changed while runs were in flight?"
        )
    return ModelMessagesTypeAdapter.validate_python(stored)


def to_transcript(messages: Sequence[ModelMessage], turn: int) -> list[Message]:
    """Each Pydantic AI message as one transcript message: its JSON under ``pydantic_ai`` and
    a chat-API rendering beside it, for ``runs show`` and the console."""
    dumped = ModelMessagesTypeAdapter.dump_python(list(messages), mode="json")
    out: list[Message] = []
    for message, body in zip(messages, dumped, strict=True):
        role, view, usage = _chat_view(message)
        stored = stored_json({**view, STATE_KEY: body}, DEFAULT_MAX_MESSAGE_BYTES)
        if stored is None:
            calls = len(message.tool_calls) if isinstance(message, ModelResponse) else 0
            raise InvalidInput(
                f"the {role} message of turn {turn} cannot be stored, even without its largest "
                f"values ({calls} tool calls: at most {DEFAULT_MAX_MESSAGE_BYTES:,} bytes a "
                "message)"
            )
        out.append(Message(turn, role, stored, usage))
    return out


def _chat_view(message: ModelMessage) -> tuple[Role, dict[str, Any], JSON]:
    """The message's role, its chat-API rendering and (for a response) its usage."""
    if isinstance(message, ModelResponse):
        text = "".join(p.content for p in message.parts if isinstance(p, TextPart))
        view: dict[str, Any] = {"role": "assistant", "content": text or None}
        if message.tool_calls:
            view["tool_calls"] = [_chat_call(c) for c in message.tool_calls]
        usage: JSON = {
            "model": message.model_name,
            "input_tokens": message.usage.input_tokens,
            "output_tokens": message.usage.output_tokens,
        }
        return "assistant", view, usage
    returns = [p for p in message.parts if isinstance(p, ToolReturnPart)]
    prompts = [p for p in message.parts if isinstance(p, UserPromptPart)]
    if returns and not prompts:
        view = {
            "role": "tool",
            "tool_call_id": returns[0].tool_call_id,
            "content": json.dumps([to_jsonable_python(r.content) for r in returns]),
        }
        return "tool", view, None
    said = " ".join(p.content if isinstance(p.content, str) else "[content]" for p in prompts)
    return "user", {"role": "user", "content": said or _describe(message)}, None


def _describe(message: ModelRequest) -> str:
    return ", ".join(sorted({type(p).__name__ for p in message.parts})) or "(empty request)"


__all__ = [
    "STATE_KEY",
    "arguments_text",
    "from_transcript",
    "raw_arguments",
    "to_transcript",
]
