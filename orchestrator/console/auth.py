"""Who may act: a bearer token for API clients, a signed cookie for browsers, and a CSRF check.

The cookie holds an HMAC of the token, never the token itself, so a cookie copied out of a
browser profile does not reveal the token, and changing the token signs every browser out.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from urllib.parse import urlsplit

from starlette.requests import Request

from orchestrator import access
from orchestrator.access import SHARED_TOKEN_PRINCIPAL, Actor
from orchestrator.errors import InvalidInput
from orchestrator.storable import check_text

SESSION_COOKIE = "orchestrator_console"
NAME_COOKIE = "orchestrator_console_name"
TOKEN_ENV = "ORCHESTRATOR_CONSOLE_TOKEN"
MAX_NAME = 100


class Via(Enum):
    NONE = "none"
    BEARER = "bearer"
    COOKIE = "cookie"


@dataclass(frozen=True)
class Auth:
    """The console's token (None: read-only) and the checks derived from it."""

    token: bytes | None

    @property
    def enabled(self) -> bool:
        return self.token is not None

    def session_value(self) -> str:
        assert self.token is not None
        return hmac.new(self.token, b"orchestrator-console-session", hashlib.sha256).hexdigest()

    def token_matches(self, offered: str) -> bool:
        return self.token is not None and hmac.compare_digest(offered.encode(), self.token)

    def via(self, request: Request) -> Via:
        """How the request proved it holds the token, if it did."""
        if self.token is None:
            return Via.NONE
        header = request.headers.get("authorization", "")
        scheme, _, offered = header.partition(" ")
        if scheme.lower() == "bearer" and self.token_matches(offered.strip()):
            return Via.BEARER
        cookie = request.cookies.get(SESSION_COOKIE, "")
        if cookie and hmac.compare_digest(cookie.encode(), self.session_value().encode()):
            return Via.COOKIE
        return Via.NONE


def same_origin(request: Request) -> bool:
    """The POST came from a page this console served (its Origin names this host and port).

    Browsers send Origin on every cross-site POST and on same-origin form POSTs, so a request
    riding on the cookie without a matching Origin is refused as a possible forgery.
    """
    origin = request.headers.get("origin")
    host = request.headers.get("host")
    if not origin or not host or origin == "null":
        return False
    parts = urlsplit(origin)
    return parts.scheme in ("http", "https") and parts.netloc.lower() == host.lower()


def origin_acceptable(request: Request, via: Via) -> bool:
    """A cookie needs a matching Origin; a bearer token cannot be forged by another site, so an
    API client may omit Origin, but one that sends it must send this console's."""
    if via is Via.BEARER and "origin" not in request.headers:
        return True
    return same_origin(request)


def actor(raw: str | None) -> Actor:
    """Who a decision in the shared-token console is recorded as: whoever holds the token (the
    principal ``shared-token``), with the name the person typed kept as a note."""
    name = " ".join((raw or "").split())
    if not name:
        raise InvalidInput("say who you are: the 'your name' field is required")
    check_text(name, "your name")
    if len(name) > MAX_NAME:
        raise InvalidInput(f"your name must be at most {MAX_NAME} characters")
    return Actor(SHARED_TOKEN_PRINCIPAL, access.Via.SHARED_TOKEN, note=name)


def read_token(env_value: str | None, token_file: Path | None) -> bytes | None:
    """The token from ``--token-file`` or the environment; never from an argument (``ps``)."""
    if token_file is not None:
        try:
            raw = token_file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as error:
            reason = getattr(error, "strerror", None) or str(error)
            raise InvalidInput(f"cannot read --token-file {str(token_file)!r}: {reason}") from None
    elif env_value is not None:
        raw = env_value
    else:
        return None
    token = raw.strip()
    if len(token) < 16:
        raise InvalidInput(
            f"the console token must be at least 16 characters (from {TOKEN_ENV} or "
            "--token-file); generate one with `python3 -c 'import secrets; "
            "print(secrets.token_urlsafe(32))'`"
        )
    return token.encode()
