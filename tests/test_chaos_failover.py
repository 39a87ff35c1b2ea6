"""Chaos campaigns on a primary and an asynchronous streaming standby, with failovers: no
(run, fence) granted twice and one request per key through them, and the checker's rule
"fence granted twice" failing against a build whose fences do not survive a failover."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import anyio
import pytest

from orchestrator.chaos import CampaignConfig, Report, run_campaign
from orchestrator.chaos.grants import duplicate_grants, read_grants
from support.chaos_mutants import FENCES_WITHOUT_EPOCH

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]  # a campaign of about 50 s each

KINDS = ("failover", "sigkill_dispatcher", "partition", "vendor_accept_timeout")


def failover_campaign(tmp_path: Path, *, runs: int = 40, **options: Any) -> Report:
    """Two of each kind over the first 34 s, 40 runs of both agents (the tool agent's script
    answers a lost turn differently when it is asked again: a send the standby did not hold
    would be a second, different email; see docs/chaos.md)."""
    config = CampaignConfig(
        seed=5,
        duration=40,
        runs=runs,
        fault_rate=0.24,
        kinds=KINDS,
        settle_seconds=90,
        work_dir=tmp_path / "campaign",
        agents=("chaos_steps", "chaos_tools"),
        **options,
    )
    return anyio.run(run_campaign, config)


def test_a_campaign_with_failovers_grants_no_fence_twice_and_sends_each_key_once(
    tmp_path: Path,
) -> None:
    report = failover_campaign(tmp_path)
    found = report.findings
    assert found.violations == [] and report.unfired == [], report.as_json()
    assert report.passed and report.replicated
    failovers = [record for record in report.faults if record.kind == "failover"]
    assert len(failovers) >= 2 and all(record.fired for record in failovers)
    assert found.fences_granted_twice == 0
    assert found.duplicate_posts == 0 and found.lost_runs == 0
    assert sum(found.runs_by_state.values()) == 40
    grants = read_grants(tmp_path / "campaign" / "grants")
    assert found.grants_recorded == len(grants) > 0
    # Each promotion raised the epoch by one, and workers ran steps under the last one.
    assert max(grant.fence >> 40 for grant in grants) == len(failovers)
    # The evidence is what the rule reads: one more process under a recorded fence is flagged.
    forged = dataclasses.replace(grants[-1], holder="chaos-w9.g1")
    [duplicate] = duplicate_grants([*grants, forged], [])
    assert (duplicate.run_id, duplicate.fence) == (forged.run_id, forged.fence)


def test_the_checker_catches_fences_that_do_not_survive_a_failover(tmp_path: Path) -> None:
    """Claims count on from the promoted server's copy: the fences the lost primary granted
    during the cut are granted again, and only the workers' records show it."""
    # Runs enough to outlast both failovers on a fast machine: a cut with nothing left to claim
    # grants no fence the promoted server could grant again.
    report = failover_campaign(tmp_path, runs=120, after_migrate=FENCES_WITHOUT_EPOCH)
    rules = {violation.rule for violation in report.findings.violations}
    assert "fence granted twice" in rules, [(f.kind, f.fired, f.detail) for f in report.faults]
    assert report.findings.fences_granted_twice >= 1
    assert not report.passed
