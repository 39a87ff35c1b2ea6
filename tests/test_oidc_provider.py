"""The loopback OpenID Connect provider (tests/support/oidc_provider.py), driven by authlib's own
client as the console will drive it: discovery, an authorization URL with PKCE S256 and a nonce, the
login form posted as a user would, the code exchanged, the ID token checked against the JWKS."""

from __future__ import annotations

import html
import re
import secrets
from collections.abc import Iterator
from typing import Any
from urllib.parse import parse_qs, urljoin, urlsplit

import httpx
import pytest
from authlib.integrations.base_client import OAuthError
from authlib.integrations.httpx_client import OAuth2Client
from authlib.oidc.core import CodeIDToken
from joserfc import jwt
from joserfc.jwk import KeySet, KeySetSerialization

from support.oidc_provider import OidcClient, OidcProvider

REDIRECT_URI = "http://127.0.0.1:9/auth/callback"
CLIENT_ID = "console"
CLIENT_SECRET = "console-secret"


@pytest.fixture
def provider() -> Iterator[OidcProvider]:
    users = {
        "alice@example.com": {"name": "Alice", "groups": ["approvers"]},
        "bob@example.com": {"name": "Bob", "groups": []},
    }
    clients = [OidcClient(CLIENT_ID, CLIENT_SECRET, [REDIRECT_URI])]
    with OidcProvider(users=users, clients=clients) as provider:
        yield provider


def oauth_client(auth_method: str = "client_secret_post") -> OAuth2Client:
    """authlib's httpx client configured as the console's will be."""
    return OAuth2Client(
        client_id=CLIENT_ID,
        client_secret=CLIENT_SECRET,
        scope="openid email profile groups",
        redirect_uri=REDIRECT_URI,
        code_challenge_method="S256",
        token_endpoint_auth_method=auth_method,
    )


def sign_in(authorization_url: str, email: str) -> str:
    """Load the login page and press ``email``'s button as a browser would; the redirect to the
    client's callback (not followed: nothing listens there) is returned."""
    with httpx.Client(follow_redirects=False) as http:
        page = http.get(authorization_url)
        assert page.status_code == 200, page.text
        assert f'<button type="submit" name="user" value="{email}">' in page.text
        form = re.search(r'<form method="post" action="([^"]*)">', page.text)
        assert form is not None, page.text
        action = urljoin(authorization_url, html.unescape(form.group(1)))
        assert action == authorization_url
        answer = http.post(action, data={"user": email})
    assert answer.status_code == 302, answer.text
    location = answer.headers["location"]
    assert location.startswith(REDIRECT_URI + "?")
    return location


def authorize(
    provider: OidcProvider, client: OAuth2Client, email: str = "alice@example.com"
) -> tuple[str, str, str]:
    """An authorization request and a sign-in: (callback URL, code_verifier, nonce)."""
    metadata = httpx.get(provider.discovery_url).json()
    verifier = secrets.token_urlsafe(48)
    nonce = secrets.token_urlsafe(16)
    url, _state = client.create_authorization_url(
        metadata["authorization_endpoint"], code_verifier=verifier, nonce=nonce
    )
    return sign_in(url, email), verifier, nonce


def code_of(callback: str) -> str:
    return parse_qs(urlsplit(callback).query)["code"][0]


def test_discovery_document(provider: OidcProvider) -> None:
    metadata = httpx.get(provider.discovery_url).json()
    assert metadata["issuer"] == provider.issuer
    assert provider.issuer.startswith("http://127.0.0.1:")
    assert metadata["authorization_endpoint"] == f"{provider.issuer}/authorize"
    assert metadata["token_endpoint"] == f"{provider.issuer}/token"
    assert metadata["jwks_uri"] == f"{provider.issuer}/jwks"
    assert metadata["userinfo_endpoint"] == f"{provider.issuer}/userinfo"
    assert metadata["response_types_supported"] == ["code"]
    assert metadata["subject_types_supported"] == ["public"]
    assert metadata["id_token_signing_alg_values_supported"] == ["RS256"]
    assert metadata["code_challenge_methods_supported"] == ["S256"]
    assert {"openid", "email", "profile", "groups"} <= set(metadata["scopes_supported"])
    jwks = httpx.get(metadata["jwks_uri"]).json()
    [key] = jwks["keys"]
    assert key["kty"] == "RSA"
    assert key["kid"]
    assert "d" not in key


@pytest.mark.parametrize("auth_method", ["client_secret_post", "client_secret_basic"])
def test_code_flow_with_pkce_gives_a_signed_id_token(
    provider: OidcProvider, auth_method: str
) -> None:
    metadata = httpx.get(provider.discovery_url).json()
    with oauth_client(auth_method) as client:
        callback, verifier, nonce = authorize(provider, client)
        sent = provider.last_authorization_request
        assert sent["code_challenge_method"] == "S256"
        assert sent["nonce"] == nonce
        assert parse_qs(urlsplit(callback).query)["state"] == [sent["state"]]

        token = client.fetch_token(
            metadata["token_endpoint"], authorization_response=callback, code_verifier=verifier
        )
        assert provider.token_requests == 1
        assert provider.tokens_issued == 1

        jwks: KeySetSerialization = httpx.get(metadata["jwks_uri"]).json()
        keys = KeySet.import_key_set(jwks)
        decoded = jwt.decode(token["id_token"], keys, algorithms=["RS256"])
        assert decoded.header["kid"] == keys.keys[0].kid
        claims: Any = CodeIDToken(
            decoded.claims,
            decoded.header,
            options={
                "iss": {"essential": True, "value": provider.issuer},
                "aud": {"essential": True, "value": CLIENT_ID},
            },
            params={"nonce": nonce, "access_token": token["access_token"]},
        )
        claims.validate()
        assert claims["sub"] == "alice@example.com"
        assert claims["email"] == "alice@example.com"
        assert claims["name"] == "Alice"
        assert claims["groups"] == ["approvers"]
        assert claims["nonce"] == nonce
        assert claims["exp"] > claims["iat"]

        userinfo = client.get(metadata["userinfo_endpoint"]).json()
        assert userinfo["email"] == "alice@example.com"
        assert userinfo["groups"] == ["approvers"]
        assert provider.userinfo_requests == 1


def test_claims_follow_the_scope(provider: OidcProvider) -> None:
    with OAuth2Client(
        client_id=CLIENT_ID,
        client_secret=CLIENT_SECRET,
        scope="openid email",
        redirect_uri=REDIRECT_URI,
        code_challenge_method="S256",
    ) as client:
        callback, verifier, _nonce = authorize(provider, client, "bob@example.com")
        token = client.fetch_token(
            provider.token_endpoint, authorization_response=callback, code_verifier=verifier
        )
    claims = jwt.decode(token["id_token"], KeySet.import_key_set(provider.public_jwks())).claims
    assert claims["email"] == "bob@example.com"
    assert "groups" not in claims
    assert "name" not in claims


def test_a_wrong_code_verifier_is_refused(provider: OidcProvider) -> None:
    with oauth_client() as client:
        callback, _verifier, _nonce = authorize(provider, client)
        with pytest.raises(OAuthError, match="invalid_grant: Code challenge failed"):
            client.fetch_token(
                provider.token_endpoint,
                authorization_response=callback,
                code_verifier=secrets.token_urlsafe(48),
            )
    assert provider.tokens_issued == 0
    # Without any verifier the code is refused too.
    answer = httpx.post(
        provider.token_endpoint,
        data={
            "grant_type": "authorization_code",
            "code": code_of(callback),
            "redirect_uri": REDIRECT_URI,
            "client_id": CLIENT_ID,
            "client_secret": CLIENT_SECRET,
        },
    )
    assert answer.status_code == 400
    assert answer.json()["error"] == "invalid_request"
    assert provider.token_requests == 2
    assert provider.tokens_issued == 0


def test_a_code_is_used_once(provider: OidcProvider) -> None:
    with oauth_client() as client:
        callback, verifier, _nonce = authorize(provider, client)
        client.fetch_token(
            provider.token_endpoint, authorization_response=callback, code_verifier=verifier
        )
        with pytest.raises(OAuthError, match="invalid_grant"):
            client.fetch_token(
                provider.token_endpoint, authorization_response=callback, code_verifier=verifier
            )
    assert provider.tokens_issued == 1


def test_an_authorization_request_without_pkce_is_refused(provider: OidcProvider) -> None:
    with OAuth2Client(client_id=CLIENT_ID, scope="openid", redirect_uri=REDIRECT_URI) as client:
        url, _state = client.create_authorization_url(
            provider.authorization_endpoint, nonce="n-0S6_WzA2Mj"
        )
    answer = httpx.get(url)
    assert answer.status_code == 302
    query = parse_qs(urlsplit(answer.headers["location"]).query)
    assert query["error"] == ["invalid_request"]


def test_a_client_registered_later(provider: OidcProvider) -> None:
    redirect_uri = "http://127.0.0.1:10/cb"
    provider.add_client("late", "late-secret", [redirect_uri])
    provider.add_user("carol@example.com", name="Carol", groups=["viewers"])
    with OAuth2Client(
        client_id="late",
        client_secret="late-secret",
        scope="openid groups",
        redirect_uri=redirect_uri,
        code_challenge_method="S256",
    ) as client:
        verifier = secrets.token_urlsafe(48)
        url, _state = client.create_authorization_url(
            provider.authorization_endpoint, code_verifier=verifier, nonce="n-1"
        )
        with httpx.Client() as http:
            callback = http.post(url, data={"user": "carol@example.com"}).headers["location"]
        token = client.fetch_token(
            provider.token_endpoint, authorization_response=callback, code_verifier=verifier
        )
    claims = jwt.decode(token["id_token"], KeySet.import_key_set(provider.public_jwks())).claims
    assert claims["aud"] == ["late"]
    assert claims["groups"] == ["viewers"]
