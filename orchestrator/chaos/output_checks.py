"""The checker's rules for live output (docs/streaming.md, invariant 17). An append is written
only while its worker holds the run's lease under its fence, at its step's checkpoint version;
what an attempt that lost the run left unfinished is retracted for every reader; a committed
step's output never is; positions are gap-free. So after a campaign:

- no stale output shown: what a reader shows (every text and progress event no later retraction
  of its fence takes back), read through ``orchestrator_stream_read``, which seals first, is of
  steps their fence committed (a ``checkpoint`` or final commit of that fence at the next
  version, in the run's timeline);
- no append after the lease ended: no text or progress of a fence follows, in the run's
  positions, one of a higher fence, nor was it written more than the clock tolerance after the
  run's fence was raised above it (a claim, a cancel, a cutover: the timeline's times, all the
  database's clock);
- positions 1..N without a gap; each retraction names positions before it of its own fence's
  text or progress (``data.fence`` its fence, ``data.events`` how many);
- no committed output retracted: a retraction takes back an event of a step its fence committed
  only when the publisher withdrew it in that step (at the event's checkpoint version: a chaos
  step's withdrawn draft, or a model's answer, which names no attempt);
- output labelled as published: a chaos step's text and progress name the fence and version it
  ran under (``agents.published_by``), which must be the event's own.

The output comes from ``run_output`` through the read function, the fences and commits from the
timelines, never from the workers' word (what the content names is checked against the columns,
not trusted instead of them).
"""

from __future__ import annotations

import collections
from collections.abc import Mapping, Sequence
from datetime import timedelta

import asyncpg

from orchestrator.chaos.agents import DRAFT, published_by
from orchestrator.chaos.findings import (
    CLOCK_TOLERANCE_SECONDS,
    COMMITTED,
    Findings,
    Row,
    event_details,
    json_value,
)

STALE_OUTPUT_SHOWN = "stale output shown"
OUTPUT_AFTER_LEASE = "output appended after its lease ended"
OUTPUT_POSITIONS_GAP = "output positions not gap-free"
RETRACTION_NOT_ITS_OWN = "retraction not of its own output"
COMMITTED_OUTPUT_RETRACTED = "committed output retracted"
OUTPUT_MISLABELLED = "output labelled with another attempt"
RULES = (
    STALE_OUTPUT_SHOWN,
    OUTPUT_AFTER_LEASE,
    OUTPUT_POSITIONS_GAP,
    RETRACTION_NOT_ITS_OWN,
    COMMITTED_OUTPUT_RETRACTED,
    OUTPUT_MISLABELLED,
)
SHOWN = ("text", "progress")
FENCE_RAISED = ("claimed", "cancelled", "cut_over")
READ_PAGE = 10_000
"""Events one read returns (the read function's most)."""
MOST_PAGES = 100
"""Reads of one run's output (a run keeps at most 100,000 events)."""


def retracts(event: Row) -> range:
    """The positions a retraction takes back (none for any other event)."""
    if event["kind"] != "retracted":
        return range(0)
    first, last = event["data"].get("from_seq"), event["data"].get("to_seq")
    if not isinstance(first, int) or not isinstance(last, int):
        return range(-1, -1)  # no positions: malformed
    return range(first, last + 1)


def taken_back(output: Sequence[Row]) -> set[int]:
    """The positions of the text and progress events a later retraction of their fence takes
    back: what a reader no longer shows."""
    by_fence: dict[int, set[int]] = collections.defaultdict(set)
    for event in output:
        by_fence[event["fence"]].update(retracts(event))
    return {
        event["seq"]
        for event in output
        if event["kind"] in SHOWN and event["seq"] in by_fence[event["fence"]]
    }


def attempt(event: Row) -> tuple[int, int]:
    """The (fence, checkpoint version) that published an event: what its content names, if it
    names any (a chaos step's), else its columns."""
    named = published_by(event["data"])
    return (named[0], named[1]) if named else (event["fence"], event["base_version"])


async def read_outputs(pool: asyncpg.Pool) -> dict[str, list[Row]]:
    """Every run's output as a reader gets it (``seq``, ``fence``, ``base_version``, ``kind``,
    ``data`` decoded, ``created_at``): each read seals first, so a lost attempt's unfinished
    output is retracted before it is returned."""
    outputs: dict[str, list[Row]] = {}
    for row in await pool.fetch("SELECT run_id FROM orchestrator.run_streams ORDER BY run_id"):
        run_id = row["run_id"]
        events: list[Row] = []
        for _ in range(MOST_PAGES):
            page = await pool.fetch(
                "SELECT * FROM orchestrator.orchestrator_stream_read($1, $2, $3)",
                run_id,
                events[-1]["seq"] if events else 0,
                READ_PAGE,
            )
            events += [{**row, "data": json_value(row["data"])} for row in page]
            if len(page) < READ_PAGE:
                break
        outputs[run_id] = events
    return outputs


def check_output(
    found: Findings, events: Mapping[str, Sequence[Row]], outputs: Mapping[str, Sequence[Row]]
) -> None:
    """``events``: each run's timeline in order; ``outputs``: each run's output, in order
    (``read_outputs``)."""
    found.runs_with_output = sum(1 for output in outputs.values() if output)
    for run_id, output in sorted(outputs.items()):
        timeline = events.get(run_id, ())
        committed = _committed(timeline)
        taken = taken_back(output)
        found.output_events += sum(1 for event in output if event["kind"] in SHOWN)
        found.output_retractions += sum(1 for event in output if event["kind"] == "retracted")
        found.output_retracted += len(taken)
        found.output_steps_retracted += len(
            {(e["fence"], e["base_version"]) for e in output if e["seq"] in taken}
            - {(fence, version - 1) for fence, version in committed}
        )
        _gap_free(found, run_id, output)
        _labelled(found, run_id, output)
        _after_lease(found, run_id, output, timeline)
        _retractions(found, run_id, output, committed)
        _shown(found, run_id, [e for e in output if e["seq"] not in taken], committed)


def _committed(timeline: Sequence[Row]) -> set[tuple[int, int]]:
    """The (fence, version) of each step commit: the step that started from version V - 1."""
    return {
        (event["fence"], int(event_details(event).get("version") or 0))
        for event in timeline
        if event["kind"] in COMMITTED
    }


def _gap_free(found: Findings, run_id: str, output: Sequence[Row]) -> None:
    seqs = [event["seq"] for event in output]
    if seqs != list(range(1, len(seqs) + 1)):
        wrong = next(n for n, seq in enumerate(seqs, 1) if seq != n)
        found.add(
            OUTPUT_POSITIONS_GAP,
            run_id,
            f"{len(seqs)} events, position {wrong} is {seqs[wrong - 1]} (last {seqs[-1]})",
        )


def _labelled(found: Findings, run_id: str, output: Sequence[Row]) -> None:
    wrong = [
        (event, attempt(event))
        for event in output
        if event["kind"] in SHOWN and attempt(event) != (event["fence"], event["base_version"])
    ]
    if wrong:
        first, (fence, version) = wrong[0]
        found.add(
            OUTPUT_MISLABELLED,
            f"{run_id}#{first['seq']}",
            f"written as fence {first['fence']} from version {first['base_version']}, "
            f"published by fence {fence} from version {version}"
            + (f" (and {len(wrong) - 1} more)" if len(wrong) > 1 else ""),
        )


def _after_lease(
    found: Findings, run_id: str, output: Sequence[Row], timeline: Sequence[Row]
) -> None:
    raised = [event for event in timeline if event["kind"] in FENCE_RAISED and event["fence"]]
    tolerance = timedelta(seconds=CLOCK_TOLERANCE_SECONDS)
    highest: tuple[int, int] | None = None
    """The highest fence that published so far, and its first position."""
    for event in output:
        if event["kind"] not in SHOWN:
            continue
        fence, subject = attempt(event)[0], f"{run_id}#{event['seq']}"
        if highest is not None and fence < highest[0]:
            found.add(
                OUTPUT_AFTER_LEASE,
                subject,
                f"{event['kind']} of fence {fence} after position {highest[1]} of fence "
                f"{highest[0]}",
            )
            continue
        if highest is None or fence > highest[0]:
            highest = (fence, event["seq"])
        newer = next((e for e in raised if e["fence"] > fence), None)
        if newer is not None and event["created_at"] > newer["at"] + tolerance:
            found.add(
                OUTPUT_AFTER_LEASE,
                subject,
                f"{event['kind']} of fence {fence} written at {event['created_at']}, after the "
                f"run was {newer['kind']} with fence {newer['fence']} at {newer['at']}",
            )


def _retractions(
    found: Findings, run_id: str, output: Sequence[Row], committed: set[tuple[int, int]]
) -> None:
    by_seq = {event["seq"]: event for event in output}
    for retraction in output:
        if retraction["kind"] != "retracted":
            continue
        fence, data = retraction["fence"], retraction["data"]
        span = retracts(retraction)
        inside = [by_seq[n] for n in span if n in by_seq and by_seq[n]["kind"] in SHOWN]
        others = [event for event in inside if event["fence"] != fence]
        if (
            not inside
            or span.start < 1
            or span.stop > retraction["seq"]
            or data.get("fence") != fence
            or others
            or data.get("events") != len(inside)
        ):
            found.add(
                RETRACTION_NOT_ITS_OWN,
                f"{run_id}#{retraction['seq']}",
                f"fence {fence} ({data.get('fence')}) takes back {data.get('from_seq')}-"
                f"{data.get('to_seq')} ({data.get('events')} events) at position "
                f"{retraction['seq']}: {len(inside)} text or progress events there, "
                f"{len(others)} of other fences",
            )
        _committed_kept(found, f"{run_id}#{retraction['seq']}", retraction, inside, committed)


def _committed_kept(
    found: Findings,
    subject: str,
    retraction: Row,
    inside: Sequence[Row],
    committed: set[tuple[int, int]],
) -> None:
    for event in inside:
        fence, version = event["fence"], event["base_version"]
        if fence != retraction["fence"] or (fence, version + 1) not in committed:
            continue
        if retraction["base_version"] == version and _withdrawable(event):
            continue  # the publisher withdrew it in its own step
        found.add(
            COMMITTED_OUTPUT_RETRACTED,
            subject,
            f"takes back position {event['seq']}, of the step fence {fence} committed from "
            f"version {version} (the retraction is from version {retraction['base_version']}: "
            f"{retraction['data'].get('reason')})",
        )
        return


def _withdrawable(event: Row) -> bool:
    """What a publisher may withdraw in its own step: a chaos step's draft, or text that names
    no attempt (a model's answer retried midway)."""
    named = published_by(event["data"])
    return named is None or named[3] == DRAFT


def _shown(
    found: Findings, run_id: str, shown: Sequence[Row], committed: set[tuple[int, int]]
) -> None:
    """``shown``: the events no retraction took back."""
    stale: collections.Counter[tuple[int, int]] = collections.Counter()
    first: dict[tuple[int, int], int] = {}
    for event in shown:
        if event["kind"] not in SHOWN:
            continue
        fence, version = attempt(event)
        if (fence, version + 1) not in committed:
            stale[fence, version] += 1
            first.setdefault((fence, version), event["seq"])
    for (fence, version), count in sorted(stale.items()):
        found.add(
            STALE_OUTPUT_SHOWN,
            f"{run_id}#{first[fence, version]}",
            f"{count} events of fence {fence} from version {version} are shown; that fence "
            f"never committed version {version + 1}",
        )
