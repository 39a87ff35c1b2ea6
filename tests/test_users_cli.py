"""``orchestrator users`` and ``orchestrator audit`` as an admin runs them: real processes against
the real database; a token is printed once, stored only as a hash, and every change is audited
under the database role that connected."""

from __future__ import annotations

import json
from typing import Any

import asyncpg
import pytest

from orchestrator.db.access import AccessStore
from orchestrator.db.audit import AuditStore
from support import cli

pytestmark = pytest.mark.slow


def ok(database_url: str, *args: str) -> Any:
    """The JSON a command printed, after checking it exited 0."""
    result = cli(database_url, *args, "--json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def refused(database_url: str, *args: str) -> str:
    """The one-line error of a command that must exit 1."""
    result = cli(database_url, *args)
    assert result.returncode == 1, (result.stdout, result.stderr)
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1, result.stderr
    return result.stderr


async def test_a_token_is_printed_once_works_until_revoked_and_every_change_is_audited(
    database_url: str, pool: asyncpg.Pool
) -> None:
    added = ok(database_url, "users", "add", "alice@example.com", "--role", "approver")
    assert (added["kind"], added["role"]) == ("person", "approver")

    created = cli(database_url, "users", "token", "create", "alice@example.com", "--expires", "7d")
    assert created.returncode == 0, created.stderr
    secret = created.stdout.strip()
    assert secret.startswith("orc_") and "\n" not in secret
    assert "not shown again" in created.stderr and secret not in created.stderr

    access = AccessStore(pool)
    authenticated = await access.authenticate(secret)
    assert authenticated is not None
    assert authenticated.principal.name == "alice@example.com"
    assert authenticated.principal.role.value == "approver"

    [listed] = ok(database_url, "users", "token", "list")
    assert listed["token_id"] == authenticated.token_id and listed["revoked_at"] is None
    table = cli(database_url, "users", "token", "list")
    users_table = cli(database_url, "users", "list")
    stored = await pool.fetchval("SELECT sha256 FROM access_tokens")
    for output in (json.dumps(listed), table.stdout, users_table.stdout):
        assert secret not in output and stored not in output
    assert "alice@example.com" in users_table.stdout and "approver" in users_table.stdout

    revoked = ok(database_url, "users", "token", "revoke", authenticated.token_id)
    assert revoked["revoked_at"] is not None
    assert await access.authenticate(secret) is None
    again = ok(database_url, "users", "token", "revoke", authenticated.token_id)
    assert again["revoked_at"] == revoked["revoked_at"]  # revoking twice changes nothing

    role = await pool.fetchval("SELECT session_user")
    rows = ok(database_url, "audit", "list")
    assert [(row["action"], row["principal"], row["via"]) for row in rows] == [
        ("principal_added", role, "database-role"),
        ("token_created", role, "database-role"),
        ("token_revoked", role, "database-role"),
    ]
    assert all(secret not in json.dumps(row) for row in rows)
    verified = ok(database_url, "audit", "verify")
    assert verified["intact"] and verified["rows"] == 3


async def test_a_disabled_persons_tokens_stop_at_once(
    database_url: str, pool: asyncpg.Pool
) -> None:
    created = cli(
        database_url, "users", "token", "create", "bob", "--role", "operator", "--expires", "never"
    )
    assert created.returncode == 0, created.stderr
    secret = created.stdout.strip()
    assert "never expires" in created.stderr
    assert await AccessStore(pool).authenticate(secret) is not None
    [bob] = ok(database_url, "users", "list")
    assert (bob["name"], bob["role"], bob["live_tokens"]) == ("bob", "operator", 1)

    assert ok(database_url, "users", "disable", "bob")["disabled_at"] is not None
    assert await AccessStore(pool).authenticate(secret) is None
    error = refused(database_url, "users", "token", "create", "bob")
    assert "no enabled principal named 'bob'" in error


async def test_a_scoped_service_token_lists_its_scope(
    database_url: str, pool: asyncpg.Pool
) -> None:
    issued = ok(
        database_url,
        *("users", "token", "create", "billing", "--role", "operator", "--service"),
        *("--agent", "refunds", "--agent", "support", "--kind", "refund"),
        *("--amount-field", "amount", "--max-amount", "250.50"),
        *("--description", "billing service, refunds only"),
    )
    assert issued["token"].startswith("orc_")
    assert issued["scope"] == {
        "agents": ["refunds", "support"],
        "kinds": ["refund"],
        "amount_field": "amount",
        "max_amount": "250.50",
    }
    authenticated = await AccessStore(pool).authenticate(issued["token"])
    assert authenticated is not None and authenticated.principal.kind.value == "service"
    scope = authenticated.scope
    assert scope.refusal(agent="refunds", kind="refund", payload={"amount": 9}) is None
    refusal = scope.refusal(agent="refunds", kind="refund", payload={"amount": 251})
    assert "above this token's maximum" in str(refusal)
    table = cli(database_url, "users", "token", "list", "--principal", "billing")
    assert "agents refunds,support; kinds refund; amount <= 250.50" in table.stdout


CAROL = ("users", "token", "create", "carol", "--role", "admin")


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (("users", "add", "bad name", "--role", "viewer"), "cannot name a principal"),
        (("users", "disable", "nobody"), "no principal named 'nobody'"),
        (("users", "token", "create", "nobody"), "add it first"),
        (("users", "token", "create", "carol", "--role", "admin", "--expires", "0s"), "above 0"),
        (("users", "token", "create", "carol", "--role", "admin", "--expires", "-1d"), "30d"),
        (("users", "token", "create", "carol", "--role", "admin", "--expires", "30s"), "1 minute"),
        (("users", "token", "create", "carol", "--role", "admin", "--expires", "99999d"), "100 y"),
        (("users", "token", "create", "carol", "--role", "admin", "--max-amount", "5"), "both"),
        (
            (*CAROL, "--amount-field", "amount", "--max-amount", "-5"),
            "at least 0",
        ),
        (
            (*CAROL, "--amount-field", "amount", "--max-amount", "lots"),
            "must be a number",
        ),
        (("users", "token", "create", "carol", "--service"), "give it with --role"),
        ((*CAROL, "--agent", "refunds"), "is a person"),
        ((*CAROL, "--description", "x" * 501), "at most 500 characters"),
        ((*CAROL, "--expires", "later"), "such as 30d"),
        (("users", "token", "revoke", "orc_abc_secret"), "not the token itself"),
        (("users", "token", "revoke", "nosuchtoken1"), "no token 'nosuchtoken1'"),
        (("audit", "verify", "--expect-head", "abc"), "64 hex digits"),
    ],
)
async def test_bad_input_is_one_line_and_changes_nothing(
    database_url: str, pool: asyncpg.Pool, args: tuple[str, ...], says: str
) -> None:
    assert says in refused(database_url, *args)
    assert await pool.fetchval("SELECT count(*) FROM principals") == 0
    assert await pool.fetchval("SELECT count(*) FROM access_tokens") == 0
    assert await pool.fetchval("SELECT count(*) FROM audit_log") == 0


async def test_a_role_other_than_the_existing_ones_is_refused_not_changed(
    database_url: str, pool: asyncpg.Pool
) -> None:
    ok(database_url, "users", "add", "dana", "--role", "viewer")
    error = refused(database_url, "users", "token", "create", "dana", "--role", "admin")
    assert "dana is viewer, not admin" in error
    assert await pool.fetchval("SELECT role FROM principals WHERE name = 'dana'") == "viewer"
    assert await pool.fetchval("SELECT count(*) FROM access_tokens") == 0


async def test_adding_a_person_again_as_they_are_changes_nothing_and_is_not_audited(
    database_url: str, pool: asyncpg.Pool
) -> None:
    for _ in range(2):
        ok(database_url, "users", "add", "erin", "--role", "approver")
    ok(database_url, "users", "add", "erin", "--role", "operator")  # a change: audited
    ok(database_url, "users", "disable", "erin")
    ok(database_url, "users", "add", "erin", "--role", "operator")  # enabled again: audited
    actions = [entry.action for entry in await AuditStore(pool).entries()]
    assert actions == [
        "principal_added",
        "principal_changed",
        "principal_disabled",
        "principal_changed",
    ]
    assert await pool.fetchval("SELECT disabled_at FROM principals WHERE name = 'erin'") is None


async def test_audit_verify_exits_1_on_a_row_edited_by_a_superuser(
    database_url: str, pool: asyncpg.Pool
) -> None:
    for name in ("erin", "frank", "gina"):
        ok(database_url, "users", "add", name, "--role", "viewer")
    head = ok(database_url, "audit", "verify")["head_sha256"]
    assert ok(database_url, "audit", "verify", "--expect-head", head)["intact"]
    async with pool.acquire() as db:  # a superuser turns the append-only trigger off
        await db.execute("SET session_replication_role = replica")
        await db.execute("UPDATE audit_log SET principal = 'mallory' WHERE seq = 2")
        await db.execute("DELETE FROM audit_log WHERE seq = 3")
        await db.execute("RESET session_replication_role")
    broken = cli(database_url, "audit", "verify", "--expect-head", head)
    assert broken.returncode == 1
    assert "BROKEN: 2 rows" in broken.stdout
    assert "problem: row 2 was changed after it was written" in broken.stderr
    assert "no longer in the chain" in broken.stderr
    as_json = cli(database_url, "audit", "verify", "--json")
    assert as_json.returncode == 1 and json.loads(as_json.stdout)["intact"] is False
    assert len(await AuditStore(pool).entries()) == 2


async def test_audit_list_filters_and_pages(database_url: str) -> None:
    for name in ("hal", "ivy", "jo"):
        ok(database_url, "users", "add", name, "--role", "viewer")
    ok(database_url, "users", "disable", "ivy")
    disabled = ok(database_url, "audit", "list", "--action", "principal_disabled")
    assert [row["detail"]["name"] for row in disabled] == ["ivy"]
    page = ok(database_url, "audit", "list", "--after", "1", "--limit", "2")
    assert [row["seq"] for row in page] == [2, 3]
    assert ok(database_url, "audit", "list", "--principal", "nobody") == []
    empty = cli(database_url, "audit", "list", "--run", "r_none")
    assert empty.returncode == 0 and empty.stdout == "" and "no audit rows" in empty.stderr
    table = cli(database_url, "audit", "list")
    assert "principal_disabled" in table.stdout and '"name":"ivy"' in table.stdout
