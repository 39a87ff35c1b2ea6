"""Who may do what: roles, the permissions each grants, the principal behind an action, and what
a scoped service token may request. Pure values; the database side is ``orchestrator.db.access``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from enum import StrEnum
from typing import Any

from orchestrator.errors import InvalidInput
from orchestrator.storable import check_text


class Role(StrEnum):
    VIEWER = "viewer"
    APPROVER = "approver"
    OPERATOR = "operator"
    ADMIN = "admin"


class Permission(StrEnum):
    READ = "read"
    SEE_PAYLOADS = "see_payloads"
    DECIDE = "decide"
    OPERATE = "operate"
    ADMINISTER = "administer"


_GRANTS: dict[Role, frozenset[Permission]] = {
    Role.VIEWER: frozenset({Permission.READ}),
    Role.APPROVER: frozenset({Permission.READ, Permission.DECIDE}),
    Role.OPERATOR: frozenset({Permission.READ, Permission.OPERATE, Permission.SEE_PAYLOADS}),
    Role.ADMIN: frozenset(Permission),
}


def allows(role: Role, permission: Permission) -> bool:
    """Whether ``role`` grants ``permission`` (approvers see only the payloads awaiting their
    decision, which the caller checks: that is not ``SEE_PAYLOADS``)."""
    return permission in _GRANTS[role]


class Via(StrEnum):
    """How the principal of an action was established."""

    OIDC = "oidc"
    PROXY_HEADER = "proxy-header"
    TOKEN = "token"
    SHARED_TOKEN = "shared-token"
    DATABASE_ROLE = "database-role"


class PrincipalKind(StrEnum):
    PERSON = "person"
    SERVICE = "service"


PRINCIPAL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@+-]{0,199}")


def check_principal_name(name: str) -> str:
    """``name`` if it can name a principal: 1-200 letters, digits and ``. _ @ + -``, and not
    ``shared-token`` (what the audit trail calls the console's shared token)."""
    if not PRINCIPAL_NAME.fullmatch(name):
        raise InvalidInput(
            f"{name!r} cannot name a principal: use 1-200 letters, digits and . _ @ + - "
            "(starting with a letter or digit), such as alice@example.com or billing-service"
        )
    if name == SHARED_TOKEN_PRINCIPAL:
        raise InvalidInput(
            f"{name!r} is reserved: the audit trail records the console's shared token under it"
        )
    return name


@dataclass(frozen=True)
class Principal:
    name: str
    kind: PrincipalKind
    role: Role

    def may(self, permission: Permission) -> bool:
        return allows(self.role, permission)


@dataclass(frozen=True)
class Actor:
    """Who did an action and how the server knows: what the audit trail and timeline record.
    ``principal`` None: the database role that connected (``session_user``), which is what a
    command run straight against the database proves. ``note`` is what the person typed (a
    name, a ticket): kept beside the principal, never trusted as one."""

    principal: str | None
    via: Via
    note: str | None = None

    @classmethod
    def acting(cls, actor: Actor | None, typed_by: str | None) -> Actor:
        """``actor`` (or the connected database role) with ``typed_by`` as its note."""
        if typed_by is not None:
            check_text(typed_by, "--by")
            if not 1 <= len(typed_by) <= 200:
                raise InvalidInput(
                    "--by must name who decides, in 1-200 characters (it is kept as a note; "
                    "the principal recorded is who the server authenticated)"
                )
        if actor is None:
            return cls(None, Via.DATABASE_ROLE, typed_by)
        return actor if typed_by is None else cls(actor.principal, actor.via, typed_by)


SHARED_TOKEN_PRINCIPAL = "shared-token"
"""The principal of the console's shared-token mode: whoever holds the one token."""


MAX_SCOPE_ITEMS = 100


@dataclass(frozen=True)
class TokenScope:
    """What a service token may ask the action proxy for. ``None`` in a field: no limit there.
    ``max_amount`` bounds the number at the payload's top-level ``amount_field``."""

    agents: frozenset[str] | None = None
    kinds: frozenset[str] | None = None
    amount_field: str | None = None
    max_amount: Decimal | None = None

    def __post_init__(self) -> None:
        for what, names in (("agents", self.agents), ("kinds", self.kinds)):
            if names is not None:
                if not names or len(names) > MAX_SCOPE_ITEMS:
                    raise InvalidInput(
                        f"a token's {what} must name 1-{MAX_SCOPE_ITEMS}; leave it out for any"
                    )
                for name in names:
                    check_text(name, f"a token's {what}")
                    if not 1 <= len(name) <= 200:
                        raise InvalidInput(f"a token's {what} must be 1-200 characters each")
        if (self.amount_field is None) != (self.max_amount is None):
            raise InvalidInput("a maximum amount needs both the payload field and the maximum")
        if self.amount_field is not None:
            check_text(self.amount_field, "the amount field")
            if not 1 <= len(self.amount_field) <= 200:
                raise InvalidInput("the amount field must be 1-200 characters")
        if self.max_amount is not None and (not self.max_amount.is_finite() or self.max_amount < 0):
            raise InvalidInput("the maximum amount must be a finite number of at least 0")

    @classmethod
    def of(
        cls,
        *,
        agents: Iterable[str] | None = None,
        kinds: Iterable[str] | None = None,
        amount_field: str | None = None,
        max_amount: str | float | Decimal | None = None,
    ) -> TokenScope:
        return cls(
            agents=None if agents is None else frozenset(agents),
            kinds=None if kinds is None else frozenset(kinds),
            amount_field=amount_field,
            max_amount=None if max_amount is None else _decimal(max_amount, "the maximum amount"),
        )

    @property
    def unlimited(self) -> bool:
        return self.agents is None and self.kinds is None and self.amount_field is None

    def refusal(self, *, agent: str, kind: str, payload: Any) -> str | None:
        """Why this scope does not cover the request (one sentence), or None when it does."""
        if self.agents is not None and agent not in self.agents:
            return (
                f"this token may request effects for agents {_listed(self.agents)} only, "
                f"not for agent {agent!r}"
            )
        if self.kinds is not None and kind not in self.kinds:
            return f"this token may request effect kinds {_listed(self.kinds)} only, not {kind!r}"
        if self.amount_field is None or self.max_amount is None:
            return None
        value = payload.get(self.amount_field) if isinstance(payload, Mapping) else None
        if isinstance(value, bool) or not isinstance(value, int | float | str):
            return (
                f"this token's requests must carry a number at the payload's "
                f"{self.amount_field!r} (at most {self.max_amount})"
            )
        try:
            amount = _decimal(value, "amount")
        except InvalidInput:
            return f"the payload's {self.amount_field!r} is not a finite number"
        if amount > self.max_amount:
            return (
                f"the payload's {self.amount_field!r} is {value}, above this token's maximum "
                f"of {self.max_amount}"
            )
        return None

    def as_json(self) -> dict[str, Any] | None:
        if self.unlimited:
            return None
        return {
            "agents": None if self.agents is None else sorted(self.agents),
            "kinds": None if self.kinds is None else sorted(self.kinds),
            "amount_field": self.amount_field,
            "max_amount": None if self.max_amount is None else str(self.max_amount),
        }

    @classmethod
    def from_json(cls, document: Mapping[str, Any] | None) -> TokenScope:
        if document is None:
            return cls()
        return cls.of(
            agents=document.get("agents"),
            kinds=document.get("kinds"),
            amount_field=document.get("amount_field"),
            max_amount=document.get("max_amount"),
        )


def _decimal(value: str | float | Decimal, what: str) -> Decimal:
    if isinstance(value, float) and not math.isfinite(value):
        raise InvalidInput(f"{what} must be a finite number")
    try:
        number = Decimal(str(value))
    except InvalidOperation:
        raise InvalidInput(f"{what} must be a number, not {value!r}") from None
    if not number.is_finite():
        raise InvalidInput(f"{what} must be a finite number")
    return number


def _listed(names: frozenset[str]) -> str:
    return ", ".join(repr(name) for name in sorted(names))
