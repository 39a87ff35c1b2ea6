"""Console sign-in through OpenID Connect: the authorization code flow with PKCE, done by
authlib's Starlette client (discovery, state, nonce and ID token checks are its, not ours)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import httpx
from authlib.integrations.starlette_client import OAuth, OAuthError
from joserfc.errors import JoseError
from starlette.requests import Request
from starlette.responses import Response

from orchestrator.access import Role
from orchestrator.console.identity import NotAllowed
from orchestrator.errors import InvalidInput

CALLBACK_PATH = "/signin/oidc/callback"


@dataclass(frozen=True)
class OidcConfig:
    issuer: str
    client_id: str
    client_secret: str
    claim: str = "email"
    """The ID token claim naming the principal (as ``orchestrator users add`` named them)."""
    redirect_url: str | None = None
    """Where the provider sends people back; None: this console's own callback URL."""
    group_roles: tuple[tuple[str, Role], ...] = ()
    """``(group, role)`` pairs: with any, a person's role comes from the first pair whose group
    the ID token's ``groups_claim`` lists, and they need not be added beforehand."""
    groups_claim: str = "groups"

    def __post_init__(self) -> None:
        parts = urlsplit(self.issuer)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise InvalidInput(f"--oidc-issuer must be an http(s) URL, not {self.issuer!r}")
        if not self.client_id or not self.client_secret:
            raise InvalidInput(
                "OpenID Connect needs --oidc-client-id and the client secret "
                "(ORCHESTRATOR_OIDC_CLIENT_SECRET or --oidc-client-secret-file)"
            )

    @property
    def scope(self) -> str:
        return "openid email profile" + (" groups" if self.group_roles else "")

    def role_of(self, claims: Mapping[str, Any]) -> Role | None:
        """The role the first matching ``group_roles`` pair grants, or None."""
        listed = claims.get(self.groups_claim)
        groups = {str(group) for group in listed} if isinstance(listed, list) else set()
        return next((role for group, role in self.group_roles if group in groups), None)

    @property
    def discovery_url(self) -> str:
        return self.issuer.rstrip("/") + "/.well-known/openid-configuration"


class OidcSignIn:
    """The two halves of a sign-in: send the browser to the provider, and read who came back."""

    def __init__(self, config: OidcConfig) -> None:
        self.config = config
        oauth = OAuth()
        oauth.register(
            "oidc",
            server_metadata_url=config.discovery_url,
            client_id=config.client_id,
            client_secret=config.client_secret,
            client_kwargs={"scope": config.scope, "code_challenge_method": "S256"},
        )
        self.client: Any = oauth.create_client("oidc")

    async def redirect(self, request: Request) -> Response:
        target = self.config.redirect_url or str(request.url_for("oidc_callback"))
        try:
            response: Response = await self.client.authorize_redirect(request, target)
        except httpx.HTTPError as error:
            raise _unreachable(self.config, error) from None
        return response

    async def signed_in(self, request: Request) -> tuple[str, dict[str, Any]]:
        """The name the provider vouches for and the verified ID token's claims."""
        try:
            token = await self.client.authorize_access_token(request)
        except OAuthError as error:
            raise NotAllowed(403, f"sign-in failed: {error.description or error.error}") from None
        except JoseError as error:
            raise NotAllowed(
                403, f"sign-in failed: the ID token did not verify ({error})"
            ) from None
        except httpx.HTTPError as error:
            raise _unreachable(self.config, error) from None
        claims = token.get("userinfo")
        if not isinstance(claims, dict):
            raise NotAllowed(403, "sign-in failed: the provider sent no ID token")
        name = claims.get(self.config.claim)
        if not isinstance(name, str) or not name:
            raise NotAllowed(
                403, f"sign-in failed: the ID token has no {self.config.claim!r} claim"
            )
        if self.config.claim == "email" and claims.get("email_verified") is False:
            raise NotAllowed(403, f"sign-in failed: the provider has not verified {name}")
        return name, claims


def _unreachable(config: OidcConfig, error: httpx.HTTPError) -> NotAllowed:
    return NotAllowed(
        503, f"the OpenID provider at {config.issuer} did not answer ({type(error).__name__})"
    )
