"""Child runs (docs/child-runs.md): what a step spawns with its commit, and what a parent that
waited for its children reads of them when it is woken."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from orchestrator.agent.budgets import Budget
from orchestrator.errors import InvalidInput
from orchestrator.ids import validate_agent_name
from orchestrator.models import JSON, RunState

CHILD_KEY = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}")
MAX_CHILDREN_PER_COMMIT = 1000
"""As the database holds a spawn to (orchestrator_child_limits): also 10,000 children per parent
and 16 levels below the root."""
ENDED = frozenset({RunState.SUCCEEDED, RunState.FAILED, RunState.CANCELLED, RunState.DEAD})


def validate_child_key(key: object) -> str:
    if not isinstance(key, str) or CHILD_KEY.fullmatch(key) is None:
        raise InvalidInput(
            f"a child key is 1-128 letters, digits and _.:- starting with a letter or digit, "
            f"not {key!r}"
        )
    return key


@dataclass(frozen=True)
class Child:
    """A run of ``agent`` with ``input``, started by the step's commit under the parent's fence.

    ``key`` names the child within its parent: a retried step that spawns the same key again
    gets the child that exists, never a second one.
    """

    agent: str
    input: JSON
    key: str
    max_attempts: int = 5
    concurrency_key: str | None = None
    """What its limits count it under (docs/flow-control.md); ``None``: its parent's."""
    priority: int = 0
    budget: Budget | None = None
    """The child's limits, carved from its parent's budget by the spawning commit (a parent
    with a budget must carve every dimension it limits): docs/child-runs.md."""
    cancel_with_parent: bool = False
    """Cancel the child (and its own children) when its parent fails for good."""

    def __post_init__(self) -> None:
        validate_agent_name(self.agent)
        validate_child_key(self.key)
        if isinstance(self.max_attempts, bool) or not 1 <= self.max_attempts <= 100:
            raise InvalidInput(f"child {self.key}: max_attempts is 1 to 100")
        if isinstance(self.priority, bool) or not -1000 <= self.priority <= 1000:
            raise InvalidInput(f"child {self.key}: priority is -1000 to 1000")
        if self.concurrency_key is not None and not 1 <= len(self.concurrency_key) <= 200:
            raise InvalidInput(f"child {self.key}: a concurrency key is 1-200 characters")
        if self.budget is not None and not isinstance(self.budget, Budget):
            raise InvalidInput(f"child {self.key}: a budget is a Budget, not {self.budget!r}")

    def spawn(self, run_id: str, traceparent: str | None = None) -> dict[str, Any]:
        """The child as orchestrator_spawn_children reads it; ``traceparent``, the spawning
        step's span, is the parent of the child's trace (as a submitter's is)."""
        return {
            "traceparent": traceparent,
            "run_id": run_id,
            "agent": self.agent,
            "input": self.input,
            "key": self.key,
            "max_attempts": self.max_attempts,
            "concurrency_key": self.concurrency_key,
            "priority": self.priority,
            "budget": None if self.budget is None else self.budget.limits(),
            "cancel_with_parent": self.cancel_with_parent,
        }


def new_children(children: Sequence[Child | str]) -> tuple[Child, ...]:
    """Of what a ``Wait`` waits for, the children it starts (the others are keys)."""
    return tuple(child for child in children if not isinstance(child, str))


def check_children(children: tuple[Child, ...]) -> None:
    """One commit's children: Child objects, distinct keys, at most the per-commit limit."""
    for child in children:
        if not isinstance(child, Child):
            raise InvalidInput(f"children are Child objects, not {type(child).__name__}")
    keys = [child.key for child in children]
    if len(set(keys)) != len(keys):
        twice = sorted({key for key in keys if keys.count(key) > 1})
        raise InvalidInput(f"two children of one commit have the same key: {', '.join(twice)}")
    if len(children) > MAX_CHILDREN_PER_COMMIT:
        raise InvalidInput(
            f"a commit spawns at most {MAX_CHILDREN_PER_COMMIT} children, not {len(children)}"
        )


@dataclass(frozen=True)
class ChildOutcome:
    """How a child a parent waited for stands when the parent is woken: its state and, once it
    ended, its result (succeeded) or error (failed, dead, cancelled). A child's failure is the
    parent's to handle."""

    key: str
    run_id: str
    state: RunState
    result: JSON = None
    error: JSON = None

    @property
    def ended(self) -> bool:
        return self.state in ENDED

    @property
    def succeeded(self) -> bool:
        return self.state is RunState.SUCCEEDED


@dataclass(frozen=True)
class ChildrenWait:
    """What a parent waits for: ``need`` of the children ``keys`` to end (all when ``None``)."""

    keys: tuple[str, ...]
    need: int | None = None
    outcomes: dict[str, ChildOutcome] = field(default_factory=dict)

    @property
    def needed(self) -> int:
        return len(self.keys) if self.need is None else min(self.need, len(self.keys))

    @property
    def satisfied(self) -> bool:
        return sum(1 for o in self.outcomes.values() if o.ended) >= self.needed
