"""Waits, signals, approvals and budgets under real faults: `serve` processes SIGSTOPped and
SIGKILLed, a PostgreSQL restart, the CLI as a person uses it. The scripted model server, the HTTP
vendor (counting raw requests per idempotency key) and PostgreSQL are real, on loopback."""

from __future__ import annotations

import json
import signal
from decimal import Decimal
from pathlib import Path
from typing import Any

import anyio
import asyncpg
import pytest

from orchestrator.db.budgets import BudgetStore
from orchestrator.db.connections import create_pool
from orchestrator.db.embedded import EmbeddedPostgres
from orchestrator.db.signals import SignalStore
from orchestrator.db.store import RunStore
from orchestrator.effects.approvals import ApprovalStore, Decision, DecisionRefused
from orchestrator.models import RunState
from orchestrator.testing import wait_for_run
from orchestrator.testing.loopback import LocalVendor, ScriptedModelServer, Slow
from support import (
    COMMITS,
    ServeProcess,
    cli,
    fenced_claims,
    handed_from_a_to_b,
    serve_args,
    serving,
    started_and_migrated,
    submit_all,
)
from support.tool_agents_for_tests import BUDGET_TURNS, REFUND_TURNS
from test_serve_faults import wait_all_terminal
from test_tool_agent_processes import AGENTS, killed_once_answered, model_env, until, vendor_config

pytestmark = pytest.mark.slow
INBOX = serving("support.agents_for_tests")
CONVERSATION = "Refund order o-17, please."


async def run_cli(database_url: str, *args: str) -> Any:
    """The CLI in a thread: the loopback servers in this event loop keep answering meanwhile."""
    return await anyio.to_thread.run_sync(lambda: cli(database_url, *args))


async def waiting(store: RunStore, run_id: str, within: float = 30) -> None:
    await wait_for_run(store, run_id, states={RunState.WAITING}, within=within)


async def approval_requests(store: RunStore, run_id: str) -> list[dict[str, Any]]:
    return [e.details for e in await store.events(run_id) if e.kind == "approval_requested"]


async def payload_hash(pool: asyncpg.Pool, payload: dict[str, Any]) -> str:
    """The SHA-256 the boundary records for ``payload`` (of its jsonb text)."""
    digest = await pool.fetchval(
        "SELECT encode(sha256(convert_to($1::jsonb::text, 'UTF8')), 'hex')", payload
    )
    return str(digest)


async def test_a_zombie_with_a_pending_approval_never_sends_a_second_refund(
    database_url: str, store: RunStore, tmp_path: Path
) -> None:
    """A's turn asks for a gated refund; A is stopped before its commit; B claims and commits the
    turn (one approval request); a person approves; A wakes: one refund, A's work refused.
    How many claims it takes depends on the machine (a starved heartbeat loses a lease and the
    run is claimed again), so the fences expected are read from the timeline."""
    async with ScriptedModelServer(REFUND_TURNS) as model, LocalVendor() as vendor:
        args = serve_args(
            AGENTS, vendor_config(tmp_path, vendor), lease_seconds="3", heartbeat_seconds="1"
        )
        # Far longer than A can take to be stopped on a loaded machine: A never commits turn 0.
        env = model_env(model, ORDERS_LOOKUP_SECONDS="30")
        run_id = (await store.submit("refunds", {"prompt": CONVERSATION})).run.run_id
        with ServeProcess(database_url, *args, name="A", env=env) as a:
            await until(lambda: model.answered(CONVERSATION, 0) == 1)
            await anyio.sleep(0.3)  # A is in the slow lookup: answered, not committed
            a.signal(signal.SIGSTOP)
            with ServeProcess(database_url, *args, name="B", env=env):
                await waiting(store, run_id, within=60)
                [pending] = await ApprovalStore(store.pool).pending(run_id=run_id)
                run = await store.get(run_id)
                await ApprovalStore(store.pool).decide(
                    run_id,
                    pending.effect_key,
                    Decision.APPROVED,
                    by="ana",
                    payload_sha256=pending.payload_sha256,
                    run_fence=run.fence,
                )
                final = await wait_for_run(store, run_id, within=60)
                a.signal(signal.SIGCONT)
                await a.wait_for_log("lease lost", within=60)
                await anyio.sleep(1.0)  # whatever A would still do, it has had time to try
    assert final.state is RunState.SUCCEEDED, final.error
    assert sorted(vendor.requests_by_key.values()) == [1]
    assert [d["payload"]["amount"] for d in vendor.deliveries.values()] == [180]
    events = await store.events(run_id)
    a_fences, _ = handed_from_a_to_b(events)
    # One approval request, by the fence that held the run when it parked, not by A.
    [asker] = [e for e in events if e.kind == "approval_requested"]
    assert asker.fence == pending.fence == run.fence and asker.worker_id != "A", events
    assert asker.details["payload_sha256"] == pending.payload_sha256
    assert not [e for e in events if e.worker_id == "A" and e.kind in COMMITS], events
    # Every claim A held ended in a lease A itself saw lost, the one it was stopped in included.
    assert [e.fence for e in events if e.kind == "lease_lost" and e.worker_id == "A"] == a_fences


async def test_changed_arguments_on_replay_never_consume_the_old_approval(
    database_url: str, store: RunStore, tmp_path: Path
) -> None:
    """A is killed between the model's answer (refund 150) and its commit; B's replay asks for
    180. Only 180 ever awaits approval; a decision naming 150's payload is refused."""
    async with ScriptedModelServer(REFUND_TURNS) as model, LocalVendor() as vendor:
        args = [*AGENTS, "--effects-config", vendor_config(tmp_path, vendor)]
        env = model_env(model, ORDERS_LOOKUP_SECONDS="60")
        run_id = (await store.submit("refunds", {"prompt": CONVERSATION})).run.run_id
        await killed_once_answered(database_url, args, env, model, CONVERSATION, turn=0)
        with ServeProcess(database_url, *args, name="B", env=env):
            await waiting(store, run_id)
            [pending] = await ApprovalStore(store.pool).pending(run_id=run_id)
            assert pending.payload == {"order_id": "o-17", "amount": 180}
            first = await payload_hash(store.pool, {"order_id": "o-17", "amount": 150})
            assert first != pending.payload_sha256
            with pytest.raises(DecisionRefused, match="is not the one you saw"):
                await ApprovalStore(store.pool).decide(
                    run_id, pending.effect_key, Decision.APPROVED, by="ana", payload_sha256=first
                )
            await anyio.sleep(0.5)
            assert vendor.requests == 0
            approved = await run_cli(
                database_url,
                "approvals",
                "approve",
                run_id,
                pending.effect_key,
                "--by",
                "ana",
                "--hash",
                str(pending.payload_sha256),
                "--json",
            )
            assert approved.returncode == 0, approved.stderr
            final = await wait_for_run(store, run_id, within=60)
    assert final.state is RunState.SUCCEEDED, final.error
    assert [d["payload"]["amount"] for d in vendor.deliveries.values()] == [180]
    assert sorted(vendor.requests_by_key.values()) == [1]
    assert len(await approval_requests(store, run_id)) == 1


async def test_cancel_while_an_approval_is_pending_withdraws_it_and_sends_nothing(
    database_url: str, store: RunStore, tmp_path: Path
) -> None:
    async with ScriptedModelServer(REFUND_TURNS) as model, LocalVendor() as vendor:
        args = [*AGENTS, "--effects-config", vendor_config(tmp_path, vendor)]
        run_id = (await store.submit("refunds", {"prompt": CONVERSATION})).run.run_id
        with ServeProcess(database_url, *args, name="A", env=model_env(model)):
            await waiting(store, run_id)
            listed = await run_cli(database_url, "approvals", "list", "--json")
            assert listed.returncode == 0, listed.stderr
            [shown] = json.loads(listed.stdout)
            assert (shown["run_id"], shown["status"]) == (run_id, "awaiting_approval")
            human = await run_cli(database_url, "approvals", "show", run_id, shown["effect_key"])
            assert shown["payload_sha256"] in human.stdout
            cancelled = await run_cli(database_url, "runs", "cancel", run_id)
            assert cancelled.returncode == 0, cancelled.stderr
            late = await run_cli(
                database_url,
                "approvals",
                "approve",
                run_id,
                shown["effect_key"],
                "--by",
                "ana",
                "--hash",
                shown["payload_sha256"],
            )
            await anyio.sleep(1.0)
    assert late.returncode == 1
    assert "was withdrawn (its run was cancelled)" in late.stderr
    assert len(late.stderr.strip().splitlines()) == 1
    assert vendor.requests == 0
    assert (await store.get(run_id)).state is RunState.CANCELLED
    kinds = [e.kind for e in await store.events(run_id)]
    assert "approval_withdrawn" in kinds and "approval_granted" not in kinds
    assert json.loads((await run_cli(database_url, "approvals", "list", "--json")).stdout) == []


async def test_a_signal_enters_the_run_once_through_a_kill_mid_step(
    database_url: str, store: RunStore, tmp_path: Path
) -> None:
    """A reads the signal and is SIGKILLed mid-step; B replays the step with the same signal:
    consumed once (by the fence that committed), one effect, and the same key sent twice is one
    signal. The fences are read from the timeline: a loaded machine may add claims."""
    async with LocalVendor() as vendor:
        args = [*INBOX, "--effects-config", vendor_config(tmp_path, vendor)]
        hold = tmp_path / "hold"
        hold.touch()  # A, once it has the signal, holds mid-step until it is killed
        input = {"hold_file": str(hold), "marker_dir": str(tmp_path)}
        run_id = (await store.submit("inbox", input)).run.run_id
        with ServeProcess(database_url, *args, name="A") as a:
            await waiting(store, run_id, within=60)
            sent = [
                await run_cli(
                    database_url,
                    "runs",
                    "signal",
                    run_id,
                    "reply",
                    "--data",
                    '{"text": "yes, go ahead"}',
                    "--idempotency-key",
                    "mail-77",
                    "--json",
                )
                for _ in range(2)
            ]
            await until(lambda: len(list(tmp_path.glob(f"{run_id}.*"))) == 1, within=60)
            a.kill()
        hold.unlink()
        with ServeProcess(database_url, *args, name="B") as b:
            final = await wait_for_run(store, run_id, within=60)
            await until(lambda: vendor.requests >= 1, within=60)
    assert [s.returncode for s in sent] == [0, 0], [s.stderr for s in sent]
    documents = [json.loads(s.stdout) for s in sent]
    assert [d["created"] for d in documents] == [True, False]
    assert documents[0]["signal"]["seq"] == documents[1]["signal"]["seq"]
    assert "nothing new was stored" in sent[1].stderr
    assert final.state is RunState.SUCCEEDED, final.error
    claims = fenced_claims(await store.events(run_id))
    assert claims[-1].worker_id == "B" and final.fence == claims[-1].fence
    assert final.result == {"replies": [{"text": "yes, go ahead"}], "fence": final.fence}
    history = await SignalStore(store.pool).history(run_id)
    assert [(signal.name, fence) for signal, _, fence in history] == [("reply", final.fence)]
    assert sorted(vendor.requests_by_key.values()) == [1]
    names = await anyio.to_thread.run_sync(lambda: [p.name for p in tmp_path.glob(f"{run_id}.*")])
    ran = sorted((int(fence), int(pid)) for _, pid, fence in (n.split(".") for n in names))
    # The step ran in A (killed, its fence never committed) and again in B's final claim.
    assert ran[0][1] == a.process.pid and ran[-1] == (final.fence, b.process.pid), ran
    assert ran[0][0] < final.fence and len({fence for fence, _ in ran}) == len(ran)


async def test_signals_and_waits_survive_a_postgres_restart(
    own_server: EmbeddedPostgres,
) -> None:
    settings = await started_and_migrated(own_server)
    dsn = str(settings.database_url)
    signalled = await submit_all(settings, "inbox", [{}] * 5)
    timed = await submit_all(settings, "inbox", [{"seconds": 6}] * 5)
    with ServeProcess(dsn, *INBOX, "--lease-seconds", "3", name="A") as a:
        pool = await create_pool(settings)
        try:
            for run_id in signalled + timed:
                await waiting(RunStore(pool), run_id)
        finally:
            await pool.close()
        assert a.stop() == 0  # every run waits in the database, none in a worker
    pool = await create_pool(settings)
    try:
        for run_id in signalled[:2]:  # stored before the restart, consumed after it
            await SignalStore(pool).send(run_id, "reply", {"before": True})
    finally:
        await pool.close()
    await anyio.to_thread.run_sync(lambda: own_server.restart(down_seconds=2))
    with ServeProcess(dsn, *INBOX, "--lease-seconds", "3", name="B") as b:
        pool = await create_pool(settings)
        try:
            for run_id in signalled[2:]:
                await SignalStore(pool).send(run_id, "reply", {"before": False})
        finally:
            await pool.close()
        runs = await wait_all_terminal(settings, signalled + timed, within=60)
        alive = b.process.poll()
    assert alive is None
    assert [run.state for run in runs] == [RunState.SUCCEEDED] * 10
    by_id = {run.run_id: run.result for run in runs}
    assert [by_id[r]["replies"] for r in signalled] == [[{"before": True}]] * 2 + [
        [{"before": False}]
    ] * 3
    assert [by_id[r] for r in timed] == [{"timed_out": True}] * 5


def turn_one_calls(model: ScriptedModelServer) -> int:
    return sum(1 for request in model.requests if request["turn"] == 1)


def replay_ledger(entries: list[dict[str, Any]], limit: int) -> list[int]:
    """Turns spent + reserved after each ledger entry, as the ledger itself tells it."""
    spent = reserved = 0
    totals = []
    for entry in entries:
        kind, turns = entry["kind"], entry["turns"]
        if kind == "reserve":
            reserved += turns
        elif kind in ("settle", "forfeit"):
            reserved, spent = 0, spent + turns
        elif kind == "top_up":
            limit += turns
        totals.append(spent + reserved)
        assert spent + reserved <= limit, (entry, spent, reserved, limit)
    return totals


async def test_a_budget_holds_through_kills_mid_model_call_and_resumes_after_a_top_up(
    database_url: str, store: RunStore
) -> None:
    """Two workers are SIGKILLed while their model call is in flight: each call's reservation
    is counted as spent, spent + reserved never passes the limit, the run waits for budget,
    and a top-up lets it finish."""
    prices = json.dumps({"test-model": {"input_per_million": 1.0, "output_per_million": 2.0}})
    async with ScriptedModelServer(BUDGET_TURNS) as model:
        env = model_env(model, ORCHESTRATOR_MODEL="test-model", ORCHESTRATOR_PRICES=prices)
        prompt = "Where are o-0 to o-5?"
        run_id = (await store.submit("budgeted", {"prompt": prompt})).run.run_id
        model.fail_next(Slow(60), times=2, turn=1)
        for calls, name in enumerate(("A", "B"), start=1):
            with ServeProcess(database_url, *AGENTS, name=name, env=env) as worker:
                await until(lambda n=calls: turn_one_calls(model) == n, within=60)  # type: ignore[misc]
                await anyio.sleep(0.3)  # the turn-1 call is in flight
                worker.kill()
        with ServeProcess(database_url, *AGENTS, name="C", env=env):
            await waiting(store, run_id)
            run = await store.get(run_id)
            assert run.wait is not None and run.wait["reason"] == "budget"
            shown = await run_cli(database_url, "runs", "budget", run_id, "--ledger", "--json")
            assert shown.returncode == 0, shown.stderr
            before = json.loads(shown.stdout)
            topped = await run_cli(database_url, "runs", "budget", run_id, "--add-turns", "10")
            assert topped.returncode == 0, topped.stderr
            final = await wait_for_run(store, run_id, within=60)
    assert final.state is RunState.SUCCEEDED, final.error
    assert before["spent"]["turns"] == 4 and before["limit"]["turns"] == 4
    kinds = [entry["kind"] for entry in before["ledger"]]
    assert kinds.count("forfeit") == 2  # the two killed attempts' calls count as spent
    assert kinds[-1] == "refused"
    ledger = [entry.as_json() for entry in await BudgetStore(store.pool).ledger(run_id)]
    replay_ledger(ledger, limit=4)
    budget = await BudgetStore(store.pool).get(run_id)
    assert budget is not None
    assert budget.spent["turns"] == 4 + 5  # after the top-up: turns 2 to 5 and the answer
    assert Decimal(str(budget.spent["cost_usd"])) > 0
    assert budget.reserved["turns"] == 0 and budget.reserved_fence is None


async def test_the_new_commands_refuse_bad_input_in_one_line_and_change_nothing(
    database_url: str, store: RunStore
) -> None:
    run_id = (await store.submit("inbox", {})).run.run_id
    refused = {
        ("runs", "signal", "r_missing", "reply"): "no run with id 'r_missing'",
        ("runs", "signal", run_id, "no spaces"): "malformed signal name",
        ("runs", "signal", run_id, "reply", "--data", "{bad"): "--data is not valid JSON",
        ("submit", "inbox", "--at", "2026-12-24T09:00"): "has no time zone",
        ("submit", "inbox", "--at", "next tuesday"): "is not an ISO 8601 time",
        ("runs", "budget", run_id): "has no budget",
        ("runs", "budget", run_id, "--add-usd", "lots"): "US dollars",
        ("approvals", "approve", run_id, "refund", "--by", "ana", "--hash", "0" * 64): (
            "no effect 'refund'"
        ),
        ("runs", "budget", run_id, "--add-turns", "9" * 30): "whole number from 1 to",
        ("runs", "budget", run_id, "--add-usd", "1e100000000"): "US dollars above 0 to",
        ("approvals", "approve", run_id, "refund", "--by", "ana", "--hash", "xyz"): "64 lower",
        ("approvals", "deny", run_id, "refund", "--by", ""): "--by must name who decides",
        ("submit", "inbox", "--delay", "1e300"): "a delay is 0 or more seconds",
        ("submit", "inbox", "--delay", "inf"): "a delay is 0 or more seconds",
    }
    for args, message in refused.items():
        result = await run_cli(database_url, *args)
        assert result.returncode == 1, (args, result.stdout, result.stderr)
        assert message in result.stderr, (args, result.stderr)
        assert len(result.stderr.strip().splitlines()) == 1, (args, result.stderr)
    usage = {
        ("submit", "inbox", "--at", "2026-12-24T09:00Z", "--delay", "5"): "not both",
        ("approvals", "approve", run_id, "refund", "--by", "ana"): "--hash",
    }
    for args, message in usage.items():
        result = await run_cli(database_url, *args)
        assert result.returncode == 2 and message in result.stderr, (args, result.stderr)
    assert [r.run_id for r in await store.list_runs()] == [run_id]  # nothing was queued
    assert await SignalStore(store.pool).history(run_id) == []

    later = await run_cli(database_url, "submit", "inbox", "--delay", "3600", "--json")
    assert later.returncode == 0, later.stderr
    run = json.loads(later.stdout)["run"]
    assert run["state"] == "queued" and run["available_at"] > run["created_at"]
    shown = json.loads((await run_cli(database_url, "runs", "show", run_id, "--json")).stdout)
    assert shown["signals"] == [] and shown["budget"] is None
    assert json.loads((await run_cli(database_url, "approvals", "list", "--json")).stdout) == []
