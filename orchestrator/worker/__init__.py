"""The worker runtime: claiming, run executions, heartbeats, group commit (asyncio)."""
