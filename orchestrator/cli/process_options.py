"""Options of the long-running processes (``serve``, ``effects serve``, ``effects dispatch``),
defined once so their help reads the same everywhere."""

from __future__ import annotations

import click

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
start_retry_option = click.option(
    "--start-retry-seconds",
    type=click.FloatRange(0, 3600),
    default=30.0,
    show_default=True,
    help="How long to keep trying to reach PostgreSQL at start (0: fail at once).",
)
