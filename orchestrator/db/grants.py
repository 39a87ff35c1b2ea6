"""Least-privilege roles: what ``orchestrator db grant`` plans and runs (docs/database-roles.md).

Six roles, names configurable: the migrator owns the schema (and so runs migrations and the
SECURITY DEFINER functions); the worker, dispatcher, proxy, console and client get only what
``sql/grants.sql`` grants them. Missing roles are created as NOLOGIN group roles: a DBA makes
login roles members of them, so passwords and login policy stay the DBA's. A plan is computed
from the catalog (which roles exist, which objects another role owns) and is plain SQL, so
``--dry-run`` can print exactly what a run would execute.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields
from functools import cache
from importlib import resources

import asyncpg

from orchestrator.db.executor import Executor
from orchestrator.errors import InvalidInput

_ROLE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.@-]{0,62}$")
_RESERVED = {"public", "none", "current_user", "session_user", "current_role", "all"}


def quote_ident(name: str) -> str:
    """``name`` as a PostgreSQL identifier, always quoted (so any name is exactly itself)."""
    return '"' + name.replace('"', '""') + '"'


@dataclass(frozen=True)
class RoleNames:
    """The six roles by kind; the defaults are what the docs' examples use. ``client`` comes
    last, so that code naming the first five by position keeps working."""

    worker: str = "orchestrator_worker"
    dispatcher: str = "orchestrator_dispatcher"
    proxy: str = "orchestrator_proxy"
    console: str = "orchestrator_console"
    migrator: str = "orchestrator_migrator"
    client: str = "orchestrator_client"

    def by_kind(self) -> dict[str, str]:
        """Kind -> name, in the order the docs' matrix lists them."""
        return {field.name: getattr(self, field.name) for field in fields(self)}

    def check(self) -> None:
        """Refuse names PostgreSQL reserves or that two kinds share: one role holding two
        kinds' grants would hold their union, which is what the split exists to prevent."""
        names = self.by_kind()
        for kind, name in names.items():
            if not _ROLE_NAME.match(name) or name.lower().startswith("pg_"):
                raise InvalidInput(
                    f"--{kind} {name!r} is not a usable role name: 1-63 letters, digits or "
                    "_.@- starting with a letter or _, not starting with pg_"
                )
            if name.lower() in _RESERVED:
                raise InvalidInput(f"--{kind} {name!r} is a name PostgreSQL reserves")
        if len(set(names.values())) != len(names):
            raise InvalidInput(
                "the six roles need six different names (one role holding two kinds' "
                f"grants would hold both): {', '.join(f'{k}={v}' for k, v in names.items())}"
            )


@dataclass(frozen=True)
class GrantPlan:
    """Statements in the order they run (one transaction), and what they change."""

    schema: str
    roles: RoleNames
    created: list[str]
    """Roles that do not exist yet, created NOLOGIN."""
    owner_changes: list[str]
    """Objects of the schema (and the schema) that the migrator role does not own yet."""
    statements: list[str]

    def sql(self) -> str:
        """The plan as one script a DBA can review and run with psql (``--dry-run``)."""
        return "\n".join(statement.rstrip().rstrip(";") + ";" for statement in self.statements)

    def summary(self) -> dict[str, object]:
        """What ``--json`` prints: enough to see whether a rerun changed anything."""
        return {
            "schema": self.schema,
            "roles": self.roles.by_kind(),
            "created": self.created,
            "owner_changes": len(self.owner_changes),
            "statements": len(self.statements),
        }


@cache
def _template() -> str:
    """``sql/grants.sql``, read once: the grants live in SQL, where a DBA reads them."""
    return resources.files("orchestrator.sql").joinpath("grants.sql").read_text("utf-8")


def render_grants(schema: str, roles: RoleNames) -> str:
    """``sql/grants.sql`` with every name a quoted identifier (never spliced unquoted)."""
    names = {kind: quote_ident(name) for kind, name in roles.by_kind().items()}
    return _template().format_map({"schema": quote_ident(schema), **names})


_OWNED_ELSEWHERE = """
WITH target AS (SELECT coalesce((SELECT oid FROM pg_roles WHERE rolname = $2), 0) AS oid)
SELECT format('ALTER SCHEMA %I OWNER TO %I', n.nspname, $2::text)
FROM pg_namespace AS n WHERE n.nspname = $1 AND n.nspowner <> (SELECT oid FROM target)
UNION ALL
SELECT format('ALTER TABLE %I.%I OWNER TO %I', n.nspname, c.relname, $2::text)
FROM pg_class AS c JOIN pg_namespace AS n ON n.oid = c.relnamespace
WHERE n.nspname = $1 AND c.relkind IN ('r', 'p') AND c.relowner <> (SELECT oid FROM target)
UNION ALL
SELECT format('ALTER SEQUENCE %I.%I OWNER TO %I', n.nspname, c.relname, $2::text)
FROM pg_class AS c JOIN pg_namespace AS n ON n.oid = c.relnamespace
WHERE n.nspname = $1 AND c.relkind = 'S' AND c.relowner <> (SELECT oid FROM target)
  AND NOT EXISTS (SELECT 1 FROM pg_depend AS d
                  WHERE d.classid = 'pg_class'::regclass AND d.objid = c.oid
                    AND d.deptype IN ('a', 'i'))
UNION ALL
SELECT format('ALTER FUNCTION %I.%I(%s) OWNER TO %I', n.nspname, p.proname,
              pg_get_function_identity_arguments(p.oid), $2::text)
FROM pg_proc AS p JOIN pg_namespace AS n ON n.oid = p.pronamespace
WHERE n.nspname = $1 AND p.proowner <> (SELECT oid FROM target)
"""
"""The schema $1 and each of its objects not owned by role $2 (identity sequences follow their
table), as the statements that give them to $2."""


async def plan_grants(db: Executor, schema: str, roles: RoleNames) -> GrantPlan:
    """The statements that bring ``schema`` to the role matrix, computed from the catalog."""
    roles.check()
    if not await db.fetchval("SELECT 1 FROM pg_namespace WHERE nspname = $1", schema):
        raise InvalidInput(
            f"there is no schema {schema!r} in this database: run `orchestrator db migrate` "
            "first (db grant grants on the objects the migrations made)"
        )
    existing = {
        row["rolname"]
        for row in await db.fetch(
            "SELECT rolname FROM pg_roles WHERE rolname = ANY($1::text[])",
            list(roles.by_kind().values()),
        )
    }
    created = [name for name in roles.by_kind().values() if name not in existing]
    statements = [f"CREATE ROLE {quote_ident(name)} NOLOGIN" for name in created]
    owner_changes = [row[0] for row in await db.fetch(_OWNED_ELSEWHERE, schema, roles.migrator)]
    if not await _may_give_to(db, roles.migrator, roles.migrator in existing):
        if not owner_changes:
            # A non-owner's GRANT and REVOKE are mere warnings in PostgreSQL: refuse instead of
            # reporting grants that did not happen.
            raise InvalidInput(
                "db grant needs more privilege than this role has: run it as a superuser or as "
                f"a member of {roles.migrator!r}, the schema's owner"
            )
        # Giving an object to a role takes membership in it (superusers aside): the DBA who
        # runs this becomes a member of the owner, as an administrator of the schema should.
        statements.append(f"GRANT {quote_ident(roles.migrator)} TO CURRENT_USER")
    statements += owner_changes
    statements.append(render_grants(schema, roles))
    return GrantPlan(schema, roles, created, owner_changes, statements)


async def _may_give_to(db: Executor, role: str, exists: bool) -> bool:
    """Whether the current role may make ``role`` an owner: a superuser, or a member of it."""
    if await db.fetchval("SELECT rolsuper FROM pg_roles WHERE rolname = current_user"):
        return True
    return exists and bool(
        await db.fetchval("SELECT pg_has_role(current_user, $1, 'MEMBER')", role)
    )


async def apply_grants(connection: asyncpg.Connection, plan: GrantPlan) -> None:
    """Run ``plan`` in one transaction; a refusal (not a superuser or CREATEROLE, not the
    owner) becomes one line that says what the role running it lacks."""
    try:
        async with connection.transaction():
            for statement in plan.statements:
                await connection.execute(statement)
    except asyncpg.InsufficientPrivilegeError as error:
        who = await connection.fetchval("SELECT current_user")
        raise InvalidInput(
            f"db grant needs more privilege than role {who!r} has ({error}): run it as a "
            "superuser, or as a role with CREATEROLE that owns the schema's objects and is a "
            f"member of {plan.roles.migrator!r}"
        ) from error
