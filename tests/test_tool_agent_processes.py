"""The tool loop under real faults: `serve` processes SIGKILLed or SIGSTOPped mid-loop, and
renewals blocked while a model call is in flight. The scripted model server, the HTTP vendor
(counting raw requests per idempotency key) and PostgreSQL are real, on loopback."""

from __future__ import annotations

import json
import signal
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlsplit

import anyio
import pytest

from orchestrator.agent.tool_loop import effect_keys
from orchestrator.db.store import RunStore
from orchestrator.effect_model import Effect, EffectStatus
from orchestrator.effects.http import HttpAdapter
from orchestrator.effects.store import EffectStore
from orchestrator.models import RunState
from orchestrator.settings import Settings
from orchestrator.testing import capture_spans, running_worker, wait_for_run
from orchestrator.testing.loopback import FaultProxy, LocalVendor, ScriptedModelServer, Slow
from support import (
    ServeProcess,
    cli,
    crm_kind,
    fenced_claims,
    serve_args,
    serving,
    write_vendors_config,
)
from support.tool_agents_for_tests import ORDERS_TURNS, SLOW_TURN_1, orders
from test_runtime import FAST, eventually

pytestmark = pytest.mark.slow
AGENTS = serving("support.tool_agents_for_tests")


def vendor_config(tmp_path: Path, vendor: LocalVendor) -> str:
    return write_vendors_config(tmp_path, {"crm": crm_kind(vendor)})


async def killed_once_answered(
    database_url: str,
    args: list[str],
    env: dict[str, str],
    model: ScriptedModelServer,
    conversation: str,
    turn: int,
) -> None:
    """Run worker A until the model has answered ``turn`` once, then SIGKILL it: with a slow
    tool in that turn, A dies between the model's answer and the turn's commit."""
    with ServeProcess(database_url, *args, name="A", env=env) as a:
        await until(lambda: model.answered(conversation, turn) == 1)
        await anyio.sleep(0.3)
        a.kill()


def model_env(model: ScriptedModelServer, **more: str) -> dict[str, str]:
    return {"OPENAI_BASE_URL": model.base_url, "OPENAI_API_KEY": "", **more}


async def until(condition: Callable[[], bool], within: float = 30) -> None:
    await eventually(condition, within=within)


async def effect_rows(store: RunStore, run_id: str) -> list[tuple[str, dict[str, object], int]]:
    records = await EffectStore(store.pool).list_effects(run_id=run_id)
    return [(r.effect_key, r.payload, r.fence) for r in records]


async def test_killed_between_the_model_answer_and_the_commit_the_replayed_turn_alone_acts(
    database_url: str, store: RunStore, tmp_path: Path
) -> None:
    """The replacement replays turn 1 and the model answers differently: only the committed
    call is ever dispatched; nothing was sent for the killed worker's call."""
    async with ScriptedModelServer(SLOW_TURN_1) as model, LocalVendor() as vendor:
        args = serve_args(
            AGENTS, vendor_config(tmp_path, vendor), lease_seconds="10", heartbeat_seconds="2"
        )
        env = model_env(model, ORDERS_LOOKUP_SECONDS="60")
        run_id = (await store.submit("orders", {"prompt": "Where is o-17?"})).run.run_id
        conversation = "Where is o-17?"
        # A is in the slow lookup: turn 1 is answered, not committed.
        await killed_once_answered(database_url, args, env, model, conversation, turn=1)
        with ServeProcess(database_url, *args, name="B", env=env):
            final = await wait_for_run(store, run_id, within=40)
            await until(lambda: len(vendor.requests_by_key) == 1, within=60)
    assert final.state is RunState.SUCCEEDED, final.error
    rows = await effect_rows(store, run_id)
    [turn_1] = [m for m in await store.messages(run_id) if m.role == "assistant" and m.turn == 1]
    assert [(key, payload) for key, payload, _ in rows] == [
        (
            *effect_keys(1, turn_1.body["tool_calls"]),
            {"order_id": "o-17", "note": "REPLAYED answer"},
        )
    ]
    assert sorted(vendor.requests_by_key.values()) == [1]
    assert [d["payload"]["note"] for d in vendor.deliveries.values()] == ["REPLAYED answer"]
    assistant_turns = [m.turn for m in await store.messages(run_id) if m.role == "assistant"]
    assert assistant_turns == [0, 1, 2]  # the conversation resumed from the last commit


async def test_killed_between_the_commit_and_the_dispatch_the_effect_is_sent_once(
    database_url: str, store: RunStore, tmp_path: Path
) -> None:
    async with ScriptedModelServer(ORDERS_TURNS) as model, LocalVendor() as vendor:
        config = vendor_config(tmp_path, vendor)
        base = [*AGENTS, "--lease-seconds", "10", "--heartbeat-seconds", "2"]
        run_id = (await store.submit("orders", {"prompt": "o-17, please"})).run.run_id
        with ServeProcess(
            database_url, *base, "--no-dispatch", name="A", env=model_env(model)
        ) as a:
            await until(lambda: model.answered("o-17, please", 1) == 1)
            await anyio.sleep(0.5)
            assert (await effect_rows(store, run_id)) != []  # turn 1 committed its effect
            a.kill()
        with ServeProcess(
            database_url, *base, "--effects-config", config, name="B", env=model_env(model)
        ):
            final = await wait_for_run(store, run_id, within=40)
    assert final.state is RunState.SUCCEEDED, final.error
    assert sorted(vendor.requests_by_key.values()) == [1]
    assert model.answered("o-17, please", 1) == 1  # turn 1 was not asked again
    told = [
        json.loads(m.body["content"])
        for m in await store.messages(run_id)
        if m.turn == 2 and m.role == "tool"
    ]
    assert told[0]["status"] == "confirmed"


async def test_a_paused_owner_resumes_after_a_replacement_and_its_stale_fence_is_refused(
    database_url: str, store: RunStore, tmp_path: Path
) -> None:
    async with ScriptedModelServer(ORDERS_TURNS) as model, LocalVendor() as vendor:
        args = serve_args(
            AGENTS, vendor_config(tmp_path, vendor), lease_seconds="2", heartbeat_seconds="0.5"
        )
        conversation = "stop and go"
        model.fail_next(Slow(2.5), turn=2, conversation=conversation)
        run_id = (await store.submit("orders", {"prompt": conversation})).run.run_id
        with ServeProcess(database_url, *args, name="A", env=model_env(model)) as a:
            await until(
                lambda: any(r["turn"] == 2 for r in model.requests)
            )  # after turn 1's commit
            a.signal(signal.SIGSTOP)
            with ServeProcess(database_url, *args, name="B", env=model_env(model)):
                final = await wait_for_run(store, run_id, within=40)
            a.signal(signal.SIGCONT)
            await until(lambda: bool(a.events("lease lost")), within=60)
            await anyio.sleep(1)
        # A still holds credentials and a live connection: its request is refused at the boundary.
        # A loaded machine may add claims (a starved heartbeat loses a lease): the fences
        # expected are read from the timeline.
        claims = fenced_claims(await store.events(run_id))
        a_fence = max(c.fence or 0 for c in claims if c.worker_id == "A")
        async with store.pool.acquire() as db:
            stale = await EffectStore(store.pool).accept(
                db, run_id, a_fence, Effect("late-note", "crm", {"note": "late"}), worker_id="A"
            )
    assert final.state is RunState.SUCCEEDED, final.error
    assert (stale.outcome, stale.accepted_fence) == ("stale", final.fence)
    assert sorted(vendor.requests_by_key.values()) == [1]  # one request per tool call
    events = await store.events(run_id)
    assert claims[0].worker_id == "A" and claims[-1].worker_id == "B"
    assert claims[-1].fence == final.fence and claims == fenced_claims(events)
    assert ("A", a_fence) in [
        (e.worker_id, e.fence) for e in events if e.kind == "stale_fence_rejected"
    ]
    a_lost = [e.fence for e in events if e.kind == "lease_lost" and e.worker_id == "A"]
    assert a_fence in a_lost, events


async def test_a_model_call_outlasting_the_lease_while_renewals_are_blocked_commits_nothing(
    settings: Settings, store: RunStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The local deadline cancels the call in flight; the turn commits nothing; only the turn
    committed after the lease was recovered acts."""
    exporter = capture_spans()
    assert exporter is not None
    exporter.clear()
    conversation = "partitioned"
    async with (
        ScriptedModelServer(ORDERS_TURNS) as model,
        LocalVendor() as vendor,
        FaultProxy("127.0.0.1", int(urlsplit(str(settings.database_url)).port or 0)) as proxy,
    ):
        model.fail_next(Slow(6), turn=1, conversation=conversation)
        monkeypatch.setenv("OPENAI_BASE_URL", model.base_url)
        proxied = Settings(database_url=proxy.dsn_for(str(settings.database_url)))
        run_id = (await store.submit("orders", {"prompt": conversation})).run.run_id
        adapters = {"crm": HttpAdapter("crm", url=vendor.send_url, reconcile="replay")}
        options = {**FAST, "lease_seconds": 2.0, "heartbeat_seconds": 0.5}
        async with running_worker(proxied, [orders], effect_adapters=adapters, **options):
            await until(lambda: any(r["turn"] == 1 for r in model.requests))
            proxy.mode = "blackhole"  # renewals (and every other statement) get no answer
            await until(lambda: model.disconnects == 1, within=60)
            proxy.mode = "forward"
            final = await wait_for_run(store, run_id, within=40)
            await until(lambda: len(vendor.requests_by_key) == 1, within=60)
    assert final.state is RunState.SUCCEEDED, final.error
    events = await store.events(run_id)
    fenced_claims(events)  # nothing committed by a fence after it was lost
    # The blackhole outlasts the lease, so a lease was lost; a loaded machine may lose more,
    # so the fences are read from the timeline.
    lost = [e.fence or 0 for e in events if e.kind == "lease_lost"]
    assert lost, events
    rows = await effect_rows(store, run_id)
    assert len(rows) == 1 and rows[0][2] > min(lost)  # requested by a claim after the stall
    record = await EffectStore(store.pool).get(run_id, rows[0][0])
    assert record.status is EffectStatus.CONFIRMED
    # The stalled turn is in the trace, labelled as never committed.
    turns_ = [
        (s.attributes["orchestrator.run.fence"], s.attributes["orchestrator.committed"])
        for s in exporter.get_finished_spans()
        if s.name == "invoke_agent orders" and s.attributes["orchestrator.run.id"] == run_id
    ]
    assert any((fence, False) in turns_ for fence in lost), turns_
    assert (rows[0][2], True) in turns_, turns_


async def test_runs_show_prints_the_conversation_and_json_gives_it_whole(
    settings: Settings, store: RunStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with ScriptedModelServer(ORDERS_TURNS) as model, LocalVendor() as vendor:
        monkeypatch.setenv("OPENAI_BASE_URL", model.base_url)
        adapters = {"crm": HttpAdapter("crm", url=vendor.send_url, reconcile="replay")}
        run_id = (await store.submit("orders", {"prompt": "show me o-17"})).run.run_id
        async with running_worker(settings, [orders], effect_adapters=adapters, **FAST):
            await wait_for_run(store, run_id, within=60)
    shown = cli(str(settings.database_url), "runs", "show", run_id)
    assert shown.returncode == 0, shown.stderr
    assert "conversation" in shown.stdout
    assert "→ lookup_order(" in shown.stdout and "→ notify(" in shown.stdout
    assert "[effect confirmed]" in shown.stdout
    whole = json.loads(cli(str(settings.database_url), "runs", "show", run_id, "--json").stdout)
    assert [m["role"] for m in whole["messages"]][:3] == ["system", "user", "assistant"]
    assert whole["messages"][1]["body"]["content"] == "show me o-17"
    assert whole["effects"][0]["status"] == "confirmed"
