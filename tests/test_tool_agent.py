"""The tool loop in one worker: real PostgreSQL, the real openai client over real HTTP to the
scripted model server, a real HTTP vendor behind the dispatcher."""

from __future__ import annotations

import json
from typing import Any, cast

import pydantic
import pytest

from orchestrator.agent.steps import Agent, Finish, Next, Outcome, Step, StepContext
from orchestrator.agent.tool_loop import ToolAgent, effect_keys, recorded_effect_keys
from orchestrator.agent.tools import ReadOnlyTool, tool
from orchestrator.agent.transcript import Transcript
from orchestrator.console.views import message_views
from orchestrator.db.store import RunStore
from orchestrator.effect_model import EffectStatus, validate_effect_key
from orchestrator.effects.http import HttpAdapter
from orchestrator.effects.store import EffectStore
from orchestrator.models import Message, RunState
from orchestrator.settings import Settings
from orchestrator.testing import capture_spans, running_worker, wait_for_run
from orchestrator.testing.loopback import (
    LocalVendor,
    RateLimited,
    ScriptedCall,
    ScriptedModelServer,
    ScriptedTurn,
    ScriptRequest,
    Slow,
    turns,
)
from support.tool_agents_for_tests import ORDERS_TURNS, lookup_order, notify, orders
from test_runtime import FAST


async def serve_one(
    settings: Settings,
    store: RunStore,
    agent: Agent,
    model: ScriptedModelServer,
    monkeypatch: pytest.MonkeyPatch,
    run_input: dict[str, Any],
    **options: Any,
) -> tuple[str, LocalVendor]:
    """Run one input through ``agent`` in a worker with a dispatcher and an HTTP vendor."""
    monkeypatch.setenv("OPENAI_BASE_URL", model.base_url)
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    async with LocalVendor() as vendor:
        adapters = {"crm": HttpAdapter("crm", url=vendor.send_url, reconcile="replay")}
        run_id = (await store.submit(agent.name, run_input)).run.run_id
        async with running_worker(
            settings, [agent], effect_adapters=adapters, **{**FAST, **options}
        ):
            await wait_for_run(store, run_id, within=60)
    return run_id, vendor


async def test_a_turn_commits_its_messages_and_effects_and_the_model_reads_the_settled_record(
    settings: Settings, store: RunStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with ScriptedModelServer(ORDERS_TURNS) as model:
        run_id, vendor = await serve_one(
            settings, store, orders, model, monkeypatch, {"prompt": "Where is o-17?"}
        )
    run = await store.get(run_id)
    assert run.state is RunState.SUCCEEDED, run.error
    assert run.result is not None
    assert run.result["output"] == "Order o-17 has shipped; the CRM is noted."
    assert run.result["turns"] == 3 and run.result["invalid_calls"] == 0
    transcript = await store.messages(run_id)
    assert [(m.turn, m.role) for m in transcript] == [
        (0, "system"),
        (0, "user"),
        (0, "assistant"),
        (0, "tool"),
        (1, "assistant"),
        (2, "tool"),
        (2, "assistant"),
    ]
    assert [m.seq for m in transcript] == list(range(7))
    assert json.loads(transcript[3].body["content"])["status"] == "shipped"
    assert transcript[2].usage["input_tokens"] > 0  # each assistant message carries its usage
    # The effect: recorded with turn 1's commit under its tool and arguments, sent once, and the
    # model was told its settled record (confirmed, the vendor's id) at turn 2.
    call = transcript[4].body["tool_calls"][0]
    [key] = effect_keys(1, transcript[4].body["tool_calls"])
    record = await EffectStore(store.pool).get(run_id, key)
    assert record.status is EffectStatus.CONFIRMED
    assert record.payload == {"order_id": "o-17", "note": "shipped today"}
    assert vendor.requests_by_key[record.idempotency_key] == 1
    told = json.loads(transcript[5].body["content"])
    assert (told["status"], told["external_id"]) == ("confirmed", record.external_id)
    assert transcript[5].body["tool_call_id"] == call["id"]
    assert [r["turn"] for r in model.requests] == [0, 1, 2]
    shown = message_views(transcript, [record], last=10, reveal=False)
    assert [c["effect_status"] for v in shown for c in v.calls] == [None, "confirmed"]


async def test_invalid_tool_calls_go_back_to_the_model_as_errors_and_are_counted(
    settings: Settings, store: RunStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    script = turns(
        ScriptedTurn(
            calls=(
                ScriptedCall("no_such_tool", {}),
                ScriptedCall("lookup_order", '{"order_id": '),  # malformed JSON
                ScriptedCall("lookup_order", {"order": "o-17"}),  # fails the schema
                ScriptedCall("notify", {"order_id": "o-17"}),  # a required field missing
            )
        ),
        ScriptedTurn(content="Sorry, I could not help."),
    )
    async with ScriptedModelServer(script) as model:
        run_id, _ = await serve_one(
            settings, store, orders, model, monkeypatch, {"prompt": "o-17?"}
        )
    run = await store.get(run_id)
    assert run.state is RunState.SUCCEEDED and run.result is not None
    assert run.result["invalid_calls"] == 4
    errors = [
        json.loads(m.body["content"])["error"]
        for m in await store.messages(run_id)
        if m.role == "tool"
    ]
    assert "there is no tool named 'no_such_tool'" in errors[0]
    assert "invalid arguments for lookup_order" in errors[1]
    assert "order_id: Field required" in errors[2] and "order: Extra inputs" in errors[2]
    assert "note: Field required" in errors[3]
    assert await EffectStore(store.pool).list_effects(run_id=run_id) == []  # nothing to send


async def test_the_turn_limit_and_the_deadline_end_the_run_failed(
    settings: Settings, store: RunStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    forever = turns(ScriptedTurn(calls=(ScriptedCall("lookup_order", {"order_id": "o-1"}),)))
    looping = ToolAgent("looping", instructions="", tools=[lookup_order], max_turns=3)
    async with ScriptedModelServer(forever) as model:
        run_id, _ = await serve_one(
            settings, store, looping, model, monkeypatch, {"prompt": "loop"}
        )
    run = await store.get(run_id)
    assert run.state is RunState.FAILED
    assert run.error is not None and "turn limit of 3" in run.error["message"]
    assert len(model.requests) == 3

    hurried = ToolAgent(
        "hurried", instructions="", tools=[lookup_order], max_turns=100, deadline_seconds=0.5
    )
    async with ScriptedModelServer(forever, latency=0.2) as model:
        run_id, _ = await serve_one(
            settings, store, hurried, model, monkeypatch, {"prompt": "hurry"}
        )
    run = await store.get(run_id)
    assert run.state is RunState.FAILED
    assert run.error is not None and "deadline passed" in run.error["message"]
    assert len(model.requests) < 10


@tool.read_only(timeout=0.2)
async def stuck(order_id: str) -> str:
    """A lookup that never answers."""
    import anyio

    await anyio.sleep(30)
    return order_id


@tool.read_only(timeout=0.2)
def stuck_sync(order_id: str) -> str:
    """A blocking lookup that answers long after its timeout (it runs in a worker thread)."""
    import time

    time.sleep(5)
    return order_id


@pytest.mark.parametrize("lookup", [stuck, stuck_sync], ids=["async", "blocking"])
async def test_a_read_only_tool_past_its_timeout_is_an_error_the_model_reads(
    settings: Settings, store: RunStore, monkeypatch: pytest.MonkeyPatch, lookup: ReadOnlyTool
) -> None:
    agent = ToolAgent(f"stuck_{lookup.name}", instructions="", tools=[lookup])
    script = turns(
        ScriptedTurn(calls=(ScriptedCall(lookup.name, {"order_id": "o-1"}),)),
        ScriptedTurn(content="The lookup timed out."),
    )
    async with ScriptedModelServer(script) as model:
        run_id, _ = await serve_one(settings, store, agent, model, monkeypatch, {"p": 1})
    run = await store.get(run_id)
    assert run.state is RunState.SUCCEEDED and run.result is not None
    assert run.result["tool_errors"] == 1
    # The timeout is the model's to read, not a failed attempt (a lease lost on a busy machine
    # may still hand the run to a second claim: not what this asserts).
    assert "retry_scheduled" not in [event.kind for event in await store.events(run_id)]
    tool_message = next(m for m in await store.messages(run_id) if m.role == "tool")
    assert "did not answer within 0.2s" in tool_message.body["content"]


async def test_429_with_retry_after_is_retried_and_every_attempt_is_in_the_usage(
    settings: Settings, store: RunStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    agent = ToolAgent("patient", instructions="", tools=[])
    async with ScriptedModelServer(turns(ScriptedTurn(content="done"))) as model:
        model.fail_next(RateLimited(retry_after=0.3), times=2)
        run_id, _ = await serve_one(settings, store, agent, model, monkeypatch, {"p": 1})
    run = await store.get(run_id)
    assert run.state is RunState.SUCCEEDED and run.result is not None
    assert run.result["model_attempts"] == 3
    assistant = next(m for m in await store.messages(run_id) if m.role == "assistant")
    outcomes = [a["outcome"] for a in assistant.usage["attempts"]]
    assert outcomes == ["rate_limited", "rate_limited", "ok"]
    assert [r["answer"] for r in model.requests] == ["429", "429", "text"]


async def test_a_model_answer_slower_than_the_lease_succeeds_while_the_heartbeat_renews(
    settings: Settings, store: RunStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The lease is renewed while the call is in flight, so the call is bounded by the model
    timeout and by losing the lease, never by the lease's length: one request, one answer."""
    agent = ToolAgent("unhurried", instructions="", tools=[])
    lease = 3.0  # renewed every 0.6 s: a busy machine still renews well within it
    async with ScriptedModelServer(turns(ScriptedTurn(content="done"))) as model:
        model.fail_next(Slow(lease * 2.5))
        run_id, _ = await serve_one(
            settings,
            store,
            agent,
            model,
            monkeypatch,
            {"p": 1},
            lease_seconds=lease,
            heartbeat_seconds=lease / 5,
        )
    run = await store.get(run_id)
    assert run.state is RunState.SUCCEEDED and run.result is not None, run.error
    assert run.result["model_attempts"] == 1
    assert [r["answer"] for r in model.requests] == ["text"]
    assert model.disconnects == 0


class Verdict(pydantic.BaseModel):
    status: str
    confidence: float


async def test_structured_output_that_fails_validation_goes_back_then_succeeds(
    settings: Settings, store: RunStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    agent = ToolAgent("judge", instructions="Judge.", tools=[], output=Verdict, stream=True)
    script = turns(
        ScriptedTurn(content='{"status": "ok"}'),  # confidence missing
        ScriptedTurn(content="not json at all"),
        ScriptedTurn(content='{"status": "ok", "confidence": 0.9}'),
    )
    async with ScriptedModelServer(script) as model:
        run_id, _ = await serve_one(settings, store, agent, model, monkeypatch, {"p": 1})
    run = await store.get(run_id)
    assert run.state is RunState.SUCCEEDED, run.error
    assert run.result is not None
    assert run.result["output"] == {"status": "ok", "confidence": 0.9}
    assert all(request["stream"] for request in model.requests)  # streamed end to end
    corrections = [m.body["content"] for m in await store.messages(run_id) if m.role == "user"][1:]
    assert len(corrections) == 2 and "confidence: Field required" in corrections[0]

    strict = ToolAgent("strict_judge", instructions="", tools=[], output=Verdict, output_retries=1)
    async with ScriptedModelServer(turns(ScriptedTurn(content="nope"))) as model:
        run_id, _ = await serve_one(settings, store, strict, model, monkeypatch, {"p": 2})
    failed = await store.get(run_id)
    assert failed.state is RunState.FAILED and failed.error is not None
    assert "did not match the required output after 2 tries" in failed.error["message"]


def test_tools_are_labelled_and_described_where_they_are_defined() -> None:
    from orchestrator.errors import InvalidInput

    assert notify.kind == "crm" and lookup_order.timeout == 30
    definition = lookup_order.definition()["function"]
    assert definition["description"] == "Look an order up by its id."
    assert definition["parameters"]["required"] == ["order_id"]
    assert "o-17" in definition["parameters"]["properties"]["order_id"]["description"]
    with pytest.raises(InvalidInput, match="not a tool"):
        ToolAgent("bad", instructions="", tools=[lambda: None])  # type: ignore[list-item]
    with pytest.raises(InvalidInput, match="give it a docstring"):

        @tool.read_only
        def undocumented(x: int) -> int:
            return x

    with pytest.raises(InvalidInput, match="has no type hint"):

        @tool.effect("crm")
        def untyped(x) -> dict[str, object]:  # type: ignore[no-untyped-def]
            """No hint."""
            return {}


async def test_turns_are_traced_on_the_genai_conventions_without_prompts_or_outputs(
    settings: Settings, store: RunStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    exporter = capture_spans()
    assert exporter is not None
    exporter.clear()
    async with ScriptedModelServer(ORDERS_TURNS) as model:
        run_id, _ = await serve_one(
            settings, store, orders, model, monkeypatch, {"prompt": "secret-canary-7f3 o-17"}
        )
    spans = exporter.get_finished_spans()
    mine = [s for s in spans if (s.attributes or {}).get("orchestrator.run.id") == run_id]
    turns_ = [s for s in mine if s.name == "invoke_agent orders"]
    assert [s.attributes["orchestrator.committed"] for s in turns_] == [True, True, True]
    assert {s.attributes["gen_ai.agent.name"] for s in turns_} == {"orders"}
    chats = [s for s in mine if s.name.startswith("chat ")]
    assert len(chats) == 3
    for chat in chats:
        assert chat.attributes["gen_ai.provider.name"] == "openai"
        assert "gen_ai.system" not in chat.attributes
        assert chat.attributes["gen_ai.usage.input_tokens"] > 0
        assert chat.attributes["orchestrator.run.fence"] == 1
        assert chat.parent is not None and chat.parent.span_id in {
            t.context.span_id for t in turns_
        }
    tools_ = {s.name: s for s in mine if s.name.startswith("execute_tool ")}
    assert set(tools_) == {"execute_tool lookup_order", "execute_tool notify"}
    assert tools_["execute_tool notify"].attributes["gen_ai.tool.call.id"]
    assert tools_["execute_tool notify"].attributes["orchestrator.effect.key"].startswith("call:1:")
    for span in spans:  # prompts and outputs never go into traces
        for value in (span.attributes or {}).values():
            assert "secret-canary-7f3" not in str(value), span.name
            assert "shipped today" not in str(value), span.name


class Notify(Step):
    """The step after the loop's stage: reads the loop's output from its checkpoint."""

    async def run(self, ctx: StepContext) -> Outcome:
        return Finish(result={"notified": ctx.checkpoint["output"], "kept": ctx.checkpoint["kept"]})


class Prepare(Step):
    async def run(self, ctx: StepContext) -> Outcome:
        return Next("resolve", checkpoint={"kept": "from before the loop"})


async def test_a_tool_loop_is_one_stage_of_a_larger_step_graph(
    settings: Settings, store: RunStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    graph = Agent("graph", first=Prepare, steps=[orders.stage("resolve", then=Notify), Notify])
    async with ScriptedModelServer(ORDERS_TURNS) as model:
        run_id, vendor = await serve_one(
            settings, store, graph, model, monkeypatch, {"prompt": "g"}
        )
    run = await store.get(run_id)
    assert run.state is RunState.SUCCEEDED, run.error
    assert run.result == {
        "notified": "Order o-17 has shipped; the CRM is noted.",
        "kept": "from before the loop",
    }
    assert sorted(vendor.requests_by_key.values()) == [1]


@tool.read_only(timeout=5)
def huge(order_id: str) -> str:
    """A lookup whose answer is far too large to store."""
    return "x" * (300 * 1024)


async def test_a_message_over_the_size_limit_is_refused_with_a_clear_error(
    settings: Settings, store: RunStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    agent = ToolAgent("oversized", instructions="", tools=[huge])
    script = turns(ScriptedTurn(calls=(ScriptedCall("huge", {"order_id": "o-1"}),)))
    async with ScriptedModelServer(script) as model:
        monkeypatch.setenv("OPENAI_BASE_URL", model.base_url)
        run_id = (await store.submit("oversized", {"p": 1}, max_attempts=1)).run.run_id
        async with running_worker(settings, [agent], **FAST):
            run = await wait_for_run(store, run_id, within=60)
    assert run.state is RunState.DEAD and run.error is not None
    assert "the tool message of turn 0 is" in run.error["message"]
    assert "over the 262,144-byte limit" in run.error["message"]
    assert await store.messages(run_id) == []  # nothing of the turn was written


def call(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def test_an_effect_key_names_the_action_not_the_models_call_id() -> None:
    """A replayed turn (new call ids, the same arguments spelled otherwise) meets the same keys;
    another action, or the same one asked twice in a turn, gets its own; every key is valid."""
    first = effect_keys(
        3,
        [
            call("call_a", "notify", '{"order_id": "o-17", "note": "hi"}'),
            call("call_b", "notify", '{"order_id": "o-17", "note": "hi"}'),
            call("call_c", "notify", '{"order_id": "o-18", "note": "hi"}'),
        ],
    )
    replayed = effect_keys(
        3,
        [
            call("call_x", "notify", '{"note":"hi","order_id":"o-17"}'),
            call("call_y", "notify", '{ "note": "hi", "order_id": "o-17" }'),
            call("call_z", "notify", '{"note": "hi", "order_id": "o-18"}'),
        ],
    )
    assert first == replayed
    assert len(set(first)) == 3 and first[1] == f"{first[0]}:2"
    assert effect_keys(4, [call("call_a", "notify", "{}")]) != effect_keys(
        3, [call("call_a", "notify", "{}")]
    )
    huge = effect_keys(10**9, [call("c", "n" * 500, '{"x": "' + "y" * 10_000 + '"}')] * 3)
    assert [validate_effect_key(key) for key in huge] == huge


def test_effects_keyed_by_call_id_by_earlier_versions_are_still_shown() -> None:
    calls = [call("call_1", "notify", "{}"), call("call_2", "lookup_order", "{}")]
    [new, _] = effect_keys(1, calls)
    assert recorded_effect_keys(1, calls, {"call:1:call_1"}) == ["call:1:call_1", None]
    assert recorded_effect_keys(1, calls, {new}) == [new, None]
    assert recorded_effect_keys(1, calls, set()) == [None, None]


async def test_each_turn_sends_the_model_the_committed_transcript_as_it_is(
    settings: Settings, store: RunStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[list[dict[str, Any]]] = []

    def script(request: ScriptRequest) -> ScriptedTurn:
        seen.append(request.messages)
        return ORDERS_TURNS(request)

    async with ScriptedModelServer(script) as model:
        run_id, _ = await serve_one(
            settings, store, orders, model, monkeypatch, {"prompt": "Where is o-17?"}
        )
    assert (await store.get(run_id)).state is RunState.SUCCEEDED
    bodies = [m.body for m in await store.messages(run_id)]
    # Turn N's request is the transcript up to its own assistant message, field for field.
    assistants = [i for i, body in enumerate(bodies) if body["role"] == "assistant"]
    assert seen == [bodies[:i] for i in assistants]


class _NoReads:
    async def messages(self, run_id: str) -> list[Message]:
        raise AssertionError("a run that has committed nothing has no transcript to read")


async def test_a_run_that_has_committed_nothing_does_not_read_its_transcript() -> None:
    transcript = Transcript(cast(RunStore, _NoReads()), "r_x", empty=True)
    assert await transcript.messages() == []
    new = [Message(0, "user", {"role": "user", "content": "hi"})]
    assert [m.seq for m in await transcript.numbered(new, fence=3)] == [0]


@tool.read_only(timeout=30)
def slow_sync_lookup(order_id: str) -> str:
    """A blocking lookup (a sync client) that takes longer than the lease."""
    import time

    time.sleep(4.5)
    return f"{order_id}: shipped"


async def test_a_slow_sync_read_only_tool_keeps_the_lease_renewed_and_commits_once(
    settings: Settings, store: RunStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A blocking tool slower than the lease (3 s) is slow, not dead: it runs off the event loop,
    so the heartbeat keeps renewing and the first claim commits the turn (no takeover)."""
    agent = ToolAgent("slow_sync", instructions="", tools=[slow_sync_lookup])
    script = turns(
        ScriptedTurn(calls=(ScriptedCall("slow_sync_lookup", {"order_id": "o-1"}),)),
        ScriptedTurn(content="o-1 has shipped."),
    )
    async with ScriptedModelServer(script) as model:
        run_id, _ = await serve_one(settings, store, agent, model, monkeypatch, {"p": 1})
    run = await store.get(run_id)
    assert run.state is RunState.SUCCEEDED, run.error
    assert run.fence == 1, "the lease was lost while the tool ran: the run was claimed again"
    tool_message = next(m for m in await store.messages(run_id) if m.role == "tool")
    assert json.loads(tool_message.body["content"]) == "o-1: shipped"
