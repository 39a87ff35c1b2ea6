"""Evidence of the fences workers ran under, kept where a failover cannot take it back.

A promoted standby may lack the lost primary's last transactions, claims included, so the new
primary's timeline cannot show that a (run, fence) was handed out twice. Each chaos worker's
agents therefore append the (run, fence) of every step they start to a file of the process's own
(``GRANTS_DIR_ENV``/``<member name>.jsonl``; the member name includes its generation, so one
file is one process). After the campaign the checker reads them beside the database's claims:
a (run, fence) that two processes ran under, or that one process ran under twice (its steps
start over: a checkpoint version not above the one before), was granted twice.
"""

from __future__ import annotations

import collections
import json
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

GRANTS_DIR_ENV = "ORCHESTRATOR_CHAOS_GRANTS_DIR"
MEMBER_ENV = "ORCHESTRATOR_CHAOS_MEMBER"
"""The process's member name (``chaos-w1.g2``), set by the campaign's cluster."""


@dataclass(frozen=True)
class Grant:
    """One step (or read-only tool) a process started under a (run, fence)."""

    run_id: str
    fence: int
    holder: str
    """The process: its member name with generation."""
    seq: int
    """The checkpoint version the step read (a tool: its turn); it grows within one claim."""
    what: str


@dataclass(frozen=True)
class Duplicate:
    run_id: str
    fence: int
    detail: str


def record_grant(run_id: str, fence: int, seq: int, what: str) -> None:
    """Append one grant to this process's file; nothing outside a campaign. One ``write`` of
    a short line to an ``O_APPEND`` file: a process killed mid-campaign leaves whole lines."""
    directory = os.environ.get(GRANTS_DIR_ENV)
    holder = os.environ.get(MEMBER_ENV)
    if not directory or not holder:
        return
    line = json.dumps(
        {"run": run_id, "fence": fence, "holder": holder, "seq": seq, "what": what},
        separators=(",", ":"),
    )
    descriptor = os.open(
        os.path.join(directory, f"{holder}.jsonl"), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644
    )
    try:
        os.write(descriptor, (line + "\n").encode())
    finally:
        os.close(descriptor)


def read_grants(directory: Path) -> list[Grant]:
    """Every grant recorded under ``directory``, each file in its own (the process's) order."""
    grants = []
    for path in sorted(directory.glob("*.jsonl")):
        for line in path.read_text(errors="replace").splitlines():
            try:
                value = json.loads(line)
                grants.append(
                    Grant(
                        str(value["run"]),
                        int(value["fence"]),
                        str(value["holder"]),
                        int(value["seq"]),
                        str(value["what"]),
                    )
                )
            except (ValueError, KeyError, TypeError):
                continue  # not a grant line: nothing to compare
    return grants


def duplicate_grants(
    grants: Iterable[Grant], claims: Iterable[tuple[str, int, str | None]]
) -> list[Duplicate]:
    """Each (run, fence) granted more than once: to two processes (by the evidence or by the
    database's ``claimed`` events, given as (run, fence, worker)), or twice to one process.

    ``grants`` must keep each holder's order (``read_grants`` does).
    """
    holders: dict[tuple[str, int], set[str]] = collections.defaultdict(set)
    again: dict[tuple[str, int], str] = {}
    last: dict[tuple[str, int, str], Grant] = {}
    for grant in grants:
        key = (grant.run_id, grant.fence)
        holders[key].add(grant.holder)
        previous = last.get((*key, grant.holder))
        if previous is not None and grant.seq <= previous.seq and key not in again:
            again[key] = (
                f"{grant.holder} ran {grant.what} at version {grant.seq} after {previous.what} "
                f"at version {previous.seq}: granted to it twice"
            )
        last[(*key, grant.holder)] = grant
    for run_id, fence, worker in claims:
        if worker:
            holders[(run_id, fence)].add(worker)
    found = []
    for key in sorted(holders.keys() | again.keys()):
        names = sorted(holders[key])
        if len(names) > 1:
            found.append(Duplicate(*key, f"granted to {' and '.join(names)}"))
        elif key in again:
            found.append(Duplicate(*key, again[key]))
    return found
