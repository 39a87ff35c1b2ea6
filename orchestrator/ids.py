"""Run ids: time-ordered, URL- and shell-safe, validated at every entry point."""

from __future__ import annotations

import os
import re
import time

from orchestrator.errors import InvalidInput

_CROCKFORD = "0123456789abcdefghjkmnpqrstvwxyz"
RUN_ID_PATTERN = re.compile(r"^[A-Za-z][A-Za-z0-9_.:-]{0,127}$")
AGENT_NAME_PATTERN = re.compile(r"^[A-Za-z][A-Za-z0-9_.-]{0,63}$")


def new_run_id() -> str:
    """``r_`` + a ULID (48-bit millisecond time, 80 random bits) in lower-case Crockford base32.

    Time-ordered ids keep the primary-key index append-mostly and sort runs by submission.
    """
    value = (time.time_ns() // 1_000_000) << 80 | int.from_bytes(os.urandom(10), "big")
    chars = []
    for _ in range(26):
        chars.append(_CROCKFORD[value & 31])
        value >>= 5
    return "r_" + "".join(reversed(chars))


def validate_run_id(run_id: str) -> str:
    return _matching(
        RUN_ID_PATTERN,
        run_id,
        f"malformed run id {run_id!r}: a run id is 1-128 characters, starts with a letter and "
        "holds only letters, digits and _ . : - (for example r_01jd3k5q8m2x7c9v4b6n0p1r2s)",
    )


def validate_agent_name(agent: str) -> str:
    return _matching(
        AGENT_NAME_PATTERN,
        agent,
        f"malformed agent name {agent!r}: an agent name is 1-64 characters, starts with a "
        "letter and holds only letters, digits and _ . -",
    )


def _matching(pattern: re.Pattern[str], value: str, problem: str) -> str:
    if not pattern.fullmatch(value):
        raise InvalidInput(problem)
    return value


_VERSION = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,63}$")


def agent_version_text(version: object, what: str = "an agent version") -> str:
    """A version as stored: a whole number from 1, or text of 1-64 letters, digits and ._+-."""
    if isinstance(version, bool) or not isinstance(version, int | str):
        raise InvalidInput(f"{what} is a whole number or text, not {version!r}")
    if isinstance(version, int):
        if version < 1:
            raise InvalidInput(f"{what} must be 1 or more, not {version!r}")
        return str(version)
    if not _VERSION.fullmatch(version):
        raise InvalidInput(
            f"{what} is 1-64 letters, digits and ._+- starting with a letter or digit, "
            f"not {version!r}"
        )
    return version
