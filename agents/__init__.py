"""Example agents shipped with orchestrator (installed as ``orchestrator.agents``)."""
