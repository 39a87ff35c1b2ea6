"""``orchestrator agents``: each agent's code versions, who runs them, what waits for them."""

from __future__ import annotations

from collections.abc import Sequence

import click
from rich.table import Table

from orchestrator.cli.consoles import stdout
from orchestrator.cli.presentation import dump_json, grid
from orchestrator.cli.support import async_command, json_option, print_found
from orchestrator.client.stores import open_stores
from orchestrator.db.workers import AgentVersion
from orchestrator.settings import Settings

DRAIN_HELP = "Let workers of another version finish the step they are in, then give it back."


@click.group()
def agents() -> None:
    """The versions of each agent's code: who runs them and the runs that wait for them."""


@agents.command("versions")
@click.option("--agent", help="Only this agent's versions.")
@json_option("Print the versions as a JSON array.")
@async_command
async def agents_versions(settings: Settings, agent: str | None, as_json: bool) -> None:
    """Each version of each agent that a live worker serves or that wrote an unfinished run's
    checkpoint: the workers that run it, those that may claim its runs (they run it or upgrade
    from it), and its unfinished runs; "stranded" when runs wait and no live worker may claim
    them (deploy a worker that serves or upgrades from that version: docs/upgrades.md)."""
    async with open_stores(settings) as stores:
        found = await stores.workers.agent_versions(stores.pool, agent)
    print_found(
        found,
        as_json,
        versions_table,
        "no versions: no live worker and no unfinished run of a versioned agent",
        document=lambda version: {**version.as_json(), "stranded": version.stranded},
    )


@agents.command("cutover")
@click.argument("agent")
@click.option(
    "--to", "version", required=True, help="The version of AGENT's code that runs it now."
)
@click.option("--drain", is_flag=True, help=DRAIN_HELP)
@json_option("Print the cutover as JSON.")
@async_command
async def agents_cutover(
    settings: Settings, agent: str, version: str, drain: bool, as_json: bool
) -> None:
    """From now on only workers running VERSION of AGENT claim or commit its runs: the runs
    workers of another version hold are taken from them at once (their fence is raised, so
    what they commit or ask to send next is refused) and are claimed by VERSION's workers
    (docs/upgrades.md). With --drain, those workers first finish and commit the step they are
    in. Audited; needs the operate permission."""
    async with open_stores(settings) as stores:
        done = await stores.agents.cutover(agent, version, drain=drain)
    if as_json:
        stdout.print_json(dump_json(done))
        return
    was = "" if done.previous is None else f" (was {done.previous})"
    if done.drain:
        count, what = done.runs_draining, "to finish the step they are in on workers of"
    else:
        count, what = done.runs_cut, "taken from workers of"
    moved = f"{count} run{'' if count == 1 else 's'} {what} another version"
    stdout.print(f"{done.agent}: cut over to version {done.version}{was}; {moved}", markup=False)


def versions_table(found: Sequence[AgentVersion]) -> Table:
    return grid(
        ("agent", "version", "run by", "may claim", "unfinished runs", ""),
        (
            (
                version.agent,
                version.version,
                ", ".join(version.workers) or "-",
                ", ".join(version.claimed_by) or "-",
                str(version.unfinished_runs),
                "stranded" if version.stranded else "",
            )
            for version in found
        ),
    )
