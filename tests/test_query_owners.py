"""Only ``db/`` and ``effects/`` issue SQL, and each table has one owner there: only the store
modules below issue named statements (``query(...)`` from ``orchestrator.db.queries``), so a
statement's caller never needs to know its SQL. (The chaos checker reads tables with its own SQL on
purpose: it must not trust the stores it checks.)"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).parent.parent
SOURCES = ("orchestrator", "effects", "agents")

STORES = {
    "orchestrator/db/queries.py": "defines query(): the named statements of sql/queries.sql",
    "orchestrator/db/store.py": "runs: submitting, watching, cancelling and retrying them",
    "orchestrator/db/run_reads.py": "runs, run_events, run_messages, run_traces: reads only",
    "orchestrator/db/leases.py": "runs: claims, renewals and releases of leases",
    "orchestrator/db/commits.py": "runs, run_events, run_messages, run_traces: fenced writes",
    "orchestrator/db/workers.py": "workers: registration and liveness",
    "orchestrator/db/purges.py": "every table a finished run has rows in: their deletion",
    "orchestrator/db/signals.py": "run_signals",
    "orchestrator/db/budgets.py": "run_budgets, budget_ledger",
    "orchestrator/db/limits.py": "flow_limits",
    "orchestrator/db/schedules.py": "schedules, schedule_slots",
    "orchestrator/db/rates.py": "rate_limits, run_holds (a rate wait's)",
    "orchestrator/db/agents.py": "agent_cutovers",
    "orchestrator/db/forks.py": "runs, run_checkpoints, effects: a fork and its receipts",
    "orchestrator/db/output.py": "run_output, run_streams: live output, appended and read",
    "effects/store.py": "effects: the boundary's records and their dispatch",
    "effects/approvals.py": "effects: the approval columns and their decisions",
    "orchestrator/db/access.py": "principals, access_tokens",
    "orchestrator/db/audit.py": "audit_log: appends and reads (never changes)",
}
"""Module -> the tables whose statements it alone issues."""


def issues_named_statements(tree: ast.Module) -> list[int]:
    """Lines that import the named-statement lookup or call ``query(...)``."""
    return [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.stmt | ast.expr) and _names_statement(node)
    ]


def _names_statement(node: ast.AST) -> bool:
    if isinstance(node, ast.ImportFrom):
        return node.module == "orchestrator.db.queries"
    if isinstance(node, ast.Import):
        return any(alias.name == "orchestrator.db.queries" for alias in node.names)
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in ("query", "queries")
    )


def source_files() -> list[Path]:
    return sorted(path for folder in SOURCES for path in (ROOT / folder).rglob("*.py"))


def test_only_the_stores_issue_named_statements() -> None:
    offenders = [
        f"{path.relative_to(ROOT)}:{line}"
        for path in source_files()
        if str(path.relative_to(ROOT)) not in STORES
        for line in issues_named_statements(ast.parse(path.read_text("utf-8")))
    ]
    assert not offenders, (
        "named statements issued outside the stores (move each into the store that owns its "
        f"table, and call its method): {', '.join(offenders)}"
    )


def test_every_store_lives_in_db_or_effects() -> None:
    assert [m for m in STORES if not m.startswith(("orchestrator/db/", "effects/"))] == []


def test_every_declared_store_exists_and_issues_statements() -> None:
    for module in STORES:
        path = ROOT / module
        assert path.is_file(), module
        if module != "orchestrator/db/queries.py":
            assert issues_named_statements(ast.parse(path.read_text("utf-8"))), module


def test_the_check_sees_a_call_outside_the_stores() -> None:
    tree = ast.parse("from orchestrator.db.queries import query\nawait_me = query('get_run')\n")
    assert issues_named_statements(tree) == [1, 2]
