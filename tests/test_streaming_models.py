"""Live output from model calls (docs/streaming.md): a Pydantic AI agent's streamed tokens, a
model call cut off midway and tried again within the same attempt (its partial text retracted by
the publisher, under the same fence), and ``SyncClient.runs.stream``. Real PostgreSQL, a real
worker, and the scripted OpenAI-compatible model server over loopback HTTP; the server holds each
streamed answer before its end until a reader has seen what came before, so that "streamed live"
is a fact the test observes, not a timing."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any

import anyio
import pytest
from pydantic_ai.messages import (
    ModelResponseOrigin,
    PartDeltaEvent,
    PartStartEvent,
    TextPart,
    TextPartDelta,
)

from orchestrator import Agent, Client, Finish, Step, StepContext, SyncClient
from orchestrator.agent import llm
from orchestrator.agent.output import OutputLimits, OutputTarget, StepOutput
from orchestrator.agent.steps import Outcome
from orchestrator.db.output import Appended, OutputEvent, OutputKind, OutputStore
from orchestrator.db.store import RunStore
from orchestrator.errors import InvalidInput
from orchestrator.integrations.pydantic_ai._streaming import LiveOutput
from orchestrator.models import RunState
from orchestrator.settings import Settings
from orchestrator.testing import running_worker
from orchestrator.testing.loopback import CutOff, ScriptedModelServer, ScriptedTurn, turns
from support import cli
from support.pydantic_ai_agents_for_tests import STREAMED_ANSWER, STREAMED_TURNS, pai_streamer
from test_runtime import FAST
from test_streaming_processes import shown

ANSWER = "Refunds reach the card in three to five working days; the bank decides the rest."


async def follow(
    client: Client,
    run_id: str,
    seen: list[OutputEvent],
    release: Callable[[list[OutputEvent]], bool],
    hold: anyio.Event,
) -> None:
    """Read the run's output to its end; let the model's held answer end once ``release``."""
    async for event in client.runs.stream(run_id):
        seen.append(event)
        if release(seen):
            hold.set()


def texts(events: list[OutputEvent]) -> list[OutputEvent]:
    return [e for e in events if e.kind is OutputKind.TEXT]


# -- Pydantic AI --------------------------------------------------------------------------------
async def test_a_pydantic_ai_agent_publishes_its_model_s_tokens_as_they_stream(
    settings: Settings, store: RunStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    hold = anyio.Event()
    async with (
        ScriptedModelServer(STREAMED_TURNS, token_chars=3) as model,
        await Client.connect(settings) as client,
    ):
        model.hold = hold  # the answer's last piece waits until a reader has seen its first
        monkeypatch.setenv("OPENAI_BASE_URL", model.base_url)
        monkeypatch.delenv("OPENAI_API_KEY", raising=False)
        run_id = (await store.submit("pai_streamer", {"prompt": "Where is o-17?"})).run.run_id
        seen: list[OutputEvent] = []
        async with running_worker(settings, [pai_streamer], **FAST):
            with anyio.fail_after(60):
                await follow(client, run_id, seen, lambda s: bool(texts(s)), hold)
        run = await store.get(run_id)
        transcript = await store.messages(run_id)
    assert run.state is RunState.SUCCEEDED, run.error
    assert run.result is not None and run.result["output"] == STREAMED_ANSWER
    # A reader saw the answer's text before the model had finished writing it (the server held
    # the last piece until then), in order, and all of it, once.
    assert hold.is_set()
    assert [e.seq for e in seen] == list(range(1, len(seen) + 1))
    assert shown(seen) == "".join(str(e.data["text"]) for e in texts(seen)) == STREAMED_ANSWER
    assert all(e.fence == run.fence for e in seen)
    # The committed turn's text is the text that was streamed.
    [answer] = [m for m in transcript if m.role == "assistant" and m.body.get("content")]
    assert answer.body["content"] == STREAMED_ANSWER
    assert [r["stream"] for r in model.requests] == [True, True]


async def test_a_superseded_pydantic_ai_response_is_withdrawn_and_its_late_text_dropped() -> None:
    store = FakeStore()
    output = published_to(store)
    live = LiveOutput(output)
    first = ModelResponseOrigin(run_id="r", run_step=1, attempt=1)
    second = ModelResponseOrigin(run_id="r", run_step=1, attempt=2)
    ctx: Any = None  # only the events' origins are read

    await live._publish(ctx, PartStartEvent(index=0, part=TextPart("Half "), origin=first))
    await live._publish(ctx, PartDeltaEvent(index=0, delta=TextPartDelta("an an"), origin=first))
    await output.flush(5)
    await live._publish(ctx, PartStartEvent(index=0, part=TextPart("The "), origin=second))
    await live._publish(ctx, PartDeltaEvent(index=0, delta=TextPartDelta("late"), origin=first))
    await live._publish(ctx, PartDeltaEvent(index=0, delta=TextPartDelta("answer"), origin=second))
    await output.flush(5)
    assert shown(store.read_back()) == "The answer"


# -- a model call cut off midway, tried again in the same attempt --------------------------------
class AskWithRetries(Step):
    """``llm.complete`` retries a dropped connection itself, within the step."""

    async def run(self, ctx: StepContext) -> Outcome:
        messages = [{"role": "user", "content": str(ctx.input["question"])}]
        reply = await llm.complete(messages, stream=True)
        return Finish({"answer": reply.content})


asker = Agent("asker", first=AskWithRetries)


async def test_a_model_call_cut_off_midway_and_retried_retracts_its_partial_text(
    settings: Settings, database_url: str, store: RunStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    hold = anyio.Event()
    async with (
        ScriptedModelServer(turns(ScriptedTurn(content=ANSWER)), token_chars=4) as model,
        await Client.connect(settings) as client,
    ):
        model.hold = hold  # the cut waits until a reader has seen the partial text
        model.fail_next(CutOff(pieces=3))
        monkeypatch.setenv("OPENAI_BASE_URL", model.base_url)
        monkeypatch.delenv("OPENAI_API_KEY", raising=False)
        run_id = (await store.submit("asker", {"question": "refund?"})).run.run_id
        seen: list[OutputEvent] = []
        read_sync: list[OutputEvent] = []

        def follow_sync() -> None:
            with SyncClient(settings) as sync_client:
                read_sync.extend(sync_client.runs.stream(run_id))

        async with running_worker(settings, [asker], **FAST):
            with anyio.fail_after(60):
                async with anyio.create_task_group() as readers:
                    readers.start_soon(anyio.to_thread.run_sync, follow_sync)
                    partial = ANSWER[:12]
                    await follow(client, run_id, seen, lambda s: shown(s) == partial, hold)
        run = await store.get(run_id)
        stored = await OutputStore(store.pool).read(run_id)

    def resume_sync() -> list[OutputEvent]:
        with SyncClient(settings) as sync_client:
            events = sync_client.runs.stream(run_id)
            first = next(events)
            events.close()  # left early: its stream ends on the client's loop
            return [first, *sync_client.runs.stream(run_id, after=first.seq)]

    resumed = await anyio.to_thread.run_sync(resume_sync)
    assert run.state is RunState.SUCCEEDED, run.error
    assert run.result == {"answer": ANSWER}
    assert run.attempt == 1  # retried by the model call itself, not by a new attempt
    assert [r.get("answer") for r in model.requests] == ["cut off", "text"]
    # One retraction, from the same fence, takes back the cut-off call's text, all of it and
    # nothing else: every reader shows the answer once.
    [retraction] = [e for e in seen if e.kind is OutputKind.RETRACTED]
    assert {e.fence for e in seen} == {run.fence}
    before = [e for e in seen if e.seq < retraction.seq]
    assert before and all(retraction.takes_back(e) for e in before)
    assert "".join(str(e.data["text"]) for e in before) == ANSWER[:12]
    assert not any(retraction.takes_back(e) for e in seen if e.seq > retraction.seq)
    assert retraction.data["reason"] == "the model call failed midway (connection_error)"
    assert shown(seen) == ANSWER
    # Stored as it is read: the publisher's own retraction.
    assert stored[retraction.seq - 1] == retraction
    # The synchronous client followed the same run live and saw the same events; one that
    # left after the first event and resumed from its position saw them too, once.
    assert read_sync == seen
    assert resumed == seen
    watched = cli(database_url, "runs", "watch", run_id, "--output")
    assert watched.returncode == 0, watched.stderr
    assert watched.stdout.splitlines() == [
        ANSWER[:12],
        f"[{retraction.seq}] retracted: fence {run.fence}'s output 1-{retraction.seq - 1} "
        "(the model call failed midway (connection_error))",
        ANSWER,
    ]


def test_the_sync_client_ends_with_a_run_s_output_and_refuses_a_bad_position_in_one_line(
    settings: Settings,
) -> None:
    with SyncClient(settings) as client:
        run = client.runs.submit("asker", {"question": "never run"})
        client.runs.cancel(run.run_id)
        assert list(client.runs.stream(run.run_id)) == []
        stream = client.runs.stream(run.run_id, after=-1)
        with pytest.raises(InvalidInput) as refused:
            next(stream)
        assert "\n" not in str(refused.value)
        assert client.runs.get(run.run_id).state is RunState.CANCELLED


# -- the publisher's own retraction, at the unit -------------------------------------------------
class FakeStore:
    """Appends as the database makes them (gap-free positions), without one."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []
        self.gate: Callable[[], Awaitable[None]] | None = None

    async def append(self, *args: Any, **kwargs: Any) -> Appended:
        if self.gate is not None:
            await self.gate()
        self.rows.extend(args[4])
        return Appended("ok", len(self.rows))

    def read_back(self) -> list[OutputEvent]:
        """The rows as the database stores them (a retraction counts what it takes back)."""
        now = datetime.now(UTC)
        events = []
        for seq, row in enumerate(self.rows, start=1):
            data = dict(row["data"])
            if row["kind"] == "retracted":
                taken = range(data["from_seq"], data["to_seq"] + 1)
                data |= {"fence": 7, "events": len(taken)}
            events.append(OutputEvent(seq, 7, 0, OutputKind(row["kind"]), data, now))
        return events


def published_to(store: FakeStore) -> StepOutput:
    fake: Any = store
    return StepOutput(OutputTarget(fake, "r_unit", "w", 7, 0, OutputLimits()))


async def test_a_withdrawn_part_drops_what_is_unwritten_and_retracts_only_what_was_written() -> (
    None
):
    store = FakeStore()
    output = published_to(store)
    output.text("Intro. ")
    unwritten = output.part()
    unwritten.text("never written")
    unwritten.withdraw("cut off")  # still buffered: dropped, nothing to retract
    await output.flush(5)
    assert [row["data"] for row in store.rows] == [{"text": "Intro. "}]
    written = output.part()
    written.text("half")
    await output.flush(5)
    # A write in flight when the call fails: what it wrote is retracted by the next write.
    in_flight = anyio.Event()
    release = anyio.Event()

    async def gate() -> None:
        in_flight.set()
        await release.wait()

    store.gate = gate
    written.text(" more")
    output._start()
    await in_flight.wait()
    written.withdraw("cut off")
    written.text(" ignored")  # a withdrawn part publishes nothing more
    output.progress("trying again")
    store.gate = None
    release.set()
    await output.flush(5)
    answer = output.part()
    answer.text("The answer.")
    answer.close()
    await output.flush(5)
    events = store.read_back()
    [retraction] = [e for e in events if e.kind is OutputKind.RETRACTED]
    assert list(retraction.retracts) == [2, 3] and retraction.data["events"] == 2
    assert shown(events) == "Intro. The answer."
    assert [e.data.get("message") for e in events if e.kind is OutputKind.PROGRESS] == [
        "trying again"
    ]


async def test_what_piles_up_behind_a_slow_write_goes_out_in_batches_the_database_takes() -> None:
    """The database takes at most 1,000 events an append: thousands of progress events
    published while one write is held go out in several, all of them, in order."""
    store = FakeStore()
    batches: list[int] = []
    in_flight = anyio.Event()
    release = anyio.Event()

    async def gate() -> None:
        in_flight.set()
        await release.wait()

    async def counted(*args: Any, **kwargs: Any) -> Appended:
        batches.append(len(args[4]))
        return await FakeStore.append(store, *args, **kwargs)

    store.gate = gate
    store.append = counted  # type: ignore[method-assign]
    output = published_to(store)
    output.progress("first")
    output._start()
    await in_flight.wait()
    for n in range(2500):
        output.progress("step", n=n)
    release.set()
    await output.flush(10)
    assert output.stopped is None
    assert max(batches) <= 1000 and sum(batches) == 2501
    assert [row["data"].get("n") for row in store.rows[1:]] == list(range(2500))
