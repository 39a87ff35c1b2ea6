"""`orchestrator console` as a person uses it: a real console process, a real headless Chromium
(Debian's, driven by Playwright), real workers and loopback vendors, a real PostgreSQL."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from datetime import datetime
from pathlib import Path
from typing import Any

import anyio
import asyncpg
import httpx
import pytest
from playwright.async_api import BrowserContext, Page, ViewportSize, async_playwright, expect

from orchestrator.client import Client
from orchestrator.db.signals import SignalStore
from orchestrator.db.store import RunStore
from orchestrator.effect_model import Effect, EffectPolicy, EffectStatus
from orchestrator.effects.approvals import ApprovalStore, Decision, DecisionRefused
from orchestrator.effects.http import HttpAdapter
from orchestrator.effects.store import EffectStore
from orchestrator.models import RunState
from orchestrator.settings import Settings
from orchestrator.testing import running_worker, wait_for_run
from orchestrator.testing.loopback import LocalVendor, ScriptedModelServer, SmtpSink
from support import ServeProcess, cli
from support.tool_agents_for_tests import REFUND_TURNS, refunds
from test_effects_processes import AGENT, events_of, vendors_config
from test_effects_proxy import free_port
from test_privacy import CANARY, run_with_canaries
from test_runtime import FAST

pytestmark = pytest.mark.slow
TOKEN = "console-token-7d1f3a9b2c"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    # Without these Chromium phones home at start, and this closed network refuses it.
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


VIEWPORT: ViewportSize = {"width": 1280, "height": 800}
"""A laptop's window: what a person must reach without scrolling sideways fits in it."""


async def within_the_window(page: Page, selector: str) -> None:
    """Every element ``selector`` matches is on screen horizontally (none off to the right).

    Measured in one pass in the page: the live refresh may swap the elements between two calls
    from here, and a swapped-out element has no box."""
    boxes = await page.eval_on_selector_all(
        selector,
        """elements => elements.map(element => {
            const box = element.getBoundingClientRect();
            return {x: box.x, width: box.width, shown: box.width > 0 || box.height > 0};
        })""",
    )
    assert boxes, selector
    for box in boxes:
        assert box["shown"], (selector, box)
        assert box["x"] >= 0 and box["x"] + box["width"] <= VIEWPORT["width"], (selector, box)
    width = await page.evaluate("document.documentElement.scrollWidth")
    assert width <= VIEWPORT["width"], f"the page is {width}px wide"


def chromium() -> str:
    path = os.environ.get("ORCHESTRATOR_CHROMIUM") or "/usr/bin/chromium"
    if Path(path).is_file():
        return path
    reason = (
        f"no Chromium at {path}: install Debian's (`apt-get install -y chromium`) or set "
        "ORCHESTRATOR_CHROMIUM to a Chromium binary"
    )
    if os.environ.get("ORCHESTRATOR_REQUIRE_BROWSER") == "1":
        pytest.fail(reason + " (ORCHESTRATOR_REQUIRE_BROWSER=1)")
    pytest.skip(reason)


@pytest.fixture
def screenshots(tmp_path: Path) -> Path:
    directory = Path(os.environ.get("ORCHESTRATOR_SCREENSHOT_DIR") or tmp_path / "screenshots")
    directory.mkdir(parents=True, exist_ok=True)
    return directory


@pytest.fixture
async def browser(tmp_path: Path) -> AsyncIterator[BrowserContext]:
    executable = chromium()
    async with async_playwright() as playwright:
        context = await playwright.chromium.launch_persistent_context(
            str(tmp_path / "chromium-profile"),  # a fresh profile: no cookies from elsewhere
            executable_path=executable,
            headless=True,
            args=CHROMIUM_ARGS,
            viewport=VIEWPORT,
        )
        try:
            yield context
        finally:
            await context.close()


class Console:
    """`orchestrator console` in its own process, on a free port."""

    def __init__(
        self,
        database_url: str,
        log: Path,
        *args: str,
        token: str | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        extra_env = env
        env = {**os.environ, "ORCHESTRATOR_DATABASE_URL": database_url}
        env.pop("ORCHESTRATOR_CONSOLE_TOKEN", None)
        # The secrets of the machine it runs on must not reach a page either.
        env.update({"OPENAI_API_KEY": f"sk-{CANARY}-key", "CRM_TOKEN": f"{CANARY}-vendor-token"})
        if token is not None:
            env["ORCHESTRATOR_CONSOLE_TOKEN"] = token
        env.update(extra_env or {})
        self.log = log
        self._log_file = log.open("w")
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "orchestrator.cli",
                "console",
                "--listen",
                f"127.0.0.1:{self.port}",
                "--refresh-seconds",
                "1",
                *args,
            ],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=self._log_file,
        )

    async def ready(self) -> None:
        async with httpx.AsyncClient(base_url=self.url, timeout=5) as client:
            with anyio.fail_after(30):
                while True:
                    assert self.process.poll() is None, self.log.read_text()
                    try:
                        if (await client.get("/healthz")).status_code == 200:
                            return
                    except httpx.TransportError:
                        pass
                    await anyio.sleep(0.1)

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait(5)
        finally:
            self._log_file.close()


@asynccontextmanager
async def console(
    database_url: str,
    tmp_path: Path,
    *args: str,
    token: str | None = None,
    env: dict[str, str] | None = None,
) -> AsyncIterator[Console]:
    log = tmp_path / f"console-{free_port()}.log"
    running = Console(database_url, log, *args, token=token, env=env)
    try:
        await running.ready()
        yield running
    finally:
        code = running.stop()
    assert code == 0, running.log.read_text()
    assert "console listening on http://127.0.0.1:" in running.log.read_text()


async def shot(page: Page, directory: Path, name: str) -> None:
    await page.screenshot(path=str(directory / f"{name}.png"), full_page=True)


async def sign_in(page: Page, base: str, name: str, token: str = TOKEN) -> None:
    await page.goto(f"{base}/attention")
    await page.locator("header").get_by_role("link", name="sign in").click()
    await page.fill("input[name=name]", name)
    await page.fill("input[name=token]", token)
    await page.get_by_role("button", name="sign in").click()


async def awaiting_approval(store: RunStore, pool: asyncpg.Pool, payload: Any) -> str:
    """A run holding one effect that awaits approval, requested under the run's fence."""
    await store.submit("desk", {"order": "o-9"})
    run = (await store.claim("W", ["desk"], limit=1, lease_seconds=60)).claimed[0]
    effect = Effect("refund", "payments", payload, requires_approval=True)
    async with pool.acquire() as db, db.transaction():
        await EffectStore(pool).accept(db, run.run_id, run.fence, effect, worker_id="W")
    return run.run_id


async def until_event(store: RunStore, run_id: str, kind: str, *, poll: float) -> None:
    """Until the run's timeline holds an event of ``kind`` (at most a minute)."""
    with anyio.fail_after(60):
        while not await events_of(store, run_id, kind):  # noqa: ASYNC110
            await anyio.sleep(poll)


# -- the SIGSTOP story ----------------------------------------------------------------------
async def test_the_sigstop_story_reads_as_two_attempts_one_refusal_one_send_each(
    database_url: str,
    store: RunStore,
    pool: asyncpg.Pool,
    tmp_path: Path,
    browser: BrowserContext,
    screenshots: Path,
) -> None:
    async with LocalVendor() as vendor:
        with SmtpSink() as sink:
            config = vendors_config(tmp_path, vendor, sink)
            args = [*AGENT, "--effects-config", config]
            args += ["--lease-seconds", "2", "--heartbeat-seconds", "0.5"]
            run_id = (
                await store.submit("contract_notice", {"customer": "ACME", "think_seconds": 3})
            ).run.run_id
            other = (await store.submit("sleepy", {"steps": 1})).run.run_id  # filtered out
            with ServeProcess(database_url, *args, name="A") as worker_a:
                await until_event(store, run_id, "claimed", poll=0.02)
                worker_a.signal(signal.SIGSTOP)
                with ServeProcess(database_url, *args, name="B"):
                    final = await wait_for_run(store, run_id, within=40)
                worker_a.signal(signal.SIGCONT)
                await until_event(store, run_id, "lease_lost", poll=0.05)
            async with pool.acquire() as db:  # A, stale, asks anyway
                stale = await EffectStore(pool).accept(
                    db, run_id, 1, Effect("notice-email", "email", {"to": "x@y.z"}), worker_id="A"
                )
    assert final.state is RunState.SUCCEEDED, final.error
    assert stale.outcome == "stale"
    assert len(sink.messages) == 1 and len(vendor.deliveries) == 1

    async with console(database_url, tmp_path) as running:
        page = await browser.new_page()
        await page.goto(running.url)
        await expect(page.locator("#runs")).to_contain_text(other)
        await page.fill("input[name=agent]", "contract_notice")
        await page.select_option("select[name=state]", ["succeeded"])
        await page.fill("input[name=since]", "1h")
        await page.get_by_role("button", name="filter").click()
        await expect(page.locator("#runs tr")).to_have_count(2)  # the header and the run
        await expect(page.locator("#runs")).not_to_contain_text(other)
        assert "state=succeeded" in page.url and "agent=contract_notice" in page.url
        await shot(page, screenshots, "runs-filtered")
        await page.get_by_role("link", name=run_id).click()
        await expect(page.locator("#run-state")).to_have_text("succeeded")

        attempts = page.locator("#attempts tr.attempt")
        await expect(attempts).to_have_count(2)
        first, second = attempts.nth(0), attempts.nth(1)
        await expect(first).to_contain_text("A")
        await expect(first).to_contain_text("lease expired; claimed again")
        await expect(second).to_contain_text("B")
        await expect(second).to_contain_text("succeeded")
        # The columns `runs show` prints, in words, and times to the second.
        headers = await page.locator("#attempts th").all_inner_texts()
        assert headers[:5] == ["fence", "worker", "claimed", "held", "ended"], headers
        assert not [h for h in headers if "_" in h], headers
        cells = await first.locator("td").all_inner_texts()
        assert cells[:2] == ["1", "A"]
        assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\dZ", cells[2]), cells
        assert re.fullmatch(r"\d+\.\ds", cells[3]), cells
        cells = await second.locator("td").all_inner_texts()
        assert cells[:2] == ["2", "B"]
        await within_the_window(page, "#attempts th")

        refusals = page.locator("#stale-refusals li")
        await expect(refusals.first).to_contain_text("fence 1 from A was refused")
        await expect(refusals.first).to_contain_text("the boundary holds fence 2")
        lost = page.locator("#timeline tr.kind-lease_lost")
        await expect(lost).to_have_count(1)
        await expect(lost).to_contain_text("A")

        effects = page.locator("table.effects tr.effect")
        await expect(effects).to_have_count(2)
        for key in ("notice-email", "crm-status"):
            row = page.locator(f"table.effects tr.effect[data-key='{key}']")
            await expect(row).to_have_count(1)
            cells = [await row.locator("td").nth(i).inner_text() for i in (0, 3, 4)]
            assert cells == [key, "2", "confirmed"]
        await expect(page.locator("#timeline tr.kind-effect_accepted")).to_have_count(2)
        await shot(page, screenshots, "run-sigstop-story")
        await page.goto(f"{running.url}/cluster")
        await expect(page.locator("#workers")).to_contain_text("A")
        await shot(page, screenshots, "workers-and-queue")


# -- approvals ------------------------------------------------------------------------------
@asynccontextmanager
async def refund_vendors(
    monkeypatch: pytest.MonkeyPatch,
) -> AsyncIterator[tuple[dict[str, Any], LocalVendor]]:
    """The scripted model the ``refunds`` agent talks to, and the CRM its effects go to (with
    the adapters a worker sends through)."""
    async with ScriptedModelServer(REFUND_TURNS) as model, LocalVendor() as vendor:
        monkeypatch.setenv("OPENAI_BASE_URL", model.base_url)
        monkeypatch.setenv("OPENAI_API_KEY", "")
        yield {"crm": HttpAdapter("crm", url=vendor.send_url, reconcile="replay")}, vendor


async def test_a_person_approves_in_the_browser_and_the_run_proceeds(
    settings: Settings,
    database_url: str,
    store: RunStore,
    pool: asyncpg.Pool,
    tmp_path: Path,
    browser: BrowserContext,
    screenshots: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with refund_vendors(monkeypatch) as (adapters, vendor):
        approved_id = (await store.submit("refunds", {"prompt": "Refund o-17."})).run.run_id
        denied_id = (await store.submit("refunds", {"prompt": "Refund o-17 again."})).run.run_id
        async with (
            running_worker(settings, [refunds], effect_adapters=adapters, **FAST),
            console(database_url, tmp_path, token=TOKEN) as running,
        ):
            for run_id in (approved_id, denied_id):
                await wait_for_run(store, run_id, states={RunState.WAITING}, within=60)
            page = await browser.new_page()
            await page.goto(f"{running.url}/attention")
            await expect(page.locator("#mode")).to_have_text("not signed in")
            await expect(page.locator("form.approve-form")).to_have_count(0)
            await within_the_window(page, "header a[href^='/signin']")
            await sign_in(page, running.url, "alice")
            assert page.url.endswith("/attention")
            await expect(page.locator("#mode")).to_have_text("signed in as alice")
            cookies = {c["name"]: c for c in await browser.cookies()}
            session = cookies["orchestrator_console"]
            assert TOKEN not in session["value"]
            assert session["httpOnly"] and session["sameSite"] == "Strict"

            row = page.locator(f"tr.effect:has(a:text('{approved_id}'))")
            effect = (await EffectStore(pool).list_effects(run_id=approved_id))[0]
            assert effect.status is EffectStatus.AWAITING_APPROVAL
            await expect(row.locator(".payload-sha")).to_have_text(str(effect.payload_sha256))
            await within_the_window(page, "button.approve, button.deny, header form button")
            await shot(page, screenshots, "needs-a-person")
            await page.goto(f"{running.url}/runs/{approved_id}")
            await within_the_window(page, "button.approve, button.deny")
            await shot(page, screenshots, "run-awaiting-approval")
            await page.goto(f"{running.url}/attention")

            # The form names the payload the page showed: had it changed, the store refuses,
            # and the page says why.
            await row.locator("form.approve-form input[name=payload_sha256]").evaluate(
                "input => input.value = '0'.repeat(64)"
            )
            await row.get_by_role("button", name="approve").click()
            await expect(page.locator("#flash-error")).to_contain_text("is not the one you saw")
            await expect(page.locator("#flash-error")).not_to_contain_text(
                str(effect.payload_sha256)
            )
            assert (await EffectStore(pool).get(approved_id, effect.effect_key)).status is (
                EffectStatus.AWAITING_APPROVAL
            )

            row = page.locator(f"tr.effect:has(a:text('{approved_id}'))")
            await row.locator("input[name=note]").first.fill("checked the order")
            await row.get_by_role("button", name="approve").click()
            await expect(page.locator("#flash")).to_contain_text("approved")
            approved = await wait_for_run(store, approved_id, within=60)

            row = page.locator(f"tr.effect:has(a:text('{denied_id}'))")
            await row.locator("form.deny-form input[name=note]").fill("not eligible")
            await row.get_by_role("button", name="deny").click()
            await expect(page.locator("#flash")).to_contain_text("denied")
            denied = await wait_for_run(store, denied_id, within=60)

            await page.goto(f"{running.url}/runs/{approved_id}")
            granted = page.locator("#timeline tr.kind-approval_granted")
            await expect(granted).to_contain_text("by=shared-token, via=shared-token")
            await expect(granted).to_contain_text("typed_by=alice")
            await expect(page.locator("#run-state")).to_have_text("succeeded")
            await shot(page, screenshots, "run-approved")
            # The refund's result answers turn 1's call, though the run reads it in turn 2.
            rows = [
                (await row.locator("td").nth(0).inner_text(), await row.inner_text())
                for row in await page.locator("#conversation tr.message").all()
            ]
            assert [turn for turn, text in rows if "reply to call_0_0_1" in text] == ["1"], rows
            assert [turn for turn, _ in rows] == ["1", "1", "1", "1", "1", "2"], rows
            shown = await anyio.to_thread.run_sync(
                lambda: cli(database_url, "runs", "show", approved_id)
            )
            turns = [line.split()[0] for line in shown.stdout.splitlines() if "call_0_0_1:" in line]
            assert turns == ["1"], shown.stdout
    assert approved.state is RunState.SUCCEEDED, approved.error
    assert denied.state is RunState.SUCCEEDED, denied.error  # told "denied", it answered
    assert [d["payload"]["amount"] for d in vendor.deliveries.values()] == [150]
    events = {
        run_id: [(e.kind, e.details) for e in await store.events(run_id)]
        for run_id in (approved_id, denied_id)
    }
    [granted_details] = [d for k, d in events[approved_id] if k == "approval_granted"]
    assert isinstance(granted_details, dict)
    assert (granted_details["by"], granted_details["typed_by"]) == ("shared-token", "alice")
    [denied_details] = [d for k, d in events[denied_id] if k == "approval_denied"]
    assert isinstance(denied_details, dict)
    assert (denied_details["by"], denied_details["typed_by"]) == ("shared-token", "alice")
    record = await EffectStore(pool).get(denied_id, effect.effect_key)
    assert (record.status, record.decision_note) == (EffectStatus.REJECTED, "not eligible")


async def test_the_live_run_page_follows_the_run_until_it_ends(
    settings: Settings,
    database_url: str,
    store: RunStore,
    tmp_path: Path,
    browser: BrowserContext,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No reload: the page re-fetches itself while the run is live, and stops once it ended."""
    async with refund_vendors(monkeypatch) as (adapters, _vendor):
        run_id = (await store.submit("refunds", {"prompt": "Refund o-17 live."})).run.run_id
        async with (
            running_worker(settings, [refunds], effect_adapters=adapters, **FAST),
            console(database_url, tmp_path, token=TOKEN) as running,
        ):
            await wait_for_run(store, run_id, states={RunState.WAITING}, within=60)
            page = await browser.new_page()
            await page.goto(f"{running.url}/runs/{run_id}")
            await expect(page.locator("#run-state")).to_have_text("waiting")
            assert await page.locator("#live").get_attribute("data-refresh") is not None
            async with httpx.AsyncClient(base_url=running.url) as client:
                [effect] = await EffectStore(store.pool).list_effects(run_id=run_id)
                answer = await client.post(
                    f"/runs/{run_id}/effects/{effect.effect_key}/approve",
                    headers={"Authorization": f"Bearer {TOKEN}"},
                    data={"by": "api", "payload_sha256": str(effect.payload_sha256)},
                )
                assert answer.status_code == 200, answer.text
            await expect(page.locator("#run-state")).to_have_text("succeeded", timeout=20_000)
            await expect(page.locator("#timeline")).to_contain_text("typed_by=api")
            assert await page.locator("#live").get_attribute("data-refresh") is None


# -- read-only and refusals -----------------------------------------------------------------
async def state_of(store: RunStore, pool: asyncpg.Pool, run_id: str) -> Any:
    effect = (await EffectStore(pool).list_effects(run_id=run_id))[0]
    return (effect.status, effect.decided_by, len(await store.events(run_id)))


async def test_without_a_token_the_console_is_read_only(
    database_url: str,
    store: RunStore,
    pool: asyncpg.Pool,
    tmp_path: Path,
    browser: BrowserContext,
    screenshots: Path,
) -> None:
    run_id = await awaiting_approval(store, pool, {"order": "o-9", "amount": 120})
    before = await state_of(store, pool, run_id)
    effect = (await EffectStore(pool).list_effects(run_id=run_id))[0]
    async with console(database_url, tmp_path) as running:
        page = await browser.new_page()
        for path in ("/attention", f"/runs/{run_id}", "/runs", "/cluster"):
            await page.goto(running.url + path)
            await expect(page.locator("#mode")).to_contain_text("read-only")
            assert await page.locator("form[method=post]").count() == 0, path
            assert await page.locator("button.approve, button.deny").count() == 0, path
        await page.goto(f"{running.url}/attention")
        await expect(page.locator("tr.effect")).to_contain_text("awaiting_approval")
        await shot(page, screenshots, "read-only")
        async with httpx.AsyncClient(base_url=running.url) as client:
            fields = {"by": "mallory", "payload_sha256": str(effect.payload_sha256)}
            for path, headers in (
                (f"/runs/{run_id}/effects/refund/approve", {"Origin": running.url}),
                (f"/runs/{run_id}/effects/refund/deny", {"Authorization": f"Bearer {TOKEN}"}),
                (f"/runs/{run_id}/effects/refund/resolve", {"Origin": running.url}),
                ("/signin", {"Origin": running.url}),
                ("/runs", {}),
                ("/no-such-page", {}),
            ):
                answer = await client.post(path, headers=headers, data=fields)
                assert answer.status_code == 403, (path, answer.text)
                assert "read-only" in answer.text
    assert await state_of(store, pool, run_id) == before


async def test_a_wrong_token_or_a_missing_origin_is_refused_and_changes_nothing(
    database_url: str, store: RunStore, pool: asyncpg.Pool, tmp_path: Path
) -> None:
    run_id = await awaiting_approval(store, pool, {"order": "o-9", "amount": 120})
    effect = (await EffectStore(pool).list_effects(run_id=run_id))[0]
    before = await state_of(store, pool, run_id)
    path = f"/runs/{run_id}/effects/refund/approve"
    fields = {"by": "mallory", "payload_sha256": str(effect.payload_sha256)}
    async with (
        console(database_url, tmp_path, token=TOKEN) as running,
        httpx.AsyncClient(base_url=running.url) as client,
    ):
        origin = {"Origin": running.url}
        refused = {
            "no credentials": await client.post(path, headers=origin, data=fields),
            "wrong sign-in": await client.post(
                "/signin", headers=origin, data={"name": "m", "token": "wrong-token-0000000"}
            ),
            "forged cookie": await client.post(
                path, headers={**origin, "Cookie": "orchestrator_console=" + "0" * 64}, data=fields
            ),
            "the token as the cookie": await client.post(
                path, headers={**origin, "Cookie": f"orchestrator_console={TOKEN}"}, data=fields
            ),
        }
        signed = await client.post("/signin", headers=origin, data={"name": "eve", "token": TOKEN})
        assert signed.status_code == 303
        cookie = signed.cookies["orchestrator_console"]
        assert TOKEN not in cookie and "HttpOnly" in signed.headers["set-cookie"]
        client.cookies.clear()
        session = {"Cookie": f"orchestrator_console={cookie}"}
        refused["cookie without Origin"] = await client.post(path, headers=session, data=fields)
        refused["cookie from another site"] = await client.post(
            path, headers={**session, "Origin": "http://evil.test"}, data=fields
        )
        refused["bearer from another site"] = await client.post(
            path,
            headers={"Authorization": f"Bearer {TOKEN}", "Origin": "http://evil.test"},
            data=fields,
        )
        for case, answer in refused.items():
            assert answer.status_code == 403, (case, answer.status_code, answer.text)
        # An API client is answered as one: 401 and a JSON error, not a page asking to sign in.
        wrong = await client.post(
            path, headers={"Authorization": "Bearer wrong-token-0000000"}, data=fields
        )
        assert wrong.status_code == 401 and wrong.headers["www-authenticate"] == "Bearer"
        assert "wrong bearer token" in wrong.json()["error"], wrong.text
        assert await state_of(store, pool, run_id) == before

        # The same request with the signed cookie and this console's Origin goes through; the
        # actor is the name the form gave.
        done = await client.post(path, headers={**session, **origin}, data={**fields, "by": "eve"})
        assert done.status_code == 303, done.text
    after = await EffectStore(pool).get(run_id, "refund")
    assert (after.status, after.decided_by) == (EffectStatus.ACCEPTED, "shared-token")


async def test_what_a_hostile_page_or_link_could_send_is_refused(
    database_url: str, store: RunStore, pool: asyncpg.Pool, tmp_path: Path
) -> None:
    run_id = await awaiting_approval(store, pool, {"order": "o-7", "amount": 30})
    effect = (await EffectStore(pool).list_effects(run_id=run_id))[0]
    before = await state_of(store, pool, run_id)
    path = f"/runs/{run_id}/effects/refund/approve"
    bearer = {"Authorization": f"Bearer {TOKEN}"}
    fields = {"by": "ops", "payload_sha256": str(effect.payload_sha256)}
    async with (
        console(database_url, tmp_path, token=TOKEN) as running,
        httpx.AsyncClient(base_url=running.url) as client,
    ):
        # DNS rebinding: a page another site serves under its own name, resolved to loopback.
        rebound = await client.get(f"/runs/{run_id}", headers={"Host": "evil.test:8790"})
        assert rebound.status_code == 400 and run_id not in rebound.text
        # A link cannot put words in the console's banner: only signed messages are shown.
        spoofed = await client.get("/runs?flash=paste+your+token+at+evil.test")
        assert spoofed.status_code == 200 and "evil.test" not in spoofed.text
        # Not a number by Python's looser reading either: a clear 400, not a crash.
        odd = await client.post(path, headers=bearer, data={**fields, "fence": "\u00b2"})
        assert odd.status_code == 400 and "whole number" in odd.text, odd.text
        huge = await client.post(path, headers=bearer, data={**fields, "note": "x" * 70_000})
        assert huge.status_code == 413, huge.text
        assert await state_of(store, pool, run_id) == before
        # An API client learns what was wrong: unknown effect 404, a stale hash 409.
        missing = await client.post(
            f"/runs/{run_id}/effects/nope/approve", headers=bearer, data=fields
        )
        assert missing.status_code == 404, missing.text
        stale = await client.post(path, headers=bearer, data={**fields, "payload_sha256": "0" * 64})
        assert stale.status_code == 409, stale.text
        # After a browser's action, the redirect stays on this console, whatever `next` says.
        origin = {"Origin": running.url}
        signed = await client.post("/signin", headers=origin, data={"name": "eve", "token": TOKEN})
        session = {"Cookie": f"orchestrator_console={signed.cookies['orchestrator_console']}"}
        client.cookies.clear()
        done = await client.post(
            path, headers={**session, **origin}, data={**fields, "next": "/\\evil.test/x"}
        )
        assert done.status_code == 303 and done.headers["location"].startswith("/?flash="), (
            done.headers
        )
        shown = await client.get(done.headers["location"], headers=session)
        assert "approved refund" in shown.text


async def test_a_refused_approval_says_where_to_look_and_never_tells_the_hash(
    database_url: str, settings: Settings, store: RunStore, pool: asyncpg.Pool, tmp_path: Path
) -> None:
    """With the current hash in a refusal, a client could approve a payload unseen in two calls."""
    run_id = await awaiting_approval(store, pool, {"order": "o-3", "amount": 75})
    current = str((await EffectStore(pool).get(run_id, "refund")).payload_sha256)
    wrong = "0" * 64
    where = f"orchestrator approvals show {run_id} refund"
    messages: dict[str, str] = {}
    with pytest.raises(DecisionRefused) as refused:
        await Client(pool, settings).approve(run_id, "refund", by="api", payload_sha256=wrong)
    messages["Client"] = str(refused.value)
    done = await anyio.to_thread.run_sync(
        lambda: cli(
            database_url, "approvals", "approve", run_id, "refund", "--by", "ana", "--hash", wrong
        )
    )
    assert done.returncode == 1 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    messages["CLI"] = done.stderr
    async with (
        console(database_url, tmp_path, token=TOKEN) as running,
        httpx.AsyncClient(base_url=running.url) as client,
    ):
        answer = await client.post(
            f"/runs/{run_id}/effects/refund/approve",
            headers={"Authorization": f"Bearer {TOKEN}"},
            data={"by": "api", "payload_sha256": wrong},
        )
        assert answer.status_code == 409, answer.text
        messages["console API"] = answer.json()["error"]
    for surface, message in messages.items():
        assert "is not the one you saw" in message and where in message, (surface, message)
        assert current not in message, (surface, message)
    assert (await EffectStore(pool).get(run_id, "refund")).status is (
        EffectStatus.AWAITING_APPROVAL
    )


async def test_a_parked_effect_is_resolved_from_the_browser(
    settings: Settings,
    database_url: str,
    store: RunStore,
    pool: asyncpg.Pool,
    tmp_path: Path,
    browser: BrowserContext,
) -> None:
    """A vendor that accepted and never answered, with no way to look it up: parked; a person
    checks with the vendor and says it was sent."""
    await store.submit("desk", {})
    run = (await store.claim("W", ["desk"], limit=1, lease_seconds=60)).claimed[0]
    async with pool.acquire() as db, db.transaction():
        await EffectStore(pool).accept(
            db, run.run_id, run.fence, Effect("crm-note", "crm", {"note": "hi"}), worker_id="W"
        )
    async with LocalVendor() as vendor:
        vendor.mode = "accept_then_hang"
        adapters = {
            "crm": HttpAdapter("crm", url=vendor.send_url, reconcile="none", timeout_seconds=0.5)
        }
        async with running_worker(
            settings, [refunds], effect_adapters=adapters, dispatch_lease_seconds=2, **FAST
        ):
            with anyio.fail_after(30):
                while (  # noqa: ASYNC110 - database state, polled
                    await EffectStore(pool).get(run.run_id, "crm-note")
                ).status is not EffectStatus.PARKED:
                    await anyio.sleep(0.1)
    async with console(database_url, tmp_path, token=TOKEN) as running:
        page = await browser.new_page()
        await sign_in(page, running.url, "bob")
        await page.goto(f"{running.url}/no-such-page")  # an error page knows who is signed in
        await expect(page.locator("#mode")).to_have_text("signed in as bob")
        await page.goto(f"{running.url}/attention")
        row = page.locator(f"tr.effect:has(a:text('{run.run_id}'))")
        await expect(row).to_contain_text("parked")
        await row.locator("select[name=decision]").select_option("sent")
        await row.locator("input[name=external_id]").fill("op_1")
        await row.get_by_role("button", name="resolve").click()
        await expect(page.locator("#flash")).to_contain_text("resolved sent by shared-token (bob)")
        await expect(page.locator("#no-parked")).to_be_visible()
        await page.goto(f"{running.url}/runs/{run.run_id}")
        resolved = page.locator("#timeline tr.kind-effect_resolved")
        await expect(resolved).to_contain_text("by=shared-token, via=shared-token")
        await expect(resolved).to_contain_text("typed_by=bob")
    record = await EffectStore(pool).get(run.run_id, "crm-note")
    assert (record.status, record.external_id) == (EffectStatus.CONFIRMED, "op_1")
    assert len(vendor.deliveries) == 1


# -- privacy --------------------------------------------------------------------------------
async def every_page(page: Page, base: str, run_ids: list[str]) -> dict[str, str]:
    """The HTML of every page the console has, for these runs."""
    html = {}
    for path in (
        "/",
        "/runs",
        "/attention",
        "/cluster",
        "/signin",
        *(f"/runs/{r}" for r in run_ids),
    ):
        await page.goto(base + path)
        html[path] = await page.content()
    return html


async def more_canaries(store: RunStore, pool: asyncpg.Pool) -> list[str]:
    """Runs whose timeline holds a canary in a superseded payload, a signal's data, a denial's
    note, a failed attempt's error and a cancel reason."""
    effects = EffectStore(pool)
    run_id = (await store.submit("private", {})).run.run_id
    first = await store.claim_run("w1", run_id, lease_seconds=0.2)
    assert first is not None
    replaceable = EffectPolicy.REPLACEABLE
    async with pool.acquire() as db:
        old = Effect("crm-x", "crm", {"note": f"{CANARY}-superseded"}, replaceable)
        await effects.accept(db, run_id, first.fence, old, worker_id="w1")
    await anyio.sleep(0.4)  # the first lease expires
    second = await store.claim_run("w2", run_id, lease_seconds=60)
    assert second is not None
    async with pool.acquire() as db:
        new = Effect("crm-x", "crm", {"note": "new"}, replaceable)
        assert (await effects.accept(db, run_id, second.fence, new, worker_id="w2")).outcome == (
            "replaced"
        )
        ask = Effect("refund", "crm", {"amount": 5}, requires_approval=True)
        await effects.accept(db, run_id, second.fence, ask, worker_id="w2")
    await SignalStore(pool).send(run_id, "note", {"text": f"{CANARY}-signal"})
    await ApprovalStore(pool).decide(
        run_id, "refund", Decision.DENIED, by="ana", note=f"{CANARY}-note"
    )
    error = {"type": "RuntimeError", "message": f"{CANARY}-error"}
    assert await store.fail(second.lease, expected_version=0, error=error)
    cancelled = (await store.submit("private", {})).run.run_id
    await store.cancel(cancelled, reason=f"{CANARY}-reason")
    return [run_id, cancelled]


async def test_contents_appear_only_with_show_payloads_and_capped(
    settings: Settings,
    database_url: str,
    store: RunStore,
    pool: asyncpg.Pool,
    tmp_path: Path,
    browser: BrowserContext,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    run, _, vendor = await run_with_canaries(settings, store, monkeypatch)
    run_id = run.run_id
    assert any(CANARY in json.dumps(d["payload"]) for d in vendor.deliveries.values())
    markup = "<script>alert('console')</script>"
    big = (
        await store.submit("private", {"prompt": f"{CANARY}-big {markup} " + "x" * 20_000})
    ).run.run_id
    runs = [run_id, big, *await more_canaries(store, pool)]

    async with console(database_url, tmp_path) as running:
        page = await browser.new_page()
        hidden = await every_page(page, running.url, runs)
        # What the default shows instead: sizes, hashes, tool names, roles, token counts.
        conversation = await page.goto(f"{running.url}/runs/{run_id}")
        assert conversation is not None
        await expect(page.locator("#conversation")).to_contain_text("notify")
        await expect(page.locator("#conversation")).to_contain_text("assistant")
        await expect(page.locator("#facts")).to_contain_text("hidden (")
    for path, text in hidden.items():
        assert CANARY not in text, f"the canary leaked into {path}"

    async with console(database_url, tmp_path, "--show-payloads") as running:
        page = await browser.new_page()
        shown = await every_page(page, running.url, runs)
    parts = ("-input", "-payload", "-answer", "-big", "-superseded", "-signal", "-note", "-error")
    for part in (*parts, "-reason"):
        assert any(CANARY + part in text for text in shown.values()), part
    for secret in (f"sk-{CANARY}-key", f"{CANARY}-vendor-token"):
        assert not any(secret in text for text in shown.values()), secret
    big_page = shown[f"/runs/{big}"]
    assert "truncated: the first 4096 of" in big_page
    assert "x" * 5000 not in big_page
    assert markup not in big_page and "&lt;script&gt;alert" in big_page  # shown, never run


async def test_a_worker_that_renewed_shows_its_last_renewal_after_its_runs_end(
    database_url: str, store: RunStore, tmp_path: Path
) -> None:
    """The last renewal was read from the runs a worker held at that moment: blank between runs."""
    with ServeProcess(
        database_url,
        "--agents",
        "orchestrator.agents.sleepy",
        "--lease-seconds",
        "2",
        "--poll-seconds",
        "0.2",
        name="renewer",
    ):
        run_id = (await store.submit("sleepy", {"steps": 1, "seconds": 4})).run.run_id
        await wait_for_run(store, run_id, states={RunState.SUCCEEDED}, within=60)
        listed = await anyio.to_thread.run_sync(
            lambda: cli(database_url, "workers", "list", "--json")
        )
        async with console(database_url, tmp_path) as running, httpx.AsyncClient() as client:
            page = (await client.get(f"{running.url}/cluster")).text
    (worker,) = json.loads(listed.stdout)
    assert worker["runs_held"] == 0 and worker["last_renewal"] is not None, worker
    claimed = next(e.at for e in await store.events(run_id) if e.kind == "claimed")
    finished = (await store.get(run_id)).finished_at
    assert finished is not None
    renewed = datetime.fromisoformat(worker["last_renewal"])
    # A 2 s lease renewed through a 4 s step: after the claim, before the finish.
    assert claimed < renewed < finished, (worker, claimed, finished)
    assert renewed.strftime("%Y-%m-%d %H:%M:%S") in page


async def test_a_scheduled_run_shows_when_it_is_due_and_waits_print_times_in_utc(
    database_url: str, store: RunStore, tmp_path: Path
) -> None:
    submitted = await anyio.to_thread.run_sync(
        lambda: cli(database_url, "submit", "inbox", "--delay", "3600")
    )
    scheduled = submitted.stdout.strip()
    available = (await store.get(scheduled)).available_at
    due = available.strftime("%Y-%m-%d %H:%M:%S.%f")[:-3] + "Z"
    parked = (await store.submit("parked", {})).run.run_id
    await store.pool.execute(  # a wait with no time limit (available_at infinity), and one with
        "UPDATE runs SET state = 'waiting', available_at = 'infinity', wait = $2 WHERE run_id = $1",
        parked,
        {"signals": ["go"], "until": None},
    )
    limited = (await store.submit("parked", {})).run.run_id
    await store.pool.execute(
        "UPDATE runs SET state = 'waiting', available_at = $2, wait = $3 WHERE run_id = $1",
        limited,
        datetime.fromisoformat("2030-01-01T02:00:00+02:00"),
        {"signals": ["go"], "until": "2030-01-01T02:00:00+02:00"},
    )

    def show(*args: str) -> str:
        done = cli(database_url, *args)
        assert done.returncode == 0, done.stderr
        return done.stdout

    listed = await anyio.to_thread.run_sync(show, "runs", "list")
    [line] = [line for line in listed.splitlines() if scheduled in line]
    assert due in line and "(in " in line, listed
    shown = json.loads(await anyio.to_thread.run_sync(show, "runs", "show", parked, "--json"))
    assert shown["run"]["available_at"].endswith("+00:00"), shown["run"]
    waiting = await anyio.to_thread.run_sync(show, "runs", "show", limited)
    assert "until 2030-01-01 00:00:00.000Z" in waiting, waiting
    async with console(database_url, tmp_path) as running, httpx.AsyncClient() as client:
        runs = (await client.get(f"{running.url}/runs")).text
        page = (await client.get(f"{running.url}/runs/{scheduled}")).text
    assert due in runs
    assert 'id="run-due"' in page and due in page


# -- the command line -----------------------------------------------------------------------
def test_bad_options_are_one_line_errors(database_url: str, tmp_path: Path) -> None:
    env = {**os.environ, "ORCHESTRATOR_DATABASE_URL": database_url}
    env.pop("ORCHESTRATOR_CONSOLE_TOKEN", None)
    missing = tmp_path / "no-such-token"
    for args, extra_env, expected in (
        (["--listen", "nowhere"], {}, "--listen takes HOST:PORT"),
        (["--listen", "127.0.0.1:0x"], {}, "--listen takes HOST:PORT"),
        (["--token-file", str(missing)], {}, "cannot read --token-file"),
        ([], {"ORCHESTRATOR_CONSOLE_TOKEN": "short"}, "at least 16 characters"),
        # Readable by the whole network without a token only when the operator says so.
        (["--listen", f"0.0.0.0:{free_port()}", "--show-payloads"], {}, "--allow-public-read-only"),
    ):
        done = subprocess.run(
            [sys.executable, "-m", "orchestrator.cli", "console", *args],
            env={**env, **extra_env},
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert done.returncode == 1, (args, done.stderr)
        assert expected in done.stderr, (args, done.stderr)
        assert len(done.stderr.strip().splitlines()) == 1, done.stderr


async def test_a_public_read_only_console_needs_the_operator_to_say_so(
    database_url: str, tmp_path: Path
) -> None:
    port = free_port()
    running = Console(
        database_url,
        tmp_path / "public.log",
        "--listen",
        f"0.0.0.0:{port}",
        "--allow-public-read-only",
    )
    running.url = f"http://127.0.0.1:{port}"
    try:
        await running.ready()
    finally:
        assert running.stop() == 0, running.log.read_text()
    assert f"console listening on http://0.0.0.0:{port}/ (read-only" in running.log.read_text()


@pytest.fixture
def busy_port() -> Iterator[int]:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        yield int(taken.getsockname()[1])


def test_a_port_in_use_is_a_one_line_error(database_url: str, busy_port: int) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", "console", "--listen", f"127.0.0.1:{busy_port}"],
        env={**os.environ, "ORCHESTRATOR_DATABASE_URL": database_url},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 1 and "cannot listen on 127.0.0.1:" in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr


async def test_a_run_page_shows_its_tree_and_a_fork_s_origin(
    database_url: str, store: RunStore, pool: asyncpg.Pool, tmp_path: Path, browser: BrowserContext
) -> None:
    from orchestrator.agent.children import Child
    from orchestrator.db.forks import ForkStore
    from orchestrator.ids import new_run_id

    await store.submit("tree", {})
    [parent] = (await store.claim("w1", ["tree"], limit=1, lease_seconds=60)).claimed
    spawned = await store.spawn_children(
        parent.lease,
        [Child("leaf", {}, key=f"k{n}").spawn(new_run_id()) for n in range(2)],
        db=pool,
    )
    assert spawned is not None
    fork = await ForkStore(pool).fork(parent.run_id, version=0)
    async with console(database_url, tmp_path) as running:
        page = await browser.new_page()
        await page.goto(f"{running.url}/runs/{parent.run_id}")
        await expect(page.locator("#children .child")).to_have_count(2)
        await expect(page.locator("#children")).to_contain_text("k0")
        await page.locator("#children a").first.click()
        await expect(page.locator("#run-parent")).to_contain_text(parent.run_id)
        await page.goto(f"{running.url}/runs/{fork.run_id}")
        await expect(page.locator("#run-forked-from")).to_contain_text(parent.run_id)
