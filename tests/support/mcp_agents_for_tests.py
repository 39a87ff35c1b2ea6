"""The MCP tool agent of the process tests (importable by `serve` subprocesses): the tickets
server classified as ``MCP_TEST_CLASSIFICATION`` (a JSON file) says."""

from __future__ import annotations

import os

from orchestrator.agent.mcp.tools import load_classification
from orchestrator.agent.tool_loop import ToolAgent

mcp_tickets = ToolAgent(
    "mcp_tickets",
    instructions="You help with orders through the tickets server.",
    tools=load_classification(os.environ["MCP_TEST_CLASSIFICATION"]),
    max_turns=6,
)
