"""Worker processes for the multi-process lease tests; run as a script with the test interpreter.

``loop``: several asyncio tasks claim runs and, at random, renew, commit steps, finish, fail,
fail an attempt, release, abandon a run (a crashed worker) or sleep past the lease and then try
to act (a paused worker). Every action is written as one JSON line with the database-clock
times the test needs to rebuild who held which lease when, independently of ``run_events``.

``serve``: one worker driven by JSON commands on stdin, one JSON answer per line on stdout.
``--clock-skew-seconds`` shifts this process's wall clock (``time.time``, ``time.time_ns``,
``datetime.now``/``utcnow``/``today``) before orchestrator is imported.

The DSN comes from ``ORCHESTRATOR_DATABASE_URL``. A test-only hook,
``CLAIMER_SQL_MUTATION="query_name|old text|new text"``, rewrites one named query in this
process only, to show that the tests catch a broken statement.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as datetime_module
import json
import os
import random
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime, tzinfo
from typing import IO, TYPE_CHECKING, Any, Self

if TYPE_CHECKING:
    import asyncpg

    from orchestrator.db.executor import TransactionConnection
    from orchestrator.db.store import RunStore
    from orchestrator.models import ClaimBatch, ClaimedRun, CommitResult, Lease

AGENT = "lease-test"
LEASE_CHOICES = (0.3, 0.5, 0.75, 1.0)
"""Lease lengths in seconds; exact in microseconds, so lease_until - lease is the grant time."""
TERMINAL = ("succeeded", "failed", "cancelled", "dead")
MUTATION_ENV = "CLAIMER_SQL_MUTATION"


def apply_clock_skew(seconds: float) -> None:
    """Shift this process's wall clock by ``seconds``; call before importing orchestrator."""
    real_time = time.time
    real_time_ns = time.time_ns
    skew_ns = round(seconds * 1_000_000_000)

    def skewed_time() -> float:
        return real_time() + seconds

    def skewed_time_ns() -> int:
        return real_time_ns() + skew_ns

    class SkewedDatetime(datetime):
        # No instance dict: compiled modules (asyncpg) check the size of datetime.datetime.
        __slots__ = ()

        @classmethod
        def now(cls, tz: tzinfo | None = None) -> Self:
            return cls.fromtimestamp(skewed_time(), tz)

        @classmethod
        def utcnow(cls) -> Self:
            return cls.fromtimestamp(skewed_time(), UTC).replace(tzinfo=None)

        @classmethod
        def today(cls) -> Self:
            return cls.fromtimestamp(skewed_time())

    time.time = skewed_time
    time.time_ns = skewed_time_ns
    # Modules that later do `from datetime import datetime` get the skewed class.
    datetime_module.datetime = SkewedDatetime  # type: ignore[misc]


def apply_sql_mutation() -> None:
    """The test-only hook: rewrite one named query in this process (see the module docstring)."""
    spec = os.environ.get(MUTATION_ENV)
    if not spec:
        return
    from orchestrator.db.queries import queries

    name, old, new = spec.split("|")
    statements = queries()
    if old not in statements[name]:
        raise SystemExit(f"{MUTATION_ENV}: {old!r} is not in query {name!r}")
    statements[name] = statements[name].replace(old, new)
    print(f"claimer: query {name!r} mutated: {old!r} -> {new!r}", file=sys.stderr)


def stamp(value: datetime | None) -> str | None:
    return None if value is None else value.isoformat()


# -- loop mode ----------------------------------------------------------------------------------
class ClaimingTask:
    """One claiming task. Its records for a (run, fence) are written in the order they happened.

    All tasks of a process share one worker id, as the runs of one ``serve`` process do: the
    owner check cannot tell them apart, so only the fence keeps a task that lost a lease from
    acting on the run another task of the same process claimed since.
    """

    def __init__(
        self,
        worker_id: str,
        task: int,
        store: RunStore,
        pool: asyncpg.Pool,
        log: Callable[[dict[str, Any]], None],
        rng: random.Random,
        deadline: float,
    ) -> None:
        self.worker_id = worker_id
        self.task = task
        self.store = store
        self.pool = pool
        self.log = log
        self.rng = rng
        self.deadline = deadline

    def record(self, kind: str, lease: Lease, **fields: Any) -> None:
        self.log(
            {
                "type": kind,
                "run": lease.run_id,
                "fence": lease.fence,
                "worker": self.worker_id,
                "task": self.task,
                **fields,
            }
        )

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while loop.time() < self.deadline:
            lease_seconds = self.rng.choice(LEASE_CHOICES)
            batch = await self.store.claim(
                self.worker_id, [AGENT], limit=self.rng.randint(1, 4), lease_seconds=lease_seconds
            )
            granted = loop.time()
            self.record_batch(batch, lease_seconds)
            if not batch.claimed:
                remaining = await self.pool.fetchval(
                    "SELECT count(*) FROM runs WHERE state <> ALL($1::text[])", list(TERMINAL)
                )
                if remaining == 0:
                    return
                await asyncio.sleep(self.rng.uniform(0.01, 0.05))
                continue
            # Runs later in a batch wait for the earlier ones, so some of them expire meanwhile.
            for claimed in batch.claimed:
                await self.work_on(claimed, lease_seconds, granted)

    def record_batch(self, batch: ClaimBatch, lease_seconds: float) -> None:
        for run_id in batch.dead_lettered:
            self.log({"type": "claim_dead_lettered", "run": run_id, "worker": self.worker_id})
        for claimed in batch.claimed:
            self.record(
                "claim",
                claimed.lease,
                lease_seconds=lease_seconds,
                claimed_at=stamp(claimed.claimed_at),
                lease_until=stamp(claimed.lease_until),
                previous_owner=claimed.previous_owner,
                previous_lease_until=stamp(claimed.previous_lease_until),
                attempt=claimed.attempt,
                version=claimed.checkpoint_version,
            )

    async def work_on(self, claimed: ClaimedRun, lease_seconds: float, granted: float) -> None:
        """Act on one claimed run; ``granted`` is when (loop time) its last grant arrived."""
        loop = asyncio.get_running_loop()
        lease = claimed.lease
        version = claimed.checkpoint_version
        for _ in range(self.rng.randint(0, 2)):
            if self.rng.random() < 0.5:
                await asyncio.sleep(self.rng.uniform(0.0, 0.05))
                lease_seconds = self.rng.choice(LEASE_CHOICES)
                if not await self.renew(lease, lease_seconds):
                    return
                granted = loop.time()
            committed = await self.commit(lease, version)
            if committed is None:
                return
            version = committed
        ending = self.rng.choices(
            ["finish", "fail", "fail_attempt", "release", "abandon", "pause"],
            weights=[30, 4, 14, 14, 24, 14],
        )[0]
        if ending == "abandon":
            self.record("abandon", lease)
            return
        if ending == "pause":
            # A paused worker wakes just after its lease expired (the grant was computed before
            # it arrived here), when another task may or may not have taken the run over yet.
            expired_in = granted + lease_seconds - loop.time()
            await asyncio.sleep(max(0.0, expired_in) + self.rng.uniform(0.0, 0.02))
            action = self.rng.choice(["renew", "commit", "finish", "release", "fail_attempt"])
            if action == "renew":
                await self.renew(lease, self.rng.choice(LEASE_CHOICES), paused=True)
            elif action == "commit":
                await self.commit(lease, version, paused=True)
            else:
                await self.end(action, lease, version, paused=True)
            return
        if await self.end(ending, lease, version) and self.rng.random() < 0.2:
            # A zombie: the same lease tries to act after it gave the run up.
            await self.renew(lease, self.rng.choice(LEASE_CHOICES), paused=True)

    async def renew(self, lease: Lease, lease_seconds: float, *, paused: bool = False) -> bool:
        before = await self.store.database_now()
        lease_until = await self.store.renew(lease, lease_seconds=lease_seconds)
        self.record(
            "renew",
            lease,
            ok=lease_until is not None,
            before=stamp(before),
            lease_until=stamp(lease_until),
            lease_seconds=lease_seconds,
            paused=paused,
        )
        return lease_until is not None

    async def commit(self, lease: Lease, version: int, *, paused: bool = False) -> int | None:
        inside: list[datetime] = []

        async def clock_inside(connection: TransactionConnection, result: CommitResult) -> None:
            # The commit's UPDATE already ran in this transaction and the row stays locked until
            # COMMIT, so this is an upper bound of the commit's time that precedes any later claim.
            inside.append(await self.store.database_now(db=connection))

        before = await self.store.database_now()
        result = await self.store.commit_step(
            lease,
            expected_version=version,
            next_step=f"step-{version + 1}",
            checkpoint={"version": version + 1, "by": self.worker_id},
            in_transaction=clock_inside,
        )
        self.record(
            "commit",
            lease,
            ok=result is not None,
            expected=version,
            version=None if result is None else result.checkpoint_version,
            before=stamp(before),
            inside=stamp(inside[0]) if inside else None,
            paused=paused,
        )
        return None if result is None else result.checkpoint_version

    async def end(self, how: str, lease: Lease, version: int, *, paused: bool = False) -> bool:
        """finish / fail / fail_attempt / release, each with the DB time it took effect by."""
        before = await self.store.database_now()
        outcome: str | None = None
        async with self.pool.acquire() as connection, connection.transaction():
            # Run inside a transaction, so the clock read after the action is an upper bound of
            # when the lease ended that precedes the COMMIT, and so any claim that sees it free.
            if how == "finish":
                ok = await self.store.finish(
                    lease, expected_version=version, result={"by": self.worker_id}, db=connection
                )
            elif how == "fail":
                ok = await self.store.fail(
                    lease,
                    expected_version=version,
                    error={"type": "StepFailed", "message": "by design"},
                    db=connection,
                )
            elif how == "fail_attempt":
                failed = await self.store.fail_attempt(
                    lease, error={"type": "Flaky", "message": "try again"}, db=connection
                )
                ok = failed is not None
                outcome = None if failed is None else failed.state.value
            elif how == "release":
                ok = await self.store.release(lease, reason="test", db=connection)
            else:
                raise ValueError(how)
            at = await self.store.database_now(db=connection)
        self.record(
            how,
            lease,
            ok=ok,
            before=stamp(before),
            at=stamp(at),
            outcome=outcome,
            version=version + 1 if how in ("finish", "fail") else None,
            paused=paused,
        )
        return ok


async def run_loop(args: argparse.Namespace, output: IO[str]) -> None:
    from orchestrator.backoff import Backoff
    from orchestrator.db.connections import create_pool
    from orchestrator.db.store import RunStore
    from orchestrator.settings import Settings

    apply_sql_mutation()
    pool = await create_pool(
        Settings.from_env(), application_name=args.worker_id, max_size=args.tasks + 2
    )
    try:
        store = RunStore(pool, backoff=Backoff(base_seconds=0.05, max_seconds=0.4))
        rng = random.Random(args.seed)
        deadline = asyncio.get_running_loop().time() + args.seconds

        def log(record: dict[str, Any]) -> None:
            output.write(json.dumps(record) + "\n")

        tasks = [
            ClaimingTask(
                args.worker_id,
                index,
                store,
                pool,
                log,
                random.Random(rng.random()),
                deadline,
            )
            for index in range(args.tasks)
        ]
        await asyncio.gather(*(task.run() for task in tasks))
    finally:
        await pool.close()


# -- serve mode ---------------------------------------------------------------------------------
async def serve(args: argparse.Namespace) -> None:
    from orchestrator.db.connections import create_pool
    from orchestrator.db.store import RunStore
    from orchestrator.models import Lease
    from orchestrator.settings import Settings

    apply_sql_mutation()
    pool = await create_pool(Settings.from_env(), application_name=args.worker_id, max_size=2)
    store = RunStore(pool)
    worker_id: str = args.worker_id
    loop = asyncio.get_running_loop()
    try:
        while line := await loop.run_in_executor(None, sys.stdin.readline):
            command: dict[str, Any] = json.loads(line)
            op = command["op"]
            before = await store.database_now()
            answer: dict[str, Any] = {"op": op, "before": stamp(before)}
            if op == "clock":
                # Looked up at call time: the skewed clock, if one was applied.
                answer.update(
                    local_time=time.time(), local_now=datetime_module.datetime.now(UTC).isoformat()
                )
            elif op in ("claim_run", "claim"):
                if op == "claim_run":
                    one = await store.claim_run(
                        worker_id, command["run_id"], lease_seconds=command["lease_seconds"]
                    )
                    claimed = [] if one is None else [one]
                else:
                    claimed = (
                        await store.claim(
                            worker_id,
                            [command["agent"]],
                            limit=100,
                            lease_seconds=command["lease_seconds"],
                        )
                    ).claimed
                answer["claimed"] = [
                    {
                        "run_id": run.run_id,
                        "fence": run.fence,
                        "worker": worker_id,
                        "claimed_at": stamp(run.claimed_at),
                        "lease_until": stamp(run.lease_until),
                        "previous_owner": run.previous_owner,
                        "previous_lease_until": stamp(run.previous_lease_until),
                    }
                    for run in claimed
                ]
            elif op == "renew":
                lease = Lease(command["run_id"], worker_id, command["fence"])
                lease_until = await store.renew(lease, lease_seconds=command["lease_seconds"])
                answer["lease_until"] = stamp(lease_until)
            elif op == "commit":
                lease = Lease(command["run_id"], worker_id, command["fence"])
                result = await store.commit_step(
                    lease,
                    expected_version=command["expected_version"],
                    next_step="next",
                    checkpoint={"by": worker_id},
                )
                answer["version"] = None if result is None else result.checkpoint_version
            else:
                raise ValueError(f"unknown op {op!r}")
            answer["after"] = stamp(await store.database_now())
            sys.stdout.write(json.dumps(answer) + "\n")
            sys.stdout.flush()
    finally:
        await pool.close()


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    modes = parser.add_subparsers(dest="mode", required=True)
    loop = modes.add_parser("loop")
    loop.add_argument("--worker-id", required=True)
    loop.add_argument("--tasks", type=int, default=8)
    loop.add_argument("--seconds", type=float, default=40.0)
    loop.add_argument("--seed", type=int, default=0)
    loop.add_argument("--output", required=True)
    one = modes.add_parser("serve")
    one.add_argument("--worker-id", required=True)
    one.add_argument("--clock-skew-seconds", type=float, default=0.0)
    args = parser.parse_args(argv)
    if args.mode == "loop":
        with open(args.output, "w", encoding="utf-8", buffering=1) as output:
            asyncio.run(run_loop(args, output))
    else:
        if args.clock_skew_seconds:
            apply_clock_skew(args.clock_skew_seconds)
        asyncio.run(serve(args))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
