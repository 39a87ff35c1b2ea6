"""How runs and timelines look on a terminal (rich tables) and in ``--json`` output."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
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


def grid(columns: Iterable[str], rows: Iterable[Iterable[str]], **options: Any) -> Table:
    """A table the CLI prints: a bold header per column, then ``rows`` (``options``: rich's,
    such as a title)."""
    table = Table(show_edge=False, header_style="bold", **options)
    for column in columns:
        table.add_column(column)
    for row in rows:
        table.add_row(*row)
    return table


def section(title: str, columns: Iterable[str], rows: Iterable[Iterable[str]]) -> Table:
    """A table of ``run show``'s and ``runs budget``'s: titled, the title on the left."""
    return grid(columns, rows, title=title, title_justify="left")


def runs_table(runs: Sequence[Run], now: datetime) -> Table:
    """The runs, one a row; a concurrency key and a limit holding a run back are columns only
    when some run has one (docs/flow-control.md)."""
    keyed = any(run.concurrency_key is not None for run in runs)
    held = any(run.held_back is not None for run in runs)
    columns = ("run id", "agent", "state", "fence", "attempt", "step", "owner", "created", "due")
    return grid(
        (*columns, *(("key",) if keyed else ()), *(("held back by",) if held else ())),
        (
            (
                run.run_id,
                run.agent,
                run.state.value,
                str(run.fence),
                f"{run.attempt}/{run.max_attempts}",
                run.step or "",
                run.lease_owner or "",
                time_text(run.created_at),
                due_text(run, now),
                *((run.concurrency_key or "",) if keyed else ()),
                *((run.held_back or "",) if held else ()),
            )
            for run in runs
        ),
    )


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
        ("agent version", _agent_versions(run)),
        ("parent", f"{run.parent_run_id} (child {run.child_key})" if run.parent_run_id else ""),
        ("root", run.root_run_id if run.root_run_id != run.parent_run_id else ""),
        ("children", _children(detail.children)),
        (
            "schedule",
            f"{run.schedule_id} slot {time_text(run.schedule_slot)}" if run.schedule_id else "",
        ),
        ("concurrency key", run.concurrency_key or ""),
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
    events = (
        (
            time_text(event.at),
            event.kind,
            "" if event.fence is None else str(event.fence),
            event.worker_id or "",
            _details(event.details),
        )
        for event in detail.events
    )
    console.print(section(title, ("at", "event", "fence", "worker", "details"), events))


def attempts_table(attempts: Sequence[Attempt], now: datetime) -> Table:
    """Each attempt: fence, worker, when it was claimed, how long it held the run, how it ended."""
    rows = (attempt_cells(attempt, now) for attempt in attempts)
    return section("attempts", ATTEMPT_COLUMNS, rows)


def workers_table(workers: Sequence[Any], now: datetime) -> Table:
    return grid(
        ("worker", "alive", "host", "pid", "agents", "runs held", "last renewal"),
        (
            (
                worker.worker_id,
                "alive" if worker.alive else "dead",
                worker.host,
                str(worker.pid),
                ", ".join(worker.agents),
                str(worker.runs_held),
                "" if worker.last_renewal is None else relative_text(worker.last_renewal, now),
            )
            for worker in workers
        ),
    )


def queue_table(rows: Sequence[dict[str, Any]]) -> Table:
    counts = ("queued", "due", "running", "waiting")
    return grid(
        ("agent", *counts, "oldest due"),
        (
            (
                row["agent"],
                *(str(row[count]) for count in counts),
                "" if row["oldest_due_seconds"] is None else f"{row['oldest_due_seconds']:.1f}s",
            )
            for row in rows
        ),
    )


def _children(children: Sequence[Run]) -> str:
    """Each child shown by key, run and state (``runs list --parent`` lists all of them)."""
    return "\n".join(f"{c.child_key}: {c.run_id} {c.state.value}" for c in children)


def _agent_versions(run: Run) -> str:
    """Which versions of the agent's code started the run and wrote its checkpoint."""
    if run.agent_version is None:
        return ""
    if run.started_version in (None, run.agent_version):
        return run.agent_version
    return f"{run.agent_version} (started under {run.started_version})"


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
    rows = (
        (
            name,
            str(state.spent.get(name, "")),
            "" if state.reserved.get(name) in (None, 0, "0") else str(state.reserved[name]),
            "unlimited" if limit is None else str(limit),
        )
        for name, limit in state.limit.items()
    )
    return section("budget", ("", "spent", "reserved", "limit"), rows)


def ledger_table(entries: Sequence[LedgerEntry]) -> Table:
    """A budget's ledger: every reservation, settlement, forfeit, refusal and top-up."""
    names = ("turns", "tool_calls", "input_tokens", "output_tokens", "cost_usd")
    rows = (
        (
            str(entry.entry),
            time_text(entry.at),
            entry.kind,
            "" if entry.fence is None else str(entry.fence),
            *(str(entry.amounts.get(name, "")) for name in names),
            _compact(entry.details) if entry.details else "",
        )
        for entry in entries
    )
    return section("ledger", ("#", "at", "kind", "fence", *names, "details"), rows)


def signals_table(signals: Sequence[tuple[Signal, datetime | None, int | None]]) -> Table:
    rows = (
        (
            str(signal.seq),
            signal.name,
            time_text(signal.sent_at),
            "pending" if fence is None else str(fence),
            _compact(signal.data),
        )
        for signal, _, fence in signals
    )
    columns = ("seq", "name", "sent", "consumed by fence", "data")
    return section("signals", columns, rows)


def approvals_table(effects: Sequence[EffectRecord]) -> Table:
    return grid(
        ("run id", "effect key", "kind", "fence", "expires", "payload sha256", "payload"),
        (
            (
                effect.run_id,
                effect.effect_key,
                effect.kind,
                str(effect.fence),
                time_text(effect.approval_expires_at),
                (effect.payload_sha256 or "")[:16] + "…",
                _compact(effect.payload, limit=80),
            )
            for effect in effects
        ),
    )


def effects_table(effects: Sequence[EffectRecord], *, wide: bool = False) -> Table:
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

    def row(effect: EffectRecord) -> list[str]:
        cells = [
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
            cells += [effect.idempotency_key, _compact(effect.payload), _compact(effect.error)]
        return cells

    return grid(columns, map(row, effects))


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
