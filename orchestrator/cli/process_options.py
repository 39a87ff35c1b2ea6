"""Options of the long-running processes (``serve``, ``effects serve``, ``effects dispatch``,
``console``, ``chaos``), defined once so their help reads the same everywhere."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import click
from click.decorators import FC


def defaulted_option(*declarations: str, **attributes: Any) -> Callable[[FC], FC]:
    """A ``click.option`` whose help shows its default: every tuning knob of these commands."""
    return click.option(*declarations, show_default=True, **attributes)


metrics_listen_option = click.option(
    "--metrics-listen",
    help="Serve Prometheus metrics on http://HOST:PORT/metrics and readiness on /ready.",
)
require_sync_standby_option = click.option(
    "--require-sync-standby",
    is_flag=True,
    default=None,
    help="Refuse to start, report not ready and send no effect while the primary has no "
    "synchronous standby or synchronous_commit is below on (ORCHESTRATOR_REQUIRE_SYNC_STANDBY=1). "
    "See docs/high-availability.md.",
)
start_retry_option = defaulted_option(
    "--start-retry-seconds",
    type=click.FloatRange(0, 3600),
    default=30.0,
    help="How long to keep trying to reach PostgreSQL at start (0: fail at once).",
)
log_format_option = click.option(
    "--log-json/--log-console", default=None, help="Default: JSON unless a terminal."
)


def process_options(*, start_retry: bool = True) -> Callable[[FC], FC]:
    """``--metrics-listen``, ``--start-retry-seconds`` (unless a process never waits for
    PostgreSQL at start) and ``--require-sync-standby``, in the order each process lists them."""
    options = [metrics_listen_option]
    if start_retry:
        options.append(start_retry_option)
    options.append(require_sync_standby_option)

    def apply(command: FC) -> FC:
        for option in reversed(options):  # decorators apply bottom-up
            command = option(command)
        return command

    return apply
