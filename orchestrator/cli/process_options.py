"""Options of the long-running processes (``serve``, ``effects serve``, ``effects dispatch``,
``console``, ``chaos``), defined once so their help reads the same everywhere."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import click
from click.decorators import FC

from orchestrator.settings import (
    Settings,
    StandbyPolicy,
    StandbyPosition,
    StandbyWait,
    WithoutStandby,
)


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
STANDBY_OPTIONS = (
    (
        "--standby-wait",
        StandbyWait,
        "Send an effect only once a streaming standby holds its claim: any one, all connected "
        "ones, or off [default: any; ORCHESTRATOR_STANDBY_WAIT]. A primary with no standby "
        "(none connected, no physical slot) sends at once. See docs/high-availability.md.",
    ),
    (
        "--standby-position",
        StandbyPosition,
        "How far a standby must have the claim: flushed (enough for a promotion) or replayed "
        "[default: flush; ORCHESTRATOR_STANDBY_POSITION].",
    ),
    (
        "--without-standby",
        WithoutStandby,
        "While an expected standby is not connected: hold effects and report not ready, or "
        "send as a lone primary with a warning and a metric [default: hold; "
        "ORCHESTRATOR_WITHOUT_STANDBY].",
    ),
)


class StandbyChoice(NamedTuple):
    """What the command line said of the standby wait (``None``: the settings decide)."""

    wait: str | None
    position: str | None
    without: str | None


def standby_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """``--standby-wait``, ``--standby-position`` and ``--without-standby``: the dispatcher's
    wait for a standby (``serve`` and ``effects dispatch``), which the command receives as one
    ``standby: StandbyChoice``."""

    @functools.wraps(command)
    def choosing(
        *args: Any,
        standby_wait: str | None,
        standby_position: str | None,
        without_standby: str | None,
        **kwargs: Any,
    ) -> Any:
        choice = StandbyChoice(standby_wait, standby_position, without_standby)
        return command(*args, standby=choice, **kwargs)

    for name, choices, text in reversed(STANDBY_OPTIONS):  # decorators apply bottom-up
        option = click.option(name, type=click.Choice([c.value for c in choices]), help=text)
        choosing = option(choosing)
    return choosing


def standby_policy(settings: Settings, choice: StandbyChoice) -> StandbyPolicy:
    """The settings' policy with the options given on the command line."""
    base = settings.standby
    return StandbyPolicy.parse(
        choice.wait or base.wait, choice.position or base.position, choice.without or base.without
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
