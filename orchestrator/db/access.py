"""People, services and their tokens in the database: who a presented token belongs to, and the
admin operations on principals and tokens (each audited in its own transaction)."""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import asyncpg

from orchestrator.access import (
    Actor,
    Principal,
    PrincipalKind,
    Role,
    TokenScope,
    Via,
    check_principal_name,
)
from orchestrator.db.audit import AuditStore, decision_span
from orchestrator.db.executor import Executor
from orchestrator.db.queries import query
from orchestrator.errors import InvalidInput, OrchestratorError
from orchestrator.models import Row, from_row, json_fields
from orchestrator.storable import check_text

TOKEN_PREFIX = "orc_"
MAX_TOKEN_SECONDS = 10 * 365 * 24 * 3600


class PrincipalNotFound(OrchestratorError):
    """No principal by that name (or it is disabled, where that matters)."""


class TokenNotFound(OrchestratorError):
    """No token by that id."""


_SIGN_IN_REFUSALS = (asyncpg.InsufficientPrivilegeError, asyncpg.InvalidParameterValueError)
"""How orchestrator_sign_in says no: not a person it may sign in, or not a name one can have."""


class SignInRefused(OrchestratorError):
    """The database would not sign this principal in: the message says why, the hint (if any)
    what to do instead."""

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.hint = hint


@dataclass(frozen=True)
class Authenticated:
    """The owner of a working token, and what the token may request of the action proxy."""

    principal: Principal
    token_id: str
    scope: TokenScope


@dataclass(frozen=True)
class PrincipalEntry:
    principal: Principal
    created_at: datetime
    created_by: str
    disabled_at: datetime | None
    live_tokens: int | None = None

    def as_json(self) -> dict[str, Any]:
        return {
            "name": self.principal.name,
            "kind": self.principal.kind.value,
            "role": self.principal.role.value,
            "created_at": self.created_at.isoformat(),
            "created_by": self.created_by,
            "disabled_at": None if self.disabled_at is None else self.disabled_at.isoformat(),
            "live_tokens": self.live_tokens,
        }


@dataclass(frozen=True)
class TokenEntry:
    """A token as listed: never its secret, never its hash."""

    token_id: str
    principal: str
    description: str | None
    scope: TokenScope
    created_at: datetime
    created_by: str
    expires_at: datetime | None
    revoked_at: datetime | None
    revoked_by: str | None
    last_used_at: datetime | None

    def as_json(self) -> dict[str, Any]:
        return json_fields(self, scope=self.scope.as_json())


@dataclass(frozen=True)
class IssuedToken:
    """A new token: ``secret`` is the whole token, shown once and stored only as its hash."""

    entry: TokenEntry
    secret: str

    def __repr__(self) -> str:  # never the secret, should the object reach a log
        return f"IssuedToken(token_id={self.entry.token_id!r}, principal={self.entry.principal!r})"


def token_sha256(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


def new_token() -> tuple[str, str]:
    """(token id, whole token). The id is public (listed, revoked by); the rest is 256 bits."""
    token_id = "".join(secrets.choice("abcdefghijklmnopqrstuvwxyz0123456789") for _ in range(12))
    return token_id, f"{TOKEN_PREFIX}{token_id}_{secrets.token_urlsafe(32)}"


def looks_like_token(value: str) -> bool:
    return value.startswith(TOKEN_PREFIX) and len(value) < 200


class AccessStore:
    """Principals and tokens. Admin operations take the ``actor`` the caller authenticated
    (None: the database role that connected) and append to the audit trail in their own
    transaction."""

    def __init__(self, pool: asyncpg.Pool) -> None:
        self.pool = pool

    async def entry(self, name: str) -> PrincipalEntry | None:
        """``name``'s record, disabled or not."""
        row = await self.pool.fetchrow(query("get_principal"), name)
        return None if row is None else _principal_entry(row)

    async def principal(self, name: str) -> Principal | None:
        row = await self.pool.fetchrow(query("get_principal"), name)
        if row is None or row["disabled_at"] is not None:
            return None
        return _principal(row)

    async def session_principal(self, name: str, token_id: str | None) -> Principal | None:
        """``name`` while enabled and, when it signed in with a token, while that token works."""
        row = await self.pool.fetchrow(query("principal_of_session"), name, token_id)
        return None if row is None else _principal(row)

    async def principals(self) -> list[PrincipalEntry]:
        return [
            _principal_entry(row, live_tokens=int(row["live_tokens"]))
            for row in await self.pool.fetch(query("list_principals"))
        ]

    async def set_principal(
        self, name: str, *, kind: PrincipalKind, role: Role, actor: Actor | None = None
    ) -> PrincipalEntry:
        """Add ``name`` or change its kind and role."""
        check_principal_name(name)
        async with self.pool.acquire() as db, db.transaction():
            return await _set_principal(db, name, kind, role, actor)

    async def disable(self, name: str, *, actor: Actor | None = None) -> PrincipalEntry:
        """Disable ``name``: its tokens stop working at once."""
        async with self.pool.acquire() as db, db.transaction():
            row = await db.fetchrow(query("disable_principal"), name)
            if row is None:
                raise PrincipalNotFound(
                    f"no principal named {name!r}: see `orchestrator users list`"
                )
            await AuditStore(db).append(actor, "principal_disabled", detail={"name": name}, db=db)
        return _principal_entry(row)

    async def create_token(
        self,
        principal: str,
        *,
        expires_in: float | None,
        scope: TokenScope | None = None,
        description: str | None = None,
        actor: Actor | None = None,
        add_as: tuple[PrincipalKind, Role] | None = None,
    ) -> IssuedToken:
        """A new token for ``principal``; its secret exists only in the answer. ``add_as``: add
        a missing principal with this kind and role in the same transaction, so a refused token
        leaves no principal behind."""
        if expires_in is not None and not 60 <= expires_in <= MAX_TOKEN_SECONDS:
            raise InvalidInput(
                "a token's lifetime must be between 1 minute and 10 years (or never expire)"
            )
        if description is not None:
            check_text(description, "the token's description")
            if len(description) > 500:
                raise InvalidInput("the token's description must be at most 500 characters")
        scope = scope or TokenScope()
        token_id, secret = new_token()
        if add_as is not None:
            check_principal_name(principal)
        async with self.pool.acquire() as db, db.transaction():
            if add_as is not None and await db.fetchrow(query("get_principal"), principal) is None:
                await _set_principal(db, principal, *add_as, actor)
            row = await db.fetchrow(
                query("create_token"),
                token_id,
                principal,
                token_sha256(secret),
                description,
                scope.as_json(),
                expires_in,
                _who(actor),
            )
            if row is None:
                raise PrincipalNotFound(
                    f"no enabled principal named {principal!r}: add it first with "
                    "`orchestrator users add NAME --role ROLE`"
                )
            entry = _token_entry(row)
            await AuditStore(db).append(
                actor,
                "token_created",
                detail={
                    "token_id": token_id,
                    "principal": principal,
                    "expires_at": None
                    if entry.expires_at is None
                    else entry.expires_at.isoformat(),
                    "scope": scope.as_json(),
                },
                db=db,
            )
        return IssuedToken(entry, secret)

    async def revoke_token(self, token_id: str, *, actor: Actor | None = None) -> TokenEntry:
        async with self.pool.acquire() as db, db.transaction():
            row = await db.fetchrow(query("revoke_token"), token_id, _who(actor))
            if row is None:
                raise TokenNotFound(
                    f"no token {token_id!r}: `orchestrator users token list` shows the ids"
                )
            if row["revoked_now"]:
                await AuditStore(db).append(
                    actor,
                    "token_revoked",
                    detail={"token_id": token_id, "principal": row["principal"]},
                    db=db,
                )
        return _token_entry(row)

    async def service_tokens_exist(self) -> bool:
        """Whether an enabled service holds a working token (read with only what the proxy's
        role may read): without one, and without flat tokens, nobody could use the proxy."""
        return bool(await self.pool.fetchval(query("service_tokens_exist")))

    async def tokens(self, principal: str | None = None) -> list[TokenEntry]:
        return [_token_entry(row) for row in await self.pool.fetch(query("list_tokens"), principal)]

    async def sign_in(
        self, name: str, via: Via, *, token_id: str | None = None, role: Role | None = None
    ) -> Principal:
        """A console sign-in of ``name`` and its audit row (and, with ``role``, an OpenID Connect
        group mapping's add or role change first), decided by the database: never an admin,
        never a disabled person or a service. ``SignInRefused`` says why not."""
        if role is not None:  # the sign-in may add them: a name a principal can have
            check_principal_name(name)
        with decision_span("sign_in", Actor(name, via)) as recorded:
            try:
                row = await self.pool.fetchrow(
                    query("sign_in"),
                    name,
                    via.value,
                    token_id,
                    None if role is None else role.value,
                )
            except (
                asyncpg.InsufficientPrivilegeError,
                asyncpg.InvalidParameterValueError,
            ) as error:
                raise SignInRefused(error.message, error.hint) from None
            assert row is not None
            recorded(row["name"], int(row["audit_seq"]))
        return _principal(row)

    async def authenticate(self, token: str) -> Authenticated | None:
        """The owner of ``token`` if it is a working token (not revoked or expired, its owner
        enabled), else None."""
        if not looks_like_token(token):
            return None
        row = await self.pool.fetchrow(query("authenticate_token"), token_sha256(token))
        if row is None:
            return None
        return Authenticated(
            principal=Principal(row["name"], PrincipalKind(row["kind"]), Role(row["role"])),
            token_id=row["token_id"],
            scope=_scope(row["scope"]),
        )


async def _set_principal(
    db: Executor, name: str, kind: PrincipalKind, role: Role, actor: Actor | None
) -> PrincipalEntry:
    row = await db.fetchrow(query("set_principal"), name, kind.value, role.value, _who(actor))
    assert row is not None
    if row["changed"]:  # adding a principal again as it is changes nothing: no audit row
        await AuditStore(db).append(
            actor,
            "principal_added" if row["created"] else "principal_changed",
            detail={"name": name, "kind": kind.value, "role": role.value},
            db=db,
        )
    return _principal_entry(row)


def _who(actor: Actor | None) -> str | None:
    """Who a row's ``created_by``/``revoked_by`` names; None: the statement takes the role that
    connected (session_user)."""
    return None if actor is None else actor.principal


def _scope(document: Mapping[str, Any] | None) -> TokenScope:
    return TokenScope.from_json(document)


def _principal(row: Row) -> Principal:
    return Principal(row["name"], PrincipalKind(row["kind"]), Role(row["role"]))


def _principal_entry(row: Row, live_tokens: int | None = None) -> PrincipalEntry:
    return PrincipalEntry(
        _principal(row), row["created_at"], row["created_by"], row["disabled_at"], live_tokens
    )


def _token_entry(row: Row) -> TokenEntry:
    return from_row(TokenEntry, row, scope=_scope(row["scope"]))
