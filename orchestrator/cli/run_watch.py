"""``runs watch``'s loops: a run's timeline as it happens, each event once, or its live output
(``--output``, docs/streaming.md)."""

from __future__ import annotations

import contextlib
import json
import time
from collections import deque
from collections.abc import Iterator

import anyio
import click

from orchestrator.cli.consoles import stdout
from orchestrator.cli.presentation import event_line, jsonable
from orchestrator.client.streaming import OutputFollower
from orchestrator.db.output import OutputEvent, OutputKind
from orchestrator.db.run_reads import RunReads
from orchestrator.errors import OrchestratorError

WATCH_PAGE = 1000
WATCH_LOOKBACK_SECONDS = 30.0
WATCH_ID_MARGIN = 10_000


async def watch(
    store: RunReads, run_id: str, *, give_up_after: float | None, as_json: bool
) -> None:
    """Poll the run's timeline (4 times a second) and print what is new until the run ends."""
    started = time.monotonic()
    # By id: a lower id may commit after a higher one, so each poll reads again from the highest
    # id seen a few seconds earlier (longer than any transaction the runtime lets run), in pages.
    seen: set[int] = set()
    floors: deque[tuple[float, int]] = deque([(started, 0)])
    while True:
        run = await store.get(run_id)
        now = time.monotonic()
        while len(floors) > 1 and floors[1][0] <= now - WATCH_LOOKBACK_SECONDS:
            floors.popleft()
        after = floors[0][1]
        seen = {event_id for event_id in seen if event_id > after}
        while True:
            page = await store.events(run_id, after=after, limit=WATCH_PAGE)
            for event in page:
                if event.event_id in seen:
                    continue
                seen.add(event.event_id)
                if as_json:
                    click.echo(json.dumps(jsonable(event), separators=(",", ":")))
                else:
                    stdout.print(event_line(event), markup=False)
            if len(page) < WATCH_PAGE:
                break
            after = page[-1].event_id
        newest = max(seen, default=floors[-1][1])
        if len(floors) == 1 and floors[0][1] == 0:
            # After the first full read, a late commit can only hold an id just below the
            # newest seen (ids are handed out as its transaction wrote): look back that far.
            floors[0] = (floors[0][0], max(0, newest - WATCH_ID_MARGIN))
        floors.append((now, newest))
        if run.state.terminal:
            if not as_json:
                stdout.print(f"run {run_id} {run.state.value}", markup=False)
            return
        if give_up_after is not None and time.monotonic() - started > give_up_after:
            raise WatchTimedOut(f"run {run_id} is still {run.state.value} after {give_up_after:g}s")
        await anyio.sleep(0.25)


class WatchTimedOut(OrchestratorError):
    """``runs watch --timeout`` passed before the run ended."""


async def watch_output(
    follower: OutputFollower,
    run_id: str,
    *,
    after: int,
    give_up_after: float | None,
    as_json: bool,
) -> None:
    """Print the run's live output as it is published, from position ``after``, until the run
    ends: text as it comes, progress on lines of its own, and where an attempt lost the run, a
    line saying its output was retracted (a terminal cannot take back what it printed)."""
    try:
        with anyio.fail_after(give_up_after) if give_up_after is not None else _forever():
            await _print_output(follower, run_id, after, as_json)
    except TimeoutError:
        raise WatchTimedOut(f"run {run_id} has not ended after {give_up_after:g}s") from None


async def _print_output(follower: OutputFollower, run_id: str, after: int, as_json: bool) -> None:
    line_open = False
    async for event in follower.stream(run_id, after=after):
        if as_json:
            click.echo(json.dumps(jsonable(event), separators=(",", ":")))
            continue
        if event.kind is OutputKind.TEXT:
            click.echo(str(event.data.get("text", "")), nl=False)  # as it comes
            line_open = True
            continue
        if line_open:
            click.echo()
            line_open = False
        click.echo(output_line(event))
    if line_open:
        click.echo()


def output_line(event: OutputEvent) -> str:
    """A live output event other than text, as ``runs watch --output`` prints it."""
    data = event.data
    if event.kind is OutputKind.RETRACTED:
        return (
            f"[{event.seq}] retracted: fence {data.get('fence')}'s output "
            f"{data.get('from_seq')}-{data.get('to_seq')} ({data.get('reason')})"
        )
    if event.kind is OutputKind.TRUNCATED:
        return f"[{event.seq}] truncated: the run's output reached its bound; the rest is dropped"
    details = {k: v for k, v in data.items() if k != "message"}
    more = f" {json.dumps(details, separators=(',', ':'))}" if details else ""
    return f"[{event.seq}] {data.get('message', '')}{more}"


@contextlib.contextmanager
def _forever() -> Iterator[None]:
    yield
