"""The console's run page follows a run's live output in a real browser (headless Chromium): text
appears as it is published, a lost attempt's unfinished output is struck through when the run is
taken over, and the page says when the run has ended. The stream is refused to a visitor who
may not see contents."""

from __future__ import annotations

from pathlib import Path

import httpx
from playwright.async_api import BrowserContext, expect

from orchestrator.db.output import OutputStore
from orchestrator.db.store import RunStore
from test_console import browser, console, screenshots, shot
from test_streaming import append, claimed, expire

__all__ = ["browser", "screenshots"]  # fixtures, imported for pytest


async def test_the_run_page_shows_live_output_and_strikes_through_a_lost_attempt(
    database_url: str,
    store: RunStore,
    tmp_path: Path,
    browser: BrowserContext,
    screenshots: Path,
) -> None:
    outputs = OutputStore(store.pool)
    first = await claimed(store, "w1")
    run_id = first.run_id
    async with console(database_url, tmp_path, "--show-payloads") as running:
        page = await browser.new_page()
        await page.goto(f"{running.url}/runs/{run_id}")
        await expect(page.locator("#output-status")).to_have_text("live")
        assert await append(outputs, first, "Half an ") == "ok"
        assert await append(outputs, first, "answer") == "ok"
        await expect(page.locator("#output")).to_contain_text("Half an answer")
        await expire(store, run_id)
        second = await claimed(store, "w2", run_id)
        assert await append(outputs, second, "The whole answer.") == "ok"
        await expect(page.locator("#output .output-retracted")).to_contain_text(
            f"fence {first.fence}'s unfinished output was retracted"
        )
        struck = page.locator("#output .retracted")
        await expect(struck).to_have_count(2)
        assert "".join(await struck.all_text_contents()) == "Half an answer"
        await expect(page.locator("#output")).to_contain_text("The whole answer.")
        assert await store.finish(second.lease, expected_version=0, result={"ok": True})
        await expect(page.locator("#output-status")).to_have_text("the run has ended")
        await shot(page, screenshots, "live-output")
        # Each piece once, though the page refreshed its other parts meanwhile.
        assert await page.locator("#output .output-text").count() == 3
    async with (
        console(database_url, tmp_path) as hidden,
        httpx.AsyncClient(base_url=hidden.url, timeout=10) as client,
    ):
        refused = await client.get(f"/runs/{run_id}/output")
        assert refused.status_code == 403
        assert "live output is contents" in refused.text
