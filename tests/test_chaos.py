"""The chaos campaign: a short seeded one keeps every promise, and deliberately broken builds make
the checker fail (so a passing campaign means something)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest

from orchestrator.chaos import CampaignConfig, Report, run_campaign
from orchestrator.chaos.deploy_checks import OLD_VERSION_COMMITTED
from orchestrator.chaos.deploy_faults import CUT_OVER
from orchestrator.chaos.faults import FAULT_KINDS
from orchestrator.chaos.tree_checks import COMMITTED_AFTER_CANCEL
from support import cli
from support.chaos_mutants import (
    BOUNDARY_WITHOUT_FENCE_CHECK,
    CANCEL_WITHOUT_CASCADE,
    CUTOVER_NOT_IN_FORCE,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]  # whole campaigns, minutes each

TESTS_DIR = Path(__file__).parent


def test_a_short_campaign_with_every_fault_keeps_every_promise(tmp_path: Path) -> None:
    """Through the CLI, as a user runs it: progress on stderr, the report as JSON on stdout."""
    done = cli(
        None,
        "chaos",
        "--seed",
        "7",
        "--duration",
        "45",
        "--runs",
        "90",
        "--fault-rate",
        "1.2",
        "--work-dir",
        str(tmp_path / "campaign"),
        "--json",
        columns=None,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    report = json.loads(done.stdout)
    assert report["passed"] and report["violations"] == [] and report["faults_not_fired"] == []
    for kind in FAULT_KINDS:
        assert report["faults"][kind]["fired"] >= 1, kind
    assert report["runs_submitted"] == 90
    assert report["lost_runs"] == 0 and report["duplicate_posts"] == 0
    assert report["deliveries"] > 90  # every run emails; most note the CRM and refund
    # A third of the runs are trees of two or three leaves; a cancel took one with its leaves.
    assert report["trees"] >= 1 and report["children"] >= 2 * report["trees"]
    assert report["cascading_cancels"] >= 1 and report["descendants_cancelled"] >= 1
    assert report["mcp_deliveries"] >= 1  # tool runs open a case through an MCP server
    assert report["stale_requests_refused"] >= 1
    # Every step publishes live output; the checker read it all (its rules: test_chaos_output).
    assert report["schedules"] >= 1 and report["scheduled_runs"] >= report["schedules"]
    assert report["slots_by_outcome"].get("fired", 0) == report["scheduled_runs"]
    assert report["runs_with_output"] >= 1
    assert report["output_events"] >= report["runs_with_output"]
    assert report["runs_keyed"] >= 1 and report["limit_samples"] >= 1  # keyed runs under limits
    assert report["cutovers"] >= len(CUT_OVER) * report["faults"]["deploy"]["fired"]  # each
    assert "quiescent" in done.stderr and "healed" in done.stderr


def campaign(tmp_path: Path, **options: Any) -> Report:
    defaults: dict[str, Any] = {"seed": 3, "duration": 30, "runs": 60, "fault_rate": 1.0}
    config = CampaignConfig(work_dir=tmp_path / "campaign", **{**defaults, **options})
    return anyio.run(run_campaign, config)


def test_the_checker_catches_a_boundary_that_lost_its_fence_check(tmp_path: Path) -> None:
    report = campaign(
        tmp_path,
        kinds=("stale_request", "sigstop_worker"),
        after_migrate=BOUNDARY_WITHOUT_FENCE_CHECK,
    )
    rules = {violation.rule for violation in report.findings.violations}
    assert "stale fence dispatched" in rules, report.findings.violations
    assert not report.passed


def test_the_checker_catches_old_workers_committing_after_a_cutover(tmp_path: Path) -> None:
    """A cutover that takes the runs old workers hold but is not in force for claims and
    commits: the old workers a deploy leaves running a while go on committing."""
    report = campaign(
        tmp_path, kinds=("deploy",), fault_rate=0.08, after_migrate=CUTOVER_NOT_IN_FORCE
    )
    rules = {violation.rule for violation in report.findings.violations}
    assert OLD_VERSION_COMMITTED in rules, report.findings.violations
    assert report.fired()["deploy"] >= 1 and report.findings.cutovers >= 2
    assert not report.passed


def test_the_checker_catches_a_cancel_that_does_not_cascade(tmp_path: Path) -> None:
    """A cancel that takes only the root it names: the leaves it picked mid-step go on
    committing (and having their effects accepted) after it."""
    report = campaign(
        tmp_path,
        kinds=("cancel",),
        agents=("chaos_tree",),
        fault_rate=0.2,
        after_migrate=CANCEL_WITHOUT_CASCADE,
    )
    rules = {violation.rule for violation in report.findings.violations}
    assert COMMITTED_AFTER_CANCEL in rules, [(f.target, f.detail) for f in report.faults]
    assert report.findings.trees >= 1 and report.findings.cascading_cancels == 0
    assert not report.passed


def test_the_checker_catches_a_dispatcher_that_resends_without_reconciling(
    tmp_path: Path,
) -> None:
    report = campaign(
        tmp_path,
        kinds=("vendor_accept_timeout", "kill_on_accept"),
        command=(
            sys.executable,
            str(TESTS_DIR / "support" / "chaos_mutants.py"),
            "resend-uncertain",
        ),
    )
    rules = {violation.rule for violation in report.findings.violations}
    assert "sent twice" in rules, report.findings.violations
    assert report.findings.duplicate_posts >= 1
    assert not report.passed


def test_chaos_bad_input_is_one_line_and_starts_nothing(tmp_path: Path) -> None:
    done = cli(
        None,
        "chaos",
        "--faults",
        "sigstop_worker,meteor",
        "--work-dir",
        str(tmp_path / "never"),
        columns=None,
    )
    assert done.returncode == 1
    assert "unknown fault kinds ['meteor']" in done.stderr
    assert "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "never").exists()
