"""``orchestrator console``: a server-rendered web console over the same tables the CLI reads.

Read-only unless a token is configured; with one, a signed-in person (or an API client holding
the bearer token) can approve, deny and resolve effects. Contents (run inputs, results, messages,
payloads) are hidden unless the console was started with ``--show-payloads``.
"""
