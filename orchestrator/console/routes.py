"""The console's handlers: pages that read, forms that act; each reads the app's state from the
request, so the app factory only wires them."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable

import anyio
from starlette.datastructures import FormData
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, RedirectResponse, Response, StreamingResponse

from orchestrator import access
from orchestrator.access import Actor, Permission
from orchestrator.client.stores import Stores
from orchestrator.client.streaming import OutputFollower
from orchestrator.console import views
from orchestrator.console.auth import NAME_COOKIE, SESSION_COOKIE, Via, actor, origin_acceptable
from orchestrator.console.pages import (
    Refused,
    acting,
    back,
    error_page,
    field,
    form_of,
    local,
    page,
    reader,
    render,
    reveal,
    state,
    visitor,
)
from orchestrator.db.budgets import TopUp
from orchestrator.db.deadlines import DATABASE_ERRORS
from orchestrator.effects.approvals import Decision
from orchestrator.errors import InvalidInput, OrchestratorError
from orchestrator.jsontext import compact, jsonable
from orchestrator.storable import parse_document

HEALTH_SECONDS = 2.0


# -- pages -------------------------------------------------------------------------------------
@page
async def runs(request: Request) -> Response:
    await reader(request)
    filters = views.RunFilters.from_query(request.query_params)
    context = await views.runs_page(state(request).stores, filters)
    return render(request, "runs.html", {**context, "live": True})


@page
async def run(request: Request) -> Response:
    found = await reader(request)
    context = await views.run_page(
        state(request).stores,
        request.path_params["run_id"],
        reveal=reveal(request, found),
        reveal_awaiting=found.may(Permission.DECIDE),
    )
    return render(request, "run.html", {**context, "output_shown": reveal(request, found)})


@page
async def output(request: Request) -> Response:
    """The run's live output as server-sent events, each with its position as its id, so a
    browser that reconnects (``Last-Event-ID``) goes on where it left off; an ``end`` event once
    the run has ended and everything it published was sent. Output is contents: it is served
    to whoever may see them (a role that sees payloads, or a console run with --show-payloads)."""
    found = await reader(request)
    if not reveal(request, found):
        raise Refused(
            403,
            "live output is contents: it is shown to roles that see payloads (or with "
            "--show-payloads)",
        )
    run_id = request.path_params["run_id"]
    raw = request.headers.get("last-event-id") or request.query_params.get("after") or "0"
    if not raw.isdigit() or len(raw) > 18:
        raise Refused(400, f"a stream position is a whole number of 0 or more, not {raw[:40]!r}")
    console = state(request)
    await console.stores.runs.get(run_id)  # RunNotFound: a 404 page, not an empty stream
    return StreamingResponse(
        server_sent(console.follower, run_id, int(raw)),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"},
    )


async def server_sent(follower: OutputFollower, run_id: str, after: int) -> AsyncIterator[str]:
    """``text/event-stream`` of the run's output after ``after``; a failure ends the response
    (the browser reconnects from its last position)."""
    try:
        async for event in follower.stream(run_id, after=after):
            data = compact(jsonable(event))  # one line: JSON escapes every line break
            yield f"id: {event.seq}\nevent: {event.kind.value}\ndata: {data}\n\n"
        yield "event: end\ndata: {}\n\n"
    except DATABASE_ERRORS:
        return
    except OrchestratorError:
        return


@page
async def attention(request: Request) -> Response:
    found = await reader(request)
    context = await views.attention_page(
        state(request).stores,
        reveal=reveal(request, found),
        reveal_awaiting=found.may(Permission.DECIDE),
    )
    return render(request, "attention.html", {**context, "live": True})


@page
async def cluster(request: Request) -> Response:
    await reader(request)
    context = await views.cluster_page(state(request).stores)
    return render(request, "cluster.html", {**context, "live": True})


@page
async def signin_form(request: Request) -> Response:
    await visitor(request)
    return render(request, "signin.html", {"next": local(request.query_params.get("next"))})


async def healthz(request: Request) -> Response:
    console = state(request)
    try:
        with anyio.fail_after(HEALTH_SECONDS):
            await console.pool.fetchval("SELECT 1")
    except DATABASE_ERRORS as error:  # TimeoutError among them
        return JSONResponse({"ok": False, "reason": type(error).__name__}, status_code=503)
    return JSONResponse({"ok": True, "read_only": not console.can_sign_in})


async def not_found(request: Request, exc: Exception) -> Response:
    status = exc.status_code if isinstance(exc, HTTPException) else 500
    detail = exc.detail if isinstance(exc, HTTPException) else "internal error"
    if request.method == "POST" and not state(request).can_sign_in:
        # Read-only: say so for every POST, whatever its path.
        return error_page(request, 403, "this console is read-only: nothing can be changed")
    return error_page(request, status, f"{detail}: {request.url.path}")


# -- signing in and out ------------------------------------------------------------------------
@page
async def signin(request: Request) -> Response:
    console = state(request)
    if not console.can_sign_in:
        raise Refused(403, "this console is read-only: there is no token to sign in with")
    if not origin_acceptable(request, Via.COOKIE):
        raise Refused(403, "refused: the sign-in form was not posted from this console")
    form = await form_of(request)
    if console.accounts is not None:
        return await _signin_with_token(request, form)
    name = actor(field(form, "name"))
    if not console.auth.token_matches(field(form, "token") or ""):
        raise Refused(403, "wrong token: nothing changed; check ORCHESTRATOR_CONSOLE_TOKEN")
    response = RedirectResponse(local(field(form, "next")), status_code=303)
    secure = console.secure_cookies or request.url.scheme == "https"
    for cookie, value in (
        (SESSION_COOKIE, console.auth.session_value()),
        (NAME_COOKIE, name.note or ""),
    ):
        response.set_cookie(
            cookie, value, httponly=True, samesite="strict", secure=secure, path="/"
        )
    return response


async def _signin_with_token(request: Request, form: FormData) -> Response:
    sign_in = state(request).sign_in
    principal, token_id = await sign_in.with_token(field(form, "token") or "")
    await sign_in.begin(request, principal.name, access.Via.TOKEN, token_id=token_id)
    return RedirectResponse(local(field(form, "next")), status_code=303)


@page
async def oidc_start(request: Request) -> Response:
    oidc = state(request).oidc
    if oidc is None:
        raise Refused(404, "this console does not sign in through OpenID Connect")
    request.session["next"] = local(request.query_params.get("next"))
    return await oidc.redirect(request)


@page
async def oidc_callback(request: Request) -> Response:
    console = state(request)
    if console.oidc is None:
        raise Refused(404, "this console does not sign in through OpenID Connect")
    name, role = await console.sign_in.with_oidc(request)
    target = local(request.session.get("next"))
    await console.sign_in.begin(request, name, access.Via.OIDC, role=role)
    return RedirectResponse(target, status_code=303)


@page
async def signout(request: Request) -> Response:
    if not origin_acceptable(request, Via.COOKIE):
        raise Refused(403, "refused: the sign-out form was not posted from this console")
    response = RedirectResponse("/", status_code=303)
    if state(request).accounts is not None:
        request.session.clear()
    response.delete_cookie(SESSION_COOKIE, path="/")
    response.delete_cookie(NAME_COOKIE, path="/")
    return response


# -- actions -----------------------------------------------------------------------------------
async def _effect_action(
    request: Request, permission: Permission
) -> tuple[str, str, FormData, Actor]:
    """An action on one effect: who may do it checked first, then its run id, key and form,
    and the actor it is recorded as."""
    form, by = await acting(request, permission)
    return request.path_params["run_id"], request.path_params["effect_key"], form, by


@page
async def decide(request: Request) -> Response:
    run_id, key, form, by = await _effect_action(request, Permission.DECIDE)
    verb = request.path_params["verb"]
    decision = {"approve": Decision.APPROVED, "deny": Decision.DENIED}.get(verb)
    if decision is None:
        raise Refused(404, f"no action {verb!r}: approve, deny or resolve")
    sha = field(form, "payload_sha256")
    if decision is Decision.APPROVED and not sha:
        raise InvalidInput("an approval must name the payload sha256 it approves")
    fence = _int_field(form, "fence")
    try:
        await state(request).stores.approvals.decide(
            run_id,
            key,
            decision,
            actor=by,
            note=field(form, "note"),
            payload_sha256=sha,
            run_fence=fence,
        )
    except OrchestratorError as error:
        return back(request, form, error=error)
    return back(request, form, flash=f"{decision.value} {key} of {run_id} as {_signed(by)}")


@page
async def resolve(request: Request) -> Response:
    run_id, key, form, by = await _effect_action(request, Permission.OPERATE)
    found = field(form, "decision")
    if found not in ("sent", "not-sent"):
        raise InvalidInput("say what you found: decision must be 'sent' or 'not-sent'")
    try:
        await state(request).stores.effects.resolve(
            run_id, key, sent=found == "sent", actor=by, external_id=field(form, "external_id")
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
        done = await take(state(request).stores, run_id, form, by)
    except OrchestratorError as error:
        return back(request, form, error=error)
    return back(request, form, flash=f"{done} as {_signed(by)}")


def _int_field(form: FormData, name: str) -> int | None:
    raw = field(form, name)
    if raw is None:
        return None
    if not (raw.isascii() and raw.isdecimal()):
        raise InvalidInput(f"{name} must be a whole number, not {raw!r}")
    return int(raw)


async def _cancel(stores: Stores, run_id: str, form: FormData, by: Actor) -> str:
    await stores.runs.cancel(run_id, reason=field(form, "reason"), actor=by)
    return f"cancelled {run_id}"


async def _retry(stores: Stores, run_id: str, form: FormData, by: Actor) -> str:
    await stores.runs.retry(run_id, actor=by)
    return f"requeued {run_id}"


async def _signal(stores: Stores, run_id: str, form: FormData, by: Actor) -> str:
    name = field(form, "name")
    if name is None:
        raise InvalidInput("name the signal (for example customer_reply)")
    raw = field(form, "data")
    data = None if raw is None else parse_document(raw, "the signal's data")
    sent = await stores.signals.send(
        run_id, name, data, idempotency_key=field(form, "idempotency_key"), actor=by
    )
    if not sent.created:  # the same form posted twice: its key stored it once
        return f"signal {name} #{sent.signal.seq} of {run_id} was already sent"
    return f"sent signal {name} #{sent.signal.seq} to {run_id}"


async def _top_up(stores: Stores, run_id: str, form: FormData, by: Actor) -> str:
    amounts: TopUp = {}
    for name in ("turns", "tool_calls", "input_tokens", "output_tokens"):
        raw = field(form, f"add_{name}")
        if raw is not None:
            if not (raw.isascii() and raw.isdecimal()):
                raise InvalidInput(f"add {name.replace('_', ' ')}: a whole number, not {raw!r}")
            amounts[name] = int(raw)
    usd = field(form, "add_usd")
    if usd is not None:
        amounts["cost_usd"] = usd
    await stores.top_up(run_id, actor=by, **amounts)
    return f"topped up the budget of {run_id}"


_RUN_ACTIONS: dict[str, Callable[[Stores, str, FormData, Actor], Awaitable[str]]] = {
    "cancel": _cancel,
    "retry": _retry,
    "signal": _signal,
    "top-up": _top_up,
}
"""What a run's forms post to, each with the permission to operate (operators, admins)."""


def _signed(actor: Actor) -> str:
    """``shared-token (alice)``: the principal, then the name the person typed."""
    return f"{actor.principal} ({actor.note})" if actor.note else str(actor.principal)
