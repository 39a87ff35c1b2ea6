"""``runs watch``'s loop: a run's timeline as it happens, each event once."""

from __future__ import annotations

import json
import time
from collections import deque

import anyio
import click

from orchestrator.cli.consoles import stdout
from orchestrator.cli.presentation import event_line, jsonable
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
