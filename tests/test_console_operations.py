"""An operator acts on runs from the console as from the CLI (cancel, retry, signal, top up),
with the same roles, Origin checks and audit rows; a service's token opens no console route; a
conversation reads as text. A real console process, real Chromium, a real PostgreSQL."""

from __future__ import annotations

import json
from decimal import Decimal
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import pytest
from playwright.async_api import BrowserContext, Dialog, expect

from orchestrator.agent.budgets import Budget
from orchestrator.db.audit import AuditStore
from orchestrator.db.budgets import BudgetStore
from orchestrator.db.store import RunStore
from orchestrator.effect_model import EffectStatus
from orchestrator.models import RunState
from test_console import awaiting_approval, browser, console
from test_console_accounts import PAYLOAD, bearer, parked, people, status_of

__all__ = ["browser"]  # the fixture, imported for pytest
pytestmark = pytest.mark.slow


async def budgeted(store: RunStore) -> str:
    """A run a worker holds, with a budget it has reserved from (so it can be topped up)."""
    await store.submit("desk", {"order": "o-11"})
    run = (await store.claim("W", ["desk"], limit=1, lease_seconds=120)).claimed[0]
    reserved = await BudgetStore(store.pool).reserve(
        run.lease, Budget(turns=3, cost_usd=Decimal(1)), [1, 10, 10], Decimal("0.01")
    )
    assert reserved.outcome == "reserved"
    return run.run_id


async def dead(store: RunStore, pool: asyncpg.Pool) -> str:
    run_id = (await store.submit("desk", {"order": "o-12"})).run.run_id
    await pool.execute(
        "UPDATE runs SET state = 'dead', finished_at = clock_timestamp(), "
        'error = \'{"type": "Boom"}\' WHERE run_id = $1',
        run_id,
    )
    return run_id


async def test_an_operator_cancels_signals_tops_up_and_retries_in_the_browser(
    database_url: str,
    tmp_path: Path,
    store: RunStore,
    pool: asyncpg.Pool,
    browser: BrowserContext,
) -> None:
    tokens = await people(pool)
    live = await budgeted(store)
    gone = await dead(store, pool)
    fence = (await store.get(live)).fence
    async with console(database_url, tmp_path, "--accounts") as running:
        page = await browser.new_page()
        # A viewer sees the run but no action.
        await page.goto(f"{running.url}/signin?next=/runs/{live}")
        await page.fill("input[name=token]", tokens["victor"])
        await page.get_by_role("button", name="sign in").click()
        await expect(page.locator("#run-actions-note")).to_contain_text("your role may not")
        assert await page.locator("#run-actions form").count() == 0
        await page.get_by_role("button", name="sign out").click()

        await page.goto(f"{running.url}/signin?next=/runs/{live}")
        await page.fill("input[name=token]", tokens["olga"])
        await page.get_by_role("button", name="sign in").click()
        await expect(page.locator("#mode")).to_contain_text("olga (operator)")

        top_up = page.locator("form.top-up-form")
        await top_up.locator("input[name=add_usd]").fill("2.5")
        await top_up.locator("input[name=add_turns]").fill("4")
        await top_up.get_by_role("button", name="top up").click()
        await expect(page.locator("#flash")).to_contain_text(f"topped up the budget of {live}")
        await expect(page.locator("#budget")).to_contain_text("3.5")

        for data, says in (('{"text": "yes …"}', "sent signal reply #"), ("{not json", None)):
            signal_form = page.locator("form.signal-form")
            await signal_form.locator("input[name=name]").fill("reply")
            await signal_form.locator("input[name=data]").fill(data)
            await signal_form.get_by_role("button", name="send signal").click()
            if says is None:
                await expect(page.locator("#flash-error")).to_contain_text("signal's data")
            else:
                await expect(page.locator("#flash")).to_contain_text(says)

        asked: list[str] = []

        async def accept(dialog: Dialog) -> None:
            asked.append(dialog.message)
            await dialog.accept()

        page.on("dialog", accept)
        cancel = page.locator("form.cancel-form")
        await cancel.locator("input[name=reason]").fill("customer withdrew")
        await cancel.get_by_role("button", name="cancel run").click()
        await expect(page.locator("#flash")).to_contain_text(f"cancelled {live} as olga")
        await expect(page.locator("#run-state")).to_have_text("cancelled")
        assert asked and live in asked[0]

        await page.goto(f"{running.url}/runs/{gone}")
        await page.get_by_role("button", name="retry run").click()
        await expect(page.locator("#flash")).to_contain_text(f"requeued {gone} as olga")
        await expect(page.locator("#run-state")).to_have_text("queued")

    run = await store.get(live)
    assert run.state is RunState.CANCELLED and run.fence > fence
    budget = await BudgetStore(pool).get(live)
    assert budget is not None and budget.limit["turns"] == 7
    assert budget.limit["cost_usd"] == "3.5"
    [signal] = await pool.fetch("SELECT name, data FROM run_signals WHERE run_id = $1", live)
    assert (signal["name"], signal["data"]) == ("reply", {"text": "yes …"})
    assert (await store.get(gone)).state is RunState.QUEUED
    audited = [
        (row.action, row.principal, row.via, row.run_id)
        for row in await AuditStore(pool).entries(limit=100)
        if row.action in ("top_up", "signal", "cancel", "retry")
    ]
    assert audited == [
        ("top_up", "olga", "token", live),
        ("signal", "olga", "token", live),
        ("cancel", "olga", "token", live),
        ("retry", "olga", "token", gone),
    ]


async def test_run_actions_need_the_role_the_origin_and_post_once(
    database_url: str, tmp_path: Path, store: RunStore, pool: asyncpg.Pool
) -> None:
    tokens = await people(pool)
    live = await budgeted(store)
    async with (
        console(database_url, tmp_path, "--accounts") as running,
        httpx.AsyncClient(base_url=running.url, timeout=10) as http,
    ):
        signal = f"/runs/{live}/signal"
        form = {"name": "reply", "data": '{"ok": true}', "idempotency_key": "k-1"}
        # An approver may decide effects, not operate runs.
        refused = await http.post(signal, data=form, headers=bearer(tokens["alice@example.com"]))
        assert refused.status_code == 403 and "may not resolve, cancel" in refused.json()["error"]
        # A bearer request naming another site's Origin is refused.
        foreign = {**bearer(tokens["olga"]), "Origin": "https://evil.example"}
        assert (await http.post(signal, data=form, headers=foreign)).status_code == 403
        # The same form posted twice stores its signal once.
        for _ in range(2):
            sent = await http.post(signal, data=form, headers=bearer(tokens["olga"]))
            assert sent.status_code == 200, sent.text
        assert "already sent" in sent.json()["detail"]
        for path, fields, says in (
            (f"/runs/{live}/top-up", {"add_turns": "-1"}, "whole number"),
            (f"/runs/{live}/top-up", {"add_usd": "0"}, "above 0"),
            (f"/runs/{live}/top-up", {}, "nothing to add"),
            (f"/runs/{live}/signal", {"name": "bad name!"}, "malformed signal name"),
            (f"/runs/{live}/retry", {}, "not dead"),
            ("/runs/r_nope/cancel", {}, "no run"),
        ):
            answer = await http.post(path, data=fields, headers=bearer(tokens["olga"]))
            assert answer.status_code in (400, 404, 409), (path, answer.text)
            assert says in answer.json()["error"], (path, answer.text)
        unknown = await http.post(f"/runs/{live}/explode", headers=bearer(tokens["olga"]))
        assert unknown.status_code == 404
    assert await pool.fetchval("SELECT count(*) FROM run_signals WHERE run_id = $1", live) == 1
    assert (await store.get(live)).state is RunState.RUNNING


async def test_a_service_token_opens_no_console_route(
    database_url: str, tmp_path: Path, store: RunStore, pool: asyncpg.Pool
) -> None:
    """The held-out attack: an operator service's token, scoped at the proxy to one agent, read
    another agent's run and passed the console's role check. Every route refuses it now."""
    tokens = await people(pool)
    service = bearer(tokens["ops-bot"])
    approval = await awaiting_approval(store, pool, PAYLOAD)
    stuck = await parked(store, pool)
    before = await pool.fetchval("SELECT count(*) FROM audit_log")
    async with (
        console(database_url, tmp_path, "--accounts") as running,
        httpx.AsyncClient(base_url=running.url, timeout=10) as http,
    ):
        for path in ("/", "/runs", f"/runs/{approval}", "/attention", "/cluster"):
            page = await http.get(path, headers=service)
            assert page.status_code == 403, (path, page.status_code)
            assert "action proxy" in page.json()["error"]
            assert "refund-visible-to-approvers" not in page.text
        for path, form in (
            (f"/runs/{approval}/effects/refund/approve", {"payload_sha256": "0" * 64}),
            (f"/runs/{approval}/effects/refund/deny", {}),
            (f"/runs/{stuck}/effects/refund/resolve", {"decision": "sent"}),
            (f"/runs/{approval}/cancel", {}),
            (f"/runs/{approval}/retry", {}),
            (f"/runs/{approval}/signal", {"name": "reply"}),
            (f"/runs/{approval}/top-up", {"add_turns": "1"}),
        ):
            answer = await http.post(path, data=form, headers=service)
            assert answer.status_code == 403, (path, answer.text)
        # Nor does it sign in, in a browser's form.
        signin = await http.post(
            "/signin", data={"token": tokens["ops-bot"]}, headers={"Origin": running.url}
        )
        assert signin.status_code == 403
    assert await status_of(pool, approval) is EffectStatus.AWAITING_APPROVAL
    assert await status_of(pool, stuck) is EffectStatus.PARKED
    assert (await store.get(approval)).state is RunState.RUNNING
    assert await pool.fetchval("SELECT count(*) FROM audit_log") == before


async def test_the_conversation_reads_as_text_not_json_escapes(
    database_url: str, tmp_path: Path, store: RunStore, pool: asyncpg.Pool
) -> None:
    run_id = (await store.submit("desk", {})).run.run_id
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "note", "arguments": json.dumps({"text": "déjà vu …"})},
    }
    bodies: list[dict[str, Any]] = [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": json.dumps("cancelled 60 …")},
        {"role": "tool", "tool_call_id": "call_2", "content": json.dumps({"left": "½ of it"})},
        {"role": "tool", "tool_call_id": "call_3", "content": '"a lone \\ud800 stays escaped"'},
    ]
    for seq, body in enumerate(bodies):
        await pool.execute(
            "INSERT INTO run_messages (run_id, seq, turn, role, body, fence) "
            "VALUES ($1, $2, 1, $3, $4, 1)",
            run_id,
            seq,
            body["role"],
            body,
        )
    async with (
        console(database_url, tmp_path, "--show-payloads") as running,
        httpx.AsyncClient(base_url=running.url, timeout=10) as http,
    ):
        page = (await http.get(f"/runs/{run_id}")).text
    for text in ("déjà vu …", "cancelled 60 …", "½ of it", "a lone \\ud800 stays escaped"):
        assert text in page, text
    assert "\\u2026" not in page and "\\u00e9" not in page
