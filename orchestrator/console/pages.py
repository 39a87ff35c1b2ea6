"""What the console's handlers share: the app's state, who is visiting, how a page is rendered or
refused, and the checks in front of an action."""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, cast
from urllib.parse import quote, urlsplit

import anyio
import asyncpg
from starlette.datastructures import FormData
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, RedirectResponse, Response
from starlette.templating import Jinja2Templates

from orchestrator import access
from orchestrator.access import Actor, Permission
from orchestrator.client.stores import Stores
from orchestrator.client.streaming import OutputFollower
from orchestrator.console.auth import NAME_COOKIE, TOKEN_ENV, Auth, Via, actor, origin_acceptable
from orchestrator.console.identity import Accounts, NotAllowed, Visitor, visitor_of
from orchestrator.console.oidc import OidcSignIn
from orchestrator.console.privacy import MAX_SHOWN_BYTES
from orchestrator.console.signin import AccountSignIn
from orchestrator.db.deadlines import DATABASE_ERRORS
from orchestrator.effects.store import EffectNotFound
from orchestrator.errors import InvalidInput, OrchestratorError, RunNotFound

MAX_FORM_FIELDS = 20
PAGE_SECONDS = 10.0
"""A page or action the database has not answered by then is a 503, not a hung request."""
MAX_FORM_BYTES = 64 * 1024
"""No form of the console is larger; a bigger body is refused before it is read."""


@dataclass(frozen=True)
class ConsoleState:
    """What the handlers read from ``request.app.state.console``, built once by ``create_app``."""

    pool: asyncpg.Pool
    stores: Stores
    templates: Jinja2Templates
    auth: Auth
    accounts: Accounts | None
    """Accounts mode: people sign in as themselves and their role decides (``auth`` unused)."""
    oidc: OidcSignIn | None
    sign_in: AccountSignIn
    flash_key: bytes
    """Signs the messages a redirect carries, so that a link cannot put words in the banner."""
    show_payloads: bool
    refresh_seconds: float
    secure_cookies: bool
    follower: OutputFollower
    """Every page's live output stream, over one listening connection (docs/streaming.md)."""

    @property
    def can_sign_in(self) -> bool:
        """Whether anyone can sign in at all: without a token or accounts the console only reads."""
        return self.accounts is not None or self.auth.enabled


def state(request: Request) -> ConsoleState:
    """The console's state, typed: Starlette's ``app.state`` is not."""
    return cast(ConsoleState, request.app.state.console)


class Refused(Exception):
    """An action the console will not take; the page says why, with this status."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


# -- who is visiting ---------------------------------------------------------------------------
async def visitor(request: Request) -> Visitor:
    """Who sent ``request`` (worked out once per request): in accounts mode, a principal of
    ``orchestrator users``; else whether it holds the shared token."""
    known = getattr(request.state, "visitor", None)
    if isinstance(known, Visitor):
        return known
    console = state(request)
    if console.accounts is not None:
        found = await visitor_of(request, console.accounts, console.stores.access)
    else:
        found = token_holder(request)
    request.state.visitor = found
    return found


def token_holder(request: Request) -> Visitor:
    """Shared-token mode: whether the request holds the token (no database read)."""
    via = state(request).auth.via(request)
    return Visitor(shared_token=via is not Via.NONE, session=via is Via.COOKIE)


async def reader(request: Request) -> Visitor:
    """The visitor of a page: in accounts mode, only someone signed in reads."""
    found = await visitor(request)
    if state(request).accounts is not None and not found.known:
        raise NotAllowed(401, "sign in first: this console shows runs to its users only")
    return found


def reveal(request: Request, found: Visitor) -> bool:
    """Contents are shown to roles that see payloads (accounts mode), else with
    --show-payloads."""
    console = state(request)
    if console.accounts is not None:
        return found.may(Permission.SEE_PAYLOADS)
    return console.show_payloads


# -- pages -------------------------------------------------------------------------------------
def render(request: Request, name: str, context: dict[str, Any], status: int = 200) -> Response:
    console = state(request)
    # A page rendered before anyone asked who is visiting (an unknown path's 404) still
    # shows a shared-token holder as signed in; in accounts mode it shows nobody.
    found = getattr(request.state, "visitor", None)
    if found is None:
        found = token_holder(request) if console.accounts is None else Visitor()
    common = {
        "can_decide": found.may(Permission.DECIDE),
        "can_resolve": found.may(Permission.OPERATE),
        "auth_enabled": console.can_sign_in,
        "accounts": console.accounts is not None,
        "oidc": console.oidc is not None,
        "signed_in": found.session,
        "who": found.label,
        "show_payloads": reveal(request, found),
        "refresh_seconds": console.refresh_seconds,
        "live": False,
        "name": request.cookies.get(NAME_COOKIE, "") if console.accounts is None else "",
        "flash": _message_of(request, "flash"),
        "flash_error": _message_of(request, "error"),
        "max_shown_bytes": MAX_SHOWN_BYTES,
        "path": request.url.path,
    }
    response = console.templates.TemplateResponse(
        request, name, {**common, **context}, status_code=status
    )
    # No page is cached or framed: they show live state, and framing invites clickjacking.
    response.headers["Cache-Control"] = "no-store"
    response.headers["X-Frame-Options"] = "DENY"
    response.headers["Content-Security-Policy"] = (
        "default-src 'self'; style-src 'self'; script-src 'self'; frame-ancestors 'none'"
    )
    response.headers["Referrer-Policy"] = "same-origin"
    return response


def page(
    handler: Callable[[Request], Awaitable[Response]],
) -> Callable[[Request], Awaitable[Response]]:
    """A user error becomes a one-line error page; a database outage a 503 page."""

    async def wrapped(request: Request) -> Response:
        try:
            with anyio.fail_after(PAGE_SECONDS):
                return await handler(request)
        except TimeoutError:
            return error_page(
                request, 503, f"the database did not answer within {PAGE_SECONDS:g}s; try again"
            )
        except Refused as refused:
            return error_page(request, refused.status, str(refused))
        except NotAllowed as refused:
            if refused.status == 401 and not _api_client(request) and request.method == "GET":
                target = quote(
                    request.url.path + (f"?{request.url.query}" if request.url.query else "")
                )
                return RedirectResponse(f"/signin?next={target}", status_code=303)
            return error_page(request, refused.status, str(refused))
        except (RunNotFound, EffectNotFound) as error:
            return error_page(request, 404, str(error))
        except asyncpg.InsufficientPrivilegeError as error:  # the database's own check
            return error_page(request, 403, f"refused: {error.message}; nothing changed")
        except asyncpg.InvalidParameterValueError as error:  # a database function's
            return error_page(request, 400, f"{error.message}; nothing changed")
        except OrchestratorError as error:
            return error_page(request, 400, str(error))
        except DATABASE_ERRORS as error:
            detail = str(error).splitlines()[0] if str(error) else type(error).__name__
            return error_page(request, 503, f"the database failed ({detail}); try again")

    return wrapped


def error_page(request: Request, status: int, message: str) -> Response:
    line = " ".join(message.split())
    if _api_client(request):
        headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
        return JSONResponse({"error": line}, status_code=status, headers=headers)
    return render(request, "error.html", {"status": status, "message": line}, status)


# -- actions -----------------------------------------------------------------------------------
async def form_of(request: Request) -> FormData:
    length = request.headers.get("content-length", "")
    if not (length.isascii() and length.isdecimal()):
        raise Refused(411, "a form must say its length (Content-Length)")
    if int(length) > MAX_FORM_BYTES:
        raise Refused(413, f"a form of the console is at most {MAX_FORM_BYTES} bytes")
    try:
        return await request.form(max_files=0, max_fields=MAX_FORM_FIELDS)
    except HTTPException as error:
        raise Refused(400, f"the form could not be read: {error.detail}") from None


async def require(request: Request, permission: Permission) -> Visitor:
    """The visitor, if they may do this: who they are, then their role, then the Origin."""
    console = state(request)
    if not console.can_sign_in:
        raise Refused(
            403,
            "this console is read-only: start it with ORCHESTRATOR_CONSOLE_TOKEN or "
            "--token-file (or --accounts) to allow actions",
        )
    found = await visitor(request)
    if not found.known and _api_client(request):
        raise Refused(
            401,
            f"wrong bearer token: nothing changed; send this console's {TOKEN_ENV}"
            if console.accounts is None
            else "unknown bearer token: nothing changed",
        )
    if not found.known:
        raise Refused(403, "sign in first (or send Authorization: Bearer TOKEN): actions need it")
    if not found.may(permission):
        raise Refused(
            403,
            f"refused: {found.label} may not {_ACTION_OF[permission]}; nothing changed (an "
            "admin changes roles with `orchestrator users add NAME --role ROLE`)",
        )
    # A bearer header cannot be forged by another site; a cookie or a proxy's header can.
    bearer = not found.session and (found.shared_token or found.via is access.Via.TOKEN)
    if not origin_acceptable(request, Via.BEARER if bearer else Via.COOKIE):
        raise Refused(
            403,
            "refused: the request's Origin header does not name this console (a form "
            "posted from another site, or a client that sent none)",
        )
    return found


async def acting(request: Request, permission: Permission) -> tuple[FormData, Actor]:
    """An action's form, once who may do it is checked, and the actor it is recorded as."""
    found = await require(request, permission)
    form = await form_of(request)
    by = actor(field(form, "by")) if found.shared_token else found.actor()
    return form, by


def back(
    request: Request,
    form: FormData,
    *,
    flash: str | None = None,
    error: OrchestratorError | None = None,
) -> Response:
    """Post/redirect/get: the page the form came from, saying what happened."""
    kind, message = ("flash", flash or "") if error is None else ("error", str(error))
    message = " ".join(message.split())
    if _api_client(request):
        # An API client: the answer itself, not a page to follow.
        if error is not None:
            return JSONResponse({"error": message}, status_code=_status_of(error))
        return JSONResponse({"ok": True, "detail": message})
    target = local(field(form, "next"))
    separator = "&" if "?" in target else "?"
    signature = _signature(state(request).flash_key, kind, message)
    query_string = f"{kind}={quote(message)}&sig={signature}"
    return RedirectResponse(f"{target}{separator}{query_string}", status_code=303)


_ACTION_OF = {
    Permission.DECIDE: "approve or deny (approvers and admins do)",
    Permission.OPERATE: "resolve, cancel, retry, signal or top up (operators and admins do)",
}


def _signature(key: bytes, kind: str, message: str) -> str:
    digest = hmac.new(key, f"{kind}:{message}".encode(), hashlib.sha256)
    return digest.hexdigest()[:32]


def _message_of(request: Request, kind: str) -> str | None:
    key = state(request).flash_key
    message = request.query_params.get(kind)
    signature = request.query_params.get("sig", "")
    if message is None or not hmac.compare_digest(signature, _signature(key, kind, message)):
        return None
    return message


def _api_client(request: Request) -> bool:
    """A request that says it is a program's (a bearer token, no browser's Origin): it gets
    JSON, errors included, never a page. A browser cannot be made to send such a request by
    another site (a cross-site Authorization header needs a CORS preflight, which is refused)."""
    scheme, _, _ = request.headers.get("authorization", "").partition(" ")
    return scheme.lower() == "bearer" and "origin" not in request.headers


def _status_of(error: OrchestratorError) -> int:
    """An API client's status for a refused action: what was wrong, not only that it was."""
    if isinstance(error, (RunNotFound, EffectNotFound)):
        return 404
    if isinstance(error, InvalidInput):
        return 400
    return 409


def field(form: FormData, name: str) -> str | None:
    value = form.get(name)
    if value is None or not isinstance(value, str):
        return None
    return value.strip() or None


def local(target: str | None) -> str:
    """Only a path on this console: a ``next`` naming another site would be an open redirect."""
    if not target:
        return "/"
    parts = urlsplit(target)
    if (
        parts.scheme
        or parts.netloc
        or not target.startswith("/")
        or target.startswith("//")
        or "\\" in target  # browsers read a backslash in a URL as a slash
    ):
        return "/"
    return target
