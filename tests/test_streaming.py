"""Live output (docs/streaming.md, invariant 17) at the database: appends are fenced, positions
are gap-free, a lost attempt's unfinished output is retracted once for every reader, committed
steps' output never is, and the output is bounded per run (real PostgreSQL)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import asyncpg
import pytest

from orchestrator import Agent, Finish, Step, StepContext
from orchestrator.agent.output import StepOutput
from orchestrator.agent.steps import Outcome
from orchestrator.db.commit_records import StepEvent
from orchestrator.db.output import OutputEvent, OutputKind, OutputStore
from orchestrator.db.store import RunStore
from orchestrator.errors import InvalidInput, RunNotFound
from orchestrator.models import ClaimedRun
from orchestrator.settings import Settings
from orchestrator.testing import running_worker, wait_for_run
from support import cli
from test_runtime import FAST

LIMITS = {"max_events": 1000, "max_bytes": 1_000_000}


def text(*pieces: str) -> list[dict[str, Any]]:
    return [{"kind": "text", "data": {"text": piece}} for piece in pieces]


async def claimed(store: RunStore, worker: str, run_id: str | None = None) -> ClaimedRun:
    if run_id is None:
        run_id = (await store.submit("streams", {"n": 1})).run.run_id
    [claim] = (await store.claim(worker, ["streams"], lease_seconds=30)).claimed
    assert claim.run_id == run_id
    return claim


async def append(
    outputs: OutputStore, claim: ClaimedRun, *pieces: str, version: int | None = None
) -> str:
    answer = await outputs.append(
        claim.run_id,
        claim.lease.worker_id,
        claim.fence,
        claim.checkpoint_version if version is None else version,
        text(*pieces),
        **LIMITS,
    )
    return answer.status


async def expire(store: RunStore, run_id: str) -> None:
    await store.pool.execute(
        "UPDATE runs SET lease_until = clock_timestamp() - interval '1 second' WHERE run_id = $1",
        run_id,
    )


def current_text(events: list[OutputEvent]) -> str:
    """What a reader shows: every text event no later retraction takes back."""
    retractions = [e for e in events if e.kind is OutputKind.RETRACTED]
    return "".join(
        e.data["text"]
        for e in events
        if e.kind is OutputKind.TEXT and not any(r.takes_back(e) for r in retractions)
    )


async def test_a_new_owner_retracts_the_lost_attempt_s_unfinished_output_only(
    store: RunStore,
) -> None:
    outputs = OutputStore(store.pool)
    first = await claimed(store, "w1")
    assert await append(outputs, first, "Step one ", "done. ") == "ok"
    committed = await store.commit_step(
        first.lease, expected_version=0, next_step="two", checkpoint={"n": 2}
    )
    assert committed is not None
    assert await append(outputs, first, "Half a sen", version=1) == "ok"
    await expire(store, first.run_id)
    # Expired: w1 publishes nothing more, and nothing is retracted before someone takes over.
    assert await append(outputs, first, "tence", version=1) == "stale"
    before = await outputs.read(first.run_id)
    assert current_text(before) == "Step one done. Half a sen"
    second = await claimed(store, "w2", first.run_id)
    events = await outputs.read(first.run_id)
    assert [e.seq for e in events] == [1, 2, 3, 4]
    retraction = events[-1]
    assert retraction.kind is OutputKind.RETRACTED
    assert retraction.data["fence"] == first.fence and list(retraction.retracts) == [3]
    # The zombie's late publish is refused; the new owner's follows the retraction.
    assert await append(outputs, first, "late", version=1) == "stale"
    assert await append(outputs, second, "Step two again.") == "ok"
    events = await outputs.read(first.run_id)
    assert current_text(events) == "Step one done. Step two again."
    assert [e.seq for e in events] == [1, 2, 3, 4, 5]
    # Read again and again: the retraction is written once.
    assert await outputs.read(first.run_id, after=3) == events[3:]


async def test_a_publisher_retracts_only_what_its_fence_wrote_in_this_step(
    store: RunStore,
) -> None:
    """A model call retried midway takes back its own text; nothing else can be taken back."""
    outputs = OutputStore(store.pool)
    first = await claimed(store, "w1")
    assert await append(outputs, first, "Step one.") == "ok"
    await store.commit_step(first.lease, expected_version=0, next_step="two", checkpoint={})
    assert await append(outputs, first, "Half", " an answer", version=1) == "ok"

    async def retract(begin: int, end: int, version: int = 1) -> str:
        retraction = {"from_seq": begin, "to_seq": end, "reason": "the call failed midway"}
        answer = await outputs.append(
            first.run_id,
            "w1",
            first.fence,
            version,
            [{"kind": "retracted", "data": retraction}],
            **LIMITS,
        )
        return answer.status

    before = await outputs.read(first.run_id)
    for begin, end in ((1, 2), (1, 1), (2, 9), (3, 2), (0, 2)):
        # A committed step's output (1), positions not written yet (9), a reversed range.
        with pytest.raises(asyncpg.InvalidParameterValueError):
            await retract(begin, end)
    assert await outputs.read(first.run_id) == before
    assert await retract(2, 3) == "ok"
    events = await outputs.read(first.run_id)
    assert events[-1].kind is OutputKind.RETRACTED and list(events[-1].retracts) == [2, 3]
    assert events[-1].data["events"] == 2 and events[-1].fence == first.fence
    assert current_text(events) == "Step one."


async def test_a_reader_seals_once_the_fence_has_moved_and_every_reader_sees_the_same(
    store: RunStore,
) -> None:
    outputs = OutputStore(store.pool)
    first = await claimed(store, "w1")
    assert await append(outputs, first, "a", "b") == "ok"
    assert await outputs.read(first.run_id) != []
    await expire(store, first.run_id)
    await claimed(store, "w2", first.run_id)  # takes over, publishes nothing yet
    one = await outputs.read(first.run_id)
    two = await outputs.read(first.run_id)
    assert one == two
    assert [e.kind for e in one] == [OutputKind.TEXT, OutputKind.TEXT, OutputKind.RETRACTED]
    assert current_text(one) == ""


@pytest.mark.parametrize("how", ["commits", "finishes"])
async def test_a_lost_attempt_s_output_is_retracted_after_the_new_owner_committed_past_it(
    store: RunStore, how: str
) -> None:
    # The new owner commits the step the lost attempt was in without publishing anything, so
    # nothing retracted the lost attempt's output before the run moved past its version: it
    # was still the lost attempt's, which never committed that step.
    outputs = OutputStore(store.pool)
    first = await claimed(store, "w1")
    assert await append(outputs, first, "Step one.") == "ok"
    await store.commit_step(first.lease, expected_version=0, next_step="two", checkpoint={})
    assert await append(outputs, first, "Half", " a step", version=1) == "ok"
    await expire(store, first.run_id)
    second = await claimed(store, "w2", first.run_id)
    if how == "commits":
        assert await store.commit_step(
            second.lease, expected_version=1, next_step="three", checkpoint={}
        )
    else:
        assert await store.finish(second.lease, expected_version=1, result={"done": True})
    events = await outputs.read(first.run_id)
    assert current_text(events) == "Step one."
    retraction = events[-1]
    assert retraction.kind is OutputKind.RETRACTED and list(retraction.retracts) == [2, 3]
    assert retraction.data["fence"] == first.fence
    assert await outputs.read(first.run_id) == events  # once, for every reader


async def test_a_commit_event_that_names_no_version_does_not_break_reading_the_output(
    store: RunStore,
) -> None:
    # A step commit's events are the worker's words: a "checkpoint" naming no version must not
    # make every later read of the run's output fail (nor pass for a commit).
    outputs = OutputStore(store.pool)
    first = await claimed(store, "w1")
    assert await append(outputs, first, "Half a step") == "ok"
    odd = StepEvent("checkpoint", {"version": "most recent"})
    assert await store.commit_step(
        first.lease, expected_version=0, next_step="two", checkpoint={}, events=[odd]
    )
    assert await append(outputs, first, " and more", version=1) == "ok"
    await expire(store, first.run_id)
    await claimed(store, "w2", first.run_id)
    events = await outputs.read(first.run_id)
    assert current_text(events) == "Half a step"  # its own commit (version 1) still counts


async def test_a_finished_run_keeps_its_output_and_a_failed_attempt_s_is_retracted(
    store: RunStore,
) -> None:
    outputs = OutputStore(store.pool)
    first = await claimed(store, "w1")
    assert await append(outputs, first, "tried") == "ok"
    assert await store.fail_attempt(first.lease, error={"message": "boom"})
    events = await outputs.read(first.run_id)
    assert [e.kind for e in events] == [OutputKind.TEXT, OutputKind.RETRACTED]
    await store.pool.execute("UPDATE runs SET available_at = now() WHERE run_id = $1", first.run_id)
    second = await claimed(store, "w2", first.run_id)
    assert await append(outputs, second, "answer") == "ok"
    assert await store.finish(second.lease, expected_version=0, result={"ok": True})
    events = await outputs.read(first.run_id)
    assert current_text(events) == "answer"
    assert events[-1].kind is OutputKind.TEXT  # nothing of the finished step is retracted


async def test_the_output_is_bounded_per_run_and_the_rest_is_dropped_with_one_marker(
    store: RunStore,
) -> None:
    outputs = OutputStore(store.pool)
    first = await claimed(store, "w1")
    bound = {"max_events": 3, "max_bytes": 1_000_000}
    answer = await outputs.append(
        first.run_id, "w1", first.fence, 0, text("a", "b", "c", "d", "e"), **bound
    )
    assert answer.status == "truncated"
    answer = await outputs.append(first.run_id, "w1", first.fence, 0, text("f"), **bound)
    assert answer.status == "truncated"
    events = await outputs.read(first.run_id)
    assert [e.kind for e in events] == [OutputKind.TEXT] * 3 + [OutputKind.TRUNCATED]


async def test_huge_or_malformed_events_are_refused_in_one_line_and_change_nothing(
    store: RunStore,
) -> None:
    outputs = OutputStore(store.pool)
    first = await claimed(store, "w1")
    assert await append(outputs, first, "kept") == "ok"
    for events in (
        text("x" * 70_000),
        [{"kind": "retracted", "data": {}}],
        [{"kind": "text", "data": "not an object"}],
        [],
    ):
        with pytest.raises(asyncpg.InvalidParameterValueError) as refused:
            await outputs.append(first.run_id, "w1", first.fence, 0, events, **LIMITS)
        assert "\n" not in str(refused.value)
    assert [e.data for e in await outputs.read(first.run_id)] == [{"text": "kept"}]
    with pytest.raises(RunNotFound):
        await outputs.read("r_nothing")
    with pytest.raises(InvalidInput):
        await outputs.read(first.run_id, after=-1)


# -- the publisher in a worker, and the command line --------------------------------------------
class Chatty(Step):
    """Publishes many small pieces and commits at once: the commit waits for them."""

    async def run(self, ctx: StepContext) -> Outcome:
        for number in range(300):
            ctx.output.text(f"{number} ")
        ctx.output.progress("counted", up_to=299)
        return Finish({"counted": 300})


chatty = Agent("chatty", first=Chatty)


async def test_a_committed_step_s_output_is_complete_and_written_in_batches(
    settings: Settings, store: RunStore
) -> None:
    run_id = (await store.submit("chatty", {})).run.run_id
    async with running_worker(settings, [chatty], **FAST):
        await wait_for_run(store, run_id, within=30)
    events = await OutputStore(store.pool).read(run_id)
    assert current_text(events) == "".join(f"{number} " for number in range(300))
    assert events[-1].data == {"up_to": 299, "message": "counted"}
    assert len(events) < 20  # batches of tokens, not one row per token


def test_a_huge_event_is_refused_in_one_line_before_anything_is_buffered() -> None:
    output = StepOutput()
    publishes: list[Callable[[], None]] = [
        lambda: output.text("x" * 70_000),
        lambda: output.progress("y", blob="z" * 70_000),
        lambda: output.text("nul\x00"),
        lambda: output.progress("bad", value=float("nan")),
    ]
    for publish in publishes:
        with pytest.raises(InvalidInput) as refused:
            publish()
        assert "\n" not in str(refused.value)


async def test_runs_watch_output_prints_the_retraction_and_resumes_from_a_position(
    database_url: str, store: RunStore
) -> None:
    outputs = OutputStore(store.pool)
    first = await claimed(store, "w1")
    assert await append(outputs, first, "half an ans") == "ok"
    await expire(store, first.run_id)
    second = await claimed(store, "w2", first.run_id)
    assert await append(outputs, second, "the answer") == "ok"
    assert await store.finish(second.lease, expected_version=0, result={})
    shown = cli(database_url, "runs", "watch", first.run_id, "--output")
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.splitlines() == [
        "half an ans",
        f"[2] retracted: fence {first.fence}'s output 1-1 (the attempt lost the run to fence "
        f"{second.fence})",
        "the answer",
    ]
    resumed = cli(database_url, "runs", "watch", first.run_id, "--output", "--json", "--after", "2")
    assert [json.loads(line)["seq"] for line in resumed.stdout.splitlines()] == [3]
    refused = cli(database_url, "runs", "watch", first.run_id, "--after", "2")
    assert refused.returncode != 0 and len(refused.stderr.strip().splitlines()) == 1
