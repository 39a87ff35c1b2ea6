"""How runs and timelines look on a terminal (rich tables) and in ``--json`` output."""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from rich.console import Console
from rich.table import Table

from orchestrator.agent.tool_loop import recorded_effect_keys
from orchestrator.client.attempts import Attempt
from orchestrator.client.detail import (
    ATTEMPT_COLUMNS,
    RunDetail,
    attempt_cells,
    conversation_turns,
    due_text,
    relative_text,
    time_text,
    utc,
)
from orchestrator.db.budgets import BudgetState, LedgerEntry
from orchestrator.db.signals import Signal
from orchestrator.effect_model import EffectRecord
from orchestrator.fences import describe_fence
from orchestrator.jsontext import jsonable as jsonable  # the CLI's modules import it from here
from orchestrator.models import Message, Run, RunEvent, RunState, StoredWait


def dump_json(value: Any) -> str:
    return json.dumps(jsonable(value), indent=2, sort_keys=False)


def _compact(value: Any, limit: int = 120) -> str:
    if value is None:
        return ""
    text = json.dumps(jsonable(value), separators=(",", ":"), sort_keys=True)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _details(details: Any) -> str:
    """An event's details in full, as ``key=value`` pairs (``--json`` gives them as JSON)."""
    if not isinstance(details, dict):
        return _compact(details, limit=10_000)
    return ", ".join(
        f"{key}={_compact(value, limit=10_000)}"
        for key, value in details.items()
        if value is not None
    )


def runs_table(runs: Sequence[Run], now: datetime) -> Table:
    table = Table(show_edge=False, header_style="bold")
    for column in ("run id", "agent", "state", "fence", "attempt", "step", "owner", "created"):
        table.add_column(column)
    table.add_column("due")
    for run in runs:
        table.add_row(
            run.run_id,
            run.agent,
            run.state.value,
            str(run.fence),
            f"{run.attempt}/{run.max_attempts}",
            run.step or "",
            run.lease_owner or "",
            time_text(run.created_at),
            due_text(run, now),
        )
    return table


def event_line(event: RunEvent) -> str:
    """One timeline event on one line (``runs watch``)."""
    fence = "" if event.fence is None else f" fence {event.fence}"
    worker = f" by {event.worker_id}" if event.worker_id else ""
    details = _details(event.details)
    return f"{time_text(event.at)} {event.kind}{fence}{worker}" + (f" {details}" if details else "")


def print_run(console: Console, detail: RunDetail) -> None:
    """State, fence, owner, lease expiry (judged by the database clock), checkpoint, attempts,
    the newest timeline events."""
    run, now, claims = detail.run, detail.now, detail.claims
    facts = Table.grid(padding=(0, 2))
    facts.add_column(style="bold")
    facts.add_column()
    lease = ""
    if run.lease_until is not None:
        lease = (
            f"{time_text(run.lease_until)} ({relative_text(run.lease_until, now)}, database clock)"
        )
    attempt = f"{run.attempt} of {run.max_attempts} since the last checkpoint"
    if claims:
        attempt += f" ({claims} claim{'s' if claims != 1 else ''} in all)"
    rows = [
        ("run id", run.run_id),
        ("agent", run.agent),
        ("state", run.state.value),
        ("fence", describe_fence(run.fence)),
        ("owner", run.lease_owner or ""),
        ("lease until", lease),
        ("attempt", "" if run.state.terminal else attempt),
        ("next step", "" if run.state.terminal else run.step or ""),
        ("waiting for", _waiting_for(run, now)),
        ("signals pending", str(run.signals_pending) if run.signals_pending else ""),
        ("checkpoint", f"version {run.checkpoint_version}: {_compact(run.checkpoint)}"),
        ("input", _compact(run.input)),
        ("result", _compact(run.result)),
        ("error", _compact(run.error)),
        ("idempotency key", run.idempotency_key or ""),
        ("created", time_text(run.created_at)),
        ("finished", time_text(run.finished_at)),
    ]
    for label, value in rows:
        if value:
            facts.add_row(label, value)
    console.print(facts)
    if detail.attempts:
        console.print(attempts_table(detail.attempts, now))
    title = "timeline"
    if detail.events_total > len(detail.events):
        title += f" (the newest {len(detail.events):,} of {detail.events_total:,} events)"
    timeline = Table(title=title, show_edge=False, header_style="bold", title_justify="left")
    for column in ("at", "event", "fence", "worker", "details"):
        timeline.add_column(column)
    for event in detail.events:
        timeline.add_row(
            time_text(event.at),
            event.kind,
            "" if event.fence is None else str(event.fence),
            event.worker_id or "",
            _details(event.details),
        )
    console.print(timeline)


def attempts_table(attempts: Sequence[Attempt], now: datetime) -> Table:
    """Each attempt: fence, worker, when it was claimed, how long it held the run, how it ended."""
    table = Table(title="attempts", show_edge=False, header_style="bold", title_justify="left")
    for column in ATTEMPT_COLUMNS:
        table.add_column(column)
    for attempt in attempts:
        table.add_row(*attempt_cells(attempt, now))
    return table


def workers_table(workers: Sequence[Any], now: datetime) -> Table:
    table = Table(show_edge=False, header_style="bold")
    for column in ("worker", "alive", "host", "pid", "agents", "runs held", "last renewal"):
        table.add_column(column)
    for worker in workers:
        renewal = worker.last_renewal
        table.add_row(
            worker.worker_id,
            "alive" if worker.alive else "dead",
            worker.host,
            str(worker.pid),
            ", ".join(worker.agents),
            str(worker.runs_held),
            "" if renewal is None else relative_text(renewal, now),
        )
    return table


def queue_table(rows: Sequence[dict[str, Any]]) -> Table:
    table = Table(show_edge=False, header_style="bold")
    for column in ("agent", "queued", "due", "running", "waiting", "oldest due"):
        table.add_column(column)
    for row in rows:
        oldest = row["oldest_due_seconds"]
        table.add_row(
            row["agent"],
            str(row["queued"]),
            str(row["due"]),
            str(row["running"]),
            str(row["waiting"]),
            "" if oldest is None else f"{oldest:.1f}s",
        )
    return table


def _waiting_for(run: Run, now: datetime) -> str:
    """What a waiting run waits for, in words (``--json`` has ``run.wait`` as stored)."""
    if run.state is not RunState.WAITING:
        return ""
    if not isinstance(run.wait, dict):
        return f"a retry, {relative_text(run.available_at, now)}"
    wait = StoredWait.from_json(run.wait)
    parts = []
    if wait.signals:
        parts.append("a signal " + " or ".join(wait.signals))
    if wait.effects:
        parts.append("effects " + ", ".join(wait.effects) + " to settle")
    if wait.reason == "budget":
        parts.append("a budget top-up (`orchestrator runs budget RUN --add-...`)")
    if wait.until is not None:
        parts.append(f"until {time_text(wait.until)}")
    due = run.available_at.year < 9999 and utc(run.available_at) <= now
    return " or ".join(parts) + (" (woken: due now)" if due else "")


def budget_table(state: BudgetState) -> Table:
    """A run's budget, per dimension: spent, reserved by the attempt in flight, and the limit."""
    table = Table(title="budget", show_edge=False, header_style="bold", title_justify="left")
    for column in ("", "spent", "reserved", "limit"):
        table.add_column(column)
    for name, limit in state.limit.items():
        reserved = state.reserved.get(name)
        table.add_row(
            name,
            str(state.spent.get(name, "")),
            "" if reserved in (None, 0, "0") else str(reserved),
            "unlimited" if limit is None else str(limit),
        )
    return table


def ledger_table(entries: Sequence[LedgerEntry]) -> Table:
    """A budget's ledger: every reservation, settlement, forfeit, refusal and top-up."""
    table = Table(title="ledger", show_edge=False, header_style="bold", title_justify="left")
    names = ("turns", "tool_calls", "input_tokens", "output_tokens", "cost_usd")
    for column in ("#", "at", "kind", "fence", *names, "details"):
        table.add_column(column)
    for entry in entries:
        table.add_row(
            str(entry.entry),
            time_text(entry.at),
            entry.kind,
            "" if entry.fence is None else str(entry.fence),
            *(str(entry.amounts.get(name, "")) for name in names),
            _compact(entry.details) if entry.details else "",
        )
    return table


def signals_table(signals: Sequence[tuple[Signal, datetime | None, int | None]]) -> Table:
    table = Table(title="signals", show_edge=False, header_style="bold", title_justify="left")
    for column in ("seq", "name", "sent", "consumed by fence", "data"):
        table.add_column(column)
    for signal, _, fence in signals:
        table.add_row(
            str(signal.seq),
            signal.name,
            time_text(signal.sent_at),
            "pending" if fence is None else str(fence),
            _compact(signal.data),
        )
    return table


def approvals_table(effects: Sequence[EffectRecord]) -> Table:
    table = Table(show_edge=False, header_style="bold")
    for column in ("run id", "effect key", "kind", "fence", "expires", "payload sha256", "payload"):
        table.add_column(column)
    for effect in effects:
        table.add_row(
            effect.run_id,
            effect.effect_key,
            effect.kind,
            str(effect.fence),
            time_text(effect.approval_expires_at),
            (effect.payload_sha256 or "")[:16] + "…",
            _compact(effect.payload, limit=80),
        )
    return table


def effects_table(effects: Sequence[EffectRecord], *, wide: bool = False) -> Table:
    table = Table(show_edge=False, header_style="bold")
    columns = [
        "run id",
        "effect key",
        "kind",
        "policy",
        "fence",
        "status",
        "attempts",
        "external id",
    ]
    if wide:
        columns += ["idempotency key", "payload", "error"]
    for column in columns:
        table.add_column(column)
    for effect in effects:
        row = [
            effect.run_id,
            effect.effect_key,
            effect.kind,
            effect.policy.value,
            str(effect.fence),
            effect.status.value,
            str(effect.attempts),
            effect.external_id or "",
        ]
        if wide:
            row += [effect.idempotency_key, _compact(effect.payload), _compact(effect.error)]
        table.add_row(*row)
    return table


def _excerpt(text: Any, limit: int = 90) -> str:
    flat = " ".join(str(text or "").split())
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"


def conversation_table(messages: Sequence[Message], effects: Sequence[EffectRecord]) -> Table:
    """A tool agent's conversation, a line per message: what was said or called, each effect
    call with its record's status, and each turn's tokens (``--json`` has every message whole)."""
    status = {effect.effect_key: effect.status.value for effect in effects}
    table = Table(title="conversation", show_edge=False, header_style="bold", title_justify="left")
    for column in ("turn", "role", "tokens in/out", "message"):
        table.add_column(column)
    for message, turn in zip(messages, conversation_turns(messages), strict=True):
        body = message.body
        tokens = ""
        if isinstance(message.usage, dict):
            attempts = len(message.usage.get("attempts") or [])
            tokens = (
                f"{message.usage.get('input_tokens', 0)}/{message.usage.get('output_tokens', 0)}"
            )
            if attempts > 1:
                tokens += f" ({attempts} attempts)"
        parts: list[str] = []
        if body.get("content"):
            parts.append(_excerpt(body["content"]))
        calls = body.get("tool_calls") or []
        for call, key in zip(calls, recorded_effect_keys(message.turn, calls, status), strict=True):
            function = call.get("function", {})
            shown = f"→ {function.get('name')}({_excerpt(function.get('arguments'), 60)})"
            if key is not None:
                shown += f" [effect {status[key]}]"
            parts.append(shown)
        if message.role == "tool":
            parts = [f"{body.get('tool_call_id', '')}: {_excerpt(body.get('content'))}"]
        table.add_row(str(turn), message.role, tokens, "\n".join(parts))
    return table
