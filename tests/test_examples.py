"""The examples in examples/ run as a user runs them (other examples have their own tests)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import anyio
import pytest

pytestmark = pytest.mark.slow

EXAMPLES = Path(__file__).parent.parent / "examples"


async def test_the_scripted_model_example_runs_a_tool_agent_through_a_429(
    database_url: str,
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OPENAI_")}
    with anyio.fail_after(120):
        finished = await anyio.run_process(
            [sys.executable, str(EXAMPLES / "scripted_model.py")],
            env={**env, "ORCHESTRATOR_DATABASE_URL": database_url},
            check=False,
        )
    assert finished.returncode == 0, finished.stderr.decode()
    printed = json.loads(finished.stdout.decode().strip().splitlines()[-1])
    assert printed["state"] == "succeeded", printed
    assert printed["result"]["output"] == "Order o-17 has shipped."
    assert printed["model_answered"] == ["429", "tool_calls", "text"]


async def test_the_mcp_example_offers_classified_tools_and_sends_its_effect_once(
    database_url: str,
) -> None:
    pytest.importorskip("mcp")
    env = {k: v for k, v in os.environ.items() if not k.startswith("OPENAI_")}
    with anyio.fail_after(120):
        finished = await anyio.run_process(
            [sys.executable, str(EXAMPLES / "mcp_tickets.py")],
            env={**env, "ORCHESTRATOR_DATABASE_URL": database_url},
            check=False,
        )
    stderr = finished.stderr.decode()
    assert finished.returncode == 0, stderr
    printed = json.loads(finished.stdout.decode().strip().splitlines()[-1])
    assert printed == {
        "state": "succeeded",
        "output": "I opened ticket T-1 for your damaged order.",
        "error": None,
    }
    opened = [line for line in stderr.splitlines() if line.startswith('{"opened"')]
    assert opened == ['{"opened": {"id": "T-1", "title": "o-17 arrived damaged"}}']


async def test_the_pydantic_ai_example_runs_an_existing_agent_with_one_send_per_key(
    database_url: str,
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OPENAI_")}
    with anyio.fail_after(120):
        finished = await anyio.run_process(
            [sys.executable, str(EXAMPLES / "pydantic_ai_agent.py")],
            env={**env, "ORCHESTRATOR_DATABASE_URL": database_url},
            check=False,
        )
    assert finished.returncode == 0, finished.stderr.decode()
    printed = json.loads(finished.stdout.decode().strip().splitlines()[-1])
    assert printed["state"] == "succeeded", printed
    assert printed["result"]["output"] == "Order o-17 has shipped; the CRM is noted."
    assert printed["model_answered"] == ["tool_calls", "tool_calls", "text"]
    assert printed["vendor_requests_per_key"] == [1]
