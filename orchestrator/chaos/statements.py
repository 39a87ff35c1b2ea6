"""How the campaign's own statements meet PostgreSQL while faults act on it: the application
name the faults spare, how long a statement may take, and which errors mean "look again"."""

from __future__ import annotations

from orchestrator.db.deadlines import DATABASE_ERRORS
from orchestrator.errors import OrchestratorError

CAMPAIGN_ERRORS: tuple[type[BaseException], ...] = (*DATABASE_ERRORS, OrchestratorError)
"""What a fault (or the campaign's person) may meet: the database restarting or backends being
terminated, or no run to act on."""
STATEMENT_SECONDS = 5.0
CAMPAIGN_APPLICATION = "chaos-campaign"
"""The campaign's own connections, which its faults leave alone."""
