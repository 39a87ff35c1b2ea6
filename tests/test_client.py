"""``orchestrator.Client`` and ``SyncClient`` as an application uses them, and the documented
web handler (examples/refund_desk.py) end to end: a real HTTP server, worker, model and vendor."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import anyio
import asyncpg
import pytest

import orchestrator.client.waiter
from orchestrator import (
    Client,
    DatabaseError,
    DatabaseUnavailable,
    InvalidInput,
    InvalidTransition,
    RunNotFound,
    SyncClient,
)
from orchestrator.agents.noop import noop
from orchestrator.effects.http import HttpAdapter
from orchestrator.effects.store import EffectNotFound
from orchestrator.models import Run, RunState
from orchestrator.settings import Settings
from orchestrator.testing import running_worker
from orchestrator.testing.loopback import LocalVendor, ScriptedModelServer
from support.tool_agents_for_tests import REFUND_TURNS, refunds
from test_waits import FAST, replies

EXAMPLE = Path(__file__).parent.parent / "examples" / "refund_desk.py"


async def test_submit_is_idempotent_and_wait_is_woken_by_the_final_commit(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    # With the safety-net re-read pushed out of reach, only the NOTIFY can end the wait.
    monkeypatch.setattr(orchestrator.client.waiter, "RECHECK_SECONDS", 3600.0)
    async with await Client.connect(settings) as client:
        first = await client.submit("noop", {"n": 1}, idempotency_key="order-17")
        again = await client.submit("noop", {"n": 1}, idempotency_key="order-17")
        assert again.run_id == first.run_id
        async with running_worker(settings, [noop], **FAST):
            done = await client.wait(first.run_id, within=60)
            assert done.state is RunState.SUCCEEDED
            assert (await client.wait(first.run_id, within=1)).state is RunState.SUCCEEDED


async def test_wait_times_out_cancel_ends_it_and_errors_are_clear(settings: Settings) -> None:
    async with await Client.connect(settings) as client:
        run = await client.submit("nobody_serves_this", {})
        with pytest.raises(TimeoutError):
            await client.wait(run.run_id, within=0.3)
        async with anyio.create_task_group() as group:
            ended: list[Any] = []

            async def waiter() -> None:
                ended.append(await client.wait(run.run_id, within=60))

            group.start_soon(waiter)
            await anyio.sleep(0.2)
            await client.cancel(run.run_id, reason="no longer needed")
        assert ended[0].state is RunState.CANCELLED
        with pytest.raises(RunNotFound):
            await client.get("r_missing")
        with pytest.raises(InvalidInput, match="not both"):
            await client.submit("noop", {}, at=ended[0].created_at, delay_seconds=1)


async def waiting_replies_run(client: Client, *, within: float) -> Run:
    """A run of ``replies`` once it waits for a signal (a worker must be running)."""
    run = await client.submit("replies", {})
    with anyio.fail_after(within):
        while (await client.get(run.run_id)).state is not RunState.WAITING:  # noqa: ASYNC110
            await anyio.sleep(0.05)
    return run


async def test_a_signal_from_the_client_wakes_the_run(settings: Settings) -> None:
    async with (
        await Client.connect(settings) as client,
        running_worker(settings, [replies], **FAST),
    ):
        run = await waiting_replies_run(client, within=60)
        signal = await client.signal(run.run_id, "reply", {"ok": True}, idempotency_key="k")
        assert signal.seq >= 1
        done = await client.wait(run.run_id, within=60)
    assert done.result["replies"] == [{"ok": True}]


def test_the_sync_client_serves_synchronous_code(settings: Settings) -> None:
    with SyncClient(settings) as client:
        run = client.submit("noop", {"n": 2}, idempotency_key="sync-1")
        assert client.get(run.run_id).state is RunState.QUEUED
        results: list[str] = []
        threads = [
            threading.Thread(target=lambda: results.append(client.get(run.run_id).run_id))
            for _ in range(4)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(10)
        assert results == [run.run_id] * 4
        assert client.cancel(run.run_id).state is RunState.CANCELLED


# -- the documented web handler ----------------------------------------------------------------
def load_example() -> Any:
    spec = importlib.util.spec_from_file_location("refund_desk", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Http:
    def __init__(self, base: str) -> None:
        self.base = base

    def call(
        self, method: str, path: str, body: Any = None, user: str | None = None
    ) -> tuple[int, Any]:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.base + path, data=data, method=method)
        request.add_header("Content-Type", "application/json")
        if user:
            request.add_header("X-User", user)
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as error:
            return error.code, json.loads(error.read())

    async def __call__(self, *args: Any, **kwargs: Any) -> tuple[int, Any]:
        return await anyio.to_thread.run_sync(lambda: self.call(*args, **kwargs))


@pytest.fixture
def refund_desk(settings: Settings) -> Iterator[Http]:
    module = load_example()
    with SyncClient(settings) as client:
        server = module.ThreadingHTTPServer(
            ("127.0.0.1", 0), module.make_handler(client, "refunds")
        )
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        try:
            yield Http(f"http://127.0.0.1:{server.server_port}")
        finally:
            server.shutdown()
            server.server_close()


async def test_the_web_handler_submits_a_run_and_records_a_person_s_approval(
    settings: Settings, refund_desk: Http, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with ScriptedModelServer(REFUND_TURNS) as model, LocalVendor() as vendor:
        monkeypatch.setenv("OPENAI_BASE_URL", model.base_url)
        monkeypatch.delenv("OPENAI_API_KEY", raising=False)
        adapters = {"crm": HttpAdapter("crm", url=vendor.send_url, reconcile="none")}
        async with running_worker(settings, [refunds], effect_adapters=adapters, **FAST):
            request = {"request_id": "req-1", "message": "Refund order o-17, please."}
            status, started = await refund_desk("POST", "/refunds", request)
            assert status == 202
            status, retried = await refund_desk("POST", "/refunds", request)
            assert retried["run_id"] == started["run_id"]  # a retried POST is the same run
            with anyio.fail_after(60):
                while not (await refund_desk("GET", "/approvals"))[1]:  # noqa: ASYNC110
                    await anyio.sleep(0.1)
            _, [shown] = await refund_desk("GET", "/approvals")
            assert shown["payload"] == {"order_id": "o-17", "amount": 150}
            path = f"/approvals/{shown['run_id']}/{shown['effect_key']}"
            decision = {"decision": "approve", "payload_sha256": shown["payload_sha256"]}
            assert (await refund_desk("POST", path, decision))[0] == 401  # who?
            stale = {**decision, "payload_sha256": "f" * 64}
            status, refused = await refund_desk("POST", path, stale, user="ana")
            assert status == 409 and "is not the one you saw" in refused["error"]
            moved = {**decision, "fence": shown["fence"] + 1}
            assert (await refund_desk("POST", path, moved, user="ana"))[0] == 409
            approved = {**decision, "fence": shown["fence"]}
            status, effect = await refund_desk("POST", path, approved, user="ana")
            # The principal is the database role the handler's client connected as (the
            # settings' URL names it); the application's own user is kept as a note.
            role = await _session_user(settings)
            assert status == 200 and effect["decided_by"] == role
            with anyio.fail_after(60):
                while (await refund_desk("GET", f"/runs/{started['run_id']}"))[1][  # noqa: ASYNC110
                    "state"
                ] != "succeeded":
                    await anyio.sleep(0.1)
    assert vendor.requests == 1
    assert [d["payload"]["amount"] for d in vendor.deliveries.values()] == [150]


# -- signals without data, database failures ---------------------------------------------------
async def test_a_signal_without_data_reaches_the_run_as_null(settings: Settings) -> None:
    async with (
        await Client.connect(settings) as client,
        running_worker(settings, [replies], **FAST),
    ):
        run = await waiting_replies_run(client, within=10)
        signal = await client.signal(run.run_id, "reply")
        assert signal.data is None
        done = await client.wait(run.run_id, within=20)
    assert done.state is RunState.SUCCEEDED
    assert done.result["replies"] == [None]


def test_the_sync_client_sends_a_signal_without_data(settings: Settings) -> None:
    with SyncClient(settings) as client:
        run = client.submit("replies", {})
        assert client.signal(run.run_id, "go", None).data is None
        again = client.signal(run.run_id, "go", None, idempotency_key="once")
        assert client.signal(run.run_id, "go", None, idempotency_key="once").seq == again.seq


TERMINATE_WAITING_CLIENT = (
    "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE application_name = "
    "'orchestrator-client' AND wait_event_type = 'Lock' AND datname = current_database()"
)


def _locked_runs(settings: Settings) -> str:
    return f"LOCK TABLE {settings.schema}.runs IN ACCESS EXCLUSIVE MODE"


async def test_a_connection_killed_mid_call_reaches_the_caller_as_the_project_s_error(
    settings: Settings,
) -> None:
    async with await Client.connect(settings) as client:
        run = await client.submit("noop", {})
        holder = await asyncpg.connect(settings.database_url)
        try:
            async with holder.transaction():
                await holder.execute(_locked_runs(settings))  # the client's read now waits
                async with anyio.create_task_group() as group:
                    raised: list[BaseException] = []

                    async def read() -> None:
                        try:
                            await client.get(run.run_id)
                        except BaseException as error:
                            raised.append(error)

                    group.start_soon(read)
                    with anyio.fail_after(10):
                        while not await holder.fetchval(TERMINATE_WAITING_CLIENT):  # noqa: ASYNC110
                            await anyio.sleep(0.05)
        finally:
            await holder.close()
    [error] = raised
    assert isinstance(error, DatabaseUnavailable), repr(error)
    assert not isinstance(error, asyncpg.PostgresError | asyncpg.InterfaceError)
    assert "database failed mid-command" in str(error) and "\n" not in str(error)


def test_a_statement_timeout_reaches_a_sync_caller_as_the_project_s_error(
    settings: Settings,
) -> None:
    impatient = dataclasses.replace(settings, statement_timeout_seconds=0.5)

    async def hold_the_lock(locked: threading.Event, done: threading.Event) -> None:
        holder = await asyncpg.connect(settings.database_url)
        try:
            async with holder.transaction():
                await holder.execute(_locked_runs(settings))
                locked.set()
                while not done.is_set():  # noqa: ASYNC110
                    await anyio.sleep(0.05)
        finally:
            await holder.close()

    with SyncClient(impatient) as client:
        run = client.submit("noop", {})
        locked, done = threading.Event(), threading.Event()
        holder = threading.Thread(target=anyio.run, args=(hold_the_lock, locked, done))
        holder.start()
        try:
            assert locked.wait(10)
            with pytest.raises(DatabaseError) as raised:
                client.get(run.run_id)
        finally:
            done.set()
            holder.join(10)
        assert not isinstance(raised.value, asyncpg.PostgresError)
        assert "statement timeout" in str(raised.value)
        assert client.get(run.run_id).run_id == run.run_id  # and the client still works


UNCLOSED = """
import sys
from orchestrator import SyncClient
from orchestrator.settings import Settings

client = SyncClient(Settings(database_url=sys.argv[1]))
run = client.submit("noop", {})
print(client.get(run.run_id).state.value)
# no close(), no with: the interpreter must still exit
"""


def test_a_script_that_never_closes_its_sync_client_still_exits(settings: Settings) -> None:
    assert settings.database_url is not None
    try:
        done = subprocess.run(
            [sys.executable, "-c", UNCLOSED, settings.database_url],
            capture_output=True,
            timeout=60,
            check=False,
        )
    except subprocess.TimeoutExpired:
        pytest.fail("a script with an unclosed SyncClient hung at exit")
    assert done.returncode == 0, done.stderr.decode()
    assert done.stdout.decode().strip() == "queued"
    assert b"Traceback" not in done.stderr


async def test_a_start_time_out_of_range_is_refused(settings: Settings) -> None:
    async with await Client.connect(settings) as client:
        far: list[dict[str, Any]] = [
            {"at": datetime(1, 1, 1, tzinfo=UTC)},
            {"at": datetime(9999, 12, 31, tzinfo=timezone(timedelta(hours=-5)))},
            {"delay_seconds": float("nan")},
            {"delay_seconds": 1e300},
        ]
        for options in far:
            with pytest.raises(InvalidInput, match="ten years"):
                await client.submit("noop", {}, **options)
        earlier = await client.submit("noop", {}, at=datetime(2020, 1, 1, tzinfo=UTC))
        assert earlier.available_at is not None
        assert earlier.available_at.year == 2020  # in the past: due at once


# -- the feature handles -------------------------------------------------------------------------
async def test_the_runs_handle_submits_lists_details_and_cancels(settings: Settings) -> None:
    async with await Client.connect(settings) as client:
        run = await client.runs.submit("nobody_serves_this", {"n": 1}, idempotency_key="h-1")
        assert (await client.runs.get(run.run_id)).state is RunState.QUEUED
        assert [r.run_id for r in await client.runs.list(agent="nobody_serves_this")] == [
            run.run_id
        ]
        assert await client.runs.list(state=RunState.SUCCEEDED) == []
        detail = await client.runs.detail(run.run_id)
        assert detail.run.run_id == run.run_id and detail.events_total >= 1
        assert detail.budget is None and detail.signals == [] and detail.effects == []
        for shown in (0, -5, 10**9):  # a page is bounded: no LIMIT error, no unbounded read
            with pytest.raises(InvalidInput, match="events shown must be 1 to 10,000"):
                await client.runs.detail(run.run_id, events=shown)
        cancelled = await client.runs.cancel(run.run_id, reason="handle test")
        assert cancelled.state is RunState.CANCELLED
        assert (await client.runs.wait(run.run_id, within=5)).state is RunState.CANCELLED
        # Unknown run ids and bad input are refused, and nothing changes.
        for call in (client.runs.get, client.runs.detail, client.runs.cancel):
            with pytest.raises(RunNotFound):
                await call("r_missing")
        with pytest.raises(InvalidInput, match="limit"):
            await client.runs.list(limit=0)
        with pytest.raises(InvalidInput):
            await client.runs.submit("nobody_serves_this", ["not", "an", "object"])
        assert len(await client.runs.list()) == 1


async def test_the_signals_and_budgets_handles(settings: Settings) -> None:
    async with await Client.connect(settings) as client:
        run = await client.runs.submit("nobody_serves_this", {})
        sent = await client.signals.send(run.run_id, "reply", {"ok": True}, idempotency_key="s")
        [(listed, consumed_at, fence)] = await client.signals.list(run.run_id)
        assert listed == sent and consumed_at is None and fence is None
        with pytest.raises(RunNotFound):
            await client.signals.send("r_missing", "reply")
        with pytest.raises(RunNotFound):
            await client.signals.list("r_missing")
        with pytest.raises(InvalidInput, match="0 or more"):
            await client.signals.list(run.run_id, newest=-1)
        with pytest.raises(InvalidInput, match="malformed signal name"):
            await client.signals.send(run.run_id, "no spaces please")
        assert len(await client.signals.list(run.run_id)) == 1  # the refused one stored nothing

        assert await client.budgets.get(run.run_id) is None
        assert await client.budgets.ledger(run.run_id) == []
        with pytest.raises(InvalidTransition, match="has no budget"):
            await client.budgets.top_up(run.run_id, cost_usd="1.50")
        with pytest.raises(InvalidInput, match="nothing to add"):
            await client.budgets.top_up(run.run_id)
        with pytest.raises(InvalidInput):
            await client.budgets.get("not a run id")
        with pytest.raises(RunNotFound):  # not "no budget": there is no such run
            await client.budgets.get("r_missing")
        with pytest.raises(RunNotFound):
            await client.budgets.ledger("r_missing")


async def test_the_effects_and_approvals_handles_refuse_what_does_not_exist(
    settings: Settings,
) -> None:
    async with await Client.connect(settings) as client:
        run = await client.runs.submit("nobody_serves_this", {})
        assert await client.effects.list(run_id=run.run_id) == []
        assert await client.approvals.list() == []
        assert await client.approvals() == []  # the flat method of earlier releases
        with pytest.raises(EffectNotFound):
            await client.effects.get(run.run_id, "refund")
        with pytest.raises(EffectNotFound):
            await client.effects.resolve(run.run_id, "refund", sent=True, by="ana")
        with pytest.raises(EffectNotFound):
            await client.approvals.approve(run.run_id, "refund", by="ana", payload_sha256="a" * 64)
        with pytest.raises(InvalidInput, match="--hash"):
            await client.approvals.deny(run.run_id, "refund", by="ana", payload_sha256="short")
        with pytest.raises(InvalidInput, match="limit"):
            await client.effects.list(limit=0)


async def test_the_ops_handle_shows_the_queue_and_purges_by_age(settings: Settings) -> None:
    async with await Client.connect(settings) as client:
        run = await client.runs.submit("nobody_serves_this", {})
        [row] = await client.ops.queue_stats()
        assert row["agent"] == "nobody_serves_this" and row["queued"] == 1
        assert await client.ops.workers() == []
        await client.runs.cancel(run.run_id)
        assert await client.ops.purgeable(timedelta(days=1)) == 0  # finished just now
        assert (await client.ops.purge(timedelta(days=1))).runs == 0
        with pytest.raises(InvalidInput, match="above 0"):
            await client.ops.purge(timedelta(0))
        with pytest.raises(InvalidInput, match="batch"):
            await client.ops.purge(timedelta(days=1), batch=0)
        for ages in (timedelta(days=999_999_999), timedelta(days=-1)):  # no OverflowError
            with pytest.raises(InvalidInput, match="at most 100 years"):
                await client.ops.purgeable(ages)
        assert (await client.runs.get(run.run_id)).state is RunState.CANCELLED  # still there


def test_the_sync_client_has_the_same_handles(settings: Settings) -> None:
    with SyncClient(settings) as client:
        run = client.runs.submit("nobody_serves_this", {})
        assert client.runs.detail(run.run_id).run.run_id == run.run_id
        assert [r.run_id for r in client.runs.list()] == [run.run_id]
        assert client.approvals() == [] and client.approvals.list(run_id=run.run_id) == []
        assert client.effects.list() == []
        client.signals.send(run.run_id, "reply")
        assert len(client.signals.list(run.run_id)) == 1
        assert client.budgets.get(run.run_id) is None
        assert client.ops.queue_stats()[0]["queued"] == 1
        with pytest.raises(RunNotFound):
            client.runs.get("r_missing")
        assert client.cancel(run.run_id).state is RunState.CANCELLED  # a flat method


async def _session_user(settings: Settings) -> str:
    assert settings.database_url is not None
    connection = await asyncpg.connect(settings.database_url)
    try:
        return str(await connection.fetchval("SELECT session_user"))
    finally:
        await connection.close()
