"""Forks that keep their receipts (docs/child-runs.md): a new run from a kept checkpoint of
another, carrying the effects that run had confirmed before that point."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from orchestrator.access import Actor
from orchestrator.db.audit import decide
from orchestrator.db.queries import query
from orchestrator.errors import InvalidInput
from orchestrator.ids import new_run_id, validate_run_id
from orchestrator.models import JsonFields, from_row

if TYPE_CHECKING:
    from orchestrator.db.executor import Executor

STEP_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_.-]{0,63}")
"""As agents name their steps (``orchestrator.agent.steps``)."""


@dataclass(frozen=True)
class Fork(JsonFields):
    run_id: str
    """The new run."""
    forked_from: str
    version: int
    """The checkpoint version it starts from (0: the start)."""
    step: str | None
    """The step it runs first (``None``: the agent's first)."""
    receipts: int
    """Effects the run had confirmed before that point, carried into the fork (never sent
    again)."""


@dataclass(frozen=True)
class ForkStore:
    db: Executor

    async def fork(
        self,
        run_id: str,
        *,
        version: int | None = None,
        step: str | None = None,
        actor: Actor | None = None,
    ) -> Fork:
        """Start a new run from ``run_id``'s kept checkpoint ``version`` (0: the start), or
        the latest from which ``step`` was to run next (audited, ``operate``)."""
        validate_run_id(run_id)
        if step is not None and not STEP_NAME.fullmatch(step):
            raise InvalidInput(f"a step name is 1-64 letters, digits and _.- , not {step!r}")
        if (version is None) == (step is None):
            raise InvalidInput("say where the fork starts: a checkpoint version or a step name")
        if version is None:
            assert step is not None
            version = await self.db.fetchval(query("checkpoint_before_step"), run_id, step)
            if version is None:
                raise InvalidInput(
                    f"run {run_id} kept no checkpoint from which step {step!r} ran next (an "
                    "agent keeps them with Agent(keep_checkpoints=True))"
                )
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise InvalidInput(f"a checkpoint version is 0 or more, not {version!r}")
        who = Actor.acting(actor, None)
        arguments = (run_id, version, new_run_id())
        row = await decide(self.db, "fork", who, query("fork_run"), *arguments, run_id=run_id)
        assert row is not None
        return from_row(Fork, row)
