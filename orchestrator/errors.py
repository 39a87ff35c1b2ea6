"""Errors a user can act on.

Every error raised to the command line is an ``OrchestratorError`` whose message says what was
wrong and what to do; the CLI prints it on one line and exits 1. Anything else is a bug.
"""

from __future__ import annotations


def error_fields(error: BaseException) -> dict[str, str]:
    """A caught error as log fields: its type, and its text, or its repr when the text is empty
    (a ``TimeoutError`` from a deadline has none), so no log line says ``error=''``."""
    return {"error": str(error) or repr(error), "error_type": type(error).__name__}


class OrchestratorError(Exception):
    """Base class: a problem the user can fix, with a message that says how."""


class InvalidInput(OrchestratorError):
    """A run's input, id, agent name or option is malformed or too large."""


class PermanentFailure(OrchestratorError):
    """A failure no retry can fix (a model endpoint that refuses the request: a wrong model
    name, URL or key), raised by a step or by code it calls: the run fails at once with this
    message, as when the step returns ``Fail``, instead of spending its attempts on it."""


class RunNotFound(OrchestratorError):
    def __init__(self, run_id: str) -> None:
        super().__init__(
            f"no run with id {run_id!r}; `orchestrator runs list` shows the runs that exist"
        )
        self.run_id = run_id


class InvalidTransition(OrchestratorError):
    """The run exists but is in a state that does not allow the requested change."""


class IdempotencyConflict(OrchestratorError):
    """A submit reused an idempotency key with a different agent or input."""


class RunAlreadyExists(OrchestratorError):
    """A submit named an explicit run id that is already taken."""


class DatabaseError(OrchestratorError):
    """PostgreSQL failed a statement (a timeout, a restart, a refusal); the driver's own error
    is its ``__cause__``. What the call did is unknown: retry it with its idempotency key."""


class DatabaseUnavailable(DatabaseError):
    """PostgreSQL could not be reached, or the connection was lost."""


class OutcomeUnknown(DatabaseUnavailable):
    """A statement's answer may not survive a failover: the server committed it locally but its
    wait for a synchronous standby was cancelled. Nothing may act on it (see
    docs/high-availability.md)."""


class PermissionDenied(OrchestratorError):
    """PostgreSQL refused a statement for lack of privilege (SQLSTATE 42501): the role this
    connects as may not do it. Nothing changed; retrying will not help, the grants or the login
    must change."""

    def __init__(self, refusal: str, *, hint: str | None = None, role: str | None = None) -> None:
        self.refusal = refusal
        self.hint = hint
        self.role = role
        who = f"role {role!r}" if role else "the database role this connects as"
        advice = f" ({hint})" if hint else ""
        super().__init__(
            f"PostgreSQL refused {who}: {refusal}{advice}; nothing changed. Each process needs "
            "its own role's privileges: run `orchestrator db grant` as the schema's owner after "
            "every `db migrate`, or connect as the login of the role this command needs "
            "(docs/database-roles.md)"
        )

    def naming(self, role: str | None) -> PermissionDenied:
        """The same refusal, naming the role that lacked the privilege."""
        return self if role is None else PermissionDenied(self.refusal, hint=self.hint, role=role)


class SchemaTooNew(OrchestratorError):
    """The database was migrated by a newer orchestrator than this one."""


class EmbeddedPostgresError(OrchestratorError):
    """The embedded PostgreSQL server could not be prepared or started."""
