"""A real OpenID Connect provider on loopback for tests, built from authlib's server side.

The console's "sign in with OpenID Connect" is tested against this provider rather than a
hand-written fake, so the client meets real discovery, PKCE (S256 only, and required), client
authentication, signed ID tokens and a JWKS. It is a Flask app (authlib's Flask integration)
served by werkzeug in a background thread on 127.0.0.1, port chosen by the OS::

    with OidcProvider(users={"alice@example.com": {"name": "Alice", "groups": ["approvers"]}},
                      clients=[OidcClient("console", "secret", ["http://127.0.0.1:8000/cb"])]
    ) as provider:
        provider.discovery_url  # http://127.0.0.1:PORT/.well-known/openid-configuration

The login page (GET /authorize) lists the configured users as submit buttons; a browser signs
in by clicking ``button[name=user][value="alice@example.com"]`` (``OidcProvider.login_selector``
builds it), and a plain HTTP client by POSTing ``user=<email>`` to the same /authorize URL.
Either way the provider answers 302 to the client's redirect_uri with ``code`` and ``state``.

Claims are released by scope, as real providers do: ``openid`` gives ``sub`` (the user's
email unless the user entry sets ``sub``), ``email`` gives ``email`` and ``email_verified``,
``profile`` gives ``name``, ``groups`` gives ``groups``. A nonce is required on every
authorization request, and PKCE is required of confidential clients too.
"""

from __future__ import annotations

import html
import threading
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

from authlib.integrations.flask_oauth2 import AuthorizationServer, ResourceProtector
from authlib.oauth2.rfc6749 import InvalidRequestError, OAuth2Error, grants
from authlib.oauth2.rfc6750 import BearerTokenValidator
from authlib.oauth2.rfc7636 import CodeChallenge
from authlib.oidc.core import UserInfo, UserInfoEndpoint
from authlib.oidc.core.grants import OpenIDCode
from authlib.oidc.discovery import OpenIDProviderMetadata
from flask import Flask, Response, jsonify, request
from joserfc.jwk import KeySet, KeySetSerialization, RSAKey
from werkzeug.serving import BaseWSGIServer, make_server

SCOPES = ["openid", "email", "profile", "groups"]
TOKEN_ENDPOINT_AUTH_METHODS = ["client_secret_basic", "client_secret_post"]
CODE_LIFETIME_SECONDS = 300
ACCESS_TOKEN_LIFETIME_SECONDS = 3600


@dataclass
class OidcClient:
    """A registered relying party; it has the attributes and methods authlib's ClientMixin
    asks of a client, so the grant and endpoints can use it directly."""

    client_id: str
    client_secret: str
    redirect_uris: Sequence[str]
    client_metadata: dict[str, Any] = field(default_factory=dict)

    def get_client_id(self) -> str:
        return self.client_id

    def get_default_redirect_uri(self) -> str:
        return self.redirect_uris[0]

    def get_allowed_scope(self, scope: str | None) -> str:
        if not scope:
            return ""
        return " ".join(s for s in scope.split() if s in SCOPES)

    def check_redirect_uri(self, redirect_uri: str) -> bool:
        return redirect_uri in self.redirect_uris

    def check_client_secret(self, client_secret: str) -> bool:
        return client_secret == self.client_secret

    def check_endpoint_auth_method(self, method: str, endpoint: str) -> bool:
        return endpoint == "token" and method in TOKEN_ENDPOINT_AUTH_METHODS

    def check_response_type(self, response_type: str) -> bool:
        return response_type == "code"

    def check_grant_type(self, grant_type: str) -> bool:
        return grant_type == "authorization_code"


@dataclass
class _User:
    """An end user of the provider; the claims it can release are computed from it."""

    email: str
    sub: str
    name: str
    groups: list[str]


@dataclass
class _AuthorizationCode:
    """An issued code with what the token request is checked against (authlib's
    AuthorizationCodeMixin and the attributes CodeChallenge reads)."""

    code: str
    client_id: str
    redirect_uri: str
    scope: str
    user_email: str
    nonce: str | None
    code_challenge: str | None
    code_challenge_method: str | None
    auth_time: int
    expires_at: float

    def get_redirect_uri(self) -> str:
        return self.redirect_uri

    def get_scope(self) -> str:
        return self.scope

    def get_nonce(self) -> str | None:
        return self.nonce

    def get_auth_time(self) -> int:
        return self.auth_time

    def get_acr(self) -> None:
        return None

    def get_amr(self) -> None:
        return None


@dataclass
class _AccessToken:
    """An issued access token (authlib's TokenMixin), for the userinfo endpoint."""

    access_token: str
    client: OidcClient
    user: _User
    scope: str
    expires_at: float

    def check_client(self, client: OidcClient) -> bool:
        return client.client_id == self.client.client_id

    def get_scope(self) -> str:
        return self.scope

    def get_expires_in(self) -> int:
        return int(self.expires_at - time.time())

    def is_expired(self) -> bool:
        return time.time() >= self.expires_at

    def is_revoked(self) -> bool:
        return False

    def get_user(self) -> _User:
        return self.user

    def get_client(self) -> OidcClient:
        return self.client


def _user_info(user: _User, scope: str) -> UserInfo:
    """The claims of ``user`` that ``scope`` releases, shared by the ID token and /userinfo so
    the two never disagree."""
    scopes = scope.split()
    claims: dict[str, Any] = {"sub": user.sub}
    if "email" in scopes:
        claims.update(email=user.email, email_verified=True)
    if "profile" in scopes:
        claims["name"] = user.name
    if "groups" in scopes:
        claims["groups"] = list(user.groups)
    return UserInfo(claims)


class OidcProvider:
    """An OpenID Connect provider on 127.0.0.1 for the length of a ``with`` block (or between
    ``start()`` and ``stop()``, which are synchronous and quick, so async tests call them too).

    What it saw is kept for assertions: ``authorization_requests`` (the query parameters of
    each GET /authorize, e.g. ``code_challenge_method``), ``token_requests`` (how many token
    requests, successful or not), ``tokens_issued`` and ``userinfo_requests``.
    """

    def __init__(
        self,
        users: Mapping[str, Mapping[str, Any]] | None = None,
        clients: Iterable[OidcClient] = (),
    ) -> None:
        self._lock = threading.Lock()
        self._users: dict[str, _User] = {}
        for email, entry in (users or {}).items():
            self.add_user(
                email,
                name=str(entry.get("name", email)),
                groups=list(entry.get("groups", [])),
                sub=entry.get("sub"),
            )
        self._clients: dict[str, OidcClient] = {c.client_id: c for c in clients}
        self._codes: dict[str, _AuthorizationCode] = {}
        self._tokens: dict[str, _AccessToken] = {}
        self._nonces: set[str] = set()
        self.authorization_requests: list[dict[str, str]] = []
        self.token_requests = 0
        self.tokens_issued = 0
        self.userinfo_requests = 0
        self.key = RSAKey.generate_key(2048, parameters={"kid": uuid.uuid4().hex}, private=True)
        self._server: BaseWSGIServer | None = None
        self._thread: threading.Thread | None = None
        self._issuer: str | None = None

    # -- configuration ------------------------------------------------------------------------

    def add_user(
        self, email: str, *, name: str, groups: Sequence[str] = (), sub: str | None = None
    ) -> None:
        """Make ``email`` one of the users offered on the login page."""
        with self._lock:
            self._users[email] = _User(email=email, sub=sub or email, name=name, groups=[*groups])

    def add_client(
        self, client_id: str, client_secret: str, redirect_uris: Sequence[str]
    ) -> OidcClient:
        """Register a confidential client, e.g. once the console's port (and so its
        redirect_uri) is known."""
        client = OidcClient(client_id, client_secret, list(redirect_uris))
        with self._lock:
            self._clients[client_id] = client
        return client

    @property
    def issuer(self) -> str:
        if self._issuer is None:
            raise RuntimeError("the provider is not started")
        return self._issuer

    @property
    def discovery_url(self) -> str:
        return f"{self.issuer}/.well-known/openid-configuration"

    @property
    def authorization_endpoint(self) -> str:
        return f"{self.issuer}/authorize"

    @property
    def token_endpoint(self) -> str:
        return f"{self.issuer}/token"

    @property
    def jwks_uri(self) -> str:
        return f"{self.issuer}/jwks"

    @property
    def userinfo_endpoint(self) -> str:
        return f"{self.issuer}/userinfo"

    @property
    def last_authorization_request(self) -> dict[str, str]:
        """The query parameters of the latest GET /authorize."""
        with self._lock:
            if not self.authorization_requests:
                raise LookupError("no authorization request yet")
            return self.authorization_requests[-1]

    @staticmethod
    def login_selector(email: str) -> str:
        """The CSS selector of the login page's button that signs ``email`` in."""
        return f'button[name="user"][value="{email}"]'

    def public_jwks(self) -> KeySetSerialization:
        """The JWKS the provider publishes (the public half of its signing key)."""
        return KeySet([self.key]).as_dict(private=False)

    def discovery_document(self) -> dict[str, Any]:
        """The provider's metadata, checked by authlib's OpenIDProviderMetadata."""
        metadata = OpenIDProviderMetadata(
            issuer=self.issuer,
            authorization_endpoint=self.authorization_endpoint,
            token_endpoint=self.token_endpoint,
            jwks_uri=self.jwks_uri,
            userinfo_endpoint=self.userinfo_endpoint,
            response_types_supported=["code"],
            response_modes_supported=["query"],
            grant_types_supported=["authorization_code"],
            subject_types_supported=["public"],
            id_token_signing_alg_values_supported=["RS256"],
            code_challenge_methods_supported=["S256"],
            scopes_supported=SCOPES,
            token_endpoint_auth_methods_supported=TOKEN_ENDPOINT_AUTH_METHODS,
            claims_supported=[
                "iss",
                "sub",
                "aud",
                "exp",
                "iat",
                "auth_time",
                "nonce",
                "email",
                "email_verified",
                "name",
                "groups",
            ],
        )
        metadata.validate()
        return dict(metadata)

    # -- lifecycle ----------------------------------------------------------------------------

    def start(self) -> OidcProvider:
        """Listen on 127.0.0.1 (an OS-chosen port) and serve in a daemon thread."""
        if self._server is not None:
            raise RuntimeError("the provider is already started")
        app = self._create_app()
        server = make_server("127.0.0.1", 0, app, threaded=True)
        self._issuer = f"http://127.0.0.1:{server.server_port}"
        self._server = server
        self._thread = threading.Thread(
            target=server.serve_forever, name="oidc-provider", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving and close the listening socket."""
        server, thread = self._server, self._thread
        self._server = self._thread = None
        if server is not None:
            server.shutdown()
            server.server_close()
        if thread is not None:
            thread.join(timeout=10)

    def __enter__(self) -> OidcProvider:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()

    # -- the server ---------------------------------------------------------------------------

    def _create_app(self) -> Flask:
        """The Flask app: authlib's AuthorizationServer with the authorization code grant, the
        OpenID Connect extension and PKCE, plus discovery, JWKS and userinfo routes."""
        provider = self
        app = Flask(f"oidc-provider-{id(self)}")
        app.config["OAUTH2_SCOPES_SUPPORTED"] = SCOPES
        app.config["OAUTH2_TOKEN_EXPIRES_IN"] = {
            "authorization_code": ACCESS_TOKEN_LIFETIME_SECONDS
        }

        class CodeGrant(grants.AuthorizationCodeGrant):  # type: ignore[misc]
            """The authorization code grant with codes kept in the provider's dict."""

            TOKEN_ENDPOINT_AUTH_METHODS = TOKEN_ENDPOINT_AUTH_METHODS

            def save_authorization_code(self, code: str, req: Any) -> None:
                payload = req.payload
                nonce = payload.data.get("nonce")
                entry = _AuthorizationCode(
                    code=code,
                    client_id=req.client.client_id,
                    redirect_uri=payload.redirect_uri or "",
                    scope=req.scope,
                    user_email=req.user.email,
                    nonce=nonce,
                    code_challenge=payload.data.get("code_challenge"),
                    code_challenge_method=payload.data.get("code_challenge_method"),
                    auth_time=int(time.time()),
                    expires_at=time.time() + CODE_LIFETIME_SECONDS,
                )
                with provider._lock:
                    provider._codes[code] = entry
                    if nonce:
                        provider._nonces.add(nonce)

            def query_authorization_code(
                self, code: str, client: OidcClient
            ) -> _AuthorizationCode | None:
                with provider._lock:
                    entry = provider._codes.get(code)
                if entry is None or entry.client_id != client.client_id:
                    return None
                if time.time() >= entry.expires_at:
                    return None
                return entry

            def delete_authorization_code(self, authorization_code: _AuthorizationCode) -> None:
                with provider._lock:
                    provider._codes.pop(authorization_code.code, None)

            def authenticate_user(self, authorization_code: _AuthorizationCode) -> _User | None:
                with provider._lock:
                    return provider._users.get(authorization_code.user_email)

        class OpenIdCode(OpenIDCode):  # type: ignore[misc]
            """ID tokens signed RS256 with the provider's key, its kid in the header."""

            def exists_nonce(self, nonce: str, req: Any) -> bool:
                with provider._lock:
                    return nonce in provider._nonces

            def resolve_client_private_key(self, client: OidcClient) -> RSAKey:
                return provider.key

            def get_client_algorithm(self, client: OidcClient) -> str:
                return "RS256"

            def get_encode_header(self, client: OidcClient) -> dict[str, str]:
                return {"alg": "RS256", "kid": provider.key.kid or ""}

            def get_client_claims(self, client: OidcClient) -> dict[str, Any]:
                return {"iss": provider.issuer, "aud": [client.client_id]}

            def generate_user_info(self, user: _User, scope: str) -> UserInfo:
                return _user_info(user, scope)

        class S256Required(CodeChallenge):  # type: ignore[misc]
            """PKCE on every authorization request, S256 only: authlib's CodeChallenge alone
            enforces it for public clients, and accepts "plain"."""

            SUPPORTED_CODE_CHALLENGE_METHOD = ["S256"]  # noqa: RUF012 - as the base class has it

            def validate_code_challenge(self, grant: Any, redirect_uri: str) -> None:
                data = grant.request.payload.data
                if not data.get("code_challenge"):
                    raise InvalidRequestError("Missing 'code_challenge'")
                if data.get("code_challenge_method") != "S256":
                    raise InvalidRequestError("'code_challenge_method' must be S256")
                super().validate_code_challenge(grant, redirect_uri)

        class TokenValidator(BearerTokenValidator):  # type: ignore[misc]
            """Bearer tokens looked up in the provider's dict."""

            def authenticate_token(self, token_string: str) -> _AccessToken | None:
                with provider._lock:
                    return provider._tokens.get(token_string)

        class UserInfoAt(UserInfoEndpoint):  # type: ignore[misc]
            """The userinfo endpoint, releasing the same claims as the ID token."""

            def get_issuer(self) -> str:
                return provider.issuer

            def generate_user_info(self, user: _User, scope: str) -> UserInfo:
                return _user_info(user, scope)

        def query_client(client_id: str) -> OidcClient | None:
            with provider._lock:
                return provider._clients.get(client_id)

        def save_token(token: Mapping[str, Any], req: Any) -> None:
            entry = _AccessToken(
                access_token=token["access_token"],
                client=req.client,
                user=req.user,
                scope=token.get("scope", ""),
                expires_at=time.time() + int(token.get("expires_in", 3600)),
            )
            with provider._lock:
                provider._tokens[entry.access_token] = entry
                provider.tokens_issued += 1

        server = AuthorizationServer(app, query_client=query_client, save_token=save_token)
        server.register_grant(CodeGrant, [OpenIdCode(require_nonce=True), S256Required()])
        protector = ResourceProtector()
        protector.register_token_validator(TokenValidator())
        server.register_endpoint(UserInfoAt(resource_protector=protector))

        @app.get("/.well-known/openid-configuration")
        def discovery() -> Response:
            return jsonify(provider.discovery_document())

        @app.get("/jwks")
        def jwks() -> Response:
            return jsonify(provider.public_jwks())

        @app.get("/authorize")
        def authorize_page() -> Any:
            with provider._lock:
                provider.authorization_requests.append(dict(request.args.items()))
                users = list(provider._users.values())
            try:
                grant = server.get_consent_grant(end_user=None)
            except OAuth2Error as error:
                return server.handle_error_response(None, error)
            return _login_page(request.full_path, grant.client.client_id, users)

        @app.post("/authorize")
        def authorize() -> Any:
            with provider._lock:
                user = provider._users.get(request.form.get("user", ""))
            if user is None:
                return Response("unknown user", status=400, mimetype="text/plain")
            try:
                grant = server.get_consent_grant(end_user=user)
            except OAuth2Error as error:
                return server.handle_error_response(None, error)
            return server.create_authorization_response(grant_user=user, grant=grant)

        @app.post("/token")
        def token() -> Any:
            with provider._lock:
                provider.token_requests += 1
            return server.create_token_response()

        @app.route("/userinfo", methods=["GET", "POST"])
        def userinfo() -> Any:
            with provider._lock:
                provider.userinfo_requests += 1
            return server.create_endpoint_response("userinfo")

        return app


def _login_page(action: str, client_id: str, users: Sequence[_User]) -> Response:
    """The login form: one submit button per user, POSTing back to the same /authorize URL
    (query string included) with ``user=<email>``."""
    buttons = "\n".join(
        f'<li><button type="submit" name="user" value="{html.escape(u.email)}">'
        f"{html.escape(u.name)} ({html.escape(u.email)})</button></li>"
        for u in users
    )
    body = f"""<!doctype html>
<html lang="en">
<head><meta charset="utf-8"><title>Sign in - test OpenID provider</title></head>
<body>
<h1>Sign in to {html.escape(client_id)}</h1>
<form method="post" action="{html.escape(action)}">
<ul>
{buttons}
</ul>
</form>
</body>
</html>
"""
    return Response(body, mimetype="text/html")
