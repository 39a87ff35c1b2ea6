"""Adapters that run agents written with other frameworks on orchestrator (optional extras)."""
