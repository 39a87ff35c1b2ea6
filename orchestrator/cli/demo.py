"""``orchestrator demo``: two workers, a paused one and real vendors, end to end."""

from __future__ import annotations

import sys

import click

from orchestrator.cli.consoles import stderr, stdout
from orchestrator.cli.support import run_async, settings_of
from orchestrator.db.embedded import EmbeddedPostgres


@click.command()
@click.option("--lease-seconds", type=click.FloatRange(1, 60), default=2.0, show_default=True)
@click.option("--runs", type=click.IntRange(1, 200), default=6, show_default=True)
@click.pass_context
def demo(ctx: click.Context, lease_seconds: float, runs: int) -> None:
    """Two workers, a paused one, real vendors: each effect still happens exactly once."""
    from orchestrator.cli.demo_story import run_demo

    settings = settings_of(ctx)
    # Leave nothing running: stop the embedded server afterwards if the demo started it.
    embedded = None if settings.database_url else EmbeddedPostgres(settings.home)
    started_here = embedded is not None and embedded.running() is None
    try:
        ok = run_async(
            lambda: run_demo(
                settings, lease_seconds=lease_seconds, runs=runs, console=stderr, out=stdout
            )
        )
    finally:
        if embedded is not None and started_here:
            embedded.stop()
    sys.exit(0 if ok else 1)
