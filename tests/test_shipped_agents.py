"""The tool agents shipped in agents/, on the local scripted model, real vendors on loopback."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from orchestrator.agent.steps import Agent
from orchestrator.agents.contract_summary import contract_summary
from orchestrator.agents.support import support
from orchestrator.db.store import RunStore
from orchestrator.effect_model import EffectStatus
from orchestrator.effects.http import HttpAdapter
from orchestrator.effects.smtp import SmtpAdapter
from orchestrator.effects.store import EffectStore
from orchestrator.models import JSON, Run, RunState
from orchestrator.settings import Settings
from orchestrator.testing import running_worker, wait_for_run
from orchestrator.testing.local_scripts import contract_summary_script, support_script
from orchestrator.testing.loopback import LocalVendor, Script, ScriptedModelServer, SmtpSink
from test_runtime import FAST


async def run_with_a_vendor_and_mail(
    settings: Settings,
    store: RunStore,
    monkeypatch: pytest.MonkeyPatch,
    agent: Agent,
    script: Script,
    vendor_kind: str,
    input: JSON,
) -> tuple[Run, ScriptedModelServer, LocalVendor, SmtpSink]:
    """Run ``input`` through ``agent`` on a scripted model, its ``vendor_kind`` effects sent to a
    vendor and its email to a sink on loopback; return the finished run and what they saw."""
    async with ScriptedModelServer(script) as model, LocalVendor() as vendor:
        with SmtpSink() as sink:
            monkeypatch.setenv("OPENAI_BASE_URL", model.base_url)
            adapters = {
                vendor_kind: HttpAdapter(vendor_kind, url=vendor.send_url, reconcile="replay"),
                "email": SmtpAdapter("email", host="127.0.0.1", port=sink.port, sender="a@o.test"),
            }
            run_id = (await store.submit(agent.name, input)).run.run_id
            async with running_worker(settings, [agent], effect_adapters=adapters, **FAST):
                run = await wait_for_run(store, run_id, within=60)
    return run, model, vendor, sink


async def test_contract_summary_emails_once_and_updates_the_crm(
    settings: Settings, store: RunStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    input: JSON = {"contract_id": "c-1001", "to": "legal@acme.test", "account": "ACME"}
    run, _, crm, sink = await run_with_a_vendor_and_mail(
        settings, store, monkeypatch, contract_summary, contract_summary_script, "crm", input
    )
    assert run.state is RunState.SUCCEEDED, run.error
    assert run.result is not None and "ACME Corp and Northwind" in run.result["output"]
    assert [str(m["To"]) for m in sink.messages] == ["legal@acme.test"]
    assert "Master services agreement" in sink.messages[0].get_content()
    assert [d["payload"]["status"] for d in crm.deliveries.values()] == ["summarised"]
    records = await EffectStore(store.pool).list_effects(run_id=run.run_id)
    assert {(r.kind, r.status) for r in records} == {
        ("email", EffectStatus.CONFIRMED),
        ("crm", EffectStatus.CONFIRMED),
    }


async def test_support_opens_a_ticket_and_replies_quoting_its_id(
    settings: Settings, store: RunStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    input: JSON = {"customer": "ana@example.com", "order_id": "o-17", "message": "?"}
    run, model, tickets, sink = await run_with_a_vendor_and_mail(
        settings, store, monkeypatch, support, support_script, "tickets", input
    )
    assert run.state is RunState.SUCCEEDED, run.error
    assert sorted(tickets.requests_by_key.values()) == [1]
    ticket_id = next(iter(tickets.deliveries.values()))["id"]
    assert len(sink.messages) == 1 and ticket_id in str(sink.messages[0]["Subject"])
    assert ticket_id in sink.messages[0].get_content()
    lookups = [r for r in model.requests if r["turn"] == 0]
    assert len(lookups) == 1  # both lookups were one turn: two calls in one answer


def test_the_readme_lists_exactly_the_agents_that_ship() -> None:
    """The README's list of shipped agents and its list of tool agents agree with agents/."""
    import importlib
    import pkgutil
    import re
    from pathlib import Path

    import orchestrator.agents
    from orchestrator.agent.steps import Agent
    from orchestrator.agent.tool_loop import ToolAgent

    shipped: dict[str, object] = {}
    for module in pkgutil.iter_modules(orchestrator.agents.__path__):
        for value in vars(importlib.import_module(f"orchestrator.agents.{module.name}")).values():
            if isinstance(value, Agent | ToolAgent):
                shipped[value.name] = value
    readme = " ".join((Path(__file__).parent.parent / "README.md").read_text().split())

    def names_after(start: str) -> set[str]:
        sentence = readme[readme.index(start) :].split(". ")[0]
        return set(re.findall(r"`([a-z_]+)`", sentence))

    assert names_after("`agents/` ships") == set(shipped)
    tool_agents = {name for name, agent in shipped.items() if isinstance(agent, ToolAgent)}
    assert names_after("The two tool agents in `agents/`") == tool_agents


TEST_DOUBLES = ("orchestrator.testing.loopback", "orchestrator.testing")


def test_shipped_agents_import_no_test_doubles() -> None:
    """agents/ shows agents as their authors write them: the local scripted model, vendors and
    worker harnesses of the tests stay out of them."""
    found = []
    for path in sorted((Path(__file__).parent.parent / "agents").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [alias.name for alias in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            found += [f"{path.name}: {name}" for name in names if name.startswith(TEST_DOUBLES)]
    assert found == []
