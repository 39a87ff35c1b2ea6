"""``orchestrator chaos``: run a seeded fault campaign and print what the checker found."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import anyio
import click
from rich.table import Table

from orchestrator.chaos import CampaignConfig, Report, run_campaign
from orchestrator.chaos.campaign import AGENTS
from orchestrator.chaos.faults import ALL_FAULT_KINDS, FAULT_KINDS, REPLICATED_FAULT_KINDS
from orchestrator.cli.consoles import stderr, stdout
from orchestrator.cli.presentation import dump_json
from orchestrator.cli.process_options import defaulted_option
from orchestrator.cli.support import json_option, run_async
from orchestrator.errors import OrchestratorError


@click.command("chaos")
@defaulted_option("--seed", type=click.IntRange(0), default=1)
@defaulted_option(
    "--duration",
    type=click.FloatRange(10, 86_400),
    default=60.0,
    help="Seconds of faults; then heal, quiescence and the checker.",
)
@defaulted_option("--runs", type=click.IntRange(1, 1_000_000), default=200)
@defaulted_option("--workers", type=click.IntRange(1, 32), default=3)
@defaulted_option("--dispatchers", type=click.IntRange(1, 32), default=2)
@defaulted_option(
    "--fault-rate",
    type=click.FloatRange(0.01, 50),
    default=1.0,
    help="Faults per second on average (every kind at least once).",
)
@click.option(
    "--faults",
    "kinds",
    default=",".join(FAULT_KINDS),
    show_default="every kind that works on one server",
    help="Comma-separated fault kinds to schedule, from: "
    + ", ".join(ALL_FAULT_KINDS)
    + f". {', '.join(REPLICATED_FAULT_KINDS)} puts the campaign on a replicated pair.",
)
@defaulted_option(
    "--agents",
    default=",".join(AGENTS),
    help="Comma-separated agents of the workload, submitted in turn.",
)
@click.option(
    "--replicated",
    is_flag=True,
    help="Run on a primary with an asynchronous streaming standby, the processes reaching it "
    "by a multi-host DSN (implied by the failover fault).",
)
@defaulted_option(
    "--settle-seconds",
    type=click.FloatRange(10, 3600),
    default=180.0,
    help="How long quiescence may take after healing.",
)
@click.option(
    "--work-dir",
    type=click.Path(file_okay=False, path_type=Path),
    help="Keep the embedded server, configs and process logs here (default: a temporary "
    "directory, removed when the campaign passes).",
)
@json_option("Print the report as JSON.")
def chaos(
    seed: int,
    duration: float,
    runs: int,
    workers: int,
    dispatchers: int,
    fault_rate: float,
    kinds: str,
    settle_seconds: float,
    work_dir: Path | None,
    agents: str,
    replicated: bool,
    as_json: bool,
) -> None:
    """Start a cluster on its own embedded PostgreSQL (a primary and a standby with
    --replicated or failovers), inject faults from the seeded schedule, heal, wait for
    quiescence and check every promise; exit 1 on any violation or on a fault that did not
    fire. The same --seed replays the same schedule."""
    config = CampaignConfig(
        seed=seed,
        duration=duration,
        runs=runs,
        workers=workers,
        dispatchers=dispatchers,
        fault_rate=fault_rate,
        kinds=tuple(kind.strip() for kind in kinds.split(",") if kind.strip()),
        settle_seconds=settle_seconds,
        work_dir=work_dir,
        replicated=replicated,
        agents=tuple(agent.strip() for agent in agents.split(",") if agent.strip()),
    )
    report = run_async(lambda: _until_terminated(config))
    if as_json:
        click.echo(dump_json(report.as_json()))
    else:
        _print(report.as_json())
    if not report.passed:
        stderr.print(
            f"[red]campaign failed[/red]: replay with {report.as_json()['replay']}; logs in "
            f"{report.work_dir}"
        )
        sys.exit(1)


async def _until_terminated(config: CampaignConfig) -> Report:
    """The campaign, ended by SIGTERM or SIGINT as by its own end: every process it started and
    its PostgreSQL are stopped before the command exits."""
    report: list[Report] = []

    async def campaign(scope: anyio.CancelScope) -> None:
        report.append(await run_campaign(config, lambda line: stderr.print(line)))
        scope.cancel()

    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async with anyio.create_task_group() as group:
            group.start_soon(campaign, group.cancel_scope)
            async for received in signals:
                stderr.print(f"{signal.Signals(received).name}: stopping the campaign")
                group.cancel_scope.cancel()
                break
    if not report:
        raise CampaignInterrupted("campaign interrupted: its processes and database are stopped")
    return report[0]


class CampaignInterrupted(OrchestratorError):
    """SIGTERM or SIGINT ended a campaign before its checker ran."""


def _print(report: dict[str, object]) -> None:
    summary = Table(title=f"chaos campaign, seed {report['seed']}")
    summary.add_column("measure")
    summary.add_column("value")
    recovery = report["recovery_seconds"]
    assert isinstance(recovery, dict)
    for measure, value in (
        ("runs submitted", report["runs_submitted"]),
        ("runs by state", report["runs_by_state"]),
        ("deliveries", report["deliveries"]),
        ("duplicate sends (must be 0)", report["duplicate_posts"]),
        ("lost runs (must be 0)", report["lost_runs"]),
        ("stale-fence rejections", report["stale_fence_rejections"]),
        ("stale requests refused at the boundary", report["stale_requests_refused"]),
        ("lost leases", report["lost_leases"]),
        ("takeovers", report["takeovers"]),
        ("grants recorded by the workers", report["grants_recorded"]),
        ("fences granted twice (must be 0)", report["fences_granted_twice"]),
        ("claims a failover took back", report["claims_lost_with_a_timeline"]),
        ("recovery p50 / p99", f"{recovery['p50']}s / {recovery['p99']}s"),
        ("first claim after each failover", report["failover_recovery_seconds"]),
        ("process restarts", report["process_restarts"]),
        ("elapsed", f"{report['elapsed_seconds']}s"),
    ):
        summary.add_row(measure, str(value))
    stdout.print(summary)
    faults = Table(title="faults")
    faults.add_column("kind")
    faults.add_column("scheduled", justify="right")
    faults.add_column("fired", justify="right")
    by_kind = report["faults"]
    assert isinstance(by_kind, dict)
    for kind, counts in by_kind.items():
        faults.add_row(kind, str(counts["scheduled"]), str(counts["fired"]))
    stdout.print(faults)
    violations = report["violations"]
    assert isinstance(violations, list)
    for violation in violations[:50]:
        stdout.print(
            f"[red]violation[/red] {violation['rule']}: {violation['subject']}: "
            f"{violation['detail']}"
        )
    for record in report["faults_not_fired"][:20]:  # type: ignore[index]
        stdout.print(f"[red]did not fire[/red] {record}")
    stdout.print("[green]passed[/green]" if report["passed"] else "[red]failed[/red]")
