"""The filter options (``--state``, ``--agent``, ``--since``, ``--until``), and acting on every
selected run (bulk ``runs cancel|retry``); the selection itself is
``orchestrator.client.selection``, which the console lists runs with too."""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import click

from orchestrator.cli.consoles import stderr, stdout
from orchestrator.client.selection import RunSelection
from orchestrator.errors import InvalidInput, InvalidTransition, OrchestratorError
from orchestrator.models import Run, RunState

if TYPE_CHECKING:
    from orchestrator.db.run_reads import RunReads


def filter_options(command: Callable[..., None]) -> Callable[..., None]:
    """``--state`` (repeatable), ``--agent``, ``--since`` and ``--until``, which the command
    receives as one ``selection: RunSelection``, then ``--limit`` and ``--all``."""

    @functools.wraps(command)
    def selecting(
        *args: Any,
        states: tuple[str, ...],
        agent: str | None,
        since: str | None,
        until: str | None,
        **kwargs: Any,
    ) -> None:
        command(*args, selection=RunSelection(states, agent, since, until), **kwargs)

    for option in reversed(
        (
            click.option(
                "--state",
                "states",
                multiple=True,
                type=click.Choice([state.value for state in RunState]),
                help="Only runs in this state (repeatable).",
            ),
            click.option("--agent", help="Only runs of this agent."),
            click.option("--since", help="Submitted at or after: ISO 8601 time or age (2h)."),
            click.option("--until", help="Submitted before: ISO 8601 time or age (2h)."),
            click.option(
                "--limit", type=click.IntRange(1, 10_000), default=1000, show_default=True
            ),
            click.option(
                "--all",
                "every",
                is_flag=True,
                help="With no RUN_ID and no filter: act on every run the command applies to.",
            ),
        )
    ):
        selecting = option(selecting)
    return selecting


def check_target(run_id: str | None, selection: RunSelection, every: bool, dry: bool) -> None:
    """One run, or filters (or ``--all``), never both and never neither: a bulk action with an
    empty RUN_ID variable must not act on every run."""
    if run_id is None:
        if not (selection.active or every):
            raise InvalidInput(
                "give a RUN_ID, or filters (--state, --agent, --since, --until), or --all"
            )
        return
    if selection.active or every or dry:
        raise InvalidInput(
            "give a RUN_ID or filters (--state, --agent, --since, --until), not both"
        )


async def bulk(
    runs: RunReads,
    selection: RunSelection,
    limit: int,
    *,
    dry_run: bool,
    as_json: bool,
    verb: str,
    act: Callable[[str], Awaitable[Run]],
) -> None:
    """Apply ``act`` to every run the filters select (or, ``dry_run``, only list them). A run
    that moved on meanwhile (finished, already requeued) is reported and skipped."""
    from orchestrator.cli.presentation import dump_json
    from orchestrator.client.selection import select_runs
    from orchestrator.db.deadlines import DATABASE_ERRORS

    targets = await select_runs(runs, selection, limit)
    done: list[str] = []
    skipped: list[dict[str, str]] = []
    failed: str | None = None
    if not dry_run:
        for index, run in enumerate(targets, 1):
            try:
                await act(run.run_id)
                done.append(run.run_id)
            except OrchestratorError as error:  # moved on meanwhile: finished, gone
                skipped.append({"run_id": run.run_id, "reason": str(error)})
            except DATABASE_ERRORS as error:  # stop, but say what was done
                failed = (
                    f"the database failed at run {index:,}: {str(error) or type(error).__name__}"
                )
                break
            if index % 100 == 0:
                stderr.print(f"{verb}: {index:,} of {len(targets):,}")
    more = len(targets) == limit
    if as_json:
        stdout.print_json(
            dump_json(
                {
                    "dry_run": dry_run,
                    "matched": [run.run_id for run in targets],
                    "done": done,
                    "skipped": skipped,
                    "more_may_match": more,
                }
            )
        )
    elif dry_run:
        for run in targets:
            stdout.print(f"would {verb} {run.run_id} ({run.state.value})", markup=False)
        stdout.print(f"{len(targets):,} runs match; nothing changed (--dry-run)")
    else:
        stdout.print(f"{verb}: {len(done):,} done, {len(skipped):,} skipped")
    if more:
        stderr.print(f"--limit {limit:,} reached: more runs may match; run it again")
    if failed is not None:
        raise InvalidTransition(failed)
