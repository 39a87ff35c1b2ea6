"""The action proxy: the effect boundary over HTTP, for workers in other processes or languages.

``POST /v1/effects`` with ``{"run_id", "effect_key", "fence", "kind", "payload"}`` (and optional
``"policy"``, ``"worker_id"``, ``"requires_approval"``, ``"approval_seconds"``) applies exactly
the rules a step's commit applies, in one transaction, and answers:

- 201 ``accepted`` (new record) or 200 ``existing`` / ``replaced`` (the record and its status);
- 404 ``unknown_run`` when no run has that id (nothing is recorded);
- 409 when the run is not running under that fence, with ``current_fence`` and ``run_state``:
  ``stale_fence`` (older than the current fence: the caller was replaced), ``fence_not_granted``
  (above it: no claim ever returned that fence), ``run_not_running`` (queued or waiting),
  ``run_cancelled``, ``run_finished``; ``key_conflict`` when the key is already used with
  another kind or policy;
- 400/413/422 for malformed JSON, an oversized body, or invalid fields; 401 without a valid
  bearer token; 503 when the database cannot be reached (or the fence store below fails);
- 409 ``fence_regression`` when the fence is below the one this proxy remembers for the run.

``GET /v1/effects/{run_id}/{effect_key}`` reads a record. ``GET /healthz`` needs no token.

**Tokens.** Two kinds of bearer are accepted. The flat tokens given at start
(``ORCHESTRATOR_PROXY_TOKENS``, ``--tokens-file``) allow anything, as they always did. With an
``AccessStore`` (``effects serve`` always passes one), a bearer shaped ``orc_<id>_<secret>`` is a
database token (``orchestrator users token create``): only a working token (not revoked, not
expired) of an enabled principal of kind ``service`` is taken; a person's token is answered 403
``forbidden`` (people use the console and the CLI; services use the proxy), any other 401. A
database token's scope (agents, effect kinds, a maximum amount at a payload field) is checked
before anything is recorded: a request outside it is answered 403 ``forbidden`` with the
``reason``, counted (``orchestrator_proxy_requests_total{outcome="forbidden"}``), and nothing is
recorded; reading an effect of a run whose agent is outside the token's agents is 403 too.
The database's answer about a token is cached in memory (by the token's sha256, never the
token; ``auth_cache_seconds``, 5 s by default, bounded in size), so **a revoked or expired
token, or a disabled principal's, still works for up to that long** in a proxy that saw it just
before. A token is never logged, nor put in a metric label; a database token's principal and
token id are logged with the proxy's refusals.

**Fence regressions** (with ``effects serve --fence-store PATH``; without one the proxy checks
fences against the database alone, as it always did). The proxy remembers, in a store of its own
(``effects/fence_store.py``: a SQLite file on its own disk, outside the database that may fail
over), the highest fence it has accepted for each run. A request whose fence is below that is
answered 409 ``fence_regression`` with ``remembered_fence`` and ``presented_fence`` (and, as in
the other 409s, ``accepted_fence`` and ``current_fence``: the remembered fence; ``run_state``:
null, since the database was not asked), logged at error level and counted
(``orchestrator_proxy_requests_total{outcome="fence_regression"}``); nothing is recorded and
nothing is sent. Why: after a failover the promoted database may have lost the transactions
that raised the run's fence, and would take the replaced worker for the owner again.

The order, per request: requests for one run take turns in this process (a lock per run); the
store is read (refused here if regressed, before any connection is taken); the boundary's rule
runs in a transaction; if the database accepted, the store is read again (the wait for a
connection may have spanned a failover), and a fence above the remembered one is written to the
store durably (``admit``: check and raise in one ``BEGIN IMMEDIATE`` SQLite transaction, fsynced)
**before** the database transaction commits. Only that commit makes the effect visible to a
dispatcher, so nothing acts on a request under a new higher fence before the proxy's record of
it is on disk; and a fence the database refuses (forged, or not yet granted) is never
remembered. Across proxy processes sharing the file, the database's row locks serialize a run's
acceptances and SQLite's write lock serializes the check-and-raise. If the store fails the
transaction rolls back and the answer is 503 ``unavailable``: nothing was recorded, retry.
"""

from __future__ import annotations

import dataclasses
import hmac
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, cast

import anyio
import asyncpg
import structlog
from opentelemetry import metrics
from opentelemetry.metrics import Counter
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from orchestrator.access import PrincipalKind, TokenScope
from orchestrator.db.access import AccessStore, Authenticated, looks_like_token, token_sha256
from orchestrator.db.deadlines import DATABASE_ERRORS
from orchestrator.db.executor import Executor
from orchestrator.db.run_reads import RunReads
from orchestrator.effect_model import (
    DEFAULT_APPROVAL_SECONDS,
    Acceptance,
    AcceptOutcome,
    Effect,
    EffectPolicy,
    EffectRecord,
)
from orchestrator.effects.fence_store import FenceStore, FenceStoreUnavailable, Remembered
from orchestrator.effects.store import EffectNotFound, EffectStore
from orchestrator.errors import InvalidInput, error_fields
from orchestrator.ids import RUN_ID_PATTERN
from orchestrator.jsontext import jsonable
from orchestrator.storable import InvalidJson, check_bigint, check_text, parse_document
from orchestrator.telemetry import EFFECT_KEY, RUN_FENCE, RUN_ID, TRACER_NAME, WORKER_ID

DEFAULT_MAX_BODY_BYTES = 256 * 1024
MAX_WORKER_ID = 200
FENCE_REGRESSION = "fence_regression"
"""The proxy's own refusal (reason code and metric outcome): a fence below the one it remembers."""
FORBIDDEN = "forbidden"
"""The proxy's refusal of a database token (reason code and metric outcome): a person's token, or
a request outside the token's scope."""
DEFAULT_AUTH_CACHE_SECONDS = 5.0
DEFAULT_AUTH_CACHE_SIZE = 1024

log = structlog.get_logger("orchestrator.proxy")


def _error(status: int, error: str, detail: str, **extra: Any) -> JSONResponse:
    return JSONResponse({"error": error, "detail": detail, **extra}, status_code=status)


def _forbidden(reason: str) -> JSONResponse:
    """403 ``forbidden``: the reason both as the usual ``detail`` and as ``reason``."""
    return _error(403, FORBIDDEN, reason, reason=reason)


def _unauthorized() -> JSONResponse:
    return _error(401, "unauthorized", "send Authorization: Bearer <token>")


@dataclass(frozen=True)
class Caller:
    """Who presented the bearer: a flat token's holder (no principal, no limits, as before
    database tokens) or a service's database token, so a request is judged by its scope."""

    principal: str | None = None
    token_id: str | None = None
    scope: TokenScope = dataclasses.field(default_factory=TokenScope)

    def log_fields(self) -> dict[str, str]:
        """What a log line may say about the caller: never the token, only its public id (and
        nothing for a flat token's holder, whose lines stay as they were)."""
        fields = {"principal": self.principal, "token_id": self.token_id}
        return {name: value for name, value in fields.items() if value is not None}


FLAT_TOKEN = Caller()


class AuthCache:
    """The database's recent answers about presented tokens, keyed by the token's sha256 (the
    token itself is never kept), so a busy agent costs no query per request; an answer is
    trusted for ``seconds``, which bounds how late a revocation takes effect here."""

    def __init__(
        self,
        access: AccessStore,
        *,
        seconds: float = DEFAULT_AUTH_CACHE_SECONDS,
        size: int = DEFAULT_AUTH_CACHE_SIZE,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if seconds < 0 or size < 1:
            raise InvalidInput("the token cache needs seconds >= 0 and a size of at least 1")
        self.access = access
        self.seconds = seconds
        self.size = size
        self.clock = clock
        self._answers: OrderedDict[str, tuple[float, Authenticated | None]] = OrderedDict()

    async def authenticate(self, token: str) -> Authenticated | None:
        """The token's owner and scope (None: not a working token), from the cache while fresh."""
        key = token_sha256(token)
        now = self.clock()
        cached = self._answers.get(key)
        if cached is not None and cached[0] > now:
            return cached[1]
        answer = await self.access.authenticate(token)
        if self.seconds > 0:
            self._remember(key, now + self.seconds, answer)
        return answer

    def _remember(self, key: str, until: float, answer: Authenticated | None) -> None:
        """Keep an answer, forgetting the oldest ones beyond ``size``."""
        self._answers.pop(key, None)
        self._answers[key] = (until, answer)
        while len(self._answers) > self.size:
            self._answers.popitem(last=False)


def _bearer(request: Request) -> str | None:
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


def _agent_refusal(scope: TokenScope, agent: str) -> str | None:
    """Why a token may not read a run of ``agent`` (None: it may)."""
    if scope.agents is None or agent in scope.agents:
        return None
    listed = ", ".join(repr(name) for name in sorted(scope.agents))
    return f"this token may read effects of agents {listed} only, not of agent {agent!r}"


class _Regressed(Exception):
    """A fence below the remembered one: answered 409, the transaction (if any) rolled back."""

    def __init__(self, seen: Remembered) -> None:
        super().__init__(seen.fence)
        self.seen = seen


class _RunTurns:
    """One lock per run with requests in flight in this process, dropped when the last leaves:
    a run's requests go through the check, the database and the store one at a time."""

    def __init__(self) -> None:
        self._locks: dict[str, tuple[anyio.Lock, int]] = {}

    @asynccontextmanager
    async def turn(self, run_id: str) -> AsyncIterator[None]:
        lock, users = self._locks.get(run_id) or (anyio.Lock(), 0)
        self._locks[run_id] = (lock, users + 1)
        try:
            async with lock:
                yield
        finally:
            lock, users = self._locks[run_id]
            if users == 1:
                del self._locks[run_id]
            else:
                self._locks[run_id] = (lock, users - 1)


@dataclass(frozen=True)
class ProxyState:
    """What the handlers read from ``request.app.state.proxy``, built once by ``create_app``."""

    pool: asyncpg.Pool
    store: EffectStore
    runs: RunReads
    allowed: tuple[bytes, ...]
    """The flat tokens, which allow anything."""
    cache: AuthCache | None
    """Services' database tokens, when the proxy was given an ``AccessStore``."""
    fences: FenceStore | None
    turns: _RunTurns
    requests: Counter
    max_body_bytes: int

    def flat(self, token: str) -> bool:
        presented = token.encode()
        return any(hmac.compare_digest(presented, candidate) for candidate in self.allowed)


def state(request: Request) -> ProxyState:
    """The proxy's state, typed: Starlette's ``app.state`` is not."""
    return cast(ProxyState, request.app.state.proxy)


def create_app(
    pool: asyncpg.Pool,
    tokens: Iterable[str] = (),
    *,
    fences: FenceStore | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    access: AccessStore | None = None,
    auth_cache_seconds: float = DEFAULT_AUTH_CACHE_SECONDS,
) -> Starlette:
    """The proxy over ``pool``. With ``fences`` (opened by the caller, closed by it after serving;
    the app prunes it in the background while it serves) it remembers the highest fence it
    accepted per run and refuses a lower one; without, the database's rule alone applies. With
    ``access`` it also takes services' database tokens, held to their scopes, trusting the
    database's answer about a token for ``auth_cache_seconds``."""
    allowed = tuple(token.encode() for token in tokens if token)
    if not allowed and access is None:
        raise InvalidInput("the action proxy needs at least one bearer token")
    app = Starlette(
        lifespan=_lifespan,
        routes=[
            Route("/v1/effects", accept, methods=["POST"]),
            Route("/v1/effects/{run_id}/{effect_key:path}", read, methods=["GET"]),
            Route("/healthz", health, methods=["GET"]),
        ],
    )
    app.state.proxy = ProxyState(
        pool=pool,
        store=EffectStore(pool),
        runs=RunReads(pool),
        allowed=allowed,
        cache=None if access is None else AuthCache(access, seconds=auth_cache_seconds),
        fences=fences,
        turns=_RunTurns(),
        requests=metrics.get_meter(TRACER_NAME).create_counter(
            "orchestrator.proxy.requests",
            unit="{request}",
            description="effect requests through the action proxy, by the boundary's answer",
        ),
        max_body_bytes=max_body_bytes,
    )
    return app


@asynccontextmanager
async def _lifespan(app: Starlette) -> AsyncIterator[None]:
    proxy = cast(ProxyState, app.state.proxy)
    # Serving, so the command's meter provider is installed: every answer's series at 0.
    for outcome in [*(o.value for o in AcceptOutcome), FENCE_REGRESSION, FORBIDDEN]:
        proxy.requests.add(0, {"outcome": outcome})
    if proxy.fences is None:
        yield
        return
    async with anyio.create_task_group() as background:
        background.start_soon(proxy.fences.keep_pruned, log)
        yield
        background.cancel_scope.cancel()


async def accept(request: Request) -> JSONResponse:
    proxy = state(request)
    caller = await _caller_of(proxy, request)
    if isinstance(caller, JSONResponse):
        if caller.status_code == 403:
            proxy.requests.add(1, {"outcome": FORBIDDEN})
        return caller
    limit = proxy.max_body_bytes
    declared = request.headers.get("content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > limit):
        return _error(413, "too_large", f"the body is over {limit} bytes")
    body = b""
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            return _error(413, "too_large", f"the body is over {limit} bytes")
    try:
        document = parse_document(body, "the body")
    except InvalidJson as error:
        return _error(400, "invalid_json", str(error))
    except InvalidInput as error:
        return _error(422, "invalid_request", str(error))
    try:
        run_id, fence, effect, worker_id = _parse_request(document)
    except InvalidInput as error:
        return _error(422, "invalid_request", str(error))
    try:
        refused = await _scope_refusal(proxy, caller, run_id, effect)
    except DATABASE_ERRORS as error:
        return _unavailable(error)
    if refused is not None:
        proxy.requests.add(1, {"outcome": refused[1]})
        return refused[0]
    return await _record(proxy, caller, run_id, fence, effect, worker_id)


async def _record(
    proxy: ProxyState,
    caller: Caller,
    run_id: str,
    fence: int,
    effect: Effect,
    worker_id: str | None,
) -> JSONResponse:
    """The boundary's answer to a request that passed every check of the proxy's own."""
    try:
        if proxy.fences is None:
            async with proxy.pool.acquire() as db, db.transaction():
                answer = await proxy.store.accept(db, run_id, fence, effect, worker_id=worker_id)
                record = await _record_of(proxy, db, answer, run_id, effect.key)
        else:
            answer, record = await _accept_fenced(
                proxy, proxy.fences, run_id, fence, effect, worker_id
            )
        proxy.requests.add(1, {"outcome": answer.outcome.value})
    except _Regressed as regressed:
        proxy.requests.add(1, {"outcome": FENCE_REGRESSION})
        return _regression(regressed.seen, run_id, fence, effect.key, worker_id, caller)
    except FenceStoreUnavailable as error:
        log.error(
            "the fence store failed: refusing effect requests until it works",
            **{RUN_ID: run_id, RUN_FENCE: fence, EFFECT_KEY: effect.key},
            **caller.log_fields(),
            **error_fields(error),
        )
        return _error(503, "unavailable", f"{error}; nothing was recorded: retry the request")
    except asyncpg.DataError as error:  # a value validation missed: the client's, not ours
        return _error(422, "invalid_request", f"the database refused a value: {error}")
    except DATABASE_ERRORS as error:
        return _unavailable(error)
    if record is None:
        return _refusal(answer, run_id, effect.key)
    status_code = 201 if answer.outcome is AcceptOutcome.ACCEPTED else 200
    return JSONResponse(
        {"outcome": answer.outcome.value, "effect": jsonable(record)}, status_code=status_code
    )


async def read(request: Request) -> JSONResponse:
    proxy = state(request)
    caller = await _caller_of(proxy, request)
    if isinstance(caller, JSONResponse):
        return caller
    run_id, effect_key = request.path_params["run_id"], request.path_params["effect_key"]
    try:
        refused = await _read_refusal(proxy, caller, run_id)
        if refused is not None:
            return refused
        record = await proxy.store.get(run_id, effect_key)
    except EffectNotFound as error:
        return _error(404, "not_found", str(error))
    except InvalidInput as error:
        return _error(422, "invalid_request", str(error))
    except DATABASE_ERRORS as error:
        return _unavailable(error)
    return JSONResponse({"effect": jsonable(record)})


async def health(request: Request) -> JSONResponse:
    return JSONResponse({"ok": True})


async def _caller_of(proxy: ProxyState, request: Request) -> Caller | JSONResponse:
    """The caller, or the answer that refuses it (401, 403 for a person, 503)."""
    token = _bearer(request)
    if token is None:
        return _unauthorized()
    if proxy.flat(token):
        return FLAT_TOKEN
    if proxy.cache is None or not looks_like_token(token):
        return _unauthorized()
    try:
        found = await proxy.cache.authenticate(token)
    except DATABASE_ERRORS as error:
        return _unavailable(error)
    if found is None:
        return _error(
            401, "unauthorized", "unknown, revoked or expired token: send a working token"
        )
    caller = Caller(found.principal.name, found.token_id, found.scope)
    if found.principal.kind is not PrincipalKind.SERVICE:
        log.warning("a person's token was refused by the action proxy", **caller.log_fields())
        return _forbidden(
            f"this token belongs to {found.principal.name!r}, a person: people act through "
            "the console or the CLI; the action proxy takes service tokens"
        )
    return caller


async def _scope_refusal(
    proxy: ProxyState, caller: Caller, run_id: str, effect: Effect
) -> tuple[JSONResponse, str] | None:
    """The answer and metric outcome refusing a request outside the caller's scope (nothing
    is recorded); None when the scope covers it."""
    if caller.scope.unlimited:
        return None
    agent = ""
    if caller.scope.agents is not None:
        found = await proxy.runs.agent_of(run_id)
        if found is None:
            unknown = Acceptance(AcceptOutcome.UNKNOWN_RUN, None, None)
            return _refusal(unknown, run_id, effect.key), AcceptOutcome.UNKNOWN_RUN.value
        agent = found
    reason = caller.scope.refusal(agent=agent, kind=effect.kind, payload=effect.payload)
    if reason is None:
        return None
    log.warning(
        "effect request outside the token's scope refused",
        reason=reason,
        kind=effect.kind,
        **caller.log_fields(),
        **{RUN_ID: run_id, EFFECT_KEY: effect.key},
    )
    return _forbidden(reason), FORBIDDEN


async def _read_refusal(proxy: ProxyState, caller: Caller, run_id: str) -> JSONResponse | None:
    """403 when the run's agent is outside the caller's agents (an unknown run is left to
    the read, which answers 404)."""
    if caller.scope.agents is None:
        return None
    agent = await proxy.runs.agent_of(run_id)
    reason = None if agent is None else _agent_refusal(caller.scope, agent)
    if reason is None:
        return None
    log.warning(
        "effect read outside the token's scope refused",
        reason=reason,
        **caller.log_fields(),
        **{RUN_ID: run_id},
    )
    return _forbidden(reason)


async def _record_of(
    proxy: ProxyState, db: Executor, answer: Acceptance, run_id: str, effect_key: str
) -> EffectRecord | None:
    """The record the answer carries, read in the acceptance's own transaction: a failover
    after the commit cannot leave an acceptance without its record to show."""
    return None if answer.outcome.refused else await proxy.store.get(run_id, effect_key, db=db)


async def _accept_fenced(
    proxy: ProxyState,
    fences: FenceStore,
    run_id: str,
    fence: int,
    effect: Effect,
    worker_id: str | None,
) -> tuple[Acceptance, EffectRecord | None]:
    """The boundary's rule with the store's: raises ``_Regressed`` (nothing committed)."""
    async with proxy.turns.turn(run_id):
        seen = await fences.remembered(run_id)
        if seen is not None and fence < seen.fence:
            raise _Regressed(seen)  # before a connection is even taken
        async with proxy.pool.acquire() as db, db.transaction():
            answer = await proxy.store.accept(db, run_id, fence, effect, worker_id=worker_id)
            if answer.outcome.refused:
                return answer, None  # the database refused it: nothing to remember
            # Read again: the wait for a connection may have spanned a failover, and
            # another proxy sharing the file may have accepted a newer fence meanwhile.
            seen = await fences.remembered(run_id)
            if seen is not None and fence < seen.fence:
                raise _Regressed(seen)  # rolls the acceptance back
            if fences.needs_admit(seen, fence):
                # On disk before the commit below makes the effect visible to anyone.
                higher = await fences.admit(run_id, fence)
                if higher is not None:
                    raise _Regressed(higher)
            return answer, await _record_of(proxy, db, answer, run_id, effect.key)


def _unavailable(error: BaseException) -> JSONResponse:
    return _error(503, "unavailable", f"the database is unavailable: {type(error).__name__}")


def _regression(
    seen: Remembered,
    run_id: str,
    fence: int,
    effect_key: str,
    worker_id: str | None,
    caller: Caller,
) -> JSONResponse:
    """409 ``fence_regression``, loudly: it means the database forgot a fence (a failover that
    lost transactions) or a replaced worker is still acting; either way a person should know."""
    detail = (
        f"fence {fence} is below fence {seen.fence}, which this proxy already accepted for "
        f"run {run_id}: the database may have lost transactions (a failover?) and the caller was "
        "replaced; refused, nothing recorded or sent"
    )
    log.error(
        "fence regression refused",
        remembered_fence=seen.fence,
        **caller.log_fields(),
        **{RUN_ID: run_id, RUN_FENCE: fence, EFFECT_KEY: effect_key, WORKER_ID: worker_id},
    )
    return _error(
        409,
        FENCE_REGRESSION,
        detail,
        accepted_fence=seen.fence,
        current_fence=seen.fence,
        run_state=None,
        remembered_fence=seen.fence,
        presented_fence=fence,
    )


def _refusal(answer: Acceptance, run_id: str, effect_key: str) -> JSONResponse:
    """404 for a run that does not exist, 409 with what is true now for any other refusal."""
    detail = answer.explain(run_id, effect_key)
    if answer.outcome is AcceptOutcome.UNKNOWN_RUN:
        return _error(404, "unknown_run", detail)
    if answer.outcome is AcceptOutcome.CONFLICT:
        return _error(409, "key_conflict", detail)
    if answer.run_state == "cancelled":
        error = "run_cancelled"
    elif answer.run_state in ("succeeded", "failed", "dead"):
        error = "run_finished"
    else:
        error = _REFUSALS[answer.outcome]
    return _error(
        409,
        error,
        detail,
        accepted_fence=answer.accepted_fence,
        current_fence=answer.accepted_fence,
        run_state=answer.run_state,
    )


_REFUSALS = {
    AcceptOutcome.STALE: "stale_fence",
    AcceptOutcome.FUTURE_FENCE: "fence_not_granted",
    AcceptOutcome.NOT_RUNNING: "run_not_running",
}


def _parse_request(document: Any) -> tuple[str, int, Effect, str | None]:
    if not isinstance(document, dict):
        raise InvalidInput("the body must be a JSON object")
    unknown = set(document) - {
        "run_id",
        "effect_key",
        "fence",
        "kind",
        "payload",
        "policy",
        "worker_id",
        "requires_approval",
        "approval_seconds",
    }
    if unknown:
        raise InvalidInput(f"unknown fields: {', '.join(sorted(unknown))}")
    run_id = document.get("run_id")
    if not isinstance(run_id, str) or not RUN_ID_PATTERN.fullmatch(run_id):
        raise InvalidInput("run_id must be a run id string such as r_01jd3k5q8m2x7c9v4b6n0p1r2s")
    fence = check_bigint(document.get("fence"), "fence (the one your claim returned)", minimum=1)
    for field in ("effect_key", "kind"):
        if not isinstance(document.get(field), str):
            raise InvalidInput(f"{field} must be a string")
    if "payload" not in document:
        raise InvalidInput("payload is required (any JSON value)")
    try:
        policy = EffectPolicy(document.get("policy", EffectPolicy.IRREVERSIBLE.value))
    except ValueError:
        raise InvalidInput("policy must be 'irreversible' or 'replaceable'") from None
    worker_id = document.get("worker_id")
    if worker_id is not None:
        if not isinstance(worker_id, str) or not 1 <= len(worker_id) <= MAX_WORKER_ID:
            raise InvalidInput(f"worker_id must be a string of 1-{MAX_WORKER_ID} characters")
        check_text(worker_id, "worker_id")
    approval = document.get("requires_approval", False)
    if not isinstance(approval, bool):
        raise InvalidInput("requires_approval must be true or false")
    seconds = document.get("approval_seconds", DEFAULT_APPROVAL_SECONDS)
    if isinstance(seconds, bool) or not isinstance(seconds, int | float):
        raise InvalidInput("approval_seconds must be a number of seconds")
    effect = Effect(
        document["effect_key"],
        document["kind"],
        document["payload"],
        policy,
        requires_approval=approval,
        approval_seconds=float(seconds),
    )
    return run_id, fence, effect, worker_id
