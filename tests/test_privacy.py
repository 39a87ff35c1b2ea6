"""A canary secret in a run's input, the prompt, a tool call's effect payload, the model API key
and a vendor token appears nowhere in spans, metrics or logs; nor does an access token, which the
database keeps only as its hash."""

from __future__ import annotations

import json
from typing import Any

import asyncpg
import pytest

from orchestrator.access import PrincipalKind, Role
from orchestrator.agent.tool_loop import ToolAgent
from orchestrator.db.access import AccessStore, token_sha256
from orchestrator.db.store import RunStore
from orchestrator.effects.http import HttpAdapter
from orchestrator.models import Run, RunState
from orchestrator.settings import Settings
from orchestrator.testing import capture_metrics, capture_spans, running_worker, wait_for_run
from orchestrator.testing.loopback import (
    LocalVendor,
    ScriptedCall,
    ScriptedModelServer,
    ScriptedTurn,
    turns,
)
from support.tool_agents_for_tests import lookup_order, notify
from test_runtime import FAST

CANARY = "canary-5f0c2e91"

private = ToolAgent(
    "private",
    instructions=f"Handle the order. Internal note {CANARY}-instructions.",
    tools=[lookup_order, notify],
    max_turns=4,
)

PRIVATE_TURNS = turns(
    ScriptedTurn(calls=(ScriptedCall("lookup_order", {"order_id": f"o-{CANARY}"}),)),
    ScriptedTurn(calls=(ScriptedCall("notify", {"order_id": "o-1", "note": f"{CANARY}-payload"}),)),
    ScriptedTurn(content=f"Done {CANARY}-answer."),
)


async def run_with_canaries(
    settings: Settings, store: RunStore, monkeypatch: pytest.MonkeyPatch
) -> tuple[Run, ScriptedModelServer, LocalVendor]:
    """The ``private`` agent run to success with a canary in its input, its prompt, its effect's
    payload, the model API key and the vendor token; the model and vendor it used (stopped)."""
    monkeypatch.setenv("OPENAI_API_KEY", f"sk-{CANARY}-key")
    monkeypatch.setenv("CRM_TOKEN", f"{CANARY}-vendor-token")
    async with ScriptedModelServer(PRIVATE_TURNS) as model, LocalVendor() as vendor:
        monkeypatch.setenv("OPENAI_BASE_URL", model.base_url)
        adapters = {
            "crm": HttpAdapter(
                "crm", url=vendor.send_url, token_env="CRM_TOKEN", reconcile="replay"
            )
        }
        run_id = (
            await store.submit("private", {"prompt": f"Where is my order? {CANARY}-input"})
        ).run.run_id
        async with running_worker(settings, [private], effect_adapters=adapters, **FAST):
            run = await wait_for_run(store, run_id, within=60)
    assert run.state is RunState.SUCCEEDED, run.error
    return run, model, vendor


def everything_in(spans: Any, reader: Any) -> str:
    """Every span (name, attributes, events, links, status) and every metric point as text."""
    parts = [span.to_json() for span in spans.get_finished_spans()]
    parts.append(reader.get_metrics_data().to_json())
    return "\n".join(parts)


async def test_the_canary_appears_in_no_span_metric_or_log(
    settings: Settings,
    store: RunStore,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    spans = capture_spans()
    reader = capture_metrics()
    assert spans is not None and reader is not None
    spans.clear()
    _, model, vendor = await run_with_canaries(settings, store, monkeypatch)
    # The secrets did travel where they had to: the model, the vendor, the database.
    assert any(CANARY in json.dumps(p) for p in [d["payload"] for d in vendor.deliveries.values()])
    assert model.requests and len(vendor.deliveries) == 1
    captured = capsys.readouterr()
    telemetry = everything_in(spans, reader)
    assert "chat" in telemetry and "orchestrator.claims" in telemetry  # something was recorded
    for where, text in (
        ("spans and metrics", telemetry),
        ("stdout", captured.out),
        ("stderr", captured.err),
    ):
        assert CANARY not in text, f"the canary leaked into {where}"


async def test_a_token_is_stored_only_as_its_hash_and_logged_nowhere(
    pool: asyncpg.Pool, capsys: pytest.CaptureFixture[str]
) -> None:
    spans = capture_spans()
    reader = capture_metrics()
    assert spans is not None and reader is not None
    spans.clear()
    access = AccessStore(pool)
    await access.set_principal("billing", kind=PrincipalKind.SERVICE, role=Role.OPERATOR)
    issued = await access.create_token("billing", expires_in=3600, description="canary test")
    assert await access.authenticate(issued.secret) is not None
    assert await access.authenticate(issued.secret + "x") is None
    await access.revoke_token(issued.entry.token_id)
    assert await access.authenticate(issued.secret) is None
    secret = issued.secret.removeprefix(f"orc_{issued.entry.token_id}_")
    assert len(secret) >= 40  # the part that is secret: everything after the public id
    stored = await pool.fetchval(
        "SELECT (SELECT string_agg(t::text, ' ') FROM access_tokens t) || "
        "(SELECT string_agg(a::text, ' ') FROM audit_log a)"
    )
    captured = capsys.readouterr()
    for where, text in (
        ("the database", stored),
        ("the token's repr", repr(issued)),
        ("spans and metrics", everything_in(spans, reader)),
        ("stdout", captured.out),
        ("stderr", captured.err),
    ):
        assert secret not in text, f"the token leaked into {where}"
    assert token_sha256(issued.secret) in stored  # what is kept instead
