"""The console's routes: pages that read, forms that act, and the checks in front of them."""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit

import anyio
import asyncpg
import jinja2
from markupsafe import Markup
from starlette.applications import Starlette
from starlette.datastructures import FormData
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.sessions import SessionMiddleware
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.templating import Jinja2Templates

from orchestrator import access
from orchestrator.access import Actor, Permission
from orchestrator.budgets import TopUp
from orchestrator.db.deadlines import DATABASE_ERRORS
from orchestrator.db.stores import Stores
from orchestrator.effects.approvals import Decision
from orchestrator.effects.store import EffectNotFound
from orchestrator.errors import InvalidInput, OrchestratorError, RunNotFound
from orchestrator.storable import parse_document

from . import views
from .auth import NAME_COOKIE, SESSION_COOKIE, TOKEN_ENV, Auth, Via, actor, origin_acceptable
from .identity import Accounts, NotAllowed, Visitor, visitor_of
from .oidc import CALLBACK_PATH, OidcConfig, OidcSignIn
from .privacy import MAX_SHOWN_BYTES, Shown
from .signin import AccountSignIn

TEMPLATES = Path(__file__).parent / "templates"
STATIC = Path(__file__).parent / "static"
REFRESH_SECONDS = 3
MAX_FORM_FIELDS = 20


PAGE_SECONDS = 10.0
"""A page or action the database has not answered by then is a 503, not a hung request."""
HEALTH_SECONDS = 2.0
MAX_FORM_BYTES = 64 * 1024
"""No form of the console is larger; a bigger body is refused before it is read."""


ACCOUNTS_COOKIE = "orchestrator_console_account"


@dataclass(frozen=True)
class ConsoleConfig:
    auth: Auth
    accounts: Accounts | None = None
    """Accounts mode: people sign in as themselves and their role decides (``auth`` unused)."""
    oidc: OidcConfig | None = None
    session_key: str = ""
    """Signs accounts-mode session cookies; empty: a random key (sessions end on restart)."""
    secure_cookies: bool = False
    """Accounts-mode session cookies only over https (browsers reach the console through TLS)."""
    show_payloads: bool = False
    schema: str = "orchestrator"
    refresh_seconds: float = REFRESH_SECONDS
    allowed_hosts: Sequence[str] = ("127.0.0.1", "localhost", "::1")
    """Host headers served (``*``: any). Pages need no token to read, so a page served to any
    Host could be read by another site through DNS rebinding."""


class Refused(Exception):
    """An action the console will not take; the page says why, with this status."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def _templates() -> Jinja2Templates:
    environment = jinja2.Environment(
        loader=jinja2.FileSystemLoader(TEMPLATES),
        # Every value is escaped: run data may hold markup, and a page must never run it.
        autoescape=True,
        undefined=jinja2.StrictUndefined,
    )
    environment.tests["shown"] = lambda value: isinstance(value, Shown)
    environment.filters["when"] = _when
    return Jinja2Templates(env=environment)


def _when(value: Any) -> str | Markup:
    if value is None:
        return ""
    if hasattr(value, "strftime"):
        # Marked as a time, so that a narrow column breaks it between date and time only.
        text = value.strftime("%Y-%m-%d %H:%M:%S.%f")[:-3] + "Z"
        return Markup('<span class="time">{}</span>').format(text)
    return str(value)


def create_app(pool: asyncpg.Pool, config: ConsoleConfig) -> Starlette:
    stores = Stores(pool, schema=config.schema)
    templates = _templates()
    auth = config.auth
    accounts = config.accounts
    oidc = OidcSignIn(config.oidc) if config.oidc is not None else None
    if oidc is not None and accounts is None:
        raise ValueError("OpenID Connect sign-in needs accounts mode")
    can_sign_in = accounts is not None or auth.enabled
    sign_in = AccountSignIn(stores.access, oidc)
    flash_key = secrets.token_bytes(32)
    """Signs the messages a redirect carries, so that a link cannot put words in the banner."""

    def signed(kind: str, message: str) -> str:
        return hmac.new(flash_key, f"{kind}:{message}".encode(), hashlib.sha256).hexdigest()[:32]

    def message_of(request: Request, kind: str) -> str | None:
        message = request.query_params.get(kind)
        signature = request.query_params.get("sig", "")
        if message is None or not hmac.compare_digest(signature, signed(kind, message)):
            return None
        return message

    async def visitor(request: Request) -> Visitor:
        """Who sent ``request`` (worked out once per request): in accounts mode, a principal of
        ``orchestrator users``; else whether it holds the shared token."""
        known = getattr(request.state, "visitor", None)
        if isinstance(known, Visitor):
            return known
        if accounts is not None:
            found = await visitor_of(request, accounts, stores.access)
        else:
            found = token_holder(request)
        request.state.visitor = found
        return found

    def token_holder(request: Request) -> Visitor:
        """Shared-token mode: whether the request holds the token (no database read)."""
        via = auth.via(request)
        return Visitor(shared_token=via is not Via.NONE, session=via is Via.COOKIE)

    async def reader(request: Request) -> Visitor:
        """The visitor of a page: in accounts mode, only someone signed in reads."""
        found = await visitor(request)
        if accounts is not None and not found.known:
            raise NotAllowed(401, "sign in first: this console shows runs to its users only")
        return found

    def reveal(found: Visitor) -> bool:
        """Contents are shown to roles that see payloads (accounts mode), else with
        --show-payloads."""
        return found.may(Permission.SEE_PAYLOADS) if accounts is not None else config.show_payloads

    def render(request: Request, name: str, context: dict[str, Any], status: int = 200) -> Response:
        # A page rendered before anyone asked who is visiting (an unknown path's 404) still
        # shows a shared-token holder as signed in; in accounts mode it shows nobody.
        found = getattr(request.state, "visitor", None)
        if found is None:
            found = token_holder(request) if accounts is None else Visitor()
        common = {
            "can_decide": found.may(Permission.DECIDE),
            "can_resolve": found.may(Permission.OPERATE),
            "auth_enabled": can_sign_in,
            "accounts": accounts is not None,
            "oidc": oidc is not None,
            "signed_in": found.session,
            "who": found.label,
            "show_payloads": reveal(found),
            "refresh_seconds": config.refresh_seconds,
            "live": False,
            "name": request.cookies.get(NAME_COOKIE, "") if accounts is None else "",
            "flash": message_of(request, "flash"),
            "flash_error": message_of(request, "error"),
            "max_shown_bytes": MAX_SHOWN_BYTES,
            "path": request.url.path,
        }
        response = templates.TemplateResponse(
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

    # -- pages ---------------------------------------------------------------------------------
    @page
    async def runs(request: Request) -> Response:
        await reader(request)
        filters = views.RunFilters.from_query(request.query_params)
        context = await views.runs_page(stores, filters)
        return render(request, "runs.html", {**context, "live": True})

    @page
    async def run(request: Request) -> Response:
        found = await reader(request)
        context = await views.run_page(
            stores,
            request.path_params["run_id"],
            reveal=reveal(found),
            reveal_awaiting=found.may(Permission.DECIDE),
        )
        return render(request, "run.html", context)

    @page
    async def attention(request: Request) -> Response:
        found = await reader(request)
        context = await views.attention_page(
            stores, reveal=reveal(found), reveal_awaiting=found.may(Permission.DECIDE)
        )
        return render(request, "attention.html", {**context, "live": True})

    @page
    async def cluster(request: Request) -> Response:
        await reader(request)
        context = await views.cluster_page(stores)
        return render(request, "cluster.html", {**context, "live": True})

    @page
    async def signin_form(request: Request) -> Response:
        await visitor(request)
        return render(request, "signin.html", {"next": _local(request.query_params.get("next"))})

    async def healthz(request: Request) -> Response:
        try:
            with anyio.fail_after(HEALTH_SECONDS):
                await pool.fetchval("SELECT 1")
        except DATABASE_ERRORS as error:  # TimeoutError among them
            return JSONResponse({"ok": False, "reason": type(error).__name__}, status_code=503)
        return JSONResponse({"ok": True, "read_only": not can_sign_in})

    # -- actions -------------------------------------------------------------------------------
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
        if not can_sign_in:
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
                if accounts is None
                else "unknown bearer token: nothing changed",
            )
        if not found.known:
            raise Refused(
                403, "sign in first (or send Authorization: Bearer TOKEN): actions need it"
            )
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
        by = actor(_field(form, "by")) if found.shared_token else found.actor()
        return form, by

    async def effect_action(
        request: Request, permission: Permission
    ) -> tuple[str, str, FormData, Actor]:
        """An action on one effect: who may do it checked first, then its run id, key and form,
        and the actor it is recorded as."""
        form, by = await acting(request, permission)
        return request.path_params["run_id"], request.path_params["effect_key"], form, by

    @page
    async def signin(request: Request) -> Response:
        if not can_sign_in:
            raise Refused(403, "this console is read-only: there is no token to sign in with")
        if not origin_acceptable(request, Via.COOKIE):
            raise Refused(403, "refused: the sign-in form was not posted from this console")
        form = await form_of(request)
        if accounts is not None:
            return await signin_with_token(request, form)
        name = actor(_field(form, "name"))
        if not auth.token_matches(_field(form, "token") or ""):
            raise Refused(403, "wrong token: nothing changed; check ORCHESTRATOR_CONSOLE_TOKEN")
        response = RedirectResponse(_local(_field(form, "next")), status_code=303)
        secure = config.secure_cookies or request.url.scheme == "https"
        for cookie, value in (
            (SESSION_COOKIE, auth.session_value()),
            (NAME_COOKIE, name.note or ""),
        ):
            response.set_cookie(
                cookie, value, httponly=True, samesite="strict", secure=secure, path="/"
            )
        return response

    async def signin_with_token(request: Request, form: FormData) -> Response:
        principal, token_id = await sign_in.with_token(_field(form, "token") or "")
        await sign_in.begin(request, principal.name, access.Via.TOKEN, token_id=token_id)
        return RedirectResponse(_local(_field(form, "next")), status_code=303)

    @page
    async def oidc_start(request: Request) -> Response:
        if oidc is None:
            raise Refused(404, "this console does not sign in through OpenID Connect")
        request.session["next"] = _local(request.query_params.get("next"))
        return await oidc.redirect(request)

    @page
    async def oidc_callback(request: Request) -> Response:
        if oidc is None:
            raise Refused(404, "this console does not sign in through OpenID Connect")
        name, role = await sign_in.with_oidc(request)
        target = _local(request.session.get("next"))
        await sign_in.begin(request, name, access.Via.OIDC, role=role)
        return RedirectResponse(target, status_code=303)

    @page
    async def signout(request: Request) -> Response:
        if not origin_acceptable(request, Via.COOKIE):
            raise Refused(403, "refused: the sign-out form was not posted from this console")
        response = RedirectResponse("/", status_code=303)
        if accounts is not None:
            request.session.clear()
        response.delete_cookie(SESSION_COOKIE, path="/")
        response.delete_cookie(NAME_COOKIE, path="/")
        return response

    @page
    async def decide(request: Request) -> Response:
        run_id, key, form, by = await effect_action(request, Permission.DECIDE)
        verb = request.path_params["verb"]
        decision = {"approve": Decision.APPROVED, "deny": Decision.DENIED}.get(verb)
        if decision is None:
            raise Refused(404, f"no action {verb!r}: approve, deny or resolve")
        sha = _field(form, "payload_sha256")
        if decision is Decision.APPROVED and not sha:
            raise InvalidInput("an approval must name the payload sha256 it approves")
        fence = _int_field(form, "fence")
        try:
            await stores.approvals.decide(
                run_id,
                key,
                decision,
                actor=by,
                note=_field(form, "note"),
                payload_sha256=sha,
                run_fence=fence,
            )
        except OrchestratorError as error:
            return back(request, form, error=error)
        return back(request, form, flash=f"{decision.value} {key} of {run_id} as {_signed(by)}")

    @page
    async def resolve(request: Request) -> Response:
        run_id, key, form, by = await effect_action(request, Permission.OPERATE)
        found = _field(form, "decision")
        if found not in ("sent", "not-sent"):
            raise InvalidInput("say what you found: decision must be 'sent' or 'not-sent'")
        try:
            await stores.effects.resolve(
                run_id, key, sent=found == "sent", actor=by, external_id=_field(form, "external_id")
            )
        except OrchestratorError as error:
            return back(request, form, error=error)
        return back(request, form, flash=f"{key} of {run_id} resolved {found} by {_signed(by)}")

    @page
    async def operate(request: Request) -> Response:
        """An operator's action on a run, as the CLI's: cancel, retry, signal, top up."""
        run_id, verb = request.path_params["run_id"], request.path_params["verb"]
        take = _RUN_ACTIONS.get(verb)
        if take is None:
            raise Refused(404, f"no action {verb!r} on a run: cancel, retry, signal or top-up")
        form, by = await acting(request, Permission.OPERATE)
        try:
            done = await take(stores, run_id, form, by)
        except OrchestratorError as error:
            return back(request, form, error=error)
        return back(request, form, flash=f"{done} as {_signed(by)}")

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
        target = _local(_field(form, "next"))
        separator = "&" if "?" in target else "?"
        query_string = f"{kind}={quote(message)}&sig={signed(kind, message)}"
        return RedirectResponse(f"{target}{separator}{query_string}", status_code=303)

    routes = [
        Route("/", runs),
        Route("/runs", runs),
        Route("/runs/{run_id}", run),
        Route("/attention", attention),
        Route("/cluster", cluster),
        Route("/signin", signin_form, methods=["GET"]),
        Route("/signin", signin, methods=["POST"]),
        Route("/signout", signout, methods=["POST"]),
        Route("/signin/oidc", oidc_start, methods=["GET"]),
        Route(CALLBACK_PATH, oidc_callback, methods=["GET"], name="oidc_callback"),
        Route("/runs/{run_id}/effects/{effect_key:path}/resolve", resolve, methods=["POST"]),
        Route("/runs/{run_id}/effects/{effect_key:path}/{verb}", decide, methods=["POST"]),
        Route("/runs/{run_id}/{verb}", operate, methods=["POST"]),
        Route("/healthz", healthz),
        Mount("/static", StaticFiles(directory=STATIC), name="static"),
    ]

    async def not_found(request: Request, exc: Exception) -> Response:
        status = exc.status_code if isinstance(exc, HTTPException) else 500
        detail = exc.detail if isinstance(exc, HTTPException) else "internal error"
        if request.method == "POST" and not can_sign_in:
            # Read-only: say so for every POST, whatever its path.
            return error_page(request, 403, "this console is read-only: nothing can be changed")
        return error_page(request, status, f"{detail}: {request.url.path}")

    middleware = [Middleware(TrustedHostMiddleware, allowed_hosts=list(config.allowed_hosts))]
    if accounts is not None:
        # Signed, not encrypted: it holds a principal's name and the public id of their token.
        # SameSite=Lax, so the provider's redirect back carries the sign-in's state.
        middleware.append(
            Middleware(
                SessionMiddleware,
                secret_key=config.session_key or secrets.token_urlsafe(32),
                session_cookie=ACCOUNTS_COOKIE,
                max_age=int(accounts.session_seconds),
                same_site="lax",
                https_only=config.secure_cookies,
            )
        )
    return Starlette(
        routes=routes, exception_handlers={HTTPException: not_found}, middleware=middleware
    )


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


def _field(form: FormData, name: str) -> str | None:
    value = form.get(name)
    if value is None or not isinstance(value, str):
        return None
    return value.strip() or None


def _int_field(form: FormData, name: str) -> int | None:
    raw = _field(form, name)
    if raw is None:
        return None
    if not (raw.isascii() and raw.isdecimal()):
        raise InvalidInput(f"{name} must be a whole number, not {raw!r}")
    return int(raw)


def _local(target: str | None) -> str:
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


async def _cancel(stores: Stores, run_id: str, form: FormData, by: Actor) -> str:
    await stores.runs.cancel(run_id, reason=_field(form, "reason"), actor=by)
    return f"cancelled {run_id}"


async def _retry(stores: Stores, run_id: str, form: FormData, by: Actor) -> str:
    await stores.runs.retry(run_id, actor=by)
    return f"requeued {run_id}"


async def _signal(stores: Stores, run_id: str, form: FormData, by: Actor) -> str:
    name = _field(form, "name")
    if name is None:
        raise InvalidInput("name the signal (for example customer_reply)")
    raw = _field(form, "data")
    data = None if raw is None else parse_document(raw, "the signal's data")
    sent = await stores.signals.send(
        run_id, name, data, idempotency_key=_field(form, "idempotency_key"), actor=by
    )
    if not sent.created:  # the same form posted twice: its key stored it once
        return f"signal {name} #{sent.signal.seq} of {run_id} was already sent"
    return f"sent signal {name} #{sent.signal.seq} to {run_id}"


async def _top_up(stores: Stores, run_id: str, form: FormData, by: Actor) -> str:
    amounts: TopUp = {}
    for name in ("turns", "tool_calls", "input_tokens", "output_tokens"):
        raw = _field(form, f"add_{name}")
        if raw is not None:
            if not (raw.isascii() and raw.isdecimal()):
                raise InvalidInput(f"add {name.replace('_', ' ')}: a whole number, not {raw!r}")
            amounts[name] = int(raw)
    usd = _field(form, "add_usd")
    if usd is not None:
        amounts["cost_usd"] = usd
    await stores.budgets.top_up(run_id, actor=by, **amounts)
    return f"topped up the budget of {run_id}"


_RUN_ACTIONS: dict[str, Callable[[Stores, str, FormData, Actor], Awaitable[str]]] = {
    "cancel": _cancel,
    "retry": _retry,
    "signal": _signal,
    "top-up": _top_up,
}
"""What a run's forms post to, each with the permission to operate (operators, admins)."""


_ACTION_OF = {
    Permission.DECIDE: "approve or deny (approvers and admins do)",
    Permission.OPERATE: "resolve, cancel, retry, signal or top up (operators and admins do)",
}


def _signed(actor: Actor) -> str:
    """``shared-token (alice)``: the principal, then the name the person typed."""
    return f"{actor.principal} ({actor.note})" if actor.note else str(actor.principal)
