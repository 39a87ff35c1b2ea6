"""Signing a person in, in accounts mode: whom a personal token or an OpenID Connect sign-in
names, the role the provider's groups give, and the session with its audit row."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request

from orchestrator.access import Actor, Principal, PrincipalKind, Via
from orchestrator.db.access import AccessStore
from orchestrator.db.audit import AuditStore

from .identity import NotAllowed, not_a_user, start_session
from .oidc import OidcSignIn


class AccountSignIn:
    def __init__(self, people: AccessStore, audit: AuditStore, oidc: OidcSignIn | None) -> None:
        self.people = people
        self.audit = audit
        self.oidc = oidc

    async def with_token(self, secret: str) -> tuple[Principal, str]:
        """The person a personal token (``orchestrator users token create``) names, and the
        token's id: the session lasts while that token works."""
        found = await self.people.authenticate(secret)
        if found is None:
            raise NotAllowed(403, "unknown, revoked or expired token: nothing changed")
        if found.principal.kind is not PrincipalKind.PERSON:
            raise NotAllowed(403, "a service's token cannot sign in to the console: use your own")
        return found.principal, found.token_id

    async def with_oidc(self, request: Request) -> Principal:
        """The person the provider vouches for: one of ``orchestrator users``, or, with
        ``--oidc-group``, whoever the provider's groups give a role."""
        assert self.oidc is not None
        name, claims = await self.oidc.signed_in(request)
        principal = await self.people.principal(name)
        if self.oidc.config.group_roles:
            principal = await self._role_from_groups(name, claims)
        if principal is None or principal.kind is not PrincipalKind.PERSON:
            raise not_a_user(name)
        return principal

    async def begin(
        self, request: Request, principal: Principal, via: Via, token_id: str | None
    ) -> None:
        start_session(request, principal, via, token_id)
        await self.audit.append(
            Actor(principal.name, via),
            "sign_in",
            detail={"role": principal.role.value, "token_id": token_id},
        )

    async def _role_from_groups(self, name: str, claims: dict[str, Any]) -> Principal:
        """The provider's groups decide the role: the person is added or their role changed
        (audited as done by their own sign-in); one an admin disabled stays out."""
        assert self.oidc is not None
        role = self.oidc.config.role_of(claims)
        if role is None:
            raise NotAllowed(
                403,
                f"{name} is in none of the groups this console gives a role to (--oidc-group)",
            )
        known = await self.people.entry(name)
        if known is not None and (
            known.disabled_at is not None or known.principal.kind is not PrincipalKind.PERSON
        ):
            raise not_a_user(name)
        if known is not None and known.principal.role is role:
            return known.principal
        entry = await self.people.set_principal(
            name, kind=PrincipalKind.PERSON, role=role, actor=Actor(name, Via.OIDC)
        )
        return entry.principal
