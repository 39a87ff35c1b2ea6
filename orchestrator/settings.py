"""Settings from ``ORCHESTRATOR_*`` environment variables, overridable by CLI flags."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

from orchestrator.errors import InvalidInput

DEFAULT_MAX_INPUT_BYTES = 1024 * 1024


def _positive_number(environ: Mapping[str, str], name: str, default: float) -> float:
    raw = environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise InvalidInput(f"{name}={raw!r} is not a number") from None
    if value <= 0:
        raise InvalidInput(f"{name}={raw!r} must be greater than zero")
    return value


@dataclass(frozen=True)
class Settings:
    """Process-wide configuration.

    ``database_url`` unset means: use (and if needed start) the embedded PostgreSQL whose data
    lives under ``home``, shared by every orchestrator process that uses the same home.
    """

    database_url: str | None = None
    home: Path = Path(".orchestrator")
    max_input_bytes: int = DEFAULT_MAX_INPUT_BYTES
    statement_timeout_seconds: float = 30.0
    connect_timeout_seconds: float = 10.0

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings:
        env = os.environ if environ is None else environ
        return cls(
            database_url=env.get("ORCHESTRATOR_DATABASE_URL") or None,
            home=Path(env.get("ORCHESTRATOR_HOME") or ".orchestrator"),
            max_input_bytes=int(
                _positive_number(env, "ORCHESTRATOR_MAX_INPUT_BYTES", DEFAULT_MAX_INPUT_BYTES)
            ),
            statement_timeout_seconds=_positive_number(
                env, "ORCHESTRATOR_STATEMENT_TIMEOUT_SECONDS", 30.0
            ),
            connect_timeout_seconds=_positive_number(
                env, "ORCHESTRATOR_CONNECT_TIMEOUT_SECONDS", 10.0
            ),
        )

    def with_overrides(self, **changes: object) -> Settings:
        present = {key: value for key, value in changes.items() if value is not None}
        return replace(self, **present)  # type: ignore[arg-type]
