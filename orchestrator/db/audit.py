"""The audit trail: every human and service decision, appended in the decision's transaction to
a hash-chained, append-only table (migration 0016), and the check that the chain is whole."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from orchestrator.access import Actor, Via
from orchestrator.db.executor import Executor
from orchestrator.db.queries import query
from orchestrator.errors import InvalidInput
from orchestrator.models import JsonFields, Row, from_row
from orchestrator.telemetry import (
    AUDIT_SEQ,
    DECISION,
    EFFECT_KEY,
    PRINCIPAL,
    PRINCIPAL_VIA,
    RUN_ID,
    start_span,
)

GENESIS = "0" * 64
"""The ``prev_sha256`` of the first row."""
MAX_LIST = 10_000
SHA256_HEX = re.compile(r"[0-9a-f]{64}")
VERIFY_PAGE = 5_000


@dataclass(frozen=True)
class AuditEntry(JsonFields):
    seq: int
    at: datetime
    db_user: str
    principal: str
    via: str
    action: str
    run_id: str | None
    effect_key: str | None
    detail: dict[str, Any]
    prev_sha256: str
    sha256: str


@dataclass(frozen=True)
class Verification:
    """What ``audit verify`` found: ``problems`` empty means the chain is whole."""

    rows: int
    head_seq: int
    head_sha256: str
    problems: list[str]

    @property
    def intact(self) -> bool:
        return not self.problems


def row_sha256(row: Row) -> str:
    """The hash a row must carry, rebuilt from its columns as ``audit_row_text`` lays them out."""
    text = "\n".join(
        [
            row["prev_sha256"],
            str(row["seq"]),
            str(row["at_micros"]),
            row["db_user"],
            row["principal"],
            row["via"],
            row["action"],
            row["run_id"] or "",
            row["effect_key"] or "",
            row["detail_text"],
        ]
    )
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


class AuditStore:
    def __init__(self, db: Executor) -> None:
        self.db = db

    async def append(
        self,
        actor: Actor | None,
        action: str,
        *,
        run_id: str | None = None,
        effect_key: str | None = None,
        detail: Mapping[str, Any] | None = None,
        db: Executor | None = None,
    ) -> int:
        """Append one row; pass the decision's own connection as ``db`` so the row commits (or
        rolls back) with it. ``actor`` None: the database role that connected decided. Only the
        schema's owner may append directly (the admin commands); every other decision appends
        its row in its own database function."""
        document = dict(detail or {})
        if actor is not None and actor.note is not None:
            document.setdefault("note", actor.note)
        with decision_span(action, actor, run_id=run_id, effect_key=effect_key) as recorded:
            row = await (db or self.db).fetchrow(
                query("audit_append"),
                None if actor is None else actor.principal,
                None if actor is None else actor.via.value,
                action,
                run_id,
                effect_key,
                document,
            )
            assert row is not None
            recorded(row["principal"], int(row["seq"]))
        return int(row["seq"])

    async def entries(
        self,
        *,
        after: int = 0,
        limit: int = 100,
        run_id: str | None = None,
        principal: str | None = None,
        action: str | None = None,
    ) -> list[AuditEntry]:
        """Rows after seq ``after``, oldest first."""
        if not 1 <= limit <= MAX_LIST:
            raise InvalidInput(f"the limit must be between 1 and {MAX_LIST}")
        if not 0 <= after < 2**63:
            raise InvalidInput("--after must be a seq of 0 or more")
        rows = await self.db.fetch(query("audit_list"), after, limit, run_id, principal, action)
        return [_entry(row) for row in rows]

    async def verify(
        self,
        *,
        expect_head: str | None = None,
        progress: Callable[[int], None] = lambda rows: None,
    ) -> Verification:
        """Rebuild every row's hash and link, in pages. Finds an edited row (its hash no longer
        matches), a deleted or inserted one (a gap in seq, or a link to the wrong row), and,
        given the head recorded earlier, rows removed from the end."""
        problems: list[str] = []
        previous_sha, previous_seq, rows, after = GENESIS, 0, 0, 0
        if expect_head is not None and not SHA256_HEX.fullmatch(expect_head):
            raise InvalidInput(
                "--expect-head takes the 64 hex digits `audit verify` printed as the head"
            )
        seen_expected = expect_head is None
        while True:
            page = await self.db.fetch(query("audit_list"), after, VERIFY_PAGE, None, None, None)
            for row in page:
                seq = int(row["seq"])
                rows += 1
                if seq != previous_seq + 1:
                    problems.append(
                        f"rows {previous_seq + 1}-{seq - 1} are missing (deleted?)"
                        if seq > previous_seq + 1
                        else f"row {seq} is out of order"
                    )
                if row["prev_sha256"] != previous_sha:
                    problems.append(f"row {seq} does not link to the row before it")
                if row_sha256(row) != row["sha256"]:
                    problems.append(f"row {seq} was changed after it was written")
                if row["sha256"] == expect_head:
                    seen_expected = True
                previous_sha, previous_seq = row["sha256"], seq
            if len(page) < VERIFY_PAGE:
                break
            progress(rows)
            after = previous_seq
        if not seen_expected:
            problems.append(
                f"the head recorded earlier ({expect_head}) is no longer in the chain: rows were "
                "removed from its end, or the chain was rewritten"
            )
        return Verification(rows, previous_seq, previous_sha, problems)


@contextmanager
def decision_span(
    action: str,
    actor: Actor | None,
    *,
    run_id: str | None = None,
    effect_key: str | None = None,
) -> Iterator[Callable[[str, int], None]]:
    """A span per decision, so a trace search by run id finds who decided what, and when; the
    caller reports the principal and audit seq the database recorded."""
    via = Via.DATABASE_ROLE if actor is None else actor.via
    known = {RUN_ID: run_id, EFFECT_KEY: effect_key}
    attributes = {
        DECISION: action,
        PRINCIPAL_VIA: via.value,
        **{key: value for key, value in known.items() if value is not None},
    }
    with start_span(f"orchestrator.decision {action}", attributes=attributes) as span:

        def recorded(principal: str, seq: int) -> None:
            span.set_attribute(PRINCIPAL, principal)
            span.set_attribute(AUDIT_SEQ, seq)

        yield recorded


async def decide(
    db: Executor,
    action: str,
    actor: Actor,
    statement: str,
    *arguments: object,
    run_id: str | None = None,
    effect_key: str | None = None,
) -> Row | None:
    """Run a decision's database function with who decides after ``arguments`` (the principal,
    how the server knows it, the typed note): the function checks them and appends the audit
    row, which the decision's span then names."""
    with decision_span(action, actor, run_id=run_id, effect_key=effect_key) as recorded:
        row = await db.fetchrow(statement, *arguments, actor.principal, actor.via.value, actor.note)
        if row is not None and row["audit_seq"] is not None:
            recorded(row["principal"], int(row["audit_seq"]))
    return row


async def decided(
    db: Executor,
    action: str,
    actor: Actor | None,
    statement: str,
    *arguments: object,
    run_id: str | None = None,
) -> Row | None:
    """``decide`` with the named statement ``statement`` (sql/queries.sql), by ``actor`` or, when
    ``None``, by the database role that connected."""
    return await decide(
        db, action, Actor.acting(actor, None), query(statement), *arguments, run_id=run_id
    )


def _entry(row: Row) -> AuditEntry:
    return from_row(AuditEntry, row)
