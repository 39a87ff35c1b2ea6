"""The action proxy: the effect boundary over HTTP, for workers in other processes or languages.

``POST /v1/effects`` with ``{"run_id", "effect_key", "fence", "kind", "payload"}`` (and optional
``"policy"``, ``"worker_id"``) applies exactly the rules a step's commit applies, in one
transaction, and answers:

- 201 ``accepted`` (new record) or 200 ``existing`` / ``replaced`` (the record and its status);
- 409 ``stale_fence`` with ``accepted_fence`` when the caller's fence is older than the one the
  boundary has accepted (or than the run's current fence): the caller has been replaced;
- 409 ``key_conflict`` when the key is already used with another kind or policy;
- 400/413/422 for malformed JSON, an oversized body, or invalid fields; 401 without a valid
  bearer token; 503 when the database cannot be reached.

``GET /v1/effects/{run_id}/{effect_key}`` reads a record. ``GET /healthz`` needs no token.
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Iterable
from typing import Any

import asyncpg
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from orchestrator.deadlines import DATABASE_ERRORS
from orchestrator.errors import InvalidInput
from orchestrator.ids import RUN_ID_PATTERN
from orchestrator.presentation import jsonable

from .model import Effect, EffectPolicy
from .store import EffectNotFound, EffectStore

DEFAULT_MAX_BODY_BYTES = 256 * 1024


def _error(status: int, error: str, detail: str, **extra: Any) -> JSONResponse:
    return JSONResponse({"error": error, "detail": detail, **extra}, status_code=status)


def create_app(
    pool: asyncpg.Pool, tokens: Iterable[str], *, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
) -> Starlette:
    allowed = [token.encode() for token in tokens if token]
    if not allowed:
        raise InvalidInput("the action proxy needs at least one bearer token")
    store = EffectStore(pool)

    def authorised(request: Request) -> bool:
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token:
            return False
        presented = token.strip().encode()
        return any(hmac.compare_digest(presented, candidate) for candidate in allowed)

    async def accept(request: Request) -> JSONResponse:
        if not authorised(request):
            return _error(401, "unauthorized", "send Authorization: Bearer <token>")
        declared = request.headers.get("content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > max_body_bytes):
            return _error(413, "too_large", f"the body is over {max_body_bytes} bytes")
        body = b""
        async for chunk in request.stream():
            body += chunk
            if len(body) > max_body_bytes:
                return _error(413, "too_large", f"the body is over {max_body_bytes} bytes")
        try:
            document = json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            return _error(400, "invalid_json", f"the body is not JSON: {error}")
        try:
            run_id, fence, effect, worker_id = _parse_request(document)
        except InvalidInput as error:
            return _error(422, "invalid_request", str(error))
        try:
            async with pool.acquire() as db, db.transaction():
                answer = await store.accept(db, run_id, fence, effect, worker_id=worker_id)
        except DATABASE_ERRORS as error:
            return _error(
                503, "unavailable", f"the database is unavailable: {type(error).__name__}"
            )
        if answer.outcome == "stale":
            return _error(
                409,
                "stale_fence",
                f"fence {fence} is older than the accepted fence {answer.accepted_fence}: "
                "another worker owns this run now",
                accepted_fence=answer.accepted_fence,
            )
        if answer.outcome == "conflict":
            return _error(409, "key_conflict", "this effect key is used with another kind/policy")
        record = await store.get(run_id, effect.key)
        status_code = 201 if answer.outcome == "accepted" else 200
        return JSONResponse(
            {"outcome": answer.outcome, "effect": jsonable(record)}, status_code=status_code
        )

    async def read(request: Request) -> JSONResponse:
        if not authorised(request):
            return _error(401, "unauthorized", "send Authorization: Bearer <token>")
        try:
            record = await store.get(
                request.path_params["run_id"], request.path_params["effect_key"]
            )
        except EffectNotFound as error:
            return _error(404, "not_found", str(error))
        except InvalidInput as error:
            return _error(422, "invalid_request", str(error))
        except DATABASE_ERRORS as error:
            return _error(
                503, "unavailable", f"the database is unavailable: {type(error).__name__}"
            )
        return JSONResponse({"effect": jsonable(record)})

    async def health(request: Request) -> JSONResponse:
        return JSONResponse({"ok": True})

    return Starlette(
        routes=[
            Route("/v1/effects", accept, methods=["POST"]),
            Route("/v1/effects/{run_id}/{effect_key:path}", read, methods=["GET"]),
            Route("/healthz", health, methods=["GET"]),
        ]
    )


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
    }
    if unknown:
        raise InvalidInput(f"unknown fields: {', '.join(sorted(unknown))}")
    run_id = document.get("run_id")
    if not isinstance(run_id, str) or not RUN_ID_PATTERN.fullmatch(run_id):
        raise InvalidInput("run_id must be a run id string such as r_01jd3k5q8m2x7c9v4b6n0p1r2s")
    fence = document.get("fence")
    if not isinstance(fence, int) or isinstance(fence, bool) or fence < 1:
        raise InvalidInput("fence must be an integer of at least 1 (the one your claim returned)")
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
    if worker_id is not None and not isinstance(worker_id, str):
        raise InvalidInput("worker_id must be a string")
    effect = Effect(document["effect_key"], document["kind"], document["payload"], policy)
    return run_id, fence, effect, worker_id
