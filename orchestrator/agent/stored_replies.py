"""A model's reply as a transcript can store it, and why any of its tool calls is not run.

A turn commits the model's reply (the assistant message) with everything it led to. But a model
can send what PostgreSQL cannot hold: a NUL (``\\u0000``) or a lone surrogate in its text or in
a call's id, name or arguments, arguments of hundreds of kilobytes, more calls than a message
holds. Committed as it came, such a reply fails the turn's commit on every attempt, and each
attempt asks (and bills) the model again. So the reply is made storable before anything is done
for it (``stored_reply``): text keeps U+FFFD where it held what PostgreSQL cannot, an id that
cannot be kept is replaced, the largest arguments are left out until the message fits. Every
call whose arguments were changed, and every call past the turn's limit, is refused: the model
reads why as that call's tool error, and nothing is done for it. ``arguments_problem`` does the
same for arguments that are storable text but parse into values jsonb cannot hold (``"\\u0000"``
escaped, ``NaN``, ``1e400``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pydantic_core import to_jsonable_python

from orchestrator.agent.llm import ToolCall
from orchestrator.errors import InvalidInput
from orchestrator.jsontext import compact, utf8_size
from orchestrator.storable import check_json, storable_json, storable_text

MAX_ID_CHARS = 200
"""A call id longer than this is replaced (ids are short; a long one is not worth storing)."""
MAX_NAME_CHARS = 200
"""A tool name longer than this is cut (no tool has one: the call is refused as unknown)."""
_WORTH_LEAVING_OUT = 1024
"""Strings shorter than this are never left out of a message (names, ids, kinds: its shape)."""


@dataclass(frozen=True, slots=True)
class StoredReply:
    """The reply as it will be committed, and what was changed to store it."""

    body: dict[str, Any]
    """The assistant message as the chat API takes it (role, content, tool_calls)."""
    refused: dict[int, str]
    """Why each refused call, by its place in the reply, is not run: its tool error."""
    content_problem: str | None
    """Why the text had to be changed to be stored, as "it holds ..." (``None``: it is stored
    as it came)."""
    fits: bool
    """Whether the body fits the size it was given; only a reply of thousands of calls does not,
    even with every call's arguments left out."""


def stored_reply(
    turn: int,
    content: str | None,
    calls: Sequence[ToolCall],
    *,
    max_calls: int,
    max_bytes: int,
) -> StoredReply:
    """``content`` and ``calls`` as an assistant message of at most ``max_bytes`` (as compact
    JSON); at most ``max_calls`` calls are run."""
    refused: dict[int, str] = {}
    content_problem = None
    held = None if content is None else _unstorable(content)
    if held is not None:
        assert content is not None
        content = storable_text(content)
        content_problem = f"it holds {held}"
    entries: list[dict[str, Any]] = []
    for index, call in enumerate(calls):
        call_id = storable_text(call.id)[:MAX_ID_CHARS]
        if call_id != call.id or not call_id:
            call_id = f"call_{turn}_{index}"
        name = storable_text(call.name)
        if len(name) > MAX_NAME_CHARS:
            name = name[:MAX_NAME_CHARS] + "..."
        arguments = call.arguments
        held = _unstorable(arguments)
        if held is not None:
            arguments = storable_text(arguments)
            refused[index] = (
                f"invalid arguments for {name}: they hold {held}, which cannot be stored; "
                "send them without it"
            )
        if index >= max_calls:
            refused[index] = (
                f"not run: at most {max_calls} tool calls per turn are run; make fewer at once"
            )
        entries.append(
            {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
        )
    body: dict[str, Any] = {"role": "assistant", "content": content}
    if entries:
        body["tool_calls"] = entries
    size = _left_out_until_it_fits(body, entries, refused, max_bytes)
    if size > max_bytes and isinstance(content, str):
        cut, size = _cut(content, size, max_bytes)
        body["content"] = cut
        content_problem = (
            f"it is {utf8_size(content):,} bytes, more than the {max_bytes:,} bytes a message "
            "can hold: answer shorter"
        )
    return StoredReply(body, refused, content_problem, size <= max_bytes)


def flood_message(calls: int, max_bytes: int) -> str:
    """Why a reply that does not fit even without its arguments fails the run."""
    return (
        f"the model's reply holds {calls} tool calls, more than one message can hold "
        f"({max_bytes:,} bytes) even without their arguments"
    )


def arguments_problem(arguments: Any) -> str | None:
    """Why parsed ``arguments`` cannot be stored (a string holding a NUL or a lone surrogate,
    NaN, an infinity), or ``None``: an effect's payload, and what a tool returns, hold them."""
    problem = unstorable_json(arguments, "arguments")
    return None if problem is None else f"{problem}; send them without it"


def unstorable_json(value: Any, what: str) -> str | None:
    """Why ``value`` (as JSON) cannot be stored, naming where in ``what`` it is, or ``None``."""
    try:
        check_json(to_jsonable_python(value), what)
    except InvalidInput as error:
        return str(error)
    except Exception:  # not JSON at all: whoever accepted the value handles it
        return None
    return None


def _unstorable(text: str) -> str | None:
    """What ``text`` holds that PostgreSQL text cannot, or ``None``."""
    if "\x00" in text:
        return "a NUL character (\\u0000)"
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return "a lone surrogate (such as \\ud800)"
    return None


def _left_out_until_it_fits(
    body: dict[str, Any], entries: list[dict[str, Any]], refused: dict[int, str], max_bytes: int
) -> int:
    """Replace the largest arguments with a note, refusing their calls, until ``body`` fits;
    its size then."""
    size = len(compact(body))  # compact JSON is ASCII: characters are bytes
    if size <= max_bytes:
        return size
    by_size = sorted(
        (
            (len(compact(entry["function"]["arguments"])), index)
            for index, entry in enumerate(entries)
        ),
        reverse=True,
    )
    for encoded, index in by_size:
        if size <= max_bytes:
            break
        function = entries[index]["function"]
        sent = utf8_size(function["arguments"])
        note = json.dumps({"omitted": f"{sent:,} bytes of arguments, too large to keep"})
        saved = encoded - len(compact(note))
        if saved <= 0:
            break  # the rest are smaller than the note
        function["arguments"] = note
        size -= saved
        refused[index] = (
            f"not run: its arguments are {sent:,} bytes; a model message holds at most "
            f"{max_bytes:,} bytes, the turn's other calls included: send less (split it, or "
            "refer to the data instead of repeating it)"
        )
    return size


def _cut(content: str, size: int, max_bytes: int) -> tuple[str, int]:
    """``content`` cut so that its message fits ``max_bytes``, marked as cut; the new size."""
    rest = size - len(compact(content))
    mark = f" [cut: {utf8_size(content):,} bytes in all]"
    budget = max_bytes - rest - len(compact(mark))  # for the kept text, without its quotes
    keep = min(len(content), max(0, budget))
    while keep > 0 and (encoded := len(compact(content[:keep])) - 2) > budget:
        keep = min(keep - 1, keep * budget // encoded)  # escapes take more than a byte
    cut = content[:keep] + mark
    return cut, rest + len(compact(cut))


def stored_json(value: Any, max_bytes: int) -> Any | None:
    """``value`` (a message's JSON, whatever it holds) as a transcript can hold it: its text
    made ``storable_text``, then its largest strings replaced with a note until it fits in
    ``max_bytes``; ``None`` when even that does not make it fit."""
    value = storable_json(value)
    size = len(compact(value))
    if size <= max_bytes:
        return value
    value = json.loads(compact(value))  # a copy to change
    found: list[tuple[int, Any, Any]] = []  # (encoded size, container, key)
    stack = [value]
    while stack:
        item = stack.pop()
        for key, member in item.items() if isinstance(item, dict) else enumerate(item):
            if isinstance(member, str) and len(member) >= _WORTH_LEAVING_OUT:
                found.append((len(compact(member)), item, key))
            elif isinstance(member, dict | list):
                stack.append(member)
    for encoded, container, key in sorted(found, key=lambda entry: entry[0], reverse=True):
        if size <= max_bytes:
            break
        note = f"[omitted: {utf8_size(container[key]):,} bytes, too large to keep]"
        size -= encoded - len(compact(note))
        container[key] = note
    return value if size <= max_bytes else None
