"""Least-privilege roles, proven by connecting as each one: `db grant` on the test's database,
then a login role per kind (a member of the granted group role, with a password, over loopback)
running the real stores and the real worker, dispatcher and console paths, and the statements
each role must not be able to run (docs/database-roles.md)."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from datetime import timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import anyio
import asyncpg
import httpx
import pytest

from orchestrator.access import Actor, PrincipalKind, Role, TokenScope, Via
from orchestrator.agent.budgets import Budget
from orchestrator.db.access import AccessStore
from orchestrator.db.budgets import BudgetStore, Spend
from orchestrator.db.connections import connect, create_pool
from orchestrator.db.executor import Executor
from orchestrator.db.grants import RoleNames, apply_grants, plan_grants, quote_ident
from orchestrator.db.limits import LimitStore, RunningLimit
from orchestrator.db.migrations import _act_as_schema_owner, migrate
from orchestrator.db.purges import PurgeStore
from orchestrator.db.rates import RateLimitStore
from orchestrator.db.run_reads import RunReads
from orchestrator.db.signals import SignalStore
from orchestrator.db.store import RunStore
from orchestrator.effect_model import AcceptOutcome, Effect, EffectStatus
from orchestrator.effects.approvals import ApprovalStore, Decision
from orchestrator.effects.dispatcher import Dispatcher
from orchestrator.effects.http import HttpAdapter
from orchestrator.effects.store import EffectStore
from orchestrator.errors import OrchestratorError
from orchestrator.models import RunState
from orchestrator.settings import Settings
from orchestrator.testing import LocalVendor, running_worker, wait_for_run
from support import cli
from test_console import console as running_console
from test_proxy_scopes import bearer, request, serving
from test_waits import FAST, parked, refunds, replies

SCHEMA = "orchestrator"
PASSWORD = "correct horse battery staple"


def as_login(dsn: str, user: str) -> str:
    """``dsn`` with ``user`` and its password in place of the superuser."""
    parts = urlsplit(dsn)
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{user}:{PASSWORD.replace(' ', '%20')}@{host}"))


@dataclass
class Logins:
    """The granted group roles and, per kind, a login role that is a member of it."""

    admin_dsn: str
    roles: RoleNames
    logins: dict[str, str]
    pools: list[asyncpg.Pool] = field(default_factory=list)

    def dsn(self, kind: str) -> str:
        return as_login(self.admin_dsn, self.logins[kind])

    def settings(self, kind: str) -> Settings:
        return Settings(database_url=self.dsn(kind))

    async def pool(self, kind: str) -> asyncpg.Pool:
        pool = await create_pool(self.settings(kind), application_name=f"test-{kind}", max_size=4)
        self.pools.append(pool)
        assert await pool.fetchval("SELECT session_user") == self.logins[kind]
        return pool


async def grant(admin_dsn: str, roles: RoleNames) -> None:
    connection = await connect(Settings(database_url=admin_dsn))
    try:
        await apply_grants(connection, await plan_grants(connection, SCHEMA, roles))
    finally:
        await connection.close()


@pytest.fixture
async def logins(database_url: str) -> AsyncIterator[Logins]:
    suffix = uuid.uuid4().hex[:8]
    roles = RoleNames(*(f"orc_{kind}_{suffix}" for kind in RoleNames().by_kind()))
    names = {kind: f"login_{kind}_{suffix}" for kind in roles.by_kind()}
    await grant(database_url, roles)
    admin = await asyncpg.connect(database_url)
    try:
        for kind, login in names.items():
            await admin.execute(
                f"CREATE ROLE {quote_ident(login)} LOGIN PASSWORD '{PASSWORD}' "
                f"IN ROLE {quote_ident(getattr(roles, kind))}"
            )
    finally:
        await admin.close()
    found = Logins(database_url, roles, names)
    yield found
    for pool in found.pools:
        await pool.close()
    admin = await asyncpg.connect(database_url)
    try:
        everyone = [*names.values(), *roles.by_kind().values()]
        await admin.execute(f"DROP OWNED BY {', '.join(map(quote_ident, everyone))} CASCADE")
        for name in everyone:
            await admin.execute(f"DROP ROLE {quote_ident(name)}")
    finally:
        await admin.close()


async def refused(action: Callable[[], Awaitable[object]]) -> None:
    """``action`` fails because the role may not do it (SQLSTATE 42501), whatever layer wraps
    the driver's error."""
    with pytest.raises((asyncpg.PostgresError, OrchestratorError)) as caught:
        await action()
    error: BaseException | None = caught.value
    while error is not None and not isinstance(error, asyncpg.InsufficientPrivilegeError):
        error = error.__cause__
    assert error is not None, f"not refused for privilege: {caught.value!r}"


def refusing(db: Executor, statement: str, *args: Any) -> Callable[[], Awaitable[object]]:
    return lambda: db.execute(statement, *args)


async def claimed_run(store: RunStore, worker: RunStore, agent: str = "roles") -> Any:
    run_id = (await store.submit(agent, {"n": 1})).run.run_id
    [claimed] = (await worker.claim("w1", [agent], lease_seconds=30)).claimed
    assert claimed.run_id == run_id
    return claimed


async def awaiting_refund(console: RunStore, worker: RunStore, amount: int = 1) -> Any:
    """A run the worker claimed, holding a refund that awaits approval."""
    claimed = await claimed_run(console, worker)
    async with worker.pool.acquire() as db:
        effect = Effect("refund", "crm", {"amount": amount}, requires_approval=True)
        await EffectStore(worker.pool).accept(
            db, claimed.run_id, claimed.fence, effect, worker_id="w1"
        )
    return claimed


# -- the worker -----------------------------------------------------------------------------
async def test_a_worker_claims_commits_and_requests_effects(logins: Logins) -> None:
    console = RunStore(await logins.pool("console"))
    worker = RunStore(await logins.pool("worker"))
    claimed = await claimed_run(console, worker)
    lease = claimed.lease
    assert await worker.renew(lease, lease_seconds=30) is not None
    budgets = BudgetStore(worker.pool)
    reserved = await budgets.reserve(lease, Budget(turns=5), [1, 10, 10], Decimal("0.01"))
    assert reserved.outcome == "reserved"

    async def record(connection: Any, _: object) -> None:
        effect = Effect("refund", "crm", {"amount": 1}, requires_approval=True)
        answer = await EffectStore(worker.pool).accept(
            connection, lease.run_id, lease.fence, effect, worker_id="w1"
        )
        assert answer.outcome is AcceptOutcome.ACCEPTED
        await BudgetStore(connection).settle(
            [(lease.run_id, Spend(lease.fence, 1, 0, 5, 5, Decimal("0.001")))]
        )

    committed = await worker.commit_step(
        lease,
        expected_version=claimed.checkpoint_version,
        next_step="two",
        checkpoint={"at": "two"},
        in_transaction=record,
    )
    assert committed is not None
    assert await worker.finish(
        lease, expected_version=committed.checkpoint_version, result={"ok": True}
    )
    # Its chores run as the schema owner: approval expiry and a retention purge.
    assert await ApprovalStore(worker.pool).expire(limit=10) == 0
    purges = PurgeStore(worker.pool)
    assert (await purges.delete_batch(await purges.clock() - timedelta(days=1), 10)).runs == 0
    assert (await console.get(lease.run_id)).state is RunState.SUCCEEDED


async def test_workers_and_dispatchers_take_rate_limits_that_only_operators_set(
    logins: Logins,
) -> None:
    console = RunStore(await logins.pool("console"))
    worker_pool = await logins.pool("worker")
    claimed = await claimed_run(console, RunStore(worker_pool))
    operator = RateLimitStore(await logins.pool("client"))  # the login decides for itself
    await operator.set("model:m", requests=1, per_seconds=3600)
    await operator.set("effect:crm", requests=1, per_seconds=3600)
    assert [rate.name for rate in await operator.list()] == ["effect:crm", "model:m"]
    worker = RateLimitStore(worker_pool)
    assert await worker.limited("model:m")
    assert (await worker.take("model:m", run_id=claimed.run_id, fence=claimed.fence)).granted == 1
    waiting = await worker.take("model:m", run_id=claimed.run_id, fence=claimed.fence)
    assert waiting.granted == 0  # and the run's timeline says why
    await worker.settle("model:m", -5)
    await worker.pause("model:m", 1, "w1")
    await LimitStore(worker_pool).declare("roles", [RunningLimit(3)], "code of w1")
    dispatcher = RateLimitStore(await logins.pool("dispatcher"))
    assert await dispatcher.limited("effect:crm")
    assert (await dispatcher.take("effect:crm", 2)).granted == 1
    await dispatcher.pause("effect:crm", 1, "d1")
    [listed] = await RunReads(console.pool).list_runs()
    assert listed.held_back == "rate limit model:m"
    for kind in ("worker", "dispatcher", "proxy"):
        with pytest.raises(asyncpg.InsufficientPrivilegeError):
            await RateLimitStore(await logins.pool(kind)).set("model:m", requests=99)
    for kind in ("client", "console", "proxy"):
        with pytest.raises(asyncpg.InsufficientPrivilegeError):
            await RateLimitStore(await logins.pool(kind)).take("model:m")
        with pytest.raises(asyncpg.InsufficientPrivilegeError):
            await LimitStore(await logins.pool(kind)).declare("roles", [], "me")


async def test_a_worker_cannot_decide_rewrite_an_effect_or_move_a_fence(logins: Logins) -> None:
    console = RunStore(await logins.pool("console"))
    pool = await logins.pool("worker")
    worker = RunStore(pool)
    claimed = await claimed_run(console, worker)
    run_id, fence = claimed.run_id, claimed.fence
    async with pool.acquire() as db:
        effect = Effect("refund", "crm", {"amount": 1}, requires_approval=True)
        answer = await EffectStore(pool).accept(db, run_id, fence, effect, worker_id="w1")
        assert answer.outcome is AcceptOutcome.ACCEPTED
    record = await EffectStore(pool).get(run_id, "refund")

    await refused(
        lambda: ApprovalStore(pool).decide(
            run_id, "refund", Decision.APPROVED, payload_sha256=record.payload_sha256
        )
    )
    for statement in (
        "UPDATE effects SET status = 'accepted', approved_sha256 = payload_sha256 "
        "WHERE run_id = $1",
        "UPDATE effects SET payload = '{\"amount\": 1000}' WHERE run_id = $1",
        "UPDATE effect_fences SET fence = 0 WHERE run_id = $1",
        "UPDATE runs SET fence = fence - 1 WHERE run_id = $1",  # lower it
        "UPDATE runs SET fence = fence + 1 WHERE run_id = $1",  # raise it under a live lease
        "UPDATE runs SET fence = fence + 1, state = 'cancelled', lease_owner = NULL, "
        "lease_until = NULL WHERE run_id = $1",  # a cancel by hand
        "DELETE FROM runs WHERE run_id = $1",
        "DELETE FROM effects WHERE run_id = $1",
        "SELECT orchestrator_cancel_run($1, 'no', NULL, NULL, NULL)",
    ):
        await refused(refusing(pool, statement, run_id))
    await refused(lambda: worker.cancel(run_id))
    await refused(
        refusing(
            pool,
            "INSERT INTO runs (run_id, agent, input, fence) VALUES ($1, 'a', '{}', 9)",
            "r_forged",
        )
    )
    # Nothing moved: the owner sees the run and the effect as the claim and the rule left them.
    assert (await console.get(run_id)).fence == fence
    after = await EffectStore(pool).get(run_id, "refund")
    assert (after.status, after.payload, after.approved_sha256) == (
        EffectStatus.AWAITING_APPROVAL,
        {"amount": 1},
        None,
    )
    # Nor may the console end the lease, which would make the run claimable early.
    await refused(
        refusing(console.pool, "UPDATE runs SET lease_until = now() WHERE run_id = $1", run_id)
    )


async def test_a_worker_claims_onto_a_failover_floor_but_cannot_jump_there_by_hand(
    logins: Logins,
) -> None:
    """After a failover a claim jumps to the new epoch's first fence: the guard lets the worker
    role's claim through (by its function, since the fence moves by more than one) and still
    refuses the same jump by hand under a live lease."""
    admin = await asyncpg.connect(logins.admin_dsn)
    try:
        database = await admin.fetchval("SELECT current_database()")
        await admin.execute(
            f"ALTER DATABASE {quote_ident(database)} SET orchestrator.fence_epoch_offset = '1'"
        )
    finally:
        await admin.close()
    console = RunStore(await logins.pool("console"))  # new sessions: they see the epoch
    worker = RunStore(await logins.pool("worker"))
    claimed = await claimed_run(console, worker)
    assert claimed.fence == 1 << 40
    other = (await console.submit("roles", {})).run.run_id
    [live] = (await worker.claim("w2", ["roles"], lease_seconds=30)).claimed
    assert (live.run_id, live.fence) == (other, 1 << 40)
    async with worker.pool.acquire() as db:
        await db.execute("SET orchestrator.fence_epoch_offset = '2'")  # a session's: ignored
        assert await db.fetchval("SELECT fence_floor()") == 1 << 40
        await refused(
            refusing(db, "UPDATE runs SET fence = fence_floor() + 1 WHERE run_id = $1", other)
        )
    assert (await console.get(other)).fence == 1 << 40


# -- the console ------------------------------------------------------------------------------
async def test_the_console_reads_and_decides_but_cannot_claim(logins: Logins) -> None:
    pool = await logins.pool("console")
    console = RunStore(pool)
    worker = RunStore(await logins.pool("worker"))
    claimed = await awaiting_refund(console, worker)
    waiting = (await console.submit("roles", {"n": 2})).run.run_id
    await refused(lambda: console.claim("console", ["roles"]))
    await refused(lambda: console.claim_run("console", waiting))
    await refused(refusing(pool, "UPDATE runs SET lease_owner = 'me' WHERE run_id = $1", waiting))
    assert {run.run_id for run in await console.list_runs(limit=10)} == {claimed.run_id, waiting}
    assert (await console.get(claimed.run_id)).state is RunState.RUNNING
    record = await EffectStore(pool).get(claimed.run_id, "refund")
    decided = await ApprovalStore(pool).decide(
        claimed.run_id, "refund", Decision.APPROVED, payload_sha256=record.payload_sha256
    )
    assert decided.status is EffectStatus.ACCEPTED
    assert decided.decided_by == logins.logins["console"]
    await refused(
        refusing(
            pool, "UPDATE effects SET payload = '{\"amount\": 9}' WHERE run_id = $1", claimed.run_id
        )
    )
    cancelled = await console.cancel(waiting, reason="not needed")
    assert cancelled.state is RunState.CANCELLED
    # Accounts mode: an OpenID Connect sign-in adds the person; people and tokens stay the
    # admin's.
    people = AccessStore(pool)
    await people.sign_in("ana@example.com", Via.OIDC, role=Role.APPROVER)
    await refused(
        lambda: people.set_principal(
            "mallory", kind=PrincipalKind.PERSON, role=Role.ADMIN, actor=Actor("ana", Via.OIDC)
        )
    )
    await refused(lambda: people.create_token("ana@example.com", expires_in=None))
    audit = await pool.fetch("SELECT principal, db_user, action FROM audit_log ORDER BY seq")
    console_login = logins.logins["console"]
    assert [tuple(row) for row in audit] == [
        (console_login, console_login, "approve"),
        (console_login, console_login, "cancel"),
        ("ana@example.com", console_login, "principal_added"),
        ("ana@example.com", console_login, "sign_in"),
    ]


async def test_the_console_process_serves_its_pages_as_the_console_role(
    logins: Logins, tmp_path: Path
) -> None:
    """`orchestrator console` itself, connected as the console login: every page reads."""
    console = RunStore(await logins.pool("console"))
    worker = RunStore(await logins.pool("worker"))
    claimed = await awaiting_refund(console, worker)
    async with (
        running_console(logins.dsn("console"), tmp_path) as running,
        httpx.AsyncClient(base_url=running.url, timeout=30) as client,
    ):
        for path in ("/runs", f"/runs/{claimed.run_id}", "/attention", "/cluster", "/healthz"):
            page = await client.get(path)
            assert page.status_code == 200, (path, page.text[:500])


# -- the proxy and the dispatcher -------------------------------------------------------------
async def test_the_proxy_serves_scoped_tokens_but_reads_no_run_payloads(logins: Logins) -> None:
    """The real proxy app over the proxy role's pool: tokens a migrator login issued are
    authenticated, a run's agent is checked, the boundary's rule accepts and refuses; and the
    role cannot read what runs carry."""
    console = RunStore(await logins.pool("console"))
    worker = RunStore(await logins.pool("worker"))
    proxy = await logins.pool("proxy")
    admin = AccessStore(await logins.pool("migrator"))
    tokens = {}
    for name, agent in (("notes-bot", "notes"), ("billing", "payments")):
        await admin.set_principal(name, kind=PrincipalKind.SERVICE, role=Role.OPERATOR)
        scope = TokenScope.of(agents=[agent])
        tokens[agent] = bearer(
            (await admin.create_token(name, expires_in=None, scope=scope)).secret
        )
    claimed = await claimed_run(console, worker, agent="notes")
    run_id, fence = claimed.run_id, claimed.fence
    async with serving(proxy) as client:
        created = await client.post(
            "/v1/effects", json=request(run_id, fence), headers=tokens["notes"]
        )
        assert created.status_code == 201, created.text
        forged = await client.post(  # a fence no claim granted
            "/v1/effects", json=request(run_id, fence + 1), headers=tokens["notes"]
        )
        assert forged.status_code == 409, forged.text
        path = f"/v1/effects/{run_id}/charge-1"
        assert (await client.get(path, headers=tokens["payments"])).status_code == 403
        own = await client.get(path, headers=tokens["notes"])
        assert own.status_code == 200 and own.json()["effect"]["payload"] == {"amount": 40}
    for statement in (
        "SELECT input FROM runs",
        "SELECT checkpoint, result FROM runs",
        "SELECT body FROM run_messages",
        "SELECT data FROM run_signals",
        "SELECT * FROM run_budgets",
        "SELECT * FROM audit_log",
        "SELECT description FROM access_tokens",
        "UPDATE access_tokens SET revoked_at = NULL",
        "UPDATE effects SET payload = '{}' WHERE run_id = $1",
        "UPDATE effect_fences SET fence = fence + 1 WHERE run_id = $1",
    ):
        args = (run_id,) if "$1" in statement else ()
        await refused(refusing(proxy, statement, *args))
    await refused(lambda: RunStore(proxy).get(run_id))


async def test_the_dispatcher_sends_what_the_console_approved_for_a_worker(
    logins: Logins,
) -> None:
    """The whole path, each part as its own role: the console submits; the worker runs the
    step that requests an effect needing approval and parks; the console approves it; the
    dispatcher sends it and wakes the run; the worker finishes it."""
    console = RunStore(await logins.pool("console"))
    dispatcher_pool = await logins.pool("dispatcher")
    async with LocalVendor() as vendor:
        adapter = HttpAdapter(
            "crm", url=vendor.send_url, lookup_url=vendor.lookup_url, reconcile="lookup"
        )
        dispatcher = Dispatcher(dispatcher_pool, {"crm": adapter}, poll_seconds=0.1)
        async with anyio.create_task_group() as group:
            group.start_soon(dispatcher.run)
            async with running_worker(logins.settings("worker"), [refunds], **FAST):
                input = {"order": 1, "amount": 5, "approval": True}
                run_id = (await console.submit("refunds", input)).run.run_id
                await parked(console, run_id)
                record = await EffectStore(console.pool).get(run_id, "refund")
                await ApprovalStore(console.pool).decide(
                    run_id, "refund", Decision.APPROVED, payload_sha256=record.payload_sha256
                )
                run = await wait_for_run(console, run_id, within=60)
            group.cancel_scope.cancel()
    assert run.state is RunState.SUCCEEDED
    assert run.result == {"status": "confirmed", "error": None}
    assert vendor.requests == 1
    for statement in (
        "SELECT input FROM runs",
        "UPDATE effects SET payload = '{}' WHERE run_id = $1",
        "UPDATE effects SET approved_sha256 = payload_sha256 WHERE run_id = $1",
        "UPDATE runs SET fence = fence + 1 WHERE run_id = $1",
    ):
        args = (run_id,) if "$1" in statement else ()
        await refused(refusing(dispatcher_pool, statement, *args))


async def test_a_worker_consumes_the_signal_the_console_sent(logins: Logins) -> None:
    console = RunStore(await logins.pool("console"))
    async with running_worker(logins.settings("worker"), [replies], **FAST):
        run_id = (await console.submit("replies", {})).run.run_id
        await parked(console, run_id)
        await SignalStore(console.pool).send(run_id, "reply", {"text": "yes"})
        run = await wait_for_run(console, run_id, within=60)
    assert run.state is RunState.SUCCEEDED
    assert run.result is not None and run.result["replies"] == [{"text": "yes"}]


async def test_a_worker_spawns_children_and_a_client_cancels_the_tree(logins: Logins) -> None:
    from test_child_runs import AGENTS

    client = RunStore(await logins.pool("client"))
    async with running_worker(logins.settings("worker"), AGENTS, **FAST):
        run_id = (await client.submit("parent", {"children": 3})).run.run_id
        run = await wait_for_run(client, run_id, within=60)
    assert run.state is RunState.SUCCEEDED, run.error
    assert run.result is not None and run.result["sum"] == 6
    children = await client.list_runs(parent=run_id)
    assert len(children) == 3 and {c.state for c in children} == {RunState.SUCCEEDED}


async def test_a_worker_carves_its_children_s_budgets_from_its_own(logins: Logins) -> None:
    from test_child_budgets import root, spender

    client = RunStore(await logins.pool("client"))
    async with running_worker(logins.settings("worker"), [root, spender], **FAST):
        run_id = (await client.submit("root", {"children": 2, "each": 3})).run.run_id
        run = await wait_for_run(client, run_id, within=60)
    assert run.state is RunState.SUCCEEDED, run.error
    assert run.result == {"children_spent": 6, "root_could_spend_more": True}


async def test_a_client_forks_a_run_and_a_worker_may_not(logins: Logins) -> None:
    from orchestrator.db.forks import ForkStore

    client = RunStore(await logins.pool("client"))
    run_id = (await client.submit("unserved", {"x": 1})).run.run_id
    fork = await ForkStore(client.pool).fork(run_id, version=0)
    assert (await client.get(fork.run_id)).forked_from == run_id
    with pytest.raises(asyncpg.InsufficientPrivilegeError):
        await ForkStore(await logins.pool("worker")).fork(run_id, version=0)


# -- every role: the audit log; the grants themselves ---------------------------------------
async def test_no_role_can_change_or_remove_an_audit_row(logins: Logins) -> None:
    console = await logins.pool("console")
    run_id = (await RunStore(console).submit("roles", {})).run.run_id
    await RunStore(console).cancel(run_id)
    for kind in RoleNames().by_kind():
        pool = await logins.pool(kind)
        for statement in (
            "UPDATE audit_log SET principal = 'someone else'",
            "DELETE FROM audit_log",
            "TRUNCATE audit_log",
        ):
            with pytest.raises(asyncpg.PostgresError):
                await pool.execute(statement)
    rows = await console.fetch("SELECT principal FROM audit_log")
    assert [row["principal"] for row in rows] == [logins.logins["console"]]


async def privileges(admin_dsn: str, roles: RoleNames) -> list[tuple[Any, ...]]:
    """Every privilege the five granted roles hold in the schema, and who owns what."""
    connection = await asyncpg.connect(admin_dsn)
    try:
        names = [roles.worker, roles.dispatcher, roles.proxy, roles.console, roles.client]
        rows = await connection.fetch(
            """
            SELECT 'table', grantee, table_name, privilege_type, NULL FROM
                information_schema.role_table_grants
            WHERE table_schema = $1 AND grantee = ANY($2::text[])
            UNION ALL
            SELECT 'column', grantee, table_name, privilege_type, column_name FROM
                information_schema.column_privileges
            WHERE table_schema = $1 AND grantee = ANY($2::text[])
            UNION ALL
            SELECT 'routine', grantee, routine_name, privilege_type, NULL FROM
                information_schema.role_routine_grants
            WHERE routine_schema = $1 AND grantee = ANY($2::text[])
            UNION ALL
            SELECT 'owner', c.relowner::regrole::text, c.relname, NULL, NULL
            FROM pg_class AS c WHERE c.relnamespace = $1::regnamespace
            ORDER BY 1, 2, 3, 4, 5
            """,
            SCHEMA,
            names,
        )
    finally:
        await connection.close()
    return [tuple(row) for row in rows]


async def role_count(admin_dsn: str, roles: RoleNames) -> int:
    connection = await asyncpg.connect(admin_dsn)
    try:
        return int(
            await connection.fetchval(
                "SELECT count(*) FROM pg_roles WHERE rolname = ANY($1::text[])",
                list(roles.by_kind().values()),
            )
        )
    finally:
        await connection.close()


async def test_db_grant_is_idempotent_and_its_dry_run_changes_nothing(database_url: str) -> None:
    suffix = uuid.uuid4().hex[:8]
    roles = RoleNames(*(f"cli_{kind}_{suffix}" for kind in RoleNames().by_kind()))
    options = [f"--{kind}={name}" for kind, name in roles.by_kind().items()]
    try:
        dry = cli(database_url, "db", "grant", *options, "--dry-run")
        assert dry.returncode == 0, dry.stderr
        assert f'CREATE ROLE "{roles.worker}" NOLOGIN;' in dry.stdout
        assert f'GRANT SELECT ON "{SCHEMA}".effects TO "{roles.proxy}";' in dry.stdout
        assert await role_count(database_url, roles) == 0  # a dry run creates nothing
        first = cli(database_url, "db", "grant", *options, "--json")
        assert first.returncode == 0, first.stderr
        assert json.loads(first.stdout)["created"] == list(roles.by_kind().values())
        granted = await privileges(database_url, roles)
        again = cli(database_url, "db", "grant", *options, "--json")
        assert again.returncode == 0, again.stderr
        summary = json.loads(again.stdout)
        assert (summary["created"], summary["owner_changes"]) == ([], 0)
        assert await privileges(database_url, roles) == granted
        assert ("owner", roles.migrator, "runs", None, None) in granted
        assert ("column", roles.console, "runs", "UPDATE", "watched") in granted
        assert not [row for row in granted if row[1] == roles.worker and row[2] == "effect_fences"]
    finally:
        if await role_count(database_url, roles):
            admin = await asyncpg.connect(database_url)
            try:
                names = ", ".join(quote_ident(name) for name in roles.by_kind().values())
                await admin.execute(f"DROP OWNED BY {names} CASCADE")
                await admin.execute(f"DROP ROLE IF EXISTS {names}")
            finally:
                await admin.close()


async def test_db_grant_without_the_privilege_says_so_in_one_line(logins: Logins) -> None:
    result = cli(logins.dsn("worker"), "db", "grant", "--worker", "someone_new_" + "x")
    assert result.returncode != 0
    assert "db grant needs more privilege" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    names = [f"--{kind}={name}" for kind, name in logins.roles.by_kind().items()]
    existing = cli(logins.dsn("console"), "db", "grant", *names)
    assert existing.returncode != 0
    assert "db grant needs more privilege" in existing.stderr, existing.stderr


async def test_a_migrator_login_migrates_as_the_schema_owner(logins: Logins) -> None:
    """What a migration run by a member login creates belongs to the migrator role."""
    connection = await connect(logins.settings("migrator"))
    try:
        assert await migrate(connection) == []  # up to date: nothing refused on the way
        async with connection.transaction():
            await _act_as_schema_owner(connection, SCHEMA)
            assert await connection.fetchval("SELECT current_user") == logins.roles.migrator
            await connection.execute("CREATE TABLE made_by_a_migration (n int)")
            owner = await connection.fetchval(
                "SELECT relowner::regrole::text FROM pg_class WHERE relname = $1",
                "made_by_a_migration",
            )
            assert owner == logins.roles.migrator
            await connection.execute("DROP TABLE made_by_a_migration")
        assert await connection.fetchval("SELECT current_user") == logins.logins["migrator"]
    finally:
        await connection.close()


async def test_db_grant_refuses_one_role_for_two_kinds(database_url: str) -> None:
    result = cli(database_url, "db", "grant", "--worker", "same", "--console", "same")
    assert result.returncode != 0
    assert "six different names" in result.stderr


async def test_a_cli_decision_as_a_migrator_login_records_that_login(logins: Logins) -> None:
    console = RunStore(await logins.pool("console"))
    worker = RunStore(await logins.pool("worker"))
    claimed = await awaiting_refund(console, worker, amount=3)
    record = await EffectStore(console.pool).get(claimed.run_id, "refund")
    result = cli(
        logins.dsn("migrator"),
        "approvals",
        "approve",
        claimed.run_id,
        "refund",
        "--hash",
        record.payload_sha256 or "",
        "--by",
        "typed name",
    )
    assert result.returncode == 0, result.stderr
    [row] = await console.pool.fetch("SELECT principal, db_user, via, action FROM audit_log")
    migrator = logins.logins["migrator"]
    assert tuple(row) == (migrator, migrator, "database-role", "approve")
