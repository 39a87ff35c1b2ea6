"""The checker's rules for trees of runs (docs/child-runs.md). A parent spawns each child once,
under the fence it holds when it commits; once a cancel commits, no run below the cancelled one
commits anything or has an effect accepted; a woken parent reads each child as it ended. Which
run is below which comes from ``runs.parent_run_id``, fences and times from the timelines, in
the order the database wrote them (``event_id``), never from the workers' own word."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import NamedTuple

from orchestrator.chaos.findings import (
    CLOCK_TOLERANCE_SECONDS,
    COMMITTED,
    TERMINAL,
    Findings,
    Row,
    event_details,
    json_value,
    repeated,
    seconds_between,
)

CHILD_SPAWNED_TWICE = "child spawned twice"
SPAWNED_BY_STALE_PARENT = "child spawned by a stale parent"
EFFECT_AFTER_CANCEL = "descendant effect accepted after its cancel committed"
COMMITTED_AFTER_CANCEL = "descendant committed after cancel"
CHILD_MISREAD = "child outcome misread"
FENCE_RAISED = ("claimed", "cancelled", "cut_over")
"""The events that raise a run's fence; only a claim hands the new fence to a worker."""
WRITTEN_BY_COMMITS = (*COMMITTED, "spawned", "submitted")
"""What fenced commits write into a run's timeline: its steps and final commit, the children it
started, and (a child's first event) its parent's commit that started it."""


class Cut(NamedTuple):
    """The cancel of ``ancestor``, committed at ``at``, as it reaches a run below it."""

    at: datetime
    ancestor: str


def check_trees(
    found: Findings,
    runs: Mapping[str, Row],
    events: Mapping[str, Sequence[Row]],
    effects: Sequence[Row],
) -> None:
    """``events``: each run's timeline in order; ``effects``: every effect record."""
    children = [run for run in runs.values() if run["parent_run_id"] is not None]
    found.children = len(children)
    found.trees = len({_ancestors(runs, run["run_id"])[-1] for run in children})
    cascaded = [
        event_details(event)["with_ancestor"]
        for timeline in events.values()
        for event in timeline
        if event["kind"] == "cancelled" and event_details(event).get("with_ancestor")
    ]
    found.descendants_cancelled = len(cascaded)
    found.cascading_cancels = len(set(cascaded))
    _check_spawns(found, children, events)
    cut_by = _cut_by(runs, events)
    _check_after_cancels(found, cut_by, events)
    _check_effects_after_cancels(found, cut_by, effects)
    _check_reads(found, runs, children)


def _ancestors(runs: Mapping[str, Row], run_id: str) -> list[str]:
    """The runs above ``run_id``, its parent first, its root last."""
    chain: list[str] = []
    parent = runs[run_id]["parent_run_id"]
    while parent is not None and parent in runs and parent not in chain:
        chain.append(parent)
        parent = runs[parent]["parent_run_id"]
    return chain


def _check_spawns(
    found: Findings, children: Sequence[Row], events: Mapping[str, Sequence[Row]]
) -> None:
    for (parent, key), twice in repeated(children, lambda c: (c["parent_run_id"], c["child_key"])):
        found.add(CHILD_SPAWNED_TWICE, f"{parent}/{key}", f"runs {', '.join(twice)}")
    for child in children:
        timeline = events.get(child["run_id"], ())
        submitted = next((e for e in timeline if e["kind"] == "submitted"), None)
        if submitted is None:
            found.add(SPAWNED_BY_STALE_PARENT, child["run_id"], "no submitted event names a fence")
            continue
        spawned_under = event_details(submitted).get("parent_fence")
        held = _fence_held(events.get(child["parent_run_id"], ()), submitted["event_id"])
        if spawned_under is None or spawned_under != held:
            found.add(
                SPAWNED_BY_STALE_PARENT,
                child["run_id"],
                f"spawned under fence {spawned_under} of {child['parent_run_id']}, which held "
                + ("no fence" if held is None else f"fence {held}")
                + " then",
            )


def _fence_held(timeline: Sequence[Row], before: int) -> int | None:
    """The fence the run's latest claim before event ``before`` handed out; ``None`` when a
    cancel or cutover had raised it past every claim (no worker held the run)."""
    held = None
    for event in timeline:
        if event["event_id"] >= before:
            break
        if event["kind"] in FENCE_RAISED:
            held = event["fence"] if event["kind"] == "claimed" else None
    return held


def _cut_by(runs: Mapping[str, Row], events: Mapping[str, Sequence[Row]]) -> dict[str, Cut]:
    """For each run below a cancelled one, the earliest cancel above it."""
    cancelled = {
        run_id: next(e["at"] for e in timeline if e["kind"] == "cancelled")
        for run_id, timeline in events.items()
        if any(e["kind"] == "cancelled" for e in timeline)
    }
    cut_by = {}
    for run_id in runs:
        cuts = [Cut(cancelled[a], a) for a in _ancestors(runs, run_id) if a in cancelled]
        if cuts:
            cut_by[run_id] = min(cuts)
    return cut_by


def _check_after_cancels(
    found: Findings, cut_by: Mapping[str, Cut], timelines: Mapping[str, Sequence[Row]]
) -> None:
    """A cancel commits for the run's whole subtree: whatever a run below it commits later
    (beyond the clock tolerance) slipped past the cancel."""
    for run_id, cut in sorted(cut_by.items()):
        late = [
            f"{event['kind']} {seconds_between(event['at'], cut.at):.2f}s"
            for event in timelines.get(run_id, ())
            if event["kind"] in WRITTEN_BY_COMMITS
            and seconds_between(event["at"], cut.at) > CLOCK_TOLERANCE_SECONDS
        ]
        if late:
            found.add(
                COMMITTED_AFTER_CANCEL,
                run_id,
                f"{', '.join(late)} after the cancel of {cut.ancestor} committed",
            )


def _check_effects_after_cancels(
    found: Findings, cut_by: Mapping[str, Cut], effects: Sequence[Row]
) -> None:
    """Once a cancel commits, the boundary accepts nothing for a run below it: its fence was
    raised in the same transaction."""
    for effect in effects:
        cut = cut_by.get(effect["run_id"])
        if cut is None:
            continue
        late = seconds_between(effect["created_at"], cut.at)
        if late > CLOCK_TOLERANCE_SECONDS:
            found.add(
                EFFECT_AFTER_CANCEL,
                f"{effect['run_id']}/{effect['effect_key']}",
                f"accepted {late:.2f}s after the cancel of {cut.ancestor} committed",
            )


def _check_reads(found: Findings, runs: Mapping[str, Row], children: Sequence[Row]) -> None:
    """A parent that waited for its children read at least ``need`` of them ended, and each
    ended one as it ended (its state, and its result when it succeeded): the chaos trees'
    results say what they read."""
    by_key = {(child["parent_run_id"], child["child_key"]): child for child in children}
    for run_id, run in sorted(runs.items()):
        result = json_value(run["result"]) if run["state"] == "succeeded" else None
        read = result.get("read") if isinstance(result, dict) else None
        if not isinstance(read, dict):
            continue
        ended = {key: seen for key, seen in read.items() if seen["state"] in TERMINAL}
        planned = json_value(run["input"])
        need = (planned.get("need") if isinstance(planned, dict) else None) or len(read)
        if len(ended) < need:
            found.add(CHILD_MISREAD, run_id, f"woken with {len(ended)} of {need} needed ended")
        for key, seen in sorted(ended.items()):
            child = by_key.get((run_id, key))
            actual = None if child is None else (child["state"], json_value(child["result"]))
            if actual != (seen["state"], seen["result"]):
                found.add(CHILD_MISREAD, f"{run_id}/{key}", f"read {seen}, but it ended {actual}")
