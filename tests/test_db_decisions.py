"""Decisions are database functions that check who decides and append their own audit row
(migration 0019, invariant 13), proven by connecting as each role's login: no role but the owner
appends to the audit trail or writes a decision's tables directly, only the console names a
person, a worker's purge keeps young runs and audits itself, the console cannot manage people,
budgets only spend forward, and every function refuses hostile arguments without changing
anything."""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

import asyncpg
import pytest

from orchestrator.access import Actor, Permission, PrincipalKind, Role, Via, allows
from orchestrator.agent.budgets import Budget
from orchestrator.db.access import AccessStore, SignInRefused
from orchestrator.db.budgets import BudgetStore, Spend
from orchestrator.db.connections import create_pool
from orchestrator.db.grants import RoleNames
from orchestrator.db.purges import PurgeStore
from orchestrator.db.signals import SignalStore
from orchestrator.db.store import RunStore
from orchestrator.effects.approvals import ApprovalStore, Decision
from orchestrator.effects.store import EffectStore
from orchestrator.errors import InvalidInput
from orchestrator.settings import Settings
from support import cli
from test_db_roles import Logins, awaiting_refund, claimed_run, logins, refused, refusing
from test_effects_proxy import auth, running_proxy

__all__ = ["logins"]  # the fixture, imported for pytest

PURGE_AGE = timedelta(hours=1, minutes=1)
REFUSALS = (
    asyncpg.InsufficientPrivilegeError,
    asyncpg.InvalidParameterValueError,
    asyncpg.CheckViolationError,
    asyncpg.InvalidRowCountInLimitClauseError,
)
"""How a function refuses a hostile call: for privilege, or for a bad argument."""
ROLES = tuple(kind for kind in RoleNames().by_kind() if kind != "migrator")
TABLES = (
    "runs",
    "run_events",
    "run_signals",
    "effects",
    "effect_fences",
    "run_budgets",
    "budget_ledger",
    "principals",
    "access_tokens",
    "audit_log",
    "flow_limits",
    "rate_limits",
    "cutover_drains",
    "budget_carves",
    "run_checkpoints",
    "run_holds",
    "agent_cutovers",
    "schedules",
    "schedule_slots",
    "run_streams",
    "run_output",
)


@pytest.fixture
async def admin(logins: Logins) -> AsyncIterator[asyncpg.Pool]:
    """A pool as the database's superuser (who owns the schema in these tests)."""
    pool = await create_pool(Settings(database_url=logins.admin_dsn), max_size=2)
    yield pool
    await pool.close()


async def snapshot(admin: asyncpg.Pool) -> dict[str, str]:
    """A digest of every table a decision writes: equal digests, nothing changed."""
    digests = {}
    for table in TABLES:
        text = await admin.fetchval(
            f"SELECT coalesce(string_agg(t::text, E'\\n' ORDER BY t::text), '') FROM {table} AS t"
        )
        digests[table] = hashlib.sha256(text.encode()).hexdigest()
    return digests


async def audit_rows(admin: asyncpg.Pool) -> list[tuple[str, str, str]]:
    rows = await admin.fetch("SELECT principal, via, action FROM audit_log ORDER BY seq")
    return [(row["principal"], row["via"], row["action"]) for row in rows]


async def people(admin: asyncpg.Pool) -> None:
    access = AccessStore(admin)
    for name, role, kind in (
        ("alice", Role.APPROVER, PrincipalKind.PERSON),
        ("olga", Role.OPERATOR, PrincipalKind.PERSON),
        ("victor", Role.VIEWER, PrincipalKind.PERSON),
        ("dave", Role.ADMIN, PrincipalKind.PERSON),
        ("billing", Role.ADMIN, PrincipalKind.SERVICE),
        ("bob", Role.APPROVER, PrincipalKind.PERSON),
    ):
        await access.set_principal(name, kind=kind, role=role)
    await access.disable("bob")


# -- the audit trail is written only by the functions that decide ------------------------------
async def test_no_role_but_the_owner_appends_to_the_audit_trail(
    logins: Logins, admin: asyncpg.Pool
) -> None:
    """The held-out forgery: the worker appended a row naming alice. Now every role is refused,
    the console included, and nothing is appended."""
    await people(admin)
    run_id = (await RunStore(await logins.pool("client")).submit("roles", {})).run.run_id
    before = await audit_rows(admin)
    for kind in ROLES:
        pool = await logins.pool(kind)
        await refused(
            refusing(
                pool,
                "SELECT audit_append('alice', 'token', 'approve', $1, 'pay', '{}')",
                run_id,
            )
        )
    assert await audit_rows(admin) == before


async def test_only_the_console_names_who_decides_and_only_a_person_allowed_to(
    logins: Logins, admin: asyncpg.Pool
) -> None:
    await people(admin)
    console = await logins.pool("console")
    client = await logins.pool("client")
    worker = RunStore(await logins.pool("worker"))
    claimed = await awaiting_refund(RunStore(client), worker)
    sha = (await EffectStore(client).get(claimed.run_id, "refund")).payload_sha256

    def decide(pool: asyncpg.Pool, actor: Actor | None) -> Any:
        return lambda: ApprovalStore(pool).decide(
            claimed.run_id, "refund", Decision.APPROVED, payload_sha256=sha, actor=actor
        )

    unchanged = await snapshot(admin)
    # A client decides only as the login it connected as: it may not name alice.
    await refused(decide(client, Actor("alice", Via.OIDC)))
    # A worker may not decide at all, as itself or as anyone.
    await refused(decide(worker.pool, None))
    await refused(decide(worker.pool, Actor("alice", Via.TOKEN)))
    # The console vouches only for an enabled person whose role allows the decision.
    for nobody in (
        Actor("victor", Via.OIDC),  # a viewer
        Actor("olga", Via.OIDC),  # an operator, who resolves but does not approve
        Actor("bob", Via.PROXY_HEADER),  # disabled
        Actor("billing", Via.TOKEN),  # a service (an admin one)
        Actor("eve", Via.OIDC),  # unknown
        Actor("alice", Via.SHARED_TOKEN),  # the shared token decides as shared-token only
    ):
        await refused(decide(console, nobody))
    assert await snapshot(admin) == unchanged

    decided = await ApprovalStore(console).decide(
        claimed.run_id,
        "refund",
        Decision.APPROVED,
        payload_sha256=sha,
        actor=Actor("alice", Via.OIDC, note="typed"),
    )
    assert decided.decided_by == "alice"
    assert (await audit_rows(admin))[-1] == ("alice", "oidc", "approve")
    cancelled = await RunStore(client).cancel(claimed.run_id, reason="done")
    assert cancelled.fence > claimed.fence
    assert (await audit_rows(admin))[-1] == (logins.logins["client"], "database-role", "cancel")


async def test_no_role_writes_a_decisions_tables_directly(
    logins: Logins, admin: asyncpg.Pool
) -> None:
    """Approve, deny, resolve, signal, top up, cancel and submit only through their functions:
    a direct write by any role is refused, so no decision escapes its audit row."""
    client = RunStore(await logins.pool("client"))
    worker = RunStore(await logins.pool("worker"))
    claimed = await awaiting_refund(client, worker)
    lease = claimed.lease
    budgets = BudgetStore(worker.pool)
    reserved = await budgets.reserve(lease, Budget(turns=5), [1, 10, 10], Decimal("0.01"))
    assert reserved.outcome == "reserved"
    unchanged = await snapshot(admin)
    for kind in ROLES:
        pool = await logins.pool(kind)
        for statement in (
            "UPDATE effects SET status = 'accepted', approved_sha256 = payload_sha256, "
            "decided_by = 'alice' WHERE run_id = $1",
            "UPDATE effects SET status = 'confirmed' WHERE run_id = $1 AND status = 'parked'",
            "UPDATE run_budgets SET turns_spent = 0, cost_spent = 0, turns_reserved = 0 "
            "WHERE run_id = $1",
            "UPDATE run_budgets SET turns_limit = 1000000 WHERE run_id = $1",
            "INSERT INTO budget_ledger (run_id, kind, turns) VALUES ($1, 'top_up', 5)",
            "INSERT INTO run_signals (run_id, name, data) VALUES ($1, 'reply', '{}')",
            "INSERT INTO runs (run_id, agent, input) VALUES ($1 || '_2', 'roles', '{}')",
            "UPDATE principals SET disabled_at = NULL WHERE name = $1",
            "INSERT INTO principals (name, kind, role, created_by) "
            "VALUES ('m' || md5($1), 'person', 'admin', 'x')",
        ):
            if kind == "dispatcher" and statement.startswith("UPDATE effects SET status = 'c"):
                continue  # the dispatcher settles effects: its own, under its lease
            await refused(refusing(pool, statement, claimed.run_id))
    # Nor can the console or a client write a run's timeline or wake a run by hand.
    for kind in ("console", "client"):
        pool = await logins.pool(kind)
        for statement in (
            "INSERT INTO run_events (run_id, kind, details) "
            "VALUES ($1, 'approval_granted', '{\"by\": \"alice\"}')",
            "UPDATE runs SET available_at = now(), signals_pending = 0 WHERE run_id = $1",
        ):
            await refused(refusing(pool, statement, claimed.run_id))
    assert await snapshot(admin) == unchanged


async def test_a_worker_purges_only_runs_finished_an_hour_ago_and_audits_each_batch(
    logins: Logins, admin: asyncpg.Pool
) -> None:
    """The held-out purge: the worker deleted runs finished seconds earlier with no audit row."""
    client = RunStore(await logins.pool("client"))
    worker = await logins.pool("worker")
    fresh = (await client.submit("roles", {})).run.run_id
    old = (await client.submit("roles", {})).run.run_id
    for run_id in (fresh, old):
        await client.cancel(run_id)
    await admin.execute(
        "UPDATE runs SET finished_at = clock_timestamp() - interval '2 hours' WHERE run_id = $1",
        old,
    )
    before = await audit_rows(admin)
    for cutoff in ("now() + interval '1 day'", "now() - interval '59 minutes'"):
        await refused(refusing(worker, f"SELECT * FROM orchestrator_purge_finished({cutoff}, 100)"))
    with pytest.raises(asyncpg.InvalidParameterValueError):  # the held-out call's batch
        await worker.execute(
            "SELECT * FROM orchestrator_purge_finished(now() + interval '1 day', 100000)"
        )
    assert await audit_rows(admin) == before
    purges = PurgeStore(worker)
    purged = await purges.delete_batch(await purges.clock() - PURGE_AGE, 100)
    assert purged.runs == 1 and purged.audit_seq is not None
    assert await admin.fetchval("SELECT count(*) FROM runs WHERE run_id = $1", fresh) == 1
    assert await admin.fetchval("SELECT count(*) FROM runs WHERE run_id = $1", old) == 0
    [row] = await admin.fetch("SELECT * FROM audit_log WHERE seq = $1", purged.audit_seq)
    assert (row["principal"], row["via"], row["action"]) == (
        logins.logins["worker"],
        "database-role",
        "purge",
    )
    assert row["detail"]["runs"] == 1
    # A batch that deleted nothing appends nothing.
    nothing = await purges.delete_batch(await purges.clock() - PURGE_AGE, 100)
    assert nothing.runs == 0 and nothing.audit_seq is None
    assert len(await audit_rows(admin)) == len(before) + 1


async def test_the_console_signs_people_in_but_does_not_manage_them(
    logins: Logins, admin: asyncpg.Pool, database_url: str
) -> None:
    await people(admin)
    console = AccessStore(await logins.pool("console"))
    unchanged = await snapshot(admin)
    await refused(
        lambda: console.set_principal("mallory", kind=PrincipalKind.PERSON, role=Role.ADMIN)
    )
    await refused(lambda: console.disable("alice"))
    await refused(lambda: console.create_token("alice", expires_in=3600))
    for name, via, role, token_id in (
        ("bob", Via.OIDC, Role.APPROVER, None),  # disabled: never re-enabled
        ("billing", Via.OIDC, Role.OPERATOR, None),  # a service
        ("mallory", Via.OIDC, Role.ADMIN, None),  # nobody is made an admin by a sign-in
        ("olga", Via.OIDC, Role.ADMIN, None),  # not even someone already known
        ("eve", Via.OIDC, None, None),  # unknown, and no role to add her with
        ("alice", Via.TOKEN, None, "aaaaaaaaaaaa"),  # a token that is not hers
    ):
        with pytest.raises(SignInRefused):
            await console.sign_in(name, via, role=role, token_id=token_id)
    assert await snapshot(admin) == unchanged
    # The CLI's people commands, run with the console's login, are refused in one line that
    # says which role lacked what and how to fix it.
    for args in (("users", "add", "mallory", "--role", "admin"), ("users", "disable", "alice")):
        done = cli(logins.dsn("console"), *args)
        assert done.returncode == 1, done.stderr
        line = done.stderr.strip()
        assert line.count("\n") == 0, line
        assert f"PostgreSQL refused role '{logins.logins['console']}'" in line
        assert "permission denied" in line and "db grant" in line
        assert "check it is up" not in line
    assert await snapshot(admin) == unchanged

    # What a sign-in may do: add a person with a mapped role, change it, keep an admin an admin.
    added = await console.sign_in("nina", Via.OIDC, role=Role.OPERATOR)
    assert (added.name, added.role) == ("nina", Role.OPERATOR)
    changed = await console.sign_in("nina", Via.OIDC, role=Role.APPROVER)
    assert changed.role is Role.APPROVER
    admin_kept = await console.sign_in("dave", Via.OIDC, role=Role.VIEWER)
    assert admin_kept.role is Role.ADMIN
    assert (await audit_rows(admin))[-5:] == [
        ("nina", "oidc", "principal_added"),
        ("nina", "oidc", "sign_in"),
        ("nina", "oidc", "principal_changed"),
        ("nina", "oidc", "sign_in"),
        ("dave", "oidc", "sign_in"),
    ]
    # Clients and workers do not sign anyone in.
    for kind in ("client", "worker"):
        await refused(
            refusing(
                await logins.pool(kind),
                "SELECT * FROM orchestrator_sign_in('dave', 'oidc', NULL, NULL)",
            )
        )


async def test_a_budget_only_spends_forward(logins: Logins, admin: asyncpg.Pool) -> None:
    client = RunStore(await logins.pool("client"))
    worker = RunStore(await logins.pool("worker"))
    claimed = await claimed_run(client, worker)
    lease = claimed.lease
    budgets = BudgetStore(worker.pool)
    assert (
        await budgets.reserve(lease, Budget(turns=5, cost_usd=Decimal(1)), [1, 10, 10], Decimal(0))
    ).outcome == "reserved"
    async with worker.pool.acquire() as db:
        await BudgetStore(db).settle([(lease.run_id, Spend(lease.fence, 2, 1, 5, 5, Decimal(0)))])
    spent = await admin.fetchrow("SELECT * FROM run_budgets WHERE run_id = $1", lease.run_id)
    unchanged = await snapshot(admin)
    worker_pool = worker.pool
    for statement in (
        # A negative reservation would shrink what is held; a negative settlement, what is spent.
        "SELECT * FROM orchestrator_reserve_budget($1, 'w1', $2, '{}', -5, 0, 0, 0)",
        "SELECT orchestrator_settle_budgets(ARRAY[$1], ARRAY[$2], ARRAY[-2]::bigint[], "
        "ARRAY[-1]::bigint[], ARRAY[-5]::bigint[], ARRAY[-5]::bigint[], ARRAY[-1]::numeric[])",
    ):
        with contextlib.suppress(asyncpg.PostgresError):
            await worker_pool.execute(statement, lease.run_id, lease.fence)
    after = await admin.fetchrow("SELECT * FROM run_budgets WHERE run_id = $1", lease.run_id)
    assert spent is not None and after is not None
    for column in ("turns_spent", "tool_calls_spent", "input_tokens_spent", "cost_spent"):
        assert after[column] >= spent[column], column
    assert await snapshot(admin) == unchanged
    # Top-ups raise limits by positive amounts only, of the five dimensions only.
    client_pool = client.pool
    for added in (
        '{"turns": -5}',
        '{"turns": 0}',
        '{"cost_usd": "-1"}',
        '{"cost_usd": "NaN"}',
        '{"turns": 1.5}',
        '{"spent": 5}',
        "{}",
        "[]",
        '{"turns": "1e400"}',
    ):
        with pytest.raises(asyncpg.PostgresError):
            await client_pool.execute(
                "SELECT * FROM orchestrator_top_up_budget($1, $2::jsonb, NULL, NULL, NULL)",
                lease.run_id,
                added,
            )
    assert await snapshot(admin) == unchanged
    topped = await BudgetStore(client_pool).top_up(lease.run_id, turns=2)
    assert topped.limit["turns"] == 7


SCHEDULE_CALLS: list[tuple[str, tuple[object, ...]]] = [
    (
        "SELECT * FROM orchestrator_create_schedule($1, 'n', 'roles', NULL, 60, 'UTC', NULL, NULL,"
        " NULL, NULL, NULL, now(), NULL, '{}', NULL, NULL, NULL, now(), NULL, NULL, NULL)",
        ("bad id!",),
    ),
    (
        "SELECT * FROM orchestrator_create_schedule('sch_a', $1, 'roles', NULL, 60, 'UTC', NULL,"
        " NULL, NULL, NULL, NULL, now(), NULL, '{}', NULL, NULL, NULL, now(), NULL, NULL, NULL)",
        ("x" * 100_000,),
    ),
    (
        "SELECT * FROM orchestrator_create_schedule('sch_b', 'n', 'roles', NULL, -60, 'UTC',"
        " NULL, NULL, NULL, NULL, NULL, now(), NULL, '{}', NULL, NULL, NULL, now(), NULL, NULL,"
        " NULL)",
        (),
    ),
    (
        "SELECT * FROM orchestrator_create_schedule('sch_c', 'n', 'roles', '* * * * *', 60,"
        " 'UTC', NULL, NULL, NULL, NULL, NULL, now(), NULL, '{}', NULL, NULL, NULL, now(), NULL,"
        " NULL, NULL)",
        (),
    ),
    (
        "SELECT * FROM orchestrator_create_schedule('sch_d', 'n', 'roles', NULL, 60, 'UTC',"
        " 'sometimes', NULL, NULL, 0, -1, now(), now() - interval '1 day', '{}', NULL, NULL,"
        " NULL, 'infinity', NULL, NULL, NULL)",
        (),
    ),
    (
        "SELECT * FROM orchestrator_create_schedule('sch_e', 'n', 'roles', NULL, 60, 'UTC', NULL,"
        " NULL, NULL, NULL, NULL, now(), NULL, '{}', NULL, NULL, NULL, now(), 'alice', 'oidc',"
        " NULL)",
        (),
    ),
    (
        "SELECT * FROM orchestrator_create_schedule('sch_f', 'hostile', 'roles', NULL, 60, 'UTC',"
        " NULL, NULL, NULL, NULL, NULL, now(), NULL, '{}', NULL, NULL, NULL, now(), NULL, NULL,"
        " NULL)",
        (),
    ),
    (
        "SELECT * FROM orchestrator_change_schedule('hostile', 'explode', NULL, NULL, NULL, NULL)",
        (),
    ),
    (
        "SELECT * FROM orchestrator_change_schedule('hostile', 'pause', NULL, 'alice', 'oidc', "
        "NULL)",
        (),
    ),
    (
        "SELECT * FROM orchestrator_change_schedule('hostile', 'resume', 'infinity', NULL, NULL, "
        "NULL)",
        (),
    ),
    ("SELECT * FROM orchestrator_claim_schedules(NULL, 30, 10)", ()),
    ("SELECT * FROM orchestrator_claim_schedules('w', 30, -1)", ()),
    (
        "SELECT * FROM orchestrator_fire_schedule('sch_hostile', 'w', 0, ARRAY[now()], "
        "ARRAY[now()], ARRAY['r_a', 'r_b'], now() + interval '1 hour', NULL)",
        (),
    ),
    (
        "SELECT * FROM orchestrator_fire_schedule('sch_hostile', 'w', 0, ARRAY[now()], "
        "ARRAY[now(), now()], ARRAY['r_a'], 'infinity', NULL)",
        (),
    ),
    (
        "SELECT orchestrator_start_scheduled_run(s, now(), 'r_x', now(), 'x') FROM schedules s",
        (),
    ),
]


async def test_hostile_arguments_to_every_function_change_nothing(
    logins: Logins, admin: asyncpg.Pool
) -> None:
    """Every definer function, called by every role with NULLs, malformed names, huge text and
    negative numbers: refused or a no-op, never a change and never an audit row."""
    await people(admin)
    client = RunStore(await logins.pool("client"))
    worker = RunStore(await logins.pool("worker"))
    claimed = await awaiting_refund(client, worker)
    run = claimed.run_id
    huge = "x" * 100_000
    calls = [
        ("SELECT * FROM orchestrator_cancel_run($1, $2, NULL, NULL, NULL)", (run, huge)),
        ("SELECT * FROM orchestrator_cancel_run($1, NULL, 'alice', 'oidc', NULL)", (run,)),
        ("SELECT * FROM orchestrator_cancel_run($1, NULL, NULL, 'oidc', NULL)", (run,)),
        ("SELECT * FROM orchestrator_cancel_run($1, NULL, NULL, NULL, $2)", (run, huge)),
        ("SELECT * FROM orchestrator_cancel_run(NULL, NULL, NULL, NULL, NULL)", ()),
        ("SELECT * FROM orchestrator_retry_run($1, 'dave', 'token', NULL)", (run,)),
        (
            "SELECT * FROM orchestrator_decide_approval($1, 'refund', 'maybe', NULL, NULL, "
            "NULL, NULL, NULL, NULL)",
            (run,),
        ),
        (
            "SELECT * FROM orchestrator_decide_approval($1, 'refund', 'approved', $2, NULL, "
            "NULL, NULL, NULL, NULL)",
            (run, huge),
        ),
        (
            "SELECT * FROM orchestrator_decide_approval($1, 'refund', 'approved', NULL, "
            "repeat('0', 64), NULL, NULL, NULL, NULL)",
            (run,),
        ),
        (
            "SELECT * FROM orchestrator_decide_approval($1, 'refund', 'approved', NULL, NULL, "
            "-1, NULL, NULL, NULL)",
            (run,),
        ),
        (
            "SELECT * FROM orchestrator_resolve_effect($1, 'refund', NULL, NULL, NULL, NULL, NULL)",
            (run,),
        ),
        (
            "SELECT * FROM orchestrator_resolve_effect($1, 'refund', true, $2, NULL, NULL, NULL)",
            (run, huge),
        ),
        (
            "SELECT * FROM orchestrator_send_signal($1, $2, NULL, NULL, NULL, NULL, NULL)",
            (run, "bad name!"),
        ),
        (
            "SELECT * FROM orchestrator_send_signal($1, 'reply', NULL, $2, NULL, NULL, NULL)",
            (run, huge),
        ),
        (
            "SELECT * FROM orchestrator_send_signal($1, 'reply', NULL, NULL, 'dave', "
            "'database-role', NULL)",
            (run,),
        ),
        ("SELECT * FROM orchestrator_top_up_budget($1, NULL, NULL, NULL, NULL)", (run,)),
        (
            "SELECT * FROM orchestrator_submit_run($1, 'bad agent!', '{}', 1, NULL, NULL, NULL)",
            ("r_hostile",),
        ),
        (
            "SELECT * FROM orchestrator_submit_run($1, 'roles', NULL, 1, NULL, NULL, NULL)",
            ("r_hostile",),
        ),
        (
            "SELECT * FROM orchestrator_submit_run($1, 'roles', '{}', -1, NULL, NULL, NULL)",
            ("r_hostile",),
        ),
        ("SELECT * FROM orchestrator_purge_finished(NULL, 10)", ()),
        ("SELECT * FROM orchestrator_purge_finished(now() - interval '2 hours', -1)", ()),
        ("SELECT * FROM orchestrator_purge_finished('-infinity', 100000000)", ()),
        ("SELECT * FROM orchestrator_expire_approvals(-1)", ()),
        ("SELECT * FROM orchestrator_sign_in(NULL, NULL, NULL, NULL)", ()),
        ("SELECT * FROM orchestrator_sign_in('dave', 'token', NULL, NULL)", ()),
        ("SELECT * FROM orchestrator_sign_in($1, 'oidc', NULL, 'operator')", (huge,)),
        ("SELECT * FROM orchestrator_sign_in('x', 'oidc', NULL, 'root')", ()),
        (
            "SELECT * FROM orchestrator_reserve_budget($1, 'w1', 999999, '{}', 1, 1, 1, 1)",
            (run,),
        ),
        ("SELECT orchestrator_may_vouch()", ()),
        # Flow control (migrations 0021, 0022): limits, rate limits, holds, declared limits.
        ("SELECT * FROM orchestrator_set_limit('roles', '*', 'all', -1, NULL, NULL, NULL)", ()),
        ("SELECT * FROM orchestrator_set_limit('roles', $1, 'key', 1, NULL, NULL, NULL)", (huge,)),
        ("SELECT * FROM orchestrator_set_limit('roles', '*', 'all', 1, 'alice', 'oidc', NULL)", ()),
        ("SELECT * FROM orchestrator_clear_limit('roles', $1, 'all', NULL, NULL, NULL)", (huge,)),
        (
            "SELECT * FROM orchestrator_set_rate_limit('model:m', 5, NULL, 'NaN', NULL, NULL, "
            "NULL)",
            (),
        ),
        (
            "SELECT * FROM orchestrator_set_rate_limit($1, 5, NULL, 60, NULL, NULL, NULL)",
            (huge,),
        ),
        (
            "SELECT * FROM orchestrator_set_rate_limit('model:m', -5, -1, 60, NULL, NULL, NULL)",
            (),
        ),
        (
            "SELECT * FROM orchestrator_set_rate_limit('model:m', 5, NULL, 60, 'alice', 'oidc', "
            "NULL)",
            (),
        ),
        ("SELECT * FROM orchestrator_clear_rate_limit($1, NULL, NULL, NULL)", (huge,)),
        ("SELECT * FROM orchestrator_rate_take(NULL, 1, 0, NULL, NULL)", ()),
        ("SELECT * FROM orchestrator_rate_take('model:m', -1, 0, NULL, NULL)", ()),
        ("SELECT * FROM orchestrator_rate_take('model:m', 1, -7, NULL, NULL)", ()),
        ("SELECT * FROM orchestrator_rate_take($1, 1, 0, $2, -5)", (huge, run)),
        ("SELECT orchestrator_rate_settle($1, 1000000000000000)", (huge,)),
        ("SELECT * FROM orchestrator_rate_pause($1, 1, 'w')", (huge,)),
        ("SELECT * FROM orchestrator_rate_pause('model:m', -1, 'w')", ()),
        ("SELECT * FROM orchestrator_rate_pause('model:m', 'Infinity', 'w')", ()),
        ("SELECT * FROM orchestrator_rate_pause('model:m', 1, $1)", (huge,)),
        ("SELECT orchestrator_hold_run($1, 'limit', $2, NULL)", (run, huge)),
        ("SELECT orchestrator_hold_run($1, 'anything', 'x', NULL)", (run,)),
        ("SELECT orchestrator_declare_limits('bad agent!', '[]', 'w')", ()),
        ("SELECT orchestrator_declare_limits('roles', 'null', 'w')", ()),
        (
            "SELECT orchestrator_declare_limits('roles', "
            '\'[{"key_pattern": "*", "per": "all", "max_running": -1}]\', \'w\')',
            (),
        ),
        ("SELECT orchestrator_declare_limits('roles', '[]', $1)", (huge,)),
        ("SELECT * FROM orchestrator_cutover('bad agent!', '2', NULL, NULL, NULL)", ()),
        ("SELECT * FROM orchestrator_cutover('roles', $1, NULL, NULL, NULL)", (huge,)),
        ("SELECT * FROM orchestrator_cutover('roles', NULL, NULL, NULL, NULL)", ()),
        ("SELECT * FROM orchestrator_cutover('roles', '2', 'alice', 'oidc', NULL)", ()),
        ("SELECT * FROM orchestrator_cutover('roles', '2', true, 'alice', 'oidc', NULL)", ()),
        ("SELECT * FROM orchestrator_cutover('roles', $1, true, NULL, NULL, NULL)", (huge,)),
        ("SELECT * FROM orchestrator_cutover('bad agent!', '2', NULL, NULL, NULL, NULL)", ()),
        # Child runs (migration 0027): only the holder of the parent's lease spawns.
        ("SELECT * FROM orchestrator_spawn_children(NULL, NULL, NULL, NULL)", ()),
        ("SELECT * FROM orchestrator_spawn_children($1, 1, 'w1', '{}')", (run,)),
        (
            "SELECT * FROM orchestrator_spawn_children($1, 999, 'w1', jsonb_build_array("
            "jsonb_build_object('run_id', 'r_01jd3k5q8m2x7c9v4b6n0p1r2s', 'agent', 'roles',"
            " 'input', '{}'::jsonb, 'key', 'k')))",
            (run,),
        ),
        ("SELECT * FROM orchestrator_spawn_children($1, 1, $2, '[]')", (run, huge)),
        ("SELECT orchestrator_carve_budgets(NULL, NULL, NULL, NULL, NULL)", ()),
        ("SELECT * FROM orchestrator_cancel_tree($1, '{}')", (run,)),  # no role may, bare
        ("SELECT * FROM orchestrator_fork_run(NULL, NULL, NULL, NULL, NULL, NULL)", ()),
        ("SELECT * FROM orchestrator_fork_run($1, -1, 'r_x', NULL, NULL, NULL)", (run,)),
        ("SELECT * FROM orchestrator_fork_run($1, 0, $2, NULL, NULL, NULL)", (run, huge)),
        ("SELECT * FROM orchestrator_fork_run($1, 99, 'r_y', NULL, NULL, NULL)", (run,)),
        (
            "SELECT * FROM orchestrator_fork_run($1, 0, 'r_z', 'alice', 'oidc', NULL)",
            (run,),
        ),
        ("SELECT orchestrator_carve_budgets($1, 999, 'w1', '{\"turns\": 1}', '[]')", (run,)),
        # Live output (migration 0031): only the lease's holder appends; reads refuse nonsense.
        ("SELECT * FROM orchestrator_stream_append(NULL, NULL, NULL, NULL, NULL, NULL, NULL)", ()),
        (
            "SELECT * FROM orchestrator_stream_append($1, 'w1', 999, 0, "
            '\'[{"kind": "text", "data": {"text": "x"}}]\', 10, 1000)',
            (run,),
        ),
        (
            "SELECT * FROM orchestrator_stream_append($1, 'w1', 1, 0, "
            '\'[{"kind": "retracted", "data": {}}]\', 10, 1000)',
            (run,),
        ),
        (
            "SELECT * FROM orchestrator_stream_append($1, 'w1', 1, 0, "
            "jsonb_build_array(jsonb_build_object('kind', 'text', 'data', "
            "jsonb_build_object('text', $2::text))), 10, 1000000)",
            (run, huge),
        ),
        (
            "SELECT * FROM orchestrator_stream_append($1, $2, 1, 0, "
            '\'[{"kind": "text", "data": {"text": "x"}}]\', -1, -1)',
            (run, huge),
        ),
        ("SELECT * FROM orchestrator_stream_read(NULL, NULL, NULL)", ()),
        ("SELECT * FROM orchestrator_stream_read($1, -1, 100000)", (run,)),
        ("SELECT * FROM orchestrator_stream_read($1, 0, 10)", (huge,)),
        ("SELECT * FROM orchestrator_stream_read($1, 0, 10)", (run,)),
        ("SELECT orchestrator_stream_seal($1)", (run,)),
        (
            "SELECT orchestrator_carve_budgets($1, 1, 'w1', NULL, jsonb_build_array("
            "jsonb_build_object('run_id', $1::text, 'budget', '{\"turns\": -5}'::jsonb)))",
            (run,),
        ),
        # Schedules (migration 0030): a due schedule exists; no hostile call may claim, fire,
        # change or backfill it.
        *SCHEDULE_CALLS,
        (
            "SELECT * FROM orchestrator_backfill_schedule('hostile', $1, $2, NULL, NULL, NULL)",
            ([datetime(2026, 1, 1, tzinfo=UTC)], ["r_a", "r_b"]),
        ),
        (
            "SELECT * FROM orchestrator_backfill_schedule('hostile', $1, $2, NULL, NULL, NULL)",
            ([datetime(9999, 1, 1, tzinfo=UTC)], ["r_a"]),
        ),
        (
            "SELECT * FROM orchestrator_backfill_schedule('hostile', $1, $2, 'alice', 'oidc', "
            "NULL)",
            ([datetime(2026, 1, 1, tzinfo=UTC)], ["r_a"]),
        ),
        (
            "SELECT * FROM orchestrator_backfill_schedule('hostile', $1, $2, NULL, NULL, NULL)",
            ([datetime(2026, 1, 1, tzinfo=UTC)] * 10_001, ["r_a"] * 10_001),
        ),
        (
            "SELECT * FROM orchestrator_backfill_schedule('hostile', $1, $2, NULL, NULL, NULL)",
            ([datetime(2026, 1, 1, tzinfo=UTC)], ["bad id!"]),
        ),
        (
            "SELECT * FROM orchestrator_change_schedule($1, 'delete', NULL, NULL, NULL, NULL)",
            (huge,),
        ),
        ("SELECT * FROM orchestrator_claim_schedules($1, 30, 10)", (huge,)),
    ]
    await admin.execute(
        "INSERT INTO schedules (schedule_id, name, agent, every_seconds, starts_at, next_fire_at,"
        " created_by) VALUES ('sch_hostile', 'hostile', 'roles', 60, now() - interval '1 day', "
        "now() - interval '1 minute', 'admin')"
    )
    unchanged = await snapshot(admin)
    refusals: list[tuple[str, str, asyncpg.PostgresError]] = []
    for kind in ROLES:
        pool = await logins.pool(kind)
        for statement, arguments in calls:
            try:
                rows = await pool.fetch(statement, *arguments)
            except asyncpg.PostgresError as error:
                refusals.append((kind, statement, error))
                continue
            assert statement.startswith("SELECT orchestrator_may_vouch") or all(
                row.get("audit_seq") is None for row in rows
            ), (kind, statement, rows)
        assert await snapshot(admin) == unchanged, (kind, "changed something")
    unclear = [
        (kind, statement, repr(error))
        for kind, statement, error in refusals
        if not isinstance(error, REFUSALS)
    ]
    assert not unclear


async def test_the_console_and_clients_write_no_run_state_effect_or_event_by_hand(
    logins: Logins, admin: asyncpg.Pool
) -> None:
    """What people's applications hold: no cancel without a fence raised, no end dated back, no
    decision on an effect and no decision's event but through the functions that audit them."""
    client = RunStore(await logins.pool("client"))
    worker = RunStore(await logins.pool("worker"))
    live = await awaiting_refund(client, worker)
    stuck = await awaiting_refund(client, worker)
    queued = (await client.submit("unserved", {})).run.run_id
    await admin.execute(
        "UPDATE effects SET status = 'parked', requires_approval = false WHERE run_id = $1",
        stuck.run_id,
    )
    unchanged = await snapshot(admin)
    for kind in ("console", "client"):
        pool = await logins.pool(kind)
        for statement, run_id in (
            (
                "UPDATE runs SET state = 'cancelled', lease_owner = NULL, lease_until = NULL, "
                "finished_at = clock_timestamp() WHERE run_id = $1",
                live.run_id,
            ),
            (
                "UPDATE runs SET state = 'failed', finished_at = now() - interval '2 hours' "
                "WHERE run_id = $1",
                queued,
            ),
            (
                "UPDATE effects SET status = 'rejected', settled_at = now(), "
                'error = \'{"type": "Denied", "by": "alice"}\' WHERE run_id = $1',
                live.run_id,
            ),
            (
                "UPDATE effects SET status = 'confirmed', settled_at = now(), external_id = 'x' "
                "WHERE run_id = $1",
                stuck.run_id,
            ),
            (
                "INSERT INTO run_events (run_id, kind, fence, details) "
                'VALUES ($1, \'approval_denied\', 1, \'{"by": "alice", "via": "token"}\')',
                live.run_id,
            ),
        ):
            await refused(refusing(pool, statement, run_id))
    assert await snapshot(admin) == unchanged


async def test_a_purge_names_the_runs_it_deleted_in_its_audit_row(
    logins: Logins, admin: asyncpg.Pool
) -> None:
    """Even a run whose end a worker dated back (its grants allow it: docs/database-roles.md)
    leaves the trail of its purge."""
    client = RunStore(await logins.pool("client"))
    worker = await logins.pool("worker")
    run_id = (await client.submit("unserved", {})).run.run_id
    await worker.execute(
        "UPDATE runs SET state = 'failed', finished_at = now() - interval '2 hours' "
        "WHERE run_id = $1",
        run_id,
    )
    purges = PurgeStore(worker)
    purged = await purges.delete_batch(await purges.clock() - PURGE_AGE, 100)
    assert purged.runs == 1 and purged.audit_seq is not None
    detail = await admin.fetchval("SELECT detail FROM audit_log WHERE seq = $1", purged.audit_seq)
    assert detail["run_ids"] == [run_id]


async def test_a_budget_refuses_nan_and_infinite_amounts(
    logins: Logins, admin: asyncpg.Pool
) -> None:
    """A NaN cost stuck in a spent counter no top-up could raise a limit past."""
    client = RunStore(await logins.pool("client"))
    worker = RunStore(await logins.pool("worker"))
    lease = (await claimed_run(client, worker)).lease
    budgets = BudgetStore(worker.pool)
    reserved = await budgets.reserve(lease, Budget(cost_usd=Decimal(1)), [1, 1, 1], Decimal(0))
    assert reserved.outcome == "reserved"
    unchanged = await snapshot(admin)
    for cost in ("NaN", "Infinity"):
        with pytest.raises(asyncpg.CheckViolationError):
            await worker.pool.execute(
                "SELECT orchestrator_settle_budgets(ARRAY[$1], ARRAY[$2::bigint], ARRAY[1], "
                "ARRAY[0], ARRAY[1], ARRAY[1], ARRAY[$3::numeric])",
                lease.run_id,
                lease.fence,
                cost,
            )
        with pytest.raises(asyncpg.CheckViolationError):
            await worker.pool.execute(
                "SELECT * FROM orchestrator_reserve_budget($1, 'w1', $2, '{}', 0, 0, 0, $3)",
                lease.run_id,
                lease.fence,
                cost,
            )
    assert await snapshot(admin) == unchanged
    # A top-up written with an exponent (Decimal's own text) is the amount it says.
    topped = await BudgetStore(client.pool).top_up(lease.run_id, cost_usd=Decimal("1E+3"))
    assert Decimal(str(topped.limit["cost_usd"])) == Decimal(1001)
    topped = await BudgetStore(client.pool).top_up(lease.run_id, cost_usd="0.0000001")
    assert Decimal(str(topped.limit["cost_usd"])) == Decimal("1001.0000001")


async def test_a_sign_in_of_a_name_no_principal_can_have_is_refused_clearly(
    logins: Logins,
) -> None:
    console = AccessStore(await logins.pool("console"))
    for name in ("o'brien@example.com", "auth0|12345", "x" * 201, "shared-token"):
        with pytest.raises(InvalidInput, match=r"cannot name a principal|is reserved"):
            await console.sign_in(name, Via.OIDC, role=Role.VIEWER)


async def test_the_proxy_starts_as_its_role_with_service_tokens_only(
    logins: Logins, admin: asyncpg.Pool
) -> None:
    """The held-out start: `effects serve` as the proxy login, with no flat tokens and a
    service's token in the database, exited 1 (permission denied for table principals)."""
    access = AccessStore(admin)
    await access.set_principal("refunds-svc", kind=PrincipalKind.SERVICE, role=Role.OPERATOR)
    token = (await access.create_token("refunds-svc", expires_in=3600)).secret
    async with running_proxy(logins.dsn("proxy"), tokens="") as proxy:
        answer = await proxy.get("/v1/effects/r_missing/key", headers=auth(token))
        assert answer.status_code == 404, answer.text


async def test_a_signal_and_a_top_up_through_their_functions_are_audited_as_the_client(
    logins: Logins, admin: asyncpg.Pool
) -> None:
    client = await logins.pool("client")
    run_id = (await RunStore(client).submit("roles", {})).run.run_id
    sent = await SignalStore(client).send(run_id, "reply", {"text": "yes"}, idempotency_key="k1")
    again = await SignalStore(client).send(run_id, "reply", {"text": "yes"}, idempotency_key="k1")
    assert sent.created and not again.created
    login = logins.logins["client"]
    assert [row for row in await audit_rows(admin) if row[2] == "signal"] == [
        (login, "database-role", "signal")
    ]


async def test_the_database_and_the_code_agree_on_what_each_role_may_do(
    pool: asyncpg.Pool,
) -> None:
    """orchestrator_role_allows (the database's check) and orchestrator.access (the console's)
    are one table written twice: they must not drift apart."""
    for role in Role:
        for permission in Permission:
            in_sql = await pool.fetchval(
                "SELECT orchestrator_role_allows($1, $2)", role.value, permission.value
            )
            assert in_sql == allows(role, permission), (role, permission)
