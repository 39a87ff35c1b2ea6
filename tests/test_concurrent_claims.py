"""Many claimers in several OS processes over ~1000 runs: one owner at a time, fences grow by one.

The claimer processes (``tests/support/claimer_process.py loop``) write one JSON line per action
with the database-clock times of what they were granted. From those records alone the test rebuilds,
for every (run, fence), the interval during which that lease could have been valid:

- start: the instant the claim's UPDATE computed ``lease_until`` (``lease_until - lease``; the
  lease lengths are exact in microseconds), a lower bound of when ownership began;
- end: the last ``lease_until`` granted (by the claim or a renewal), or, when the owner finished,
  failed, failed an attempt or released the run, the database clock read inside that same
  transaction, whichever is earlier. This is an upper bound of validity that still precedes any
  claim able to see the run free.

Validity is half-open, ``[start, end)``: at ``lease_until`` the lease is already expired. The
records are then cross-checked against the store's own ``run_events`` and final rows.

Set ``CLAIMER_SQL_MUTATION="claim_due|AND lease_until < clock_timestamp()|"`` to run the claimers
with a claim that ignores lease expiry: the test must then fail on overlapping leases.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import random
import sys
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from orchestrator.db.store import RunStore

CLAIMER = Path(__file__).parent / "support" / "claimer_process.py"
AGENT = "lease-test"
RUNS = 1000
PROCESSES = 4
TASKS_PER_PROCESS = 8
PROCESS_SECONDS = 40.0
"""Each claimer stops by then even if runs remain (the test then drains them itself)."""
PROCESS_TIMEOUT = 75.0
"""Claimers still alive by then are killed and the test fails."""
TERMINAL = {"succeeded", "failed", "cancelled", "dead"}


def when(value: str) -> datetime:
    return datetime.fromisoformat(value)


@dataclass
class Tenure:
    """One fence's lease on one run, as its worker saw it."""

    run_id: str
    fence: int
    worker: str
    start: datetime
    end: datetime
    ended_by: str | None = None
    commits: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class Ledger:
    """Every claimer record, folded into tenures; violations found while folding."""

    tenures: dict[tuple[str, int], Tenure] = field(default_factory=dict)
    claims: list[dict[str, Any]] = field(default_factory=list)
    versions: dict[str, list[tuple[int, int]]] = field(default_factory=lambda: defaultdict(list))
    ends: list[dict[str, Any]] = field(default_factory=list)
    claim_dead_letters: list[dict[str, Any]] = field(default_factory=list)
    kinds: Counter[str] = field(default_factory=Counter)
    paused_attempts: int = 0
    violations: list[str] = field(default_factory=list)

    def fold(self, record: dict[str, Any]) -> None:
        kind = record["type"]
        self.kinds[kind] += 1
        if kind == "claim_dead_lettered":
            self.claim_dead_letters.append(record)
            return
        key = (record["run"], record["fence"])
        if kind == "claim":
            self.claims.append(record)
            if key in self.tenures:
                self.violations.append(f"fence {key} was granted twice: {record}")
                return
            lease_until = when(record["lease_until"])
            start = lease_until - timedelta(seconds=record["lease_seconds"])
            # claimed_at is read in the same statement, just after lease_until was computed.
            if when(record["claimed_at"]) < start:
                self.violations.append(f"claimed_at precedes the lease grant: {record}")
            self.tenures[key] = Tenure(
                record["run"], record["fence"], record["worker"], start, lease_until
            )
            return
        tenure = self.tenures.get(key)
        if tenure is None or tenure.worker != record["worker"]:
            self.violations.append(f"{kind} by a worker that was never granted {key}: {record}")
            return
        if record.get("paused"):
            self.paused_attempts += 1
        if kind == "abandon" or not record["ok"]:
            return
        # A successful action proves the lease was valid when its statement ran, which was after
        # `before`: so `before` must precede the end of validity known so far.
        if tenure.ended_by is not None:
            self.violations.append(f"{kind} succeeded after {tenure.ended_by}: {record}")
        if when(record["before"]) >= tenure.end:
            self.violations.append(
                f"{kind} succeeded although the lease had expired at {tenure.end}: {record}"
            )
        if kind == "renew":
            tenure.end = when(record["lease_until"])
        elif kind == "commit":
            tenure.commits.append(record)
            self.versions[record["run"]].append((record["version"], record["fence"]))
            if record["version"] != record["expected"] + 1:
                self.violations.append(f"commit skipped a version: {record}")
        else:
            self.ends.append(record)
            tenure.end = min(tenure.end, when(record["at"]))
            tenure.ended_by = kind
            if record["version"] is not None:
                self.versions[record["run"]].append((record["version"], record["fence"]))


async def submit_runs(store: RunStore, count: int) -> list[str]:
    rng = random.Random(count)
    run_ids: list[str] = []
    for offset in range(0, count, 50):
        submissions = await asyncio.gather(
            *(
                store.submit(AGENT, {"n": index}, max_attempts=rng.randint(2, 5))
                for index in range(offset, min(offset + 50, count))
            )
        )
        run_ids.extend(submission.run.run_id for submission in submissions)
    return run_ids


async def run_claimers(database_url: str, directory: Path, seed: int) -> list[Path]:
    env = {**os.environ, "ORCHESTRATOR_DATABASE_URL": database_url}
    outputs = [directory / f"claimer-{index}.jsonl" for index in range(PROCESSES)]
    processes = [
        await asyncio.create_subprocess_exec(
            sys.executable,
            str(CLAIMER),
            "loop",
            "--worker-id",
            f"p{index}",
            "--tasks",
            str(TASKS_PER_PROCESS),
            "--seconds",
            str(PROCESS_SECONDS),
            "--seed",
            str(seed + index),
            "--output",
            str(output),
            env=env,
        )
        for index, output in enumerate(outputs)
    ]
    try:
        codes = await asyncio.wait_for(
            asyncio.gather(*(process.wait() for process in processes)), PROCESS_TIMEOUT
        )
    finally:
        for process in processes:
            if process.returncode is None:
                process.kill()
                await process.wait()
    assert codes == [0] * PROCESSES, f"claimer processes exited with {codes}"
    return outputs


async def drain(store: RunStore, run_count: int) -> list[dict[str, Any]]:
    """Claim and finish whatever the claimers left: proof that no run was lost."""
    records: list[dict[str, Any]] = []
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 30.0
    while True:
        left = await store.pool.fetchval(
            "SELECT count(*) FROM runs WHERE state <> ALL($1::text[])", list(TERMINAL)
        )
        if left == 0:
            return records
        assert loop.time() < deadline, f"{left} runs never became claimable again"
        batch = await store.claim("drain", [AGENT], limit=run_count, lease_seconds=30.0)
        for run_id in batch.dead_lettered:
            records.append({"type": "claim_dead_lettered", "run": run_id, "worker": "drain"})
        for claimed in batch.claimed:
            records.append(
                {
                    "type": "claim",
                    "run": claimed.run_id,
                    "fence": claimed.fence,
                    "worker": "drain",
                    "lease_seconds": 30.0,
                    "claimed_at": claimed.claimed_at.isoformat(),
                    "lease_until": claimed.lease_until.isoformat(),
                    "previous_owner": claimed.previous_owner,
                    "previous_lease_until": (
                        None
                        if claimed.previous_lease_until is None
                        else claimed.previous_lease_until.isoformat()
                    ),
                    "attempt": claimed.attempt,
                    "version": claimed.checkpoint_version,
                }
            )
            before = await store.database_now()
            assert await store.finish(claimed.lease, expected_version=claimed.checkpoint_version)
            records.append(
                {
                    "type": "finish",
                    "run": claimed.run_id,
                    "fence": claimed.fence,
                    "worker": "drain",
                    "ok": True,
                    "before": before.isoformat(),
                    "at": (await store.database_now()).isoformat(),
                    "outcome": None,
                    "version": claimed.checkpoint_version + 1,
                }
            )
        if not batch.claimed and not batch.dead_lettered:
            await asyncio.sleep(0.1)


def check_leases(ledger: Ledger, runs: dict[str, asyncpg.Record]) -> list[str]:
    """(a) no overlap in DB time, (b) fences 1, 2, 3… and (c) commits by the current fence."""
    problems: list[str] = []
    by_run: dict[str, list[Tenure]] = defaultdict(list)
    for tenure in ledger.tenures.values():
        by_run[tenure.run_id].append(tenure)
    claims_by_key = {(claim["run"], claim["fence"]): claim for claim in ledger.claims}
    for run_id, row in runs.items():
        tenures = sorted(by_run.get(run_id, []), key=lambda tenure: tenure.fence)
        fences = [tenure.fence for tenure in tenures]
        if fences != list(range(1, len(fences) + 1)):
            problems.append(f"{run_id}: claimed fences {fences} are not 1, 2, 3…")
        if row["fence"] != len(fences):
            problems.append(f"{run_id}: stored fence {row['fence']} after {len(fences)} claims")
        for previous, current in itertools.pairwise(tenures):
            if not previous.end <= current.start:
                problems.append(
                    f"{run_id}: fence {previous.fence} ({previous.worker}) valid until "
                    f"{previous.end}, but fence {current.fence} ({current.worker}) was granted at "
                    f"{current.start}: two owners at once"
                )
            for commit in previous.commits:
                if not when(commit["inside"]) <= current.start:
                    problems.append(
                        f"{run_id}: fence {previous.fence} committed version {commit['version']} "
                        f"after fence {current.fence} was granted"
                    )
            claim = claims_by_key[(run_id, current.fence)]
            if claim["previous_owner"] is not None:
                # Taken over on expiry: the store's view of the old lease must be exactly the last
                # lease_until its owner was granted (a renewal we did not see would show here).
                if previous.ended_by is not None or claim["previous_owner"] != previous.worker:
                    problems.append(f"{run_id}: takeover of a lease that had ended: {claim}")
                elif when(claim["previous_lease_until"]) != previous.end:
                    problems.append(
                        f"{run_id}: fence {current.fence} took over a lease valid until "
                        f"{claim['previous_lease_until']}, but its owner was last granted "
                        f"{previous.end}"
                    )
            elif previous.ended_by not in ("release", "fail_attempt"):
                problems.append(
                    f"{run_id}: fence {current.fence} claimed with no previous owner, but fence "
                    f"{previous.fence} ended by {previous.ended_by or 'expiry'}"
                )
        versions = sorted(ledger.versions.get(run_id, []))
        numbers = [version for version, _ in versions]
        if numbers != list(range(1, len(numbers) + 1)):
            problems.append(f"{run_id}: committed checkpoint versions {numbers} are not 1, 2, 3…")
        if [fence for _, fence in versions] != sorted(fence for _, fence in versions):
            problems.append(f"{run_id}: a lower fence committed after a higher one: {versions}")
        if row["checkpoint_version"] != len(numbers):
            problems.append(
                f"{run_id}: stored checkpoint version {row['checkpoint_version']}, "
                f"but {len(numbers)} commits succeeded"
            )
    return problems


def check_events(
    ledger: Ledger, events: list[asyncpg.Record], runs: dict[str, asyncpg.Record]
) -> list[str]:
    """The store's own timeline must tell the same story as the claimers' records."""
    problems: list[str] = []
    timeline: dict[str, list[asyncpg.Record]] = defaultdict(list)
    for event in events:
        timeline[event["run_id"]].append(event)

    claimed_events = Counter(
        (event["run_id"], event["fence"], event["worker_id"], when(event["details"]["lease_until"]))
        for event in events
        if event["kind"] == "claimed"
    )
    claimed_records = Counter(
        (claim["run"], claim["fence"], claim["worker"], when(claim["lease_until"]))
        for claim in ledger.claims
    )
    if claimed_events != claimed_records:
        problems.append(
            f"claimed events and claim records differ: only in events "
            f"{list((claimed_events - claimed_records).elements())[:5]}, only in records "
            f"{list((claimed_records - claimed_events).elements())[:5]}"
        )
    for run_id, run_events in timeline.items():
        fences = [event["fence"] for event in run_events if event["kind"] == "claimed"]
        if fences != list(range(1, len(fences) + 1)):
            problems.append(f"{run_id}: claimed events carry fences {fences}")
        if (
            run_events[-1]["kind"] not in ("succeeded", "failed", "dead_lettered", "cancelled")
            and runs[run_id]["state"] in TERMINAL
        ):
            problems.append(f"{run_id}: finished, but its timeline ends with {run_events[-1]}")

    checkpoint_events = Counter(
        (event["run_id"], event["fence"], event["worker_id"], event["details"]["version"])
        for event in events
        if event["kind"] == "checkpoint"
    )
    commit_records = Counter(
        (commit["run"], commit["fence"], commit["worker"], commit["version"])
        for tenure in ledger.tenures.values()
        for commit in tenure.commits
    )
    if checkpoint_events != commit_records:
        problems.append("checkpoint events and successful commit records differ")

    event_kind = {"finish": "succeeded", "fail": "failed", "release": "released"}
    ending_events = {
        (event["run_id"], event["fence"], event["worker_id"], event["kind"]): event
        for event in events
    }
    for end in ledger.ends:
        kind = event_kind.get(end["type"]) or (
            "dead_lettered" if end["outcome"] == "dead" else "retry_scheduled"
        )
        logged = ending_events.get((end["run"], end["fence"], end["worker"], kind))
        if logged is None:
            problems.append(f"no {kind} event for {end}")
        elif not when(end["before"]) <= logged["at"] <= when(end["at"]):
            problems.append(f"{kind} event at {logged['at']} is outside its action: {end}")
    expected_dead = Counter(
        (record["run"], record["worker"]) for record in ledger.claim_dead_letters
    ) + Counter(
        (end["run"], end["worker"])
        for end in ledger.ends
        if end["type"] == "fail_attempt" and end["outcome"] == "dead"
    )
    dead_events = Counter(
        (event["run_id"], event["worker_id"])
        for event in events
        if event["kind"] == "dead_lettered"
    )
    if dead_events != expected_dead:
        problems.append("dead_lettered events and dead-letter records differ")
    return problems


@pytest.mark.slow
async def test_concurrent_claimers_never_share_a_run(
    store: RunStore, database_url: str, tmp_path: Path
) -> None:
    seed = random.randrange(1_000_000)
    print(f"claimer seed {seed}")
    run_ids = await submit_runs(store, RUNS)

    outputs = await run_claimers(database_url, tmp_path, seed)
    ledger = Ledger()
    per_process: Counter[int] = Counter()
    for index, output in enumerate(outputs):
        for line in output.read_text(encoding="utf-8").splitlines():
            record = json.loads(line)
            ledger.fold(record)
            per_process[index] += record["type"] == "claim"
    left_by_claimers = await store.pool.fetchval(
        "SELECT count(*) FROM runs WHERE state <> ALL($1::text[])", list(TERMINAL)
    )
    # (d) No run lost: whatever the claimers left is claimable, and gets finished here.
    for record in await drain(store, RUNS):
        ledger.fold(record)

    rows = await store.pool.fetch("SELECT * FROM runs")
    runs = {row["run_id"]: row for row in rows}
    assert sorted(runs) == sorted(run_ids)
    assert {row["state"] for row in rows} <= TERMINAL
    events = await store.pool.fetch(
        "SELECT run_id, kind, fence, worker_id, at, details FROM run_events ORDER BY event_id"
    )

    problems = ledger.violations + check_leases(ledger, runs) + check_events(ledger, events, runs)
    assert not problems, f"{len(problems)} problems, first ones:\n" + "\n".join(problems[:15])

    # (e) Enough contention happened for the checks above to mean something.
    claims = len(ledger.claims)
    takeovers = [claim for claim in ledger.claims if claim["previous_owner"] is not None]
    cross_process = [claim for claim in takeovers if claim["previous_owner"] != claim["worker"]]
    reclaimed_runs = {claim["run"] for claim in ledger.claims if claim["fence"] > 1}
    states = Counter(row["state"] for row in rows)
    print(
        f"claims={claims} takeovers={len(takeovers)} cross-process={len(cross_process)} "
        f"reclaimed runs={len(reclaimed_runs)} paused attempts={ledger.paused_attempts} "
        f"left by claimers={left_by_claimers} actions={dict(ledger.kinds)} states={dict(states)}"
    )
    assert all(per_process[index] > 0 for index in range(PROCESSES)), per_process
    assert claims >= 1.5 * RUNS
    assert len(takeovers) >= 100
    assert len(cross_process) >= 20
    assert len(reclaimed_runs) >= RUNS // 4
    assert ledger.paused_attempts >= 20
    assert ledger.kinds["commit"] >= RUNS
    assert states["succeeded"] > 0 and states["dead"] > 0
