"""``orchestrator effects serve|dispatch``: the action proxy and the effect dispatcher, each a
long-running process."""

from __future__ import annotations

import signal
from contextlib import AsyncExitStack
from functools import partial
from pathlib import Path

import anyio
import click
import structlog

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
from orchestrator.db.access import AccessStore
from orchestrator.db.bootstrap import open_store
from orchestrator.db.deadlines import enter_when_reachable
from orchestrator.db.outages import watch
from orchestrator.db.retention import parse_age
from orchestrator.db.standby_wait import StandbyGate
from orchestrator.db.sync_standby import SyncStandbyRequirement
from orchestrator.errors import InvalidInput
from orchestrator.worker.metrics_endpoint import sample_gauges, serving_metrics


@click.command("serve")
@defaulted_option("--listen", default="127.0.0.1:8787", help="HOST:PORT")
@click.option(
    "--tokens",
    envvar="ORCHESTRATOR_PROXY_TOKENS",
    help="Comma-separated bearer tokens callers must present. On the command line they are "
    "visible to every user of the machine (ps): prefer ORCHESTRATOR_PROXY_TOKENS or "
    "--tokens-file. Optional when a service holds a database token (`orchestrator users token "
    "create`), which the proxy always accepts within its scope.",
)
@click.option(
    "--tokens-file",
    envvar="ORCHESTRATOR_PROXY_TOKENS_FILE",
    type=click.Path(dir_okay=False, path_type=Path),
    help="A file of bearer tokens, one a line or comma-separated (ORCHESTRATOR_PROXY_TOKENS_FILE).",
)
@defaulted_option("--max-body-bytes", type=click.IntRange(1024), default=256 * 1024)
@click.option(
    "--fence-store",
    type=click.Path(path_type=Path),
    help="Remember the highest fence accepted per run in this SQLite file on a local disk, and "
    "refuse a lower one with 409 fence_regression even if the database forgot it in a failover "
    "(ORCHESTRATOR_PROXY_FENCE_STORE; default: none, the database's check alone). "
    "See docs/high-availability.md.",
)
@defaulted_option(
    "--fence-store-retention",
    envvar="ORCHESTRATOR_PROXY_FENCE_RETENTION",
    default="7d",
    help="With --fence-store: forget a run's fence after this long without a request "
    "(at least 1h).",
)
@process_options(start_retry=False)
@log_format_option
@click.pass_context
def effects_serve(
    ctx: click.Context,
    listen: str,
    tokens: str | None,
    tokens_file: Path | None,
    max_body_bytes: int,
    fence_store: Path | None,
    fence_store_retention: str,
    metrics_listen: str | None,
    require_sync_standby: bool | None,
    log_json: bool | None,
) -> None:
    """Serve the effect boundary over HTTP (the action proxy) until SIGTERM/SIGINT."""
    import uvicorn

    from orchestrator.effects.fence_store import FenceStore, check_retention
    from orchestrator.effects.proxy import create_app
    from orchestrator.telemetry import configure_logging

    settings = settings_of(ctx).with_overrides(
        proxy_fence_store=fence_store, require_sync_standby=require_sync_standby
    )
    requirement = SyncStandbyRequirement(settings.require_sync_standby)
    configure_logging(json_logs=log_json)
    host, _, port = listen.rpartition(":")
    if not host or not port.isdigit():
        raise click.UsageError(f"--listen must be HOST:PORT, not {listen!r}")

    async def body() -> None:
        token_list = _proxy_tokens(tokens, tokens_file) if tokens or tokens_file else []
        retention = check_retention(parse_age(fence_store_retention, "--fence-store-retention"))
        async with AsyncExitStack() as stack:
            # Before the database: a bad path is a one-line error at once, not after a wait.
            fences = None
            if settings.proxy_fence_store is not None:
                fences = FenceStore.open(settings.proxy_fence_store, retention=retention)
                stack.callback(fences.close)
            store = await stack.enter_async_context(
                open_store(settings, application_name="orchestrator-proxy", max_size=10)
            )
            await requirement.require_at_start(store.pool)
            access = AccessStore(store.pool)
            if not token_list and not await access.service_tokens_exist():
                raise InvalidInput(
                    "no bearer tokens: set ORCHESTRATOR_PROXY_TOKENS, pass --tokens-file, or "
                    "create a service token with `orchestrator users token create`"
                )
            app = create_app(
                store.pool,
                token_list,
                fences=fences,
                max_body_bytes=max_body_bytes,
                access=access,
            )
            # log_config=None: uvicorn's records go through configure_logging's handler.
            # proxy_headers=False: no X-Forwarded-* header rewrites who connected.
            config = uvicorn.Config(
                app,
                host=host.strip("[]"),
                port=int(port),
                log_level="warning",
                log_config=None,
                proxy_headers=False,
            )
            server = uvicorn.Server(config)
            if fences is None:
                remembering = "no fence store (the database's fence check alone)"
            else:
                remembering = (
                    f"fence store {fences.path.resolve()} ({await fences.count()} runs remembered)"
                )
            stderr.print(f"action proxy listening on http://{listen}; {remembering}", markup=False)
            with serving_metrics(
                metrics_listen, store.pool, gauges=False, sync_standby=requirement
            ):
                async with anyio.create_task_group() as group:
                    group.start_soon(watch, store.pool, structlog.get_logger("orchestrator.proxy"))
                    await server.serve()
                    group.cancel_scope.cancel()

    run_async(body)


def _proxy_tokens(tokens: str | None, tokens_file: Path | None) -> list[str]:
    """The tokens of ``--tokens`` (or its variable) and of ``--tokens-file``, together."""
    raw = tokens or ""
    if tokens_file is not None:
        try:
            raw += "," + tokens_file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as error:
            reason = getattr(error, "strerror", None) or str(error)
            raise InvalidInput(
                f"cannot read --tokens-file {str(tokens_file)!r}: {reason}"
            ) from None
    found = raw.replace(",", " ").split()
    if not found:
        raise InvalidInput("no bearer tokens given: put at least one in --tokens-file, one a line")
    return found


@click.command("dispatch")
@click.option(
    "--effects-config",
    envvar="ORCHESTRATOR_EFFECTS_CONFIG",
    required=True,
    type=click.Path(dir_okay=False),
    help="Vendors per effect kind (JSON).",
)
@defaulted_option("--lease-seconds", type=click.FloatRange(1), default=60.0)
@defaulted_option("--poll-seconds", type=click.FloatRange(0.05), default=1.0)
@defaulted_option(
    "--concurrency",
    type=click.IntRange(1, 1000),
    default=20,
    help="Vendor calls in flight at once.",
)
@defaulted_option(
    "--batch",
    type=click.IntRange(1, 1000),
    default=20,
    help="Effects claimed per statement.",
)
@click.option("--dispatcher-id", help="Default: dispatch:host:pid:random.")
@process_options()
@standby_options
@click.option("--log-json/--log-console", default=None)
@click.pass_context
def effects_dispatch(
    ctx: click.Context,
    effects_config: str,
    lease_seconds: float,
    poll_seconds: float,
    concurrency: int,
    batch: int,
    dispatcher_id: str | None,
    metrics_listen: str | None,
    start_retry_seconds: float,
    require_sync_standby: bool | None,
    standby: StandbyChoice,
    log_json: bool | None,
) -> None:
    """Run only the effect dispatcher (outbox relay) until SIGTERM/SIGINT."""
    from orchestrator.effects.dispatcher import DISPATCH_POOL, Dispatcher
    from orchestrator.effects.vendors import load_adapters
    from orchestrator.telemetry import configure_logging

    settings = settings_of(ctx).with_overrides(require_sync_standby=require_sync_standby)
    requirement = SyncStandbyRequirement(settings.require_sync_standby)
    gate = StandbyGate(standby_policy(settings, standby))
    configure_logging(json_logs=log_json)

    async def body() -> None:
        adapters = load_adapters(effects_config)
        if not adapters:
            raise InvalidInput(f"{effects_config} configures no effect kinds")
        async with AsyncExitStack() as stack:
            store = await enter_when_reachable(
                stack,
                lambda: open_store(
                    settings,
                    application_name="orchestrator-dispatch",
                    max_size=concurrency + 3,
                    keep_session_state=DISPATCH_POOL["keep_session_state"],
                ),
                within=start_retry_seconds,
                log=structlog.get_logger("orchestrator.dispatch"),
            )
            await requirement.require_at_start(store.pool)
            dispatcher = Dispatcher(
                store.pool,
                adapters,
                dispatcher_id=dispatcher_id,
                lease_seconds=lease_seconds,
                poll_seconds=poll_seconds,
                concurrency=concurrency,
                batch=batch,
                sync_standby=requirement,
                standby=gate,
            )
            with (
                serving_metrics(
                    metrics_listen, store.pool, sync_standby=requirement, standby=gate
                ) as gauges,
                anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals,
            ):
                async with anyio.create_task_group() as group:

                    async def finish_then_stop() -> None:
                        await dispatcher.finish()
                        group.cancel_scope.cancel()

                    group.start_soon(dispatcher.run)
                    if gauges is not None:
                        group.start_soon(
                            partial(
                                sample_gauges, store.pool, gauges, dispatcher.outage, limits=False
                            )
                        )
                    async for _ in signals:
                        if dispatcher.stopping:
                            break  # asked again: stop at once
                        stderr.print(
                            "stopping: the sends in flight end first (send again to exit at once)"
                        )
                        group.start_soon(finish_then_stop)
                    group.cancel_scope.cancel()
        stderr.print(f"dispatcher stopped: {dispatcher.outcomes}")

    run_async(body)
