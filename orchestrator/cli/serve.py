"""``orchestrator serve``: a worker claiming and running agent runs until signalled."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from typing import TYPE_CHECKING

import anyio
import click

from orchestrator.cli.consoles import stderr
from orchestrator.cli.process_options import (
    StandbyChoice,
    defaulted_option,
    log_format_option,
    process_options,
    standby_options,
    standby_policy,
)
from orchestrator.cli.support import run_async, settings_of
from orchestrator.db.retention import DEFAULT_RETENTION, parse_retention
from orchestrator.errors import InvalidInput
from orchestrator.worker.metrics_endpoint import MetricsEndpoint

if TYPE_CHECKING:
    from orchestrator.worker.worker import Worker


def _split_modules(values: tuple[str, ...]) -> list[str]:
    return [part for value in values for part in value.replace(",", " ").split() if part]


@click.command()
@click.option(
    "--agents",
    "agent_modules",
    multiple=True,
    envvar="ORCHESTRATOR_AGENTS",
    help="Module(s) defining Agent objects, e.g. orchestrator.agents.sleepy (repeatable; "
    "ORCHESTRATOR_AGENTS takes a space- or comma-separated list).",
)
@click.option("--worker-id", help="Default: host:pid:random.")
@defaulted_option("--concurrency", type=click.IntRange(1, 100_000), default=10)
@defaulted_option("--lease-seconds", type=click.FloatRange(0.5), default=45.0)
@click.option(
    "--heartbeat-seconds", type=click.FloatRange(0.1), help="Default: a third of the lease."
)
@defaulted_option("--poll-seconds", type=click.FloatRange(0.05), default=2.0)
@defaulted_option("--claim-batch", type=click.IntRange(1, 1000), default=50)
@defaulted_option("--grace-seconds", type=click.FloatRange(0), default=30.0)
@defaulted_option("--status-seconds", type=click.FloatRange(0.5), default=10.0)
@defaulted_option(
    "--takeover/--no-takeover",
    default=True,
    help="Claim runs of workers whose database session is gone before their lease ends.",
)
@defaulted_option(
    "--reap-seconds",
    type=click.FloatRange(0.05),
    default=1.0,
    help="How often this worker looks for workers whose session is gone (with --takeover): "
    "a killed worker's runs are claimed elsewhere within about this long.",
)
@click.option(
    "--effects-config",
    envvar="ORCHESTRATOR_EFFECTS_CONFIG",
    type=click.Path(dir_okay=False),
    help="Vendors per effect kind (JSON); with it, serve also dispatches effects.",
)
@defaulted_option(
    "--dispatch/--no-dispatch",
    default=True,
    help="Run the effect dispatcher inside serve (needs --effects-config).",
)
@defaulted_option(
    "--dispatch-lease-seconds",
    type=click.FloatRange(1),
    default=60.0,
    help="How long the built-in dispatcher holds an effect it sends. Shorter: an effect in "
    "flight when its worker dies is reconciled sooner. It must outlast the slowest vendor "
    "call: a call still unanswered at 80% of it is given up as uncertain.",
)
@defaulted_option(
    "--schedules/--no-schedules",
    default=True,
    help="Fire the schedules whose slot has come (every serve process shares them).",
)
@process_options()
@standby_options
@defaulted_option(
    "--retention",
    default=DEFAULT_RETENTION,
    help="Delete finished runs older than this in the background (30d, 12h, ...; off: keep).",
)
@log_format_option
@click.pass_context
def serve(
    ctx: click.Context,
    agent_modules: tuple[str, ...],
    worker_id: str | None,
    concurrency: int,
    lease_seconds: float,
    heartbeat_seconds: float | None,
    poll_seconds: float,
    claim_batch: int,
    grace_seconds: float,
    status_seconds: float,
    takeover: bool,
    reap_seconds: float,
    effects_config: str | None,
    dispatch: bool,
    dispatch_lease_seconds: float,
    schedules: bool,
    metrics_listen: str | None,
    start_retry_seconds: float,
    require_sync_standby: bool | None,
    standby: StandbyChoice,
    retention: str,
    log_json: bool | None,
) -> None:
    """Claim and run agent runs until SIGTERM/SIGINT (a second signal exits at once)."""
    from orchestrator.agent.steps import AgentRegistry
    from orchestrator.effects.vendors import load_adapters
    from orchestrator.telemetry import (
        QueueGauges,
        configure_logging,
        install_sdk_from_env,
        shutdown_sdk,
    )
    from orchestrator.worker.gc_tuning import tune_for_worker
    from orchestrator.worker.worker import Worker, WorkerConfig, default_worker_id

    settings = settings_of(ctx)
    settings = settings.with_overrides(
        require_sync_standby=require_sync_standby,
        standby=standby_policy(settings, standby),
    )
    configure_logging(json_logs=log_json)
    modules = _split_modules(agent_modules)
    if not modules:
        raise click.UsageError(
            "no agents to serve: pass --agents MODULE (e.g. --agents orchestrator.agents.sleepy)"
        )

    _import_from_working_directory()

    async def body() -> None:
        registry = AgentRegistry.from_modules(modules)
        adapters = load_adapters(effects_config) if dispatch and effects_config else {}
        config = WorkerConfig(
            agents=registry,
            worker_id=worker_id or default_worker_id(),
            concurrency=concurrency,
            lease_seconds=lease_seconds,
            heartbeat_seconds=heartbeat_seconds or lease_seconds / 3,
            poll_seconds=poll_seconds,
            claim_batch=claim_batch,
            grace_seconds=grace_seconds,
            status_seconds=status_seconds,
            dead_session_takeover=takeover,
            reap_seconds=reap_seconds,
            effect_adapters=adapters,
            dispatch_lease_seconds=dispatch_lease_seconds,
            retention=parse_retention(retention),
            schedules=schedules,
            start_retry_seconds=start_retry_seconds,
            gauges=QueueGauges() if metrics_listen else None,
        )
        try:
            worker = Worker(settings, config)
        except ValueError as error:
            raise InvalidInput(str(error)) from None
        install_sdk_from_env(prometheus=metrics_listen is not None)
        endpoint = (
            None
            if metrics_listen is None
            else MetricsEndpoint(metrics_listen, worker.readiness, asyncio.get_running_loop())
        )
        tune_for_worker()  # start-up is done: see orchestrator/gc_tuning.py
        try:
            async with anyio.create_task_group() as group:
                group.start_soon(_watch_signals, worker)
                await worker.run()
                group.cancel_scope.cancel()
        finally:
            if endpoint is not None:
                endpoint.close()
            shutdown_sdk()

    run_async(body)


def _import_from_working_directory() -> None:
    """Put the working directory first on the import path, as ``python -m`` does: the
    ``orchestrator`` script's own path is its bin directory, so ``--agents myagent`` in the folder
    holding ``myagent.py`` would not be found."""
    here = os.getcwd()
    if not any(os.path.abspath(entry or os.curdir) == here for entry in sys.path):
        sys.path.insert(0, here)


async def _watch_signals(worker: Worker) -> None:
    """First SIGTERM/SIGINT: drain gracefully. Second: exit at once."""
    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for received in signals:
            if worker.stop_requested:
                stderr.print(f"second {signal.Signals(received).name}: exiting now")
                os._exit(130)
            stderr.print(f"{signal.Signals(received).name}: draining (send again to exit at once)")
            worker.request_stop()
