"""Checkpoints written by an older version of an agent's code, upgraded for the version that
claims the run (docs/upgrades.md)."""

from __future__ import annotations

from orchestrator.agent.steps import Agent
from orchestrator.models import JSON, ClaimedRun


class UpgradeFailed(Exception):
    """An older version's checkpoint could not be upgraded for the version claiming it."""


def upgraded_checkpoint(agent: Agent, claimed: ClaimedRun) -> JSON:
    """``claimed``'s checkpoint, written under an older version of ``agent``, as this version
    reads it (in memory: the claim's first commit stores it). ``UpgradeFailed`` names both
    versions when the agent declares no upgrade from that version, or its upgrade raises."""
    older = claimed.agent_version or ""
    upgrade = agent.upgrades.get(older)
    try:
        if upgrade is None:
            raise LookupError(f"version {agent.version} declares no upgrade from it")
        return upgrade(claimed.checkpoint)
    except Exception as error:
        raise UpgradeFailed(
            f"upgrading the checkpoint of run {claimed.run_id} from version {older} to version "
            f"{agent.version} of agent {agent.name} failed: {type(error).__name__}: {error}"
        ) from error


def checkpoint_needs_storing(
    claimed: ClaimedRun, agent: Agent, version: int, checkpoint: JSON
) -> bool:
    """Whether a final step that keeps ``checkpoint`` (at ``version``) must send it: the
    database holds it as another version of ``agent`` wrote it (upgraded since, or from before
    versions), and no commit of this attempt has stored it yet. Otherwise NULL keeps it."""
    return (
        checkpoint is not None
        and claimed.agent_version != agent.version
        and version == claimed.checkpoint_version
    )
