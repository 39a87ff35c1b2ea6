"""Which vendor answers each effect kind: the dispatcher's configuration, read into adapters.

It sits above both the built-in adapters and the MCP adapter, so that neither imports the other.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from orchestrator.effects.adapters import Adapter
from orchestrator.errors import InvalidInput


def load_adapters(path: str | Path | None = None) -> dict[str, Adapter]:
    """Vendors from a JSON file (``ORCHESTRATOR_EFFECTS_CONFIG``): ``{"kinds": {KIND: {...}}}``.

    Example: ``{"kinds": {"email": {"adapter": "smtp", "host": "127.0.0.1", "port": 2525,
    "sender": "agents@example.com"}, "crm": {"adapter": "http", "url": "https://…",
    "token_env": "CRM_TOKEN", "reconcile": "lookup", "lookup_url": "https://…/{idempotency_key}"}}}``
    """
    location = path or os.environ.get("ORCHESTRATOR_EFFECTS_CONFIG")
    if not location:
        return {}
    try:
        document = json.loads(Path(location).read_text("utf-8"))
    except OSError as error:
        raise InvalidInput(f"cannot read effects config {location}: {error.strerror}") from None
    except json.JSONDecodeError as error:
        raise InvalidInput(f"effects config {location} is not valid JSON: {error.msg}") from None
    kinds = document.get("kinds") if isinstance(document, dict) else None
    if not isinstance(kinds, dict):
        raise InvalidInput(f'effects config {location} must be {{"kinds": {{KIND: {{...}}}}}}')
    try:
        return {kind: adapter_from_config(kind, options) for kind, options in kinds.items()}
    except (TypeError, ValueError) as error:
        raise InvalidInput(f"effects config {location}: {error}") from None


def adapter_from_config(kind: str, config: dict[str, Any]) -> Adapter:
    """Build an adapter from one entry of the dispatcher's vendor configuration."""
    options = dict(config)
    adapter = options.pop("adapter", None)
    # Each vendor's module is imported only when a kind uses it (the mcp one needs its extra).
    if adapter == "http":
        from orchestrator.effects.http import HttpAdapter

        return HttpAdapter(kind, **options)
    if adapter == "smtp":
        from orchestrator.effects.smtp import SmtpAdapter

        return SmtpAdapter(kind, **options)
    if adapter == "mcp":
        from orchestrator.effects.mcp import McpAdapter

        return McpAdapter(kind, **options)
    raise ValueError(
        f"effect kind {kind!r}: adapter must be 'http', 'smtp' or 'mcp', not {adapter!r}"
    )
