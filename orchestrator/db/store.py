"""The run store: leases and fencing tokens on PostgreSQL.

Every method is one statement, or one transaction, whose WHERE clause carries the ownership
conditions; a method that finds its conditions no longer hold changes nothing and says so
(``None`` or ``False``), and the caller treats that as lost ownership. ``RunStore`` is composed
of its parts, one module each: reads (run_reads.py), leases (leases.py) and fenced commits
(commits.py); submitting, cancelling and retrying runs are here.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import TypeAlias, TypedDict

import asyncpg

from orchestrator.access import Actor
from orchestrator.backoff import Backoff
from orchestrator.db.audit import decide
from orchestrator.db.commit_records import (
    FailOutcome,
    InTransaction,
    Park,
    RunFinish,
    StepCommit,
    StepEvent,
)
from orchestrator.db.commits import Commits
from orchestrator.db.leases import Leases
from orchestrator.db.limits import check_flow
from orchestrator.db.queries import query
from orchestrator.db.run_reads import MAX_LIST_LIMIT, RunReads
from orchestrator.db.workers import (
    LIVENESS_LOCK_NAMESPACE,
    REREGISTER_GRACE_SECONDS,
    ExpiredLease,
    WorkerRegistry,
    liveness_namespace,
)
from orchestrator.errors import (
    IdempotencyConflict,
    InvalidInput,
    InvalidTransition,
    RunAlreadyExists,
)
from orchestrator.ids import new_run_id, validate_agent_name, validate_run_id
from orchestrator.jsontext import compact, utf8_size
from orchestrator.models import JSON, Run, Submission
from orchestrator.settings import DEFAULT_MAX_INPUT_BYTES
from orchestrator.storable import check_json, check_text
from orchestrator.telemetry import current_traceparent

MAX_ATTEMPTS_LIMIT = 1_000

Refusal: TypeAlias = "Callable[[Run], str]"
"""Why an operator's transition was refused, given the run as it is."""


def encode_input(value: JSON, *, max_bytes: int) -> JSON:
    """Validate a run's input: a JSON object no larger than ``max_bytes`` once encoded."""
    if not isinstance(value, dict):
        raise InvalidInput(
            f'input must be a JSON object (for example {{"topic": "..."}}), '
            f"not a {type(value).__name__}"
        )
    check_json(value, "input")
    try:
        size = utf8_size(compact(value))
    except (TypeError, ValueError) as error:
        raise InvalidInput(f"input is not JSON-serialisable: {error}") from None
    if size > max_bytes:
        raise InvalidInput(
            f"input is {size:,} bytes, over the {max_bytes:,}-byte limit; store large documents "
            "elsewhere and pass a reference, or raise ORCHESTRATOR_MAX_INPUT_BYTES"
        )
    return value


class SubmitOptions(TypedDict, total=False):
    """A submission's options besides its agent, input and start time."""

    run_id: str | None
    idempotency_key: str | None
    max_attempts: int
    concurrency_key: str | None
    priority: int


class RunStore(RunReads, Leases, Commits):
    """Typed operations on runs; see ``sql/queries.sql`` for the statements and their rules."""

    def __init__(
        self,
        pool: asyncpg.Pool,
        *,
        max_input_bytes: int = DEFAULT_MAX_INPUT_BYTES,
        backoff: Backoff | None = None,
    ) -> None:
        super().__init__(pool, backoff=backoff)
        self.max_input_bytes = max_input_bytes

    async def submit(
        self,
        agent: str,
        input: JSON,
        *,
        run_id: str | None = None,
        idempotency_key: str | None = None,
        max_attempts: int = 5,
        not_before: datetime | None = None,
        concurrency_key: str | None = None,
        priority: int = 0,
    ) -> Submission:
        """Queue a run (due at ``not_before``, or now). The same idempotency key returns the run
        it first created. ``concurrency_key`` and ``priority``: docs/flow-control.md."""
        validate_agent_name(agent)
        check_flow(concurrency_key, priority)
        if not_before is not None and not_before.utcoffset() is None:
            raise InvalidInput("a run's start time must be timezone-aware (e.g. 2026-12-24T09:00Z)")
        encode_input(input, max_bytes=self.max_input_bytes)
        if run_id is not None:
            validate_run_id(run_id)
        if not 1 <= max_attempts <= MAX_ATTEMPTS_LIMIT:
            raise InvalidInput(f"max attempts must be between 1 and {MAX_ATTEMPTS_LIMIT}")
        if idempotency_key is not None:
            check_text(idempotency_key, "the idempotency key")
            if not 1 <= len(idempotency_key) <= 200:
                raise InvalidInput("an idempotency key must be 1-200 characters")
        record = await self.pool.fetchrow(
            query("submit_run"),
            run_id or new_run_id(),
            agent,
            input,
            max_attempts,
            idempotency_key,
            not_before,
            current_traceparent(),
            concurrency_key,
            priority,
        )
        if record is not None:
            return Submission(Run.from_record(record), created=True)
        if idempotency_key is not None:
            existing = await self.pool.fetchrow(
                query("get_run_by_idempotency_key"), idempotency_key
            )
            if existing is not None:
                run = Run.from_record(existing)
                if run.agent != agent or run.input != input:
                    raise IdempotencyConflict(
                        f"idempotency key {idempotency_key!r} was already used for run "
                        f"{run.run_id} with a different agent or input; use a new key for a new run"
                    )
                return Submission(run, created=False)
        raise RunAlreadyExists(
            f"run id {run_id!r} is already taken; omit --run-id to get a fresh one"
        )

    async def watch(self, run_id: str) -> None:
        """Mark the run watched, before a client reads it: its final commit will then NOTIFY
        orchestrator_finished, so the client waits without polling."""
        await self.pool.execute(query("watch_run"), run_id)

    # -- operator actions ---------------------------------------------------------------------
    async def cancel(
        self, run_id: str, *, reason: str | None = None, actor: Actor | None = None
    ) -> Run:
        """Cancel an unfinished run and raise its fence, so its owner can no longer act; by
        ``actor`` (None: the database role that connected), in the timeline and audit trail."""
        validate_run_id(run_id)
        if reason is not None:
            check_text(reason, "the cancel reason")
            if len(reason) > 2000:
                raise InvalidInput("the cancel reason must be at most 2000 characters")
        return await self._transition(
            run_id,
            "cancel",
            actor,
            query("cancel_run"),
            (run_id, reason),
            lambda run: (
                f"run {run_id} is already {run.state.value}; only queued, waiting or "
                "running runs can be cancelled"
            ),
        )

    async def retry(self, run_id: str, *, actor: Actor | None = None) -> Run:
        """Requeue a dead-lettered run with a fresh set of attempts (audited like a cancel)."""
        return await self._transition(
            run_id,
            "retry",
            actor,
            query("requeue_dead"),
            (run_id,),
            lambda run: (
                f"run {run_id} is {run.state.value}, not dead; only dead-lettered runs "
                "can be retried (submit a new run to repeat a finished one)"
            ),
        )

    async def _transition(
        self,
        run_id: str,
        action: str,
        actor: Actor | None,
        statement: str,
        arguments: tuple[object, ...],
        refusal: Refusal,
    ) -> Run:
        """An operator's transition by ``actor`` (None: the database role that connected),
        which its database function audits in the same transaction: no row back means the run
        was in a state it does not apply to, and ``refusal`` says which (``RunNotFound`` if
        there is no such run). Who decides is passed after ``arguments``."""
        validate_run_id(run_id)
        acting = Actor.acting(actor, None)
        done = await decide(self.pool, action, acting, statement, *arguments, run_id=run_id)
        if done is None:
            raise InvalidTransition(refusal(await self.get(run_id)))
        return await self.get(run_id)


__all__ = [
    "LIVENESS_LOCK_NAMESPACE",
    "MAX_ATTEMPTS_LIMIT",
    "MAX_LIST_LIMIT",
    "REREGISTER_GRACE_SECONDS",
    "ExpiredLease",
    "FailOutcome",
    "InTransaction",
    "Park",
    "RunFinish",
    "RunStore",
    "StepCommit",
    "StepEvent",
    "SubmitOptions",
    "WorkerRegistry",
    "encode_input",
    "liveness_namespace",
]
