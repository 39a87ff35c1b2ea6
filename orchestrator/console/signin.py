"""Signing a person in, in accounts mode: whom a personal token or an OpenID Connect sign-in
names, the role the provider's groups give, and the session with its audit row."""

from __future__ import annotations

from starlette.requests import Request

from orchestrator.access import Principal, PrincipalKind, Role, Via
from orchestrator.console.identity import NotAllowed, not_a_user, start_session
from orchestrator.console.oidc import OidcSignIn
from orchestrator.db.access import AccessStore, SignInRefused


class AccountSignIn:
    def __init__(self, people: AccessStore, oidc: OidcSignIn | None) -> None:
        self.people = people
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

    async def with_oidc(self, request: Request) -> tuple[str, Role | None]:
        """The person the provider vouches for, and, with ``--oidc-group``, the role the
        provider's groups give them (the sign-in then adds them or changes their role)."""
        assert self.oidc is not None
        name, claims = await self.oidc.signed_in(request)
        if not self.oidc.config.group_roles:
            return name, None
        role = self.oidc.config.role_of(claims)
        if role is None:
            raise NotAllowed(
                403,
                f"{name} is in none of the groups this console gives a role to (--oidc-group)",
            )
        return name, role

    async def begin(
        self,
        request: Request,
        name: str,
        via: Via,
        *,
        token_id: str | None = None,
        role: Role | None = None,
    ) -> Principal:
        """Sign ``name`` in: the database checks them and records the sign-in (and a group
        mapping's add or role change) in the audit trail; then the browser session starts."""
        try:
            principal = await self.people.sign_in(name, via, token_id=token_id, role=role)
        except SignInRefused as refused:
            if refused.hint is None:  # unknown, disabled, a service, or a token not theirs
                raise not_a_user(name) from None
            raise NotAllowed(403, f"refused: {refused}: {refused.hint}; nothing changed") from None
        start_session(request, principal, via, token_id)
        return principal
