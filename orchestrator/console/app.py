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
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.templating import Jinja2Templates

from orchestrator.access import Actor
from orchestrator.db.deadlines import DATABASE_ERRORS
from orchestrator.db.stores import Stores
from orchestrator.effects.approvals import Decision
from orchestrator.effects.store import EffectNotFound
from orchestrator.errors import InvalidInput, OrchestratorError, RunNotFound

from . import views
from .auth import NAME_COOKIE, SESSION_COOKIE, TOKEN_ENV, Auth, Via, actor, origin_acceptable
from .privacy import MAX_SHOWN_BYTES, Shown

TEMPLATES = Path(__file__).parent / "templates"
STATIC = Path(__file__).parent / "static"
REFRESH_SECONDS = 3
MAX_FORM_FIELDS = 20


PAGE_SECONDS = 10.0
"""A page or action the database has not answered by then is a 503, not a hung request."""
HEALTH_SECONDS = 2.0
MAX_FORM_BYTES = 64 * 1024
"""No form of the console is larger; a bigger body is refused before it is read."""


@dataclass(frozen=True)
class ConsoleConfig:
    auth: Auth
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

    def render(request: Request, name: str, context: dict[str, Any], status: int = 200) -> Response:
        via = auth.via(request)
        common = {
            "can_act": via is not Via.NONE,
            "auth_enabled": auth.enabled,
            "signed_in": via is Via.COOKIE,
            "show_payloads": config.show_payloads,
            "refresh_seconds": config.refresh_seconds,
            "live": False,
            "name": request.cookies.get(NAME_COOKIE, ""),
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
            except (RunNotFound, EffectNotFound) as error:
                return error_page(request, 404, str(error))
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
        filters = views.RunFilters.from_query(request.query_params)
        context = await views.runs_page(stores, filters)
        return render(request, "runs.html", {**context, "live": True})

    @page
    async def run(request: Request) -> Response:
        context = await views.run_page(
            stores, request.path_params["run_id"], reveal=config.show_payloads
        )
        return render(request, "run.html", context)

    @page
    async def attention(request: Request) -> Response:
        context = await views.attention_page(stores, reveal=config.show_payloads)
        return render(request, "attention.html", {**context, "live": True})

    @page
    async def cluster(request: Request) -> Response:
        context = await views.cluster_page(stores)
        return render(request, "cluster.html", {**context, "live": True})

    @page
    async def signin_form(request: Request) -> Response:
        return render(request, "signin.html", {"next": _local(request.query_params.get("next"))})

    async def healthz(request: Request) -> Response:
        try:
            with anyio.fail_after(HEALTH_SECONDS):
                await pool.fetchval("SELECT 1")
        except DATABASE_ERRORS as error:  # TimeoutError among them
            return JSONResponse({"ok": False, "reason": type(error).__name__}, status_code=503)
        return JSONResponse({"ok": True, "read_only": not auth.enabled})

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

    def require_token(request: Request) -> None:
        if not auth.enabled:
            raise Refused(
                403,
                "this console is read-only: start it with ORCHESTRATOR_CONSOLE_TOKEN or "
                "--token-file to allow actions",
            )
        via = auth.via(request)
        if via is Via.NONE and _api_client(request):
            raise Refused(
                401, f"wrong bearer token: nothing changed; send this console's {TOKEN_ENV}"
            )
        if via is Via.NONE:
            raise Refused(
                403, "sign in first (or send Authorization: Bearer TOKEN): actions need the token"
            )
        if not origin_acceptable(request, via):
            raise Refused(
                403,
                "refused: the request's Origin header does not name this console (a form "
                "posted from another site, or a client that sent none)",
            )

    async def effect_action(request: Request) -> tuple[str, str, FormData]:
        """An action on one effect: the token checked first, then its run id, key and form."""
        require_token(request)
        form = await form_of(request)
        return request.path_params["run_id"], request.path_params["effect_key"], form

    @page
    async def signin(request: Request) -> Response:
        if not auth.enabled:
            raise Refused(403, "this console is read-only: there is no token to sign in with")
        if not origin_acceptable(request, Via.COOKIE):
            raise Refused(403, "refused: the sign-in form was not posted from this console")
        form = await form_of(request)
        name = actor(_field(form, "name"))
        if not auth.token_matches(_field(form, "token") or ""):
            raise Refused(403, "wrong token: nothing changed; check ORCHESTRATOR_CONSOLE_TOKEN")
        response = RedirectResponse(_local(_field(form, "next")), status_code=303)
        secure = request.url.scheme == "https"
        for cookie, value in (
            (SESSION_COOKIE, auth.session_value()),
            (NAME_COOKIE, name.note or ""),
        ):
            response.set_cookie(
                cookie, value, httponly=True, samesite="strict", secure=secure, path="/"
            )
        return response

    @page
    async def signout(request: Request) -> Response:
        if not origin_acceptable(request, Via.COOKIE):
            raise Refused(403, "refused: the sign-out form was not posted from this console")
        response = RedirectResponse("/", status_code=303)
        response.delete_cookie(SESSION_COOKIE, path="/")
        response.delete_cookie(NAME_COOKIE, path="/")
        return response

    @page
    async def decide(request: Request) -> Response:
        run_id, key, form = await effect_action(request)
        verb = request.path_params["verb"]
        decision = {"approve": Decision.APPROVED, "deny": Decision.DENIED}.get(verb)
        if decision is None:
            raise Refused(404, f"no action {verb!r}: approve, deny or resolve")
        by = actor(_field(form, "by"))
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
        run_id, key, form = await effect_action(request)
        by = actor(_field(form, "by"))
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
        Route("/runs/{run_id}/effects/{effect_key:path}/resolve", resolve, methods=["POST"]),
        Route("/runs/{run_id}/effects/{effect_key:path}/{verb}", decide, methods=["POST"]),
        Route("/healthz", healthz),
        Mount("/static", StaticFiles(directory=STATIC), name="static"),
    ]

    async def not_found(request: Request, exc: Exception) -> Response:
        status = exc.status_code if isinstance(exc, HTTPException) else 500
        detail = exc.detail if isinstance(exc, HTTPException) else "internal error"
        if request.method == "POST" and not auth.enabled:
            # Read-only: say so for every POST, whatever its path.
            return error_page(request, 403, "this console is read-only: nothing can be changed")
        return error_page(request, status, f"{detail}: {request.url.path}")

    return Starlette(
        routes=routes,
        exception_handlers={HTTPException: not_found},
        middleware=[Middleware(TrustedHostMiddleware, allowed_hosts=list(config.allowed_hosts))],
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


def _signed(actor: Actor) -> str:
    """``shared-token (alice)``: the principal, then the name the person typed."""
    return f"{actor.principal} ({actor.note})" if actor.note else str(actor.principal)
