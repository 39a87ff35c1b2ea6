"""The checker's rules for deploys (the ``deploy`` fault, docs/upgrades.md). Once an agent is cut
over to a version, only that version's code commits its runs, and every run that finishes
afterwards finishes under it; no step meets a checkpoint its version cannot read (an upgrade
missing or wrong); no run is left behind on an older version. The cutovers come from the audit
log; which version each worker process ran, from the campaign that started it
(``Cluster.served``), not from the workers' own word."""

from __future__ import annotations

import collections
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

import asyncpg

from orchestrator.chaos import findings
from orchestrator.chaos.agents import MISREAD
from orchestrator.chaos.findings import COMMITTED, Findings, Row, as_text, json_value

OLD_VERSION_COMMITTED = "committed by a version cut over from"
FINISHED_UNDER_OLD_VERSION = "finished under a version cut over from"
CHECKPOINT_MISREAD = "checkpoint misread"
STRANDED = "run stranded by a deploy"


@dataclass(frozen=True)
class Cutover:
    agent: str
    version: str
    at: datetime
    runs_cut: int


async def read_cutovers(pool: asyncpg.Pool) -> list[Cutover]:
    """Every cutover the audit log recorded, oldest first."""
    rows = await pool.fetch(
        "SELECT at, detail FROM orchestrator.audit_log WHERE action = 'agent_cutover' ORDER BY seq"
    )
    cutovers = []
    for row in rows:
        detail = json_value(row["detail"])
        cutovers.append(
            Cutover(detail["agent"], detail["version"], row["at"], int(detail["runs_cut"]))
        )
    return cutovers


class Versions:
    """The versions of each agent's code that may commit its runs, by its cutovers."""

    def __init__(self, cutovers: Sequence[Cutover]) -> None:
        self._of: dict[str, list[Cutover]] = collections.defaultdict(list)
        for cutover in sorted(cutovers, key=lambda cutover: cutover.at):
            self._of[cutover.agent].append(cutover)

    def allowed(self, agent: str, at: datetime) -> frozenset[str] | None:
        """The version ``agent`` was cut over to at ``at``, and within the clock tolerance of a
        later cutover that one's too; ``None`` (any version) before its first cutover."""
        tolerance = timedelta(seconds=findings.CLOCK_TOLERANCE_SECONDS)
        before = [c.version for c in self._of[agent] if c.at <= at - tolerance]
        near = [c.version for c in self._of[agent] if at - tolerance < c.at <= at + tolerance]
        return frozenset(before[-1:] + near) if before else None

    def latest(self, agent: str) -> str | None:
        cutovers = self._of[agent]
        return cutovers[-1].version if cutovers else None


def check_deploys(
    found: Findings,
    runs: Mapping[str, Row],
    events: Mapping[str, Sequence[Row]],
    cutovers: Sequence[Cutover],
    served: Mapping[str, str],
) -> None:
    """``events``: each run's timeline in order; ``served``: the version each worker ran."""
    versions = Versions(cutovers)
    found.cutovers = len(cutovers)
    found.runs_cut_over = sum(cutover.runs_cut for cutover in cutovers)
    found.runs_upgraded = sum(
        1
        for run in runs.values()
        if run["started_version"] is not None and run["agent_version"] != run["started_version"]
    )
    found.runs_by_version = dict(
        collections.Counter(run["agent_version"] or "none" for run in runs.values())
    )
    for run_id, timeline in events.items():
        run = runs.get(run_id)
        if run is not None:
            _check_commits(found, run, timeline, versions, served)
    for run_id, run in runs.items():
        _check_end(found, run_id, run, versions)


def _check_commits(
    found: Findings,
    run: Row,
    timeline: Sequence[Row],
    versions: Versions,
    served: Mapping[str, str],
) -> None:
    run_id, agent = run["run_id"], run["agent"]
    misread = next((e for e in timeline if MISREAD in as_text(e["details"])), None)
    if misread is not None:  # once: each retry meets the same checkpoint
        found.add(CHECKPOINT_MISREAD, run_id, f"{misread['kind']}: {misread['details']}"[:300])
    stale = []
    for event in timeline:
        version = served.get(event["worker_id"] or "")
        if event["kind"] not in COMMITTED or version is None:
            continue
        allowed = versions.allowed(agent, event["at"])
        if allowed is not None and version not in allowed:
            stale.append(
                f"{event['kind']} by {event['worker_id']}, which ran version {version}, while "
                f"{agent} was cut over to {', '.join(sorted(allowed))}"
            )
    if stale:  # once per run: the first, and how many more
        more = f" (and {len(stale) - 1} more commits)" if len(stale) > 1 else ""
        found.add(OLD_VERSION_COMMITTED, run_id, stale[0] + more)


def _check_end(found: Findings, run_id: str, run: Row, versions: Versions) -> None:
    agent, version = run["agent"], run["agent_version"]
    if run["state"] == "succeeded":
        allowed = versions.allowed(agent, run["finished_at"])
        if allowed is not None and version not in allowed:
            found.add(
                FINISHED_UNDER_OLD_VERSION,
                run_id,
                f"its last checkpoint is version {version}'s; {agent} was cut over to "
                f"{', '.join(sorted(allowed))}",
            )
    latest = versions.latest(agent)
    if (
        run["state"] not in findings.TERMINAL
        and version is not None
        and latest not in (None, version)
    ):
        found.add(
            STRANDED,
            run_id,
            f"{run['state']} with a checkpoint of version {version}; {agent} is cut over to "
            f"{latest}",
        )
