"""The audit trail: append-only, hash-chained, and ``audit verify`` catching what a superuser
forced past the trigger; each decision is also a span naming its principal."""

from __future__ import annotations

import anyio
import asyncpg
import pytest

from orchestrator.access import Actor, PrincipalKind, Role, Via
from orchestrator.db.access import AccessStore
from orchestrator.db.audit import AuditStore
from orchestrator.db.store import RunStore
from orchestrator.effects.approvals import ApprovalStore, Decision
from orchestrator.effects.store import EffectStore
from orchestrator.telemetry import AUDIT_SEQ, EFFECT_KEY, PRINCIPAL, PRINCIPAL_VIA, RUN_ID
from orchestrator.testing import capture_spans
from test_console import awaiting_approval


async def _three_rows(pool: asyncpg.Pool) -> AuditStore:
    audit = AuditStore(pool)
    for number in range(3):
        await audit.append(
            Actor("alice@example.com", Via.TOKEN, note="ticket 7"),
            "signal",
            run_id=f"r_{number}",
            detail={"n": number, "text": "ünïcode ✓"},
        )
    return audit


async def test_rows_chain_and_verify_whole(pool: asyncpg.Pool) -> None:
    audit = await _three_rows(pool)
    entries = await audit.entries()
    assert [entry.seq for entry in entries] == [1, 2, 3]
    assert entries[0].prev_sha256 == "0" * 64
    assert [entry.prev_sha256 for entry in entries[1:]] == [e.sha256 for e in entries[:2]]
    assert entries[0].principal == "alice@example.com" and entries[0].via == "token"
    assert entries[0].detail == {"n": 0, "text": "ünïcode ✓", "note": "ticket 7"}
    verified = await audit.verify(expect_head=entries[-1].sha256)
    assert verified.intact and verified.rows == 3 and verified.head_seq == 3


async def test_without_an_actor_the_connected_role_is_the_principal(pool: asyncpg.Pool) -> None:
    audit = AuditStore(pool)
    await audit.append(None, "purge", detail={"runs": 0})
    (entry,) = await audit.entries()
    role = await pool.fetchval("SELECT session_user")
    assert (entry.principal, entry.via, entry.db_user) == (role, "database-role", role)


@pytest.mark.parametrize(
    "statement",
    ["UPDATE audit_log SET principal = 'mallory'", "DELETE FROM audit_log", "TRUNCATE audit_log"],
)
async def test_the_table_refuses_changes(pool: asyncpg.Pool, statement: str) -> None:
    await _three_rows(pool)
    with pytest.raises(asyncpg.RaiseError, match="append-only"):
        await pool.execute(statement)
    assert (await AuditStore(pool).verify()).intact


async def _forced(pool: asyncpg.Pool, statement: str) -> None:
    """As a superuser who turns the triggers off for the session."""
    async with pool.acquire() as db:
        await db.execute("SET session_replication_role = replica")
        try:
            await db.execute(statement)
        finally:
            await db.execute("RESET session_replication_role")


async def test_verify_catches_an_edited_row(pool: asyncpg.Pool) -> None:
    audit = await _three_rows(pool)
    await _forced(pool, "UPDATE audit_log SET principal = 'mallory' WHERE seq = 2")
    verified = await audit.verify()
    assert verified.problems == ["row 2 was changed after it was written"]


async def test_verify_catches_an_edit_that_rehashes_the_row(pool: asyncpg.Pool) -> None:
    """An editor who also rewrites the row's own hash breaks the next row's link."""
    audit = await _three_rows(pool)
    await _forced(
        pool,
        "UPDATE audit_log SET detail = '{\"n\": 99}', sha256 = encode(sha256(convert_to("
        "audit_row_text(prev_sha256, seq, at, db_user, principal, via, action, run_id,"
        " effect_key, '{\"n\": 99}'::jsonb), 'UTF8')), 'hex') WHERE seq = 2",
    )
    assert (await audit.verify()).problems == ["row 3 does not link to the row before it"]


async def test_verify_catches_a_deleted_row(pool: asyncpg.Pool) -> None:
    audit = await _three_rows(pool)
    await _forced(pool, "DELETE FROM audit_log WHERE seq = 2")
    problems = (await audit.verify()).problems
    assert "rows 2-2 are missing (deleted?)" in problems
    assert "row 3 does not link to the row before it" in problems


async def test_verify_catches_the_newest_rows_deleted_given_the_recorded_head(
    pool: asyncpg.Pool,
) -> None:
    audit = await _three_rows(pool)
    head = (await audit.verify()).head_sha256
    await _forced(pool, "DELETE FROM audit_log WHERE seq = 3")
    assert (await audit.verify()).intact  # without the head, a shorter chain is whole
    (problem,) = (await audit.verify(expect_head=head)).problems
    assert "no longer in the chain" in problem


async def test_a_rolled_back_decision_leaves_no_row_and_no_gap(pool: asyncpg.Pool) -> None:
    audit = AuditStore(pool)
    await audit.append(None, "signal")
    async with pool.acquire() as db:
        transaction = db.transaction()
        await transaction.start()
        await audit.append(None, "cancel", db=db)
        await transaction.rollback()
    await audit.append(None, "retry")
    entries = await audit.entries()
    assert [(e.seq, e.action) for e in entries] == [(1, "signal"), (2, "retry")]
    assert (await audit.verify()).intact


async def test_concurrent_appends_keep_one_line(pool: asyncpg.Pool) -> None:
    audit = AuditStore(pool)

    async def append(number: int) -> None:
        await audit.append(None, "signal", detail={"n": number})

    async with anyio.create_task_group() as group:
        for number in range(40):
            group.start_soon(append, number)
    verified = await audit.verify()
    assert verified.intact and verified.rows == 40


async def test_a_decision_is_a_span_naming_its_principal(
    store: RunStore, pool: asyncpg.Pool
) -> None:
    spans = capture_spans()
    assert spans is not None
    spans.clear()
    await AccessStore(pool).set_principal(
        "alice@example.com", kind=PrincipalKind.PERSON, role=Role.APPROVER
    )
    run_id = await awaiting_approval(store, pool, {"order": "o-1", "amount": 3})
    effect = await EffectStore(pool).get(run_id, "refund")
    await ApprovalStore(pool).decide(
        run_id,
        "refund",
        Decision.APPROVED,
        actor=Actor("alice@example.com", Via.OIDC),
        payload_sha256=effect.payload_sha256,
    )
    [span] = [s for s in spans.get_finished_spans() if s.name == "orchestrator.decision approve"]
    attributes = dict(span.attributes or {})
    assert attributes[PRINCIPAL] == "alice@example.com"
    assert attributes[PRINCIPAL_VIA] == "oidc"
    assert (attributes[RUN_ID], attributes[EFFECT_KEY]) == (run_id, "refund")
    [row] = await AuditStore(pool).entries(run_id=run_id)
    assert attributes[AUDIT_SEQ] == row.seq and row.principal == "alice@example.com"
