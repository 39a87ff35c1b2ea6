"""Who is asking, in accounts mode: a person signed in as themselves (a browser session made by a
personal token or OpenID Connect), an API client with its own token, or a trusted reverse proxy
vouching for a user; and what their role lets them do on this console."""

from __future__ import annotations

import ipaddress
import time
from collections.abc import Sequence
from dataclasses import dataclass

from starlette.requests import Request

from orchestrator import access
from orchestrator.access import Actor, Permission, Principal, PrincipalKind
from orchestrator.db.access import AccessStore, looks_like_token
from orchestrator.errors import InvalidInput

SESSION_SECONDS = 12 * 3600
MAX_NAME = 200
Network = ipaddress.IPv4Network | ipaddress.IPv6Network


class NotAllowed(Exception):
    """A request served as nobody: it proves nobody (401), somebody this console refuses (403),
    or the sign-in could not be checked (503)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class TrustedProxy:
    """A reverse proxy (oauth2-proxy style) that signs people in and names them in a header;
    the header is believed only from these peer addresses."""

    networks: Sequence[Network]
    user_header: str = "X-Forwarded-Email"

    def trusts(self, peer: str | None) -> bool:
        if peer is None:
            return False
        try:
            address = ipaddress.ip_address(peer)
        except ValueError:
            return False
        return any(address in network for network in self.networks)


@dataclass(frozen=True)
class Accounts:
    """Accounts mode: every principal is one of ``orchestrator users``; sign-in by personal
    token, OpenID Connect (see ``oidc``) or a trusted proxy's header."""

    session_seconds: float = SESSION_SECONDS
    trusted_proxy: TrustedProxy | None = None


@dataclass(frozen=True)
class Visitor:
    """The person or program behind one request. ``principal`` None: nobody signed in, or the
    shared-token holder (``shared_token``), whose actions need a typed name."""

    principal: Principal | None = None
    via: access.Via | None = None
    shared_token: bool = False
    session: bool = False

    @property
    def known(self) -> bool:
        return self.principal is not None or self.shared_token

    def may(self, permission: Permission) -> bool:
        if self.shared_token:
            return permission in (Permission.READ, Permission.DECIDE, Permission.OPERATE)
        return self.principal is not None and self.principal.may(permission)

    def actor(self) -> Actor:
        assert self.principal is not None and self.via is not None
        return Actor(self.principal.name, self.via)

    @property
    def label(self) -> str:
        if self.principal is None:
            return "shared token" if self.shared_token else ""
        return f"{self.principal.name} ({self.principal.role.value})"


async def visitor_of(request: Request, accounts: Accounts, people: AccessStore) -> Visitor:
    """The visitor in accounts mode: a trusted proxy's header, then a bearer token, then the
    browser session; nobody when none of them names a working principal."""
    proxy = accounts.trusted_proxy
    if proxy is not None and proxy.user_header in request.headers:
        return await _from_proxy(request, proxy, people)
    scheme, _, offered = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer":
        return await _from_bearer(offered.strip(), people)
    return await _from_session(request, accounts, people)


async def _from_proxy(request: Request, proxy: TrustedProxy, people: AccessStore) -> Visitor:
    peer = request.client.host if request.client else None
    if not proxy.trusts(peer):
        raise NotAllowed(
            403,
            f"refused: the {proxy.user_header} header came from {peer or 'an unknown address'}, "
            "which is not a --trusted-proxy; nothing changed",
        )
    named = request.headers.getlist(proxy.user_header)
    if len(named) != 1:  # a proxy that appends its own header leaves the client's first
        raise NotAllowed(403, f"the {proxy.user_header} header must come once, not {len(named)}")
    name = named[0].strip()
    if not 1 <= len(name) <= MAX_NAME:
        raise NotAllowed(403, f"the {proxy.user_header} header must name one person")
    principal = await people.principal(name)
    if principal is None or principal.kind is not PrincipalKind.PERSON:
        raise NotAllowed(403, _not_a_user(name))
    return Visitor(principal, access.Via.PROXY_HEADER)


async def _from_bearer(offered: str, people: AccessStore) -> Visitor:
    found = await people.authenticate(offered) if looks_like_token(offered) else None
    if found is None:
        raise NotAllowed(
            401,
            "unknown, revoked or expired token: nothing changed; create one with "
            "`orchestrator users token create NAME`",
        )
    if found.principal.kind is not PrincipalKind.PERSON:
        # A service's token is scoped for the action proxy; here it would read and decide
        # beyond its scope, for every agent.
        raise NotAllowed(
            403,
            f"refused: {found.principal.name} is a service, and a service's token works only "
            "at the action proxy (`orchestrator effects serve`); nothing changed",
        )
    return Visitor(found.principal, access.Via.TOKEN)


async def _from_session(request: Request, accounts: Accounts, people: AccessStore) -> Visitor:
    session = request.session
    name, via, started = session.get("principal"), session.get("via"), session.get("at")
    if not isinstance(name, str) or via not in ("token", "oidc") or not isinstance(started, int):
        return Visitor()
    if time.time() - started > accounts.session_seconds:
        session.clear()
        return Visitor()
    token_id = session.get("token_id")
    principal = await people.session_principal(
        name, token_id if isinstance(token_id, str) else None
    )
    if principal is None:  # disabled, or the token it signed in with was revoked
        session.clear()
        return Visitor()
    return Visitor(principal, access.Via(via), session=True)


def start_session(
    request: Request, principal: Principal, via: access.Via, token_id: str | None
) -> None:
    request.session.clear()
    request.session.update(
        {
            "principal": principal.name,
            "via": via.value,
            "token_id": token_id,
            "at": int(time.time()),
        }
    )


def _not_a_user(name: str) -> str:
    return (
        f"{name} is not a person allowed on this console (unknown or disabled): an admin adds "
        f"them with `orchestrator users add {name} --role viewer|approver|operator|admin`"
    )


def not_a_user(name: str) -> NotAllowed:
    return NotAllowed(403, _not_a_user(name))


def parse_networks(values: Sequence[str]) -> list[Network]:
    """``--trusted-proxy`` values: addresses or CIDR networks (127.0.0.1, 10.0.0.0/8, ::1)."""
    networks = []
    for value in values:
        try:
            networks.append(ipaddress.ip_network(value.strip(), strict=False))
        except ValueError:
            raise InvalidInput(
                f"--trusted-proxy takes an address or network such as 127.0.0.1 or "
                f"10.0.0.0/8, not {value!r}"
            ) from None
    return networks
