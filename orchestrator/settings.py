"""Settings from ``ORCHESTRATOR_*`` environment variables, overridable by CLI flags."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from enum import StrEnum
from pathlib import Path
from typing import TypeVar
from urllib.parse import urlsplit

from orchestrator.errors import InvalidInput


class StandbyWait(StrEnum):
    """Which standbys must hold a record before it is acted on."""

    ANY = "any"
    """One physical standby (one that is promoted; Patroni promotes the most advanced)."""
    ALL = "all"
    """Every connected physical standby, and every physical replication slot has one."""
    OFF = "off"
    """Never wait: a failover may take back a record whose effect was sent (lookups then)."""


class StandbyPosition(StrEnum):
    """How far a standby must have the record: flushed to its disk (enough for a promotion,
    which replays everything flushed) or replayed (readable there)."""

    FLUSH = "flush"
    REPLAY = "replay"


class WithoutStandby(StrEnum):
    """What a dispatcher does while a standby it expects is not connected."""

    HOLD = "hold"
    """Send nothing and report not ready until one streams again."""
    SEND = "send"
    """Send as a lone primary, with a warning and a metric (a failover may repeat a send)."""


@dataclass(frozen=True)
class StandbyPolicy:
    wait: StandbyWait = StandbyWait.ANY
    position: StandbyPosition = StandbyPosition.FLUSH
    without: WithoutStandby = WithoutStandby.HOLD

    def __post_init__(self) -> None:
        # Given as text ("all"), each choice must still compare by identity below.
        object.__setattr__(self, "wait", _choice(StandbyWait, self.wait, "--standby-wait"))
        object.__setattr__(
            self, "position", _choice(StandbyPosition, self.position, "--standby-position")
        )
        object.__setattr__(
            self, "without", _choice(WithoutStandby, self.without, "--without-standby")
        )

    @classmethod
    def parse(
        cls,
        wait: str,
        position: str,
        without: str,
        *,
        names: tuple[str, str, str] = ("--standby-wait", "--standby-position", "--without-standby"),
    ) -> StandbyPolicy:
        """From option values; a bad one is a one-line ``InvalidInput`` naming where it came
        from (``names``: the options, or the environment variables) and the choices."""
        return cls(
            _choice(StandbyWait, wait, names[0]),
            _choice(StandbyPosition, position, names[1]),
            _choice(WithoutStandby, without, names[2]),
        )


E = TypeVar("E", bound=StrEnum)


def _choice(kind: type[E], value: str, option: str) -> E:
    try:
        return kind(str(value).strip().lower())
    except ValueError:
        choices = ", ".join(member.value for member in kind)
        raise InvalidInput(f"{option} must be one of {choices}, not {value!r}") from None


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


def _flag(environ: Mapping[str, str], name: str) -> bool:
    raw = (environ.get(name) or "").strip().lower()
    if raw in ("", "0", "false", "no", "off"):
        return False
    if raw in ("1", "true", "yes", "on"):
        return True
    raise InvalidInput(f"{name}={raw!r} is not a yes/no value: use 1 or 0")


DSN_SCHEMES = ("postgresql", "postgres")
DEFAULT_SCHEMA = "orchestrator"
_SCHEMA_NAME = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")


def check_schema_name(name: str) -> str:
    """``name`` if it is a plain lower-case PostgreSQL identifier (no quoting ever needed)."""
    if not _SCHEMA_NAME.fullmatch(name) or name.startswith("pg_"):
        raise InvalidInput(
            f"ORCHESTRATOR_SCHEMA={name!r} is not a usable schema name: 1-63 lower-case letters, "
            "digits and _, starting with a letter or _, and not pg_..."
        )
    return name


def check_database_url(url: str) -> str:
    """``url`` if it is a PostgreSQL URL whose ports are numbers in 0-65535 (several
    ``host:port`` pairs, comma-separated, name a multi-host server as libpq allows)."""
    hint = "expected postgresql://USER:PASSWORD@HOST:PORT/DATABASE"
    if "\x00" in url or not url.isprintable():
        raise InvalidInput(f"ORCHESTRATOR_DATABASE_URL holds control characters; {hint}")
    try:
        parts = urlsplit(url)
    except ValueError as error:
        raise InvalidInput(f"ORCHESTRATOR_DATABASE_URL is not a URL ({error}); {hint}") from None
    if parts.scheme not in DSN_SCHEMES:
        raise InvalidInput(
            f"ORCHESTRATOR_DATABASE_URL must start with postgresql:// (got "
            f"{(parts.scheme + '://') if parts.scheme else 'no scheme'}); {hint}"
        )
    hosts = parts.netloc.rpartition("@")[2]
    for host in hosts.split(","):
        port = host.rpartition("]")[2] if host.startswith("[") else host
        _, colon, number = port.rpartition(":")
        if colon and number and not (number.isdigit() and int(number) <= 65535):
            raise InvalidInput(
                f"ORCHESTRATOR_DATABASE_URL has port {number!r}; a port is a number in 0-65535"
            )
    return url


STANDBY_VARIABLES = (
    "ORCHESTRATOR_STANDBY_WAIT",
    "ORCHESTRATOR_STANDBY_POSITION",
    "ORCHESTRATOR_WITHOUT_STANDBY",
)


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
    schema: str = DEFAULT_SCHEMA
    """The PostgreSQL schema holding every table, function and index of orchestrator."""
    require_sync_standby: bool = False
    """Refuse to start, report not ready and send no effect while the primary does not
    replicate synchronously (``--require-sync-standby``; docs/high-availability.md)."""
    standby: StandbyPolicy = field(default_factory=StandbyPolicy)
    """Where the primary has streaming standbys, a dispatcher sends an effect only once one
    holds its claim (``--standby-wait``, ``--standby-position``, ``--without-standby``;
    docs/high-availability.md)."""
    proxy_fence_store: Path | None = None
    """The action proxy's own SQLite file of the highest fence it accepted per run
    (``effects serve --fence-store``). None: the proxy keeps no such record and checks fences
    against the database alone, as before."""

    def __post_init__(self) -> None:
        if self.database_url is not None:
            check_database_url(self.database_url)
        check_schema_name(self.schema)
        if not isinstance(self.standby, StandbyPolicy):
            raise InvalidInput(
                f"Settings.standby must be a StandbyPolicy, not {self.standby!r}: e.g. "
                "StandbyPolicy(wait='all') (orchestrator.db.standby_wait)"
            )

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
            schema=env.get("ORCHESTRATOR_SCHEMA") or DEFAULT_SCHEMA,
            require_sync_standby=_flag(env, "ORCHESTRATOR_REQUIRE_SYNC_STANDBY"),
            standby=StandbyPolicy.parse(
                env.get("ORCHESTRATOR_STANDBY_WAIT") or StandbyWait.ANY,
                env.get("ORCHESTRATOR_STANDBY_POSITION") or StandbyPosition.FLUSH,
                env.get("ORCHESTRATOR_WITHOUT_STANDBY") or WithoutStandby.HOLD,
                names=STANDBY_VARIABLES,
            ),
            proxy_fence_store=Path(env["ORCHESTRATOR_PROXY_FENCE_STORE"])
            if env.get("ORCHESTRATOR_PROXY_FENCE_STORE")
            else None,
        )

    def with_overrides(self, **changes: object) -> Settings:
        present = {key: value for key, value in changes.items() if value is not None}
        return replace(self, **present)  # type: ignore[arg-type]
