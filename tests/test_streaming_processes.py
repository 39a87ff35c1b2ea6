"""Live output under real faults (invariant 17): clients follow a run while its `serve` is
SIGSTOPped mid-answer and replaced (a step's `llm.chat`, and a Pydantic AI agent's turn). The
scripted model server streams; PostgreSQL and the processes are real, on loopback."""

from __future__ import annotations

import signal
from collections.abc import Callable

import anyio
import pytest

from orchestrator import Client
from orchestrator.db.output import OutputEvent, OutputKind, OutputStore
from orchestrator.db.store import RunStore
from orchestrator.models import Run, RunState
from orchestrator.settings import Settings
from orchestrator.testing import wait_for_run
from orchestrator.testing.loopback import ScriptedModelServer, ScriptedTurn, turns
from support import ServeProcess, serving
from support.pydantic_ai_agents_for_tests import STREAMED_ANSWER, STREAMED_TURNS
from test_runtime import eventually

pytestmark = pytest.mark.slow
AGENTS = serving("support.streaming_agents_for_tests")
ANSWER = "The quick brown fox jumps over the lazy dog, and then it naps in the afternoon sun."
LEASE = ["--lease-seconds", "2", "--heartbeat-seconds", "0.5"]


def shown(events: list[OutputEvent]) -> str:
    """What a reader shows once every retraction has taken back what it names."""
    retractions = [e for e in events if e.kind is OutputKind.RETRACTED]
    return "".join(
        str(e.data["text"])
        for e in events
        if e.kind is OutputKind.TEXT and not any(r.takes_back(e) for r in retractions)
    )


async def until(condition: Callable[[], bool], within: float = 30) -> None:
    await eventually(condition, within=within)


async def paused_and_replaced(
    a: ServeProcess,
    database_url: str,
    agents: list[str],
    env: dict[str, str],
    store: RunStore,
    run_id: str,
) -> Run:
    """SIGSTOP ``a``, let ``B`` finish the run, then SIGCONT ``a`` until it knows it lost the
    run (and has tried whatever it still tries to publish): the run as ``B`` ended it."""
    a.signal(signal.SIGSTOP)
    with ServeProcess(database_url, *agents, *LEASE, name="B", env=env):
        final = await wait_for_run(store, run_id, within=60)
    a.signal(signal.SIGCONT)
    await until(lambda: bool(a.events("lease lost")), within=60)
    await anyio.sleep(1)  # whatever the zombie still tries to publish, it tries now
    return final


async def test_two_readers_see_a_paused_owner_s_half_answer_retracted_and_the_new_one_once(
    database_url: str, store: RunStore
) -> None:
    script = turns(ScriptedTurn(content=ANSWER))
    async with (
        ScriptedModelServer(script, token_seconds=0.1, token_chars=4) as model,
        await Client.connect(Settings(database_url=database_url)) as one,
        await Client.connect(Settings(database_url=database_url)) as two,
    ):
        env = {"OPENAI_BASE_URL": model.base_url, "OPENAI_API_KEY": ""}
        run_id = (await store.submit("streamer", {"question": "fox?"})).run.run_id
        seen_one: list[OutputEvent] = []
        seen_two: list[OutputEvent] = []

        async def follow(client: Client, seen: list[OutputEvent]) -> None:
            async for event in client.runs.stream(run_id):
                seen.append(event)

        async def follow_reconnecting() -> None:
            """Reader two drops its stream after three events and resumes from its position."""
            async for event in two.runs.stream(run_id):
                seen_two.append(event)
                if len(seen_two) == 3:
                    break
            await anyio.sleep(0.5)
            async for event in two.runs.stream(run_id, after=seen_two[-1].seq):
                seen_two.append(event)

        with anyio.fail_after(120):  # the readers end with the run
            async with anyio.create_task_group() as readers:
                readers.start_soon(follow, one, seen_one)
                readers.start_soon(follow_reconnecting)
                with ServeProcess(database_url, *AGENTS, *LEASE, name="A", env=env) as a:
                    # Mid-answer: some of the model's text has reached both readers.
                    await until(lambda: sum(e.kind is OutputKind.TEXT for e in seen_one) >= 3)
                    final = await paused_and_replaced(a, database_url, AGENTS, env, store, run_id)
        # A zombie with credentials and a live connection: its publish is refused.
        stale_fence = next(e.fence for e in seen_one if e.kind is OutputKind.RETRACTED)
        late = await OutputStore(store.pool).append(
            run_id,
            "A",
            stale_fence,
            1,
            [{"kind": "text", "data": {"text": "zombie"}}],
            max_events=100,
            max_bytes=10_000,
        )
        assert late.status == "stale"
        reread = [e async for e in one.runs.stream(run_id)]
    assert final.state is RunState.SUCCEEDED, final.error
    assert final.result == {"answer": ANSWER}
    assert reread == seen_one
    for seen in (seen_one, seen_two):
        assert [e.seq for e in seen] == list(range(1, len(seen) + 1))  # none missed, none twice
        assert shown(seen) == ANSWER  # the new owner's answer, once
        # One retraction per unbroken run of a stale fence's positions; a busy machine may
        # lose a lease more than once, each loss retracted in turn.
        retractions = [e for e in seen if e.kind is OutputKind.RETRACTED]
        assert retractions and all(r.fence < final.fence for r in retractions)

        def taken_back(event: OutputEvent, retractions: list[OutputEvent] = retractions) -> bool:
            return any(r.takes_back(event) for r in retractions)

        assert any(e.kind is OutputKind.TEXT and taken_back(e) for e in seen)  # a half answer
        # Nothing a stale fence published is current: all of it before its last retraction,
        # and all of it taken back but the committed first step's progress.
        for stale in {r.fence for r in retractions}:
            last = max(r.seq for r in retractions if r.fence == stale)
            of_stale = [e for e in seen if e.fence == stale and e.kind is not OutputKind.RETRACTED]
            assert all(e.seq < last for e in of_stale)
            kept = [e for e in of_stale if not taken_back(e)]
            assert all(e.data.get("message") == "prepared" for e in kept)
        # The committed first step's progress stays (a busy machine may have run it under an
        # earlier fence, or twice: once it committed, it is not taken back).
        prepared = [e for e in seen if e.data.get("message") == "prepared"]
        assert not taken_back(prepared[-1])
    assert [e.as_json() for e in seen_one] == [e.as_json() for e in seen_two]


PAI_AGENTS = serving("support.pydantic_ai_agents_for_tests")


async def test_a_paused_pydantic_ai_owner_s_streamed_half_answer_is_retracted_for_its_successor(
    database_url: str, store: RunStore
) -> None:
    """A Pydantic AI agent streaming its answer (``stream=True``) is SIGSTOPped mid-answer: the
    model server holds the answer's last piece until a reader has seen the new owner's
    retraction of A's half answer, so A is stopped with its answer unfinished, for certain."""
    hold = anyio.Event()
    async with (
        ScriptedModelServer(STREAMED_TURNS, token_chars=3) as model,
        await Client.connect(Settings(database_url=database_url)) as client,
    ):
        model.hold = hold
        env = {"OPENAI_BASE_URL": model.base_url, "OPENAI_API_KEY": ""}
        run_id = (await store.submit("pai_streamer", {"prompt": "o-17, paused"})).run.run_id
        seen: list[OutputEvent] = []

        async def follow() -> None:
            async for event in client.runs.stream(run_id):
                seen.append(event)
                if event.kind is OutputKind.RETRACTED:
                    hold.set()  # the new owner publishes: let the answers end

        with anyio.fail_after(120):
            async with anyio.create_task_group() as readers:
                readers.start_soon(follow)
                with ServeProcess(database_url, *PAI_AGENTS, *LEASE, name="A", env=env) as a:
                    await until(lambda: any(e.kind is OutputKind.TEXT for e in seen))
                    final = await paused_and_replaced(
                        a, database_url, PAI_AGENTS, env, store, run_id
                    )
        reread = [e async for e in client.runs.stream(run_id)]
    assert final.state is RunState.SUCCEEDED, final.error
    assert final.result is not None and final.result["output"] == STREAMED_ANSWER
    assert reread == seen
    assert [e.seq for e in seen] == list(range(1, len(seen) + 1))
    [retraction] = [e for e in seen if e.kind is OutputKind.RETRACTED]
    half = [e for e in seen if e.kind is OutputKind.TEXT and e.seq < retraction.seq]
    assert half and all(retraction.takes_back(e) for e in half)
    assert STREAMED_ANSWER.startswith("".join(str(e.data["text"]) for e in half))
    assert retraction.fence < final.fence
    assert all(e.fence == final.fence for e in seen if e.seq > retraction.seq)
    assert shown(seen) == STREAMED_ANSWER  # the new owner's answer, once
