"""What each page shows, read with the same store methods and queries the CLI uses."""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from orchestrator.agent.tool_loop import recorded_effect_keys
from orchestrator.client.detail import (
    ATTEMPT_COLUMNS,
    CHILDREN_SHOWN,
    attempt_cells,
    conversation_turns,
    due_text,
    load_run_detail,
    more_events_hint,
)
from orchestrator.client.selection import RunSelection, select_runs
from orchestrator.client.stores import Stores
from orchestrator.console.privacy import Shown, event_details, readable, show, text_of
from orchestrator.effect_model import EffectRecord, EffectStatus
from orchestrator.errors import InvalidInput
from orchestrator.ids import validate_agent_name
from orchestrator.models import Message, RunState

LIST_LIMIT = 200


@dataclass(frozen=True)
class RunFilters(RunSelection):
    """The runs list's filters: ``runs list``'s options, read from a query string."""

    @classmethod
    def from_query(cls, params: Any) -> RunFilters:
        """The runs list's query string (``?state=running&agent=a&since=2h``), checked the way
        ``runs list`` checks its options."""
        states = tuple(value for value in params.getlist("state") if value)
        known = {state.value for state in RunState}
        for state in states:
            if state not in known:
                raise InvalidInput(
                    f"unknown state {state!r}; choose from {', '.join(sorted(known))}"
                )
        agent = (params.get("agent") or "").strip() or None
        if agent is not None:
            validate_agent_name(agent)
        since = (params.get("since") or "").strip() or None
        until = (params.get("until") or "").strip() or None
        return cls(states, agent, since, until)


async def runs_page(stores: Stores, filters: RunFilters) -> dict[str, Any]:
    found = await select_runs(stores.runs, filters, LIST_LIMIT)
    now = await stores.runs.database_now()
    return {
        "runs": found,
        "due": {run.run_id: due_text(run, now) for run in found},
        "filters": filters,
        "states": [state.value for state in RunState],
        "more": len(found) == LIST_LIMIT,
        "limit": LIST_LIMIT,
    }


@dataclass(frozen=True)
class MessageView:
    turn: int
    role: str
    fence: int
    at: datetime | None
    input_tokens: Any
    output_tokens: Any
    model_attempts: int
    content: Shown
    calls: list[dict[str, Any]]
    tool_call_id: str | None


def message_views(
    messages: Sequence[Message], effects: Sequence[EffectRecord], *, reveal: bool, last: int
) -> list[MessageView]:
    """The ``last`` messages: role, turn (numbered as ``conversation_table`` numbers them, from
    the whole transcript), tokens, tool names with their effect's status; contents as ``Shown``
    (hidden unless ``--show-payloads``), as ``conversation_table`` shows them on a terminal."""
    status = {effect.effect_key: effect.status.value for effect in effects}
    turns = conversation_turns(messages)[-last:]
    views = []
    for message, turn in zip(messages[-last:], turns, strict=True):
        body = message.body
        usage = message.usage if isinstance(message.usage, dict) else {}
        calls = []
        tool_calls = body.get("tool_calls") or []
        keys = recorded_effect_keys(message.turn, tool_calls, status)
        for call, key in zip(tool_calls, keys, strict=True):
            function = call.get("function", {}) if isinstance(call, dict) else {}
            calls.append(
                {
                    "name": str(function.get("name", "")),
                    "arguments": show(_readable(function.get("arguments")), reveal=reveal),
                    "effect_key": key,
                    "effect_status": None if key is None else status[key],
                }
            )
        views.append(
            MessageView(
                turn=turn,
                role=message.role,
                fence=message.fence,
                at=message.at,
                input_tokens=usage.get("input_tokens") if usage else None,
                output_tokens=usage.get("output_tokens") if usage else None,
                model_attempts=len(usage.get("attempts") or []) if usage else 0,
                content=show(_readable(body.get("content") or None), reveal=reveal),
                calls=calls,
                tool_call_id=body.get("tool_call_id"),
            )
        )
    return views


def _readable(value: Any) -> Any:
    return readable(value) if isinstance(value, str) else value


def effect_view(
    effect: EffectRecord, *, reveal: bool, reveal_awaiting: bool = False
) -> dict[str, Any]:
    """An effect's row; ``reveal_awaiting``: its payload shown while it awaits a decision (what
    an approver must see to decide)."""
    reveal = reveal or (reveal_awaiting and effect.status is EffectStatus.AWAITING_APPROVAL)
    return {
        "record": effect,
        "payload": show(effect.payload, reveal=reveal),
        "result": show(effect.result, reveal=reveal),
        "error": show(effect.error, reveal=reveal),
    }


async def run_page(
    stores: Stores, run_id: str, *, reveal: bool, reveal_awaiting: bool = False
) -> dict[str, Any]:
    detail = await load_run_detail(stores, run_id, events=MAX_ROWS_SHOWN)
    run, now, messages, effects = detail.run, detail.now, detail.messages, detail.effects
    signals, budget = detail.signals, detail.budget
    attempts = [
        {"fence": attempt.fence, "cells": attempt_cells(attempt, now)}
        for attempt in detail.attempts
    ]
    return {
        "run": run,
        "now": now,
        "due": due_text(run, now),
        "live": not run.state.terminal,
        "attempt_columns": ATTEMPT_COLUMNS,
        "attempts": attempts,
        "events": [
            {"event": event, "details": event_details(event.kind, event.details, reveal=reveal)}
            for event in detail.events
        ],
        "events_total": detail.events_total,
        "events_more": more_events_hint(detail),
        "stale_refusals": detail.stale_refusals,
        "children": detail.children,
        "children_shown": CHILDREN_SHOWN,
        "facts": {
            "input": show(run.input, reveal=reveal),
            "checkpoint": show(run.checkpoint, reveal=reveal),
            "result": show(run.result, reveal=reveal),
            "error": show(run.error, reveal=reveal),
        },
        "messages": message_views(messages, effects, reveal=reveal, last=MAX_ROWS_SHOWN),
        "messages_total": len(messages),
        "max_rows": MAX_ROWS_SHOWN,
        "effects": [
            effect_view(effect, reveal=reveal, reveal_awaiting=reveal_awaiting)
            for effect in effects
        ],
        "signals": [
            {
                "signal": signal,
                "consumed_at": at,
                "fence": fence,
                "data": show(signal.data, reveal=reveal),
            }
            for signal, at, fence in signals
        ],
        "budget": None if budget is None else budget.as_json(),
        # A fresh key per page: a form posted twice (a double click, a resent request) stores
        # its signal once.
        "signal_key": f"console-{secrets.token_urlsafe(12)}",
    }


MAX_ROWS_SHOWN = 500
"""The newest timeline events and messages a run page renders (``runs events`` pages through
every event, ``runs show --json`` has every message)."""


async def attention_page(
    stores: Stores, *, reveal: bool, reveal_awaiting: bool = False
) -> dict[str, Any]:
    """Effects a person must act on: parked ones (resolve) and those awaiting approval."""
    parked = await stores.effects.list_effects(status=EffectStatus.PARKED, limit=1000)
    pending = await stores.approvals.pending(limit=1000)
    fences = {}
    for run_id in {effect.run_id for effect in pending}:
        fences[run_id] = (await stores.runs.get(run_id)).fence
    return {
        "parked": [effect_view(effect, reveal=reveal) for effect in parked],
        "pending": [
            {
                **effect_view(effect, reveal=reveal, reveal_awaiting=reveal_awaiting),
                "run_fence": fences[effect.run_id],
            }
            for effect in pending
        ],
        "now": await stores.runs.database_now(),
    }


async def cluster_page(stores: Stores) -> dict[str, Any]:
    """``workers list`` and ``queue stats``, on one page."""
    workers = await stores.workers.list_workers(stores.pool)
    queue = await stores.runs.queue_stats()
    return {"workers": workers, "queue": queue, "now": await stores.runs.database_now()}


__all__ = [
    "RunFilters",
    "attention_page",
    "cluster_page",
    "run_page",
    "runs_page",
    "text_of",
]
