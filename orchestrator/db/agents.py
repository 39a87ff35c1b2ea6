"""Agents as a whole (docs/upgrades.md): the fenced cutover of an agent to a version of its code."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from orchestrator.access import Actor
from orchestrator.db.audit import decide
from orchestrator.db.queries import query
from orchestrator.ids import agent_version_text, validate_agent_name
from orchestrator.models import JsonFields, from_row

if TYPE_CHECKING:
    from orchestrator.db.executor import Executor


@dataclass(frozen=True)
class Cutover(JsonFields):
    agent: str
    version: str
    previous: str | None
    """The version the agent was cut over to before (``None``: never)."""
    runs_cut: int
    """Runs taken from workers of another version (fence raised, due at once)."""
    drain: bool = False
    """Whether the runs workers of another version hold finish the step they are in first."""
    runs_draining: int = 0
    """Runs left to finish their step (a drain): each is given back after it."""


class AgentStore:
    def __init__(self, db: Executor) -> None:
        self.db = db

    async def cutover(
        self, agent: str, version: int | str, *, drain: bool = False, actor: Actor | None = None
    ) -> Cutover:
        """From now on only workers running ``version`` of ``agent`` claim or commit its runs;
        the runs other workers hold are taken from them at once or, with ``drain``, after the
        step they are in (audited, ``operate``)."""
        validate_agent_name(agent)
        text = agent_version_text(version, "the version to cut over to")
        who = Actor.acting(actor, None)
        row = await decide(self.db, "agent_cutover", who, query("cutover"), agent, text, drain)
        assert row is not None
        return from_row(Cutover, row)
