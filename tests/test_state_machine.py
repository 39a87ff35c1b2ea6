"""A stateful property test of the run state machine against a pure-Python model.

Hypothesis drives random sequences of submits (with idempotency keys), claims (one run, or a
batch), renewals (one, or many in one statement), step commits (alone, with extra writes in the
same transaction, rolled back, or grouped), finishes (alone or grouped), failed attempts,
releases, cancels and retries against a real PostgreSQL, and checks after every step that each
run's row and timeline match a small model of what ``sql/queries.sql`` promises: state, fence,
owner, lease, attempt, checkpoint and version, result and error, and every event with its kind,
fence, worker and key details.

Every lease a claim ever granted stays in the machine, and the machine also forges leases (other
workers, neighbouring fences). Using a stale or forged lease must be rejected and must change
nothing at all: the whole ``runs`` table and the event count are compared before and after.

Time is never waited for: leases are long (``LEASE_SECONDS``) and retry backoff is hours long,
so real time never expires a lease or makes a retry due during a test. The ``expire`` and
``make_due`` rules move ``lease_until`` / ``available_at`` into the past with a direct update.

Hypothesis state machines are synchronous; the store is async. The test runs the store on an
event loop in a thread of its own (``LoopThread``), independent of pytest-asyncio's loop.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from types import TracebackType
from typing import Any, ClassVar, TypeVar

import asyncpg
import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import event as note_outcome
from hypothesis import strategies as st
from hypothesis.internal.conjecture import engine as hypothesis_engine
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from orchestrator.backoff import Backoff
from orchestrator.db.connections import create_pool
from orchestrator.db.store import RunFinish, RunStore, StepCommit, StepEvent
from orchestrator.errors import IdempotencyConflict, InvalidTransition
from orchestrator.models import JSON, ClaimedRun, CommitResult, Lease, Run, RunState
from orchestrator.settings import Settings
from orchestrator.testing import DatabaseFactory

pytestmark = pytest.mark.slow

T = TypeVar("T")

LEASE_SECONDS = 600.0
"""Far longer than a test: only the ``expire`` rule ever expires a lease."""

BACKOFF = Backoff(base_seconds=3600.0, max_seconds=7200.0)
"""The shortest retry delay is a tenth of the base: six minutes, so no retry comes due by itself."""

AGENTS = ("alpha", "beta")
WORKERS = ("w1", "w2")
IDEMPOTENCY_KEYS = (None, None, None, "k1", "k2")

ACTIVE_STATES = frozenset({RunState.QUEUED, RunState.WAITING, RunState.RUNNING})

VERSION_OFFSETS = st.sampled_from((0, 0, 0, -1, 1))
"""How far a commit's expected checkpoint version is off the stored one (mostly not)."""
STEP_NAMES = st.sampled_from(("plan", "act", "report"))
CHECKPOINTS = st.fixed_dictionaries({"i": st.integers(0, 9)})
FINAL_CHECKPOINTS = st.none() | st.fixed_dictionaries({"final": st.integers(0, 9)})
EXTRA_EVENTS = st.lists(st.integers(0, 9), max_size=2)
"""Events a step commits besides its checkpoint event."""


def refusal(code: int) -> dict[str, JSON]:
    return {"type": "Refused", "code": code}


STATE_MACHINE_SETTINGS = settings(
    max_examples=60,
    stateful_step_count=40,
    deadline=None,
    database=None,
    # No "explain" phase: on Python < 3.12 it traces every line, which makes replaying a failing
    # run against the database many times slower.
    phases=(Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink),
    suppress_health_check=[HealthCheck.too_slow],
)


class LoopThread:
    """An asyncio event loop running in its own thread, for driving async code from sync code."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._serve, name="state-machine-loop", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_forever()
        finally:
            self.loop.run_until_complete(self.loop.shutdown_asyncgens())
            self.loop.close()

    def run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout=60)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=30)

    def __enter__(self) -> LoopThread:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()


@dataclass(frozen=True)
class Environment:
    loop: LoopThread
    pool: asyncpg.Pool
    store: RunStore


@dataclass(frozen=True)
class ExpectedEvent:
    kind: str
    fence: int
    worker_id: str | None
    details: Mapping[str, JSON] = field(default_factory=dict)
    """A subset of the stored details that must match exactly."""


@dataclass
class ModelRun:
    """What the SQL promises about one run."""

    run_id: str
    agent: str
    input: JSON
    max_attempts: int
    idempotency_key: str | None
    state: RunState = RunState.QUEUED
    fence: int = 0
    attempt: int = 0
    owner: str | None = None
    expired: bool = False
    """Running, and the ``expire`` rule moved its lease into the past."""
    due: bool = True
    """Queued runs are always due; waiting runs only after the ``make_due`` rule."""
    version: int = 0
    step: str | None = None
    checkpoint: JSON = None
    result: JSON = None
    error: JSON = None
    granted_fences: list[int] = field(default_factory=list)
    events: list[ExpectedEvent] = field(default_factory=list)

    def claimable(self) -> bool:
        if self.state is RunState.QUEUED:
            return True
        if self.state is RunState.WAITING:
            return self.due
        return self.state is RunState.RUNNING and self.expired

    def exhausted(self) -> bool:
        """Claiming it dead-letters it instead: its lease expired on the last attempt."""
        return self.state is RunState.RUNNING and self.expired and self.attempt >= self.max_attempts

    def accepts(self, lease: Lease) -> bool:
        """Whether the database must honour ``lease`` right now."""
        return (
            self.state is RunState.RUNNING
            and not self.expired
            and self.owner == lease.worker_id
            and self.fence == lease.fence
        )


class Boom(Exception):
    """Raised inside a commit's transaction: the whole step must roll back."""


Snapshot = tuple[dict[str, dict[str, Any]], int]
"""Every run row by id, and the number of events."""


class RunStateMachine(RuleBasedStateMachine):
    environment: ClassVar[Environment | None] = None

    def __init__(self) -> None:
        super().__init__()
        assert self.environment is not None, "set RunStateMachine.environment first"
        self.env = self.environment
        self.store = self.env.store
        self.model: dict[str, ModelRun] = {}
        self.keys: dict[str, str] = {}
        self.issued: list[Lease] = []
        self.highest_fence_seen: dict[str, int] = {}
        self.execute("TRUNCATE runs, run_events CASCADE")

    # -- plumbing -----------------------------------------------------------------------------
    def run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        return self.env.loop.run(coroutine)

    def execute(self, sql: str, *args: Any) -> str:
        return self.run(self.env.pool.execute(sql, *args))

    def snapshot(self) -> Snapshot:
        async def take() -> Snapshot:
            async with self.env.pool.acquire() as connection:
                rows = await connection.fetch("SELECT * FROM runs")
                count = await connection.fetchval("SELECT count(*) FROM run_events")
            return {row["run_id"]: dict(row) for row in rows}, int(count)

        return self.run(take())

    def assert_unchanged(self, before: Snapshot, *, except_runs: Sequence[str] = ()) -> None:
        """No run other than ``except_runs`` changed; with none excepted, no event either."""
        after = self.snapshot()
        excepted = set(except_runs)
        assert before[0].keys() - excepted == after[0].keys() - excepted, "runs came or went"
        for run_id, row in before[0].items():
            if run_id not in except_runs:
                assert after[0][run_id] == row, f"run {run_id} changed"
        if not except_runs:
            assert after[1] == before[1], "events were appended"

    def assert_only_changed(
        self, before: Snapshot, run_id: str, columns: frozenset[str]
    ) -> dict[str, Any]:
        """Of all runs, only ``columns`` of ``run_id`` changed, and no event was appended."""
        after = self.snapshot()
        self.assert_unchanged(before, except_runs=[run_id])
        assert after[1] == before[1], "events were appended"
        old, new = before[0][run_id], after[0][run_id]
        changed = {name for name in old if old[name] != new[name]}
        assert changed <= columns, f"unexpected changes to {sorted(changed - columns)}"
        return new

    def db_now(self) -> datetime:
        now = self.run(self.env.pool.fetchval("SELECT clock_timestamp()"))
        assert isinstance(now, datetime)
        return now

    # -- model transitions shared by several rules --------------------------------------------
    def grant(self, model: ModelRun, claimed: ClaimedRun, worker: str, before: Snapshot) -> None:
        """Check a claim against the model, then apply it."""
        old_fence = before[0][model.run_id]["fence"]
        assert claimed.lease == Lease(model.run_id, worker, model.fence + 1)
        assert claimed.fence == old_fence + 1, "a claim raises the fence by exactly one"
        assert claimed.fence not in model.granted_fences, "a fence was granted twice"
        assert all(claimed.fence > fence for fence in model.granted_fences)
        assert claimed.attempt == model.attempt + 1
        assert claimed.max_attempts == model.max_attempts
        assert claimed.agent == model.agent
        assert claimed.input == model.input
        assert claimed.checkpoint_version == model.version
        assert claimed.step == model.step
        assert claimed.checkpoint == model.checkpoint
        assert claimed.lease_until > claimed.claimed_at
        was_running = model.state is RunState.RUNNING
        previous_owner = model.owner if was_running else None
        assert claimed.previous_owner == previous_owner
        assert (claimed.previous_lease_until is not None) == was_running
        model.state = RunState.RUNNING
        model.fence += 1
        model.attempt += 1
        model.owner = worker
        model.expired = False
        model.granted_fences.append(model.fence)
        model.events.append(
            ExpectedEvent(
                "claimed",
                model.fence,
                worker,
                {
                    "attempt": model.attempt,
                    "checkpoint_version": model.version,
                    "previous_owner": previous_owner,
                },
            )
        )
        self.issued.append(claimed.lease)

    def dead_letter_on_claim(self, model: ModelRun, worker: str) -> None:
        assert model.exhausted()
        previous_owner = model.owner
        model.state = RunState.DEAD
        model.owner = None
        model.expired = False
        model.error = {
            "type": "LeaseExpired",
            "message": f"the lease of {previous_owner} expired during attempt "
            f"{model.attempt} of {model.max_attempts}",
        }
        model.events.append(
            ExpectedEvent(
                "dead_lettered",
                model.fence,
                worker,
                {"attempt": model.attempt, "previous_owner": previous_owner},
            )
        )

    def end_lease(self, model: ModelRun) -> None:
        model.owner = None
        model.expired = False

    # -- choosing what to act on --------------------------------------------------------------
    def pick_run(
        self, data: st.DataObject, prefer: Callable[[ModelRun], bool], why: str
    ) -> ModelRun:
        """Any run, but half the time one for which ``prefer`` holds (if there is one)."""
        preferred = [run_id for run_id, model in self.model.items() if prefer(model)]
        if bool(preferred) and data.draw(st.booleans(), label=f"pick one {why}"):
            return self.model[data.draw(st.sampled_from(preferred), label=why)]
        return self.model[data.draw(st.sampled_from(list(self.model)), label="any run")]

    def pick_lease(self, data: st.DataObject) -> Lease:
        """A run's current lease, any lease ever granted, or a forged one.

        The forgeries that matter most are aimed at a live lease: its owner with an older fence
        (a worker that lost the run and claimed it again), and another worker with the current
        fence.
        """
        current = [
            Lease(model.run_id, model.owner, model.fence)
            for model in self.model.values()
            if model.owner is not None and not model.expired
        ]
        kinds = ["granted", "forged"]
        if current:
            kinds += ["current"] * 3 + ["older fence", "other worker"] * 2
        kind = data.draw(st.sampled_from(kinds), label="lease kind")
        if kind == "granted":
            return data.draw(st.sampled_from(self.issued), label="granted lease")
        if kind == "forged":
            base = data.draw(st.sampled_from(self.issued), label="forged from")
            worker = data.draw(st.sampled_from(WORKERS), label="forged worker")
            delta = data.draw(st.sampled_from((-1, 0, 1)), label="forged fence delta")
            return Lease(base.run_id, worker, max(base.fence + delta, 0))
        lease = data.draw(st.sampled_from(current), label="current lease")
        if kind == "older fence":
            back = data.draw(st.integers(1, lease.fence), label="fences back")
            return Lease(lease.run_id, lease.worker_id, lease.fence - back)
        if kind == "other worker":
            others = [worker for worker in WORKERS if worker != lease.worker_id]
            return Lease(lease.run_id, data.draw(st.sampled_from(others)), lease.fence)
        return lease

    def pick_batch(self, data: st.DataObject, count: int, *, unique: bool = True) -> list[Lease]:
        """Up to ``count`` leases presented by one worker: its own live ones, or any lease
        (stale, forged, another worker's) under its name. ``unique``: one per run."""
        owners = sorted(
            {model.owner for model in self.model.values() if model.owner and not model.expired}
        )
        worker = data.draw(st.sampled_from(owners or WORKERS), label="batch worker")
        own = [
            Lease(model.run_id, worker, model.fence)
            for model in self.model.values()
            if model.owner == worker and not model.expired
        ]
        batch: list[Lease] = []
        for _ in range(count):
            if bool(own) and data.draw(st.booleans(), label="own live lease"):
                lease = data.draw(st.sampled_from(own), label="own lease")
            else:
                other = self.pick_lease(data)
                lease = Lease(other.run_id, worker, other.fence)
            if not unique or all(lease.run_id != chosen.run_id for chosen in batch):
                batch.append(lease)
        return batch

    def pick_group(self, data: st.DataObject, count: int) -> tuple[str, list[tuple[Lease, int]]]:
        """A group commit's worker and its leases, each with the version its commit expects
        (most often the run's current one)."""
        leases = self.pick_batch(data, count)
        return leases[0].worker_id, [
            (lease, self.model[lease.run_id].version + data.draw(VERSION_OFFSETS, label="offset"))
            for lease in leases
        ]

    def taking_effect(self, group: list[tuple[Lease, int]]) -> set[str]:
        """The runs of a group commit that must take effect: each by its own conditions."""
        return {
            lease.run_id
            for lease, expected_version in group
            if self.model[lease.run_id].accepts(lease)
            and expected_version == self.model[lease.run_id].version
        }

    def has_runs(self) -> bool:
        return bool(self.model)

    def has_leases(self) -> bool:
        return bool(self.issued)

    def has_unexpired_leases(self) -> bool:
        return any(
            model.state is RunState.RUNNING and not model.expired for model in self.model.values()
        )

    def has_pending_retries(self) -> bool:
        return any(
            model.state is RunState.WAITING and not model.due for model in self.model.values()
        )

    # -- rules: submitting --------------------------------------------------------------------
    @rule(
        agent=st.sampled_from(AGENTS),
        number=st.integers(0, 1),
        key=st.sampled_from(IDEMPOTENCY_KEYS),
        max_attempts=st.sampled_from((1, 1, 2, 3)),
    )
    def submit(self, agent: str, number: int, key: str | None, max_attempts: int) -> None:
        payload = {"n": number}
        before = self.snapshot()
        submitting = self.store.submit(
            agent, payload, idempotency_key=key, max_attempts=max_attempts
        )
        if key is not None and key in self.keys:
            existing = self.model[self.keys[key]]
            if existing.agent == agent and existing.input == payload:
                submission = self.run(submitting)
                assert not submission.created
                assert submission.run.run_id == existing.run_id
                note_outcome("submit: deduplicated")
            else:
                with pytest.raises(IdempotencyConflict):
                    self.run(submitting)
                note_outcome("submit: conflict")
            self.assert_unchanged(before)
            return
        submission = self.run(submitting)
        assert submission.created
        run = submission.run
        assert (run.state, run.fence, run.attempt, run.checkpoint_version) == (
            RunState.QUEUED,
            0,
            0,
            0,
        )
        assert run.lease_owner is None
        assert run.lease_until is None
        self.assert_unchanged(before, except_runs=[run.run_id])
        model = ModelRun(run.run_id, agent, payload, max_attempts, key)
        model.events.append(
            ExpectedEvent(
                "submitted",
                0,
                None,
                {"agent": agent, "max_attempts": max_attempts, "idempotency_key": key},
            )
        )
        self.model[run.run_id] = model
        if key is not None:
            self.keys[key] = run.run_id

    # -- rules: claiming ----------------------------------------------------------------------
    @precondition(has_runs)
    @rule(data=st.data(), worker=st.sampled_from(WORKERS), expire_first=st.booleans())
    def claim_run(self, data: st.DataObject, worker: str, expire_first: bool) -> None:
        model = self.pick_run(data, ModelRun.claimable, "claimable")
        run_id = model.run_id
        if expire_first and model.state is RunState.RUNNING:
            self.expire_lease(model)
        before = self.snapshot()
        claimed = self.run(self.store.claim_run(worker, run_id, lease_seconds=LEASE_SECONDS))
        if not model.claimable():
            assert claimed is None, f"claimed a {model.state} run that is not claimable"
            note_outcome(f"claim_run: refused ({model.state})")
            self.assert_unchanged(before)
            return
        self.assert_unchanged(before, except_runs=[run_id])
        if model.exhausted():
            assert claimed is None, "claimed a run whose lease expired on its last attempt"
            note_outcome("claim_run: dead-lettered")
            self.dead_letter_on_claim(model, worker)
            return
        assert claimed is not None, f"did not claim a claimable {model.state} run"
        note_outcome(f"claim_run: claimed ({model.state})")
        self.grant(model, claimed, worker, before)

    @precondition(has_runs)
    @rule(
        worker=st.sampled_from(WORKERS),
        # Unique, as the supervisor passes them. With a name repeated, claim_due probes that
        # agent twice and counts each due run twice against the limit, so a batch can come back
        # smaller than the limit while due runs wait (a store quirk, not a safety issue).
        agents=st.lists(st.sampled_from(AGENTS), max_size=len(AGENTS), unique=True),
        spare=st.integers(0, 2),
        data=st.data(),
    )
    def claim_due(self, worker: str, agents: list[str], spare: int, data: st.DataObject) -> None:
        live = [
            run_id
            for run_id, model in self.model.items()
            if model.agent in agents and model.state is RunState.RUNNING and not model.expired
        ]
        if bool(live) and data.draw(st.booleans(), label="expire a lease first"):
            self.expire_lease(self.model[data.draw(st.sampled_from(live), label="expire")])
        eligible = {
            run_id
            for run_id, model in self.model.items()
            if model.agent in agents and model.claimable()
        }
        # The limit never cuts the eligible set: which runs a capped batch takes is the
        # database's choice, and the draws that follow must not depend on it (Hypothesis
        # replays examples and needs each to draw the same way every time).
        limit = max(len(eligible) + spare, 1)
        before = self.snapshot()
        batch = self.run(self.store.claim(worker, agents, limit=limit, lease_seconds=LEASE_SECONDS))
        taken = [claimed.run_id for claimed in batch.claimed] + batch.dead_lettered
        assert len(taken) == len(set(taken)), "a run was taken twice in one claim"
        assert set(taken) <= eligible, f"took runs that are not claimable: {set(taken) - eligible}"
        assert len(taken) == min(limit, len(eligible))
        self.assert_unchanged(before, except_runs=taken)
        note_outcome(f"claim_due: {len(batch.claimed)} claimed, {len(batch.dead_lettered)} dead")
        for run_id in taken:
            model = self.model[run_id]
            note_outcome(f"claim_due: took a {'dead' if model.exhausted() else model.state} run")
        for claimed in batch.claimed:
            model = self.model[claimed.run_id]
            assert not model.exhausted(), "claimed a run whose lease expired on its last attempt"
            self.grant(model, claimed, worker, before)
        for run_id in batch.dead_lettered:
            self.dead_letter_on_claim(self.model[run_id], worker)

    # -- rules: leases ------------------------------------------------------------------------
    @precondition(has_leases)
    @rule(data=st.data())
    def renew(self, data: st.DataObject) -> None:
        lease = self.pick_lease(data)
        model = self.model[lease.run_id]
        before = self.snapshot()
        lease_until = self.run(self.store.renew(lease, lease_seconds=LEASE_SECONDS))
        if not model.accepts(lease):
            assert lease_until is None, f"renewed a lease the run does not honour: {lease}"
            note_outcome("renew: rejected")
            self.assert_unchanged(before)
            return
        assert lease_until is not None, f"refused to renew the current lease {lease}"
        note_outcome("renew: renewed")
        old_until = before[0][lease.run_id]["lease_until"]
        assert lease_until >= old_until
        row = self.assert_only_changed(
            before, lease.run_id, frozenset({"lease_until", "updated_at"})
        )
        assert row["lease_until"] == lease_until

    @precondition(has_leases)
    @rule(data=st.data(), count=st.integers(1, 4))
    def renew_many(self, data: st.DataObject, count: int) -> None:
        mine = self.pick_batch(data, count, unique=False)
        worker = mine[0].worker_id
        expected = {lease.run_id for lease in mine if self.model[lease.run_id].accepts(lease)}
        before = self.snapshot()
        renewed = self.run(self.store.renew_many(worker, mine, lease_seconds=LEASE_SECONDS))
        assert set(renewed) == expected
        note_outcome(f"renew_many: {len(expected)} of {len(mine)} renewed")
        after = self.snapshot()
        self.assert_unchanged(before, except_runs=sorted(expected))
        assert after[1] == before[1]
        for run_id in expected:
            assert after[0][run_id]["lease_until"] == renewed[run_id]
            old, new = before[0][run_id], after[0][run_id]
            changed = {name for name in old if old[name] != new[name]}
            assert changed <= {"lease_until", "updated_at"}

    @precondition(has_leases)
    @rule(data=st.data(), reason=st.sampled_from(("shutdown", "drain")))
    def release(self, data: st.DataObject, reason: str) -> None:
        lease = self.pick_lease(data)
        model = self.model[lease.run_id]
        before = self.snapshot()
        released = self.run(self.store.release(lease, reason=reason))
        if not model.accepts(lease):
            assert not released, f"released with a lease the run does not honour: {lease}"
            note_outcome("release: rejected")
            self.assert_unchanged(before)
            return
        assert released, f"refused to release with the current lease {lease}"
        note_outcome("release: released")
        self.assert_unchanged(before, except_runs=[lease.run_id])
        model.state = RunState.QUEUED
        model.attempt = max(model.attempt - 1, 0)
        model.due = True
        self.end_lease(model)
        model.events.append(
            ExpectedEvent("released", model.fence, lease.worker_id, {"reason": reason})
        )

    # -- rules: progress ----------------------------------------------------------------------
    def apply_commit(
        self, model: ModelRun, worker: str, next_step: str, checkpoint: JSON, extra: list[int]
    ) -> None:
        model.version += 1
        model.step = next_step
        model.checkpoint = checkpoint
        model.attempt = 1
        model.events.append(
            ExpectedEvent(
                "checkpoint", model.fence, worker, {"version": model.version, "step": next_step}
            )
        )
        model.events.extend(ExpectedEvent("note", model.fence, worker, {"i": i}) for i in extra)

    def apply_finish(
        self, model: ModelRun, worker: str, succeed: bool, value: int, checkpoint: JSON
    ) -> None:
        model.version += 1
        if checkpoint is not None:  # no final checkpoint keeps the last one
            model.checkpoint = checkpoint
        self.end_lease(model)
        if succeed:
            model.state = RunState.SUCCEEDED
            model.result = {"answer": value}
            model.error = None
            model.events.append(
                ExpectedEvent("succeeded", model.fence, worker, {"version": model.version})
            )
        else:
            model.state = RunState.FAILED
            model.result = None
            model.error = refusal(value)
            model.events.append(
                ExpectedEvent(
                    "failed", model.fence, worker, {"version": model.version, "error": model.error}
                )
            )

    @precondition(has_leases)
    @rule(
        data=st.data(),
        version_offset=VERSION_OFFSETS,
        next_step=STEP_NAMES,
        checkpoint=CHECKPOINTS,
        extra=EXTRA_EVENTS,
        mode=st.sampled_from(("plain", "in transaction", "in transaction", "rolled back")),
    )
    def commit_step(
        self,
        data: st.DataObject,
        version_offset: int,
        next_step: str,
        checkpoint: dict[str, int],
        extra: list[int],
        mode: str,
    ) -> None:
        lease = self.pick_lease(data)
        model = self.model[lease.run_id]
        expected_version = model.version + version_offset
        succeeds = model.accepts(lease) and version_offset == 0
        calls: list[CommitResult] = []

        async def in_transaction(connection: object, result: CommitResult) -> None:
            calls.append(result)
            if mode == "rolled back" and succeeds:
                raise Boom

        before = self.snapshot()
        committing = self.store.commit_step(
            lease,
            expected_version=expected_version,
            next_step=next_step,
            checkpoint=checkpoint,
            events=[StepEvent("note", {"i": i}) for i in extra],
            in_transaction=None if mode == "plain" else in_transaction,
        )
        if not succeeds:
            assert self.run(committing) is None, f"committed with {lease} at {expected_version}"
            assert calls == [], "in_transaction ran although ownership was not proven"
            why = "version" if model.accepts(lease) else "lease"
            note_outcome(f"commit_step: rejected ({why})")
            self.assert_unchanged(before)
            return
        if mode == "rolled back":
            # A failure inside the transaction rolls the whole step back.
            with pytest.raises(Boom):
                self.run(committing)
            assert len(calls) == 1
            note_outcome("commit_step: rolled back")
            self.assert_unchanged(before)
            return
        result = self.run(committing)
        assert result is not None, f"refused a commit with the current lease {lease}"
        assert calls == ([] if mode == "plain" else [result])
        note_outcome(f"commit_step: committed ({mode})")
        assert result.checkpoint_version == model.version + 1
        assert result.lease_until == before[0][lease.run_id]["lease_until"]
        self.assert_unchanged(before, except_runs=[lease.run_id])
        self.apply_commit(model, lease.worker_id, next_step, checkpoint, extra)

    @precondition(has_leases)
    @rule(data=st.data(), count=st.integers(1, 3))
    def commit_steps(self, data: st.DataObject, count: int) -> None:
        """A group commit: each run's commit must stand or fall on its own conditions."""
        worker, group = self.pick_group(data, count)
        commits: list[StepCommit] = []
        extras: dict[str, list[int]] = {}
        for lease, expected_version in group:
            extras[lease.run_id] = data.draw(EXTRA_EVENTS, label="extra events")
            commits.append(
                StepCommit(
                    lease,
                    expected_version,
                    data.draw(STEP_NAMES, label="next step"),
                    data.draw(CHECKPOINTS, label="checkpoint"),
                    [StepEvent("note", {"i": i}) for i in extras[lease.run_id]],
                )
            )
        expected = self.taking_effect(group)
        before = self.snapshot()
        results = self.run(self.store.commit_steps(worker, commits))
        assert set(results) == expected, "the group commit took effect for the wrong runs"
        note_outcome(f"commit_steps: {len(expected)} of {len(commits)} committed")
        self.assert_unchanged(before, except_runs=sorted(expected))
        for commit in commits:
            run_id = commit.lease.run_id
            if run_id in expected:
                model = self.model[run_id]
                assert results[run_id].checkpoint_version == model.version + 1
                assert results[run_id].lease_until == before[0][run_id]["lease_until"]
                self.apply_commit(
                    model, worker, commit.next_step, commit.checkpoint, extras[run_id]
                )

    @precondition(has_leases)
    @rule(
        data=st.data(),
        version_offset=VERSION_OFFSETS,
        succeed=st.booleans(),
        value=st.integers(0, 9),
        checkpoint=FINAL_CHECKPOINTS,
    )
    def finish(
        self,
        data: st.DataObject,
        version_offset: int,
        succeed: bool,
        value: int,
        checkpoint: dict[str, int] | None,
    ) -> None:
        lease = self.pick_lease(data)
        model = self.model[lease.run_id]
        expected_version = model.version + version_offset
        succeeds = model.accepts(lease) and version_offset == 0
        before = self.snapshot()
        if succeed:
            done = self.run(
                self.store.finish(
                    lease,
                    expected_version=expected_version,
                    result={"answer": value},
                    checkpoint=checkpoint,
                )
            )
        else:
            done = self.run(
                self.store.fail(
                    lease,
                    expected_version=expected_version,
                    error=refusal(value),
                    checkpoint=checkpoint,
                )
            )
        if not succeeds:
            assert not done, f"finished with {lease} at version {expected_version}"
            note_outcome("finish: rejected")
            self.assert_unchanged(before)
            return
        assert done, f"refused to finish with the current lease {lease}"
        note_outcome(f"finish: {'succeeded' if succeed else 'failed'}")
        self.assert_unchanged(before, except_runs=[lease.run_id])
        self.apply_finish(model, lease.worker_id, succeed, value, checkpoint)

    @precondition(has_leases)
    @rule(data=st.data(), count=st.integers(1, 3))
    def finish_many(self, data: st.DataObject, count: int) -> None:
        """A group final commit: each run finishes or not on its own conditions."""
        worker, group = self.pick_group(data, count)
        finishes: list[RunFinish] = []
        plans: dict[str, tuple[bool, int, JSON]] = {}
        for lease, expected_version in group:
            succeed = data.draw(st.booleans(), label="succeed")
            value = data.draw(st.integers(0, 9), label="value")
            checkpoint = data.draw(FINAL_CHECKPOINTS, label="final checkpoint")
            plans[lease.run_id] = (succeed, value, checkpoint)
            finishes.append(
                RunFinish(
                    lease,
                    expected_version,
                    RunState.SUCCEEDED if succeed else RunState.FAILED,
                    result={"answer": value} if succeed else None,
                    error=None if succeed else refusal(value),
                    checkpoint=checkpoint,
                )
            )
        expected = self.taking_effect(group)
        before = self.snapshot()
        finished = self.run(self.store.finish_many(worker, finishes))
        assert finished == expected, "the group finish took effect for the wrong runs"
        note_outcome(f"finish_many: {len(expected)} of {len(finishes)} finished")
        self.assert_unchanged(before, except_runs=sorted(expected))
        for run_id in sorted(expected):
            succeed, value, checkpoint = plans[run_id]
            self.apply_finish(self.model[run_id], worker, succeed, value, checkpoint)

    @precondition(has_leases)
    @rule(data=st.data(), code=st.integers(0, 9))
    def fail_attempt(self, data: st.DataObject, code: int) -> None:
        lease = self.pick_lease(data)
        model = self.model[lease.run_id]
        error = {"type": "StepError", "code": code}
        before = self.snapshot()
        outcome = self.run(self.store.fail_attempt(lease, error=error))
        if not model.accepts(lease):
            assert outcome is None, f"failed an attempt with {lease}"
            note_outcome("fail_attempt: rejected")
            self.assert_unchanged(before)
            return
        assert outcome is not None, f"refused to fail an attempt with the current lease {lease}"
        self.assert_unchanged(before, except_runs=[lease.run_id])
        assert outcome.attempt == model.attempt
        self.end_lease(model)
        model.error = error
        if model.attempt >= model.max_attempts:
            assert outcome.state is RunState.DEAD
            assert outcome.retry_at is None
            model.state = RunState.DEAD
            kind = "dead_lettered"
        else:
            assert outcome.state is RunState.WAITING
            assert outcome.retry_at is not None
            assert outcome.retry_at > self.db_now(), "a retry must wait for its backoff"
            model.state = RunState.WAITING
            model.due = False
            kind = "retry_scheduled"
        note_outcome(f"fail_attempt: {kind}")
        model.events.append(
            ExpectedEvent(
                kind,
                model.fence,
                lease.worker_id,
                {"attempt": model.attempt, "max_attempts": model.max_attempts, "error": error},
            )
        )

    # -- rules: operators ---------------------------------------------------------------------
    @precondition(has_runs)
    @rule(data=st.data(), reason=st.sampled_from((None, "operator")))
    def cancel(self, data: st.DataObject, reason: str | None) -> None:
        model = self.model[data.draw(st.sampled_from(list(self.model)), label="cancel")]
        run_id = model.run_id
        before = self.snapshot()
        if model.state not in ACTIVE_STATES:
            with pytest.raises(InvalidTransition):
                self.run(self.store.cancel(run_id, reason=reason))
            note_outcome("cancel: refused")
            self.assert_unchanged(before)
            return
        run = self.run(self.store.cancel(run_id, reason=reason))
        assert run.state is RunState.CANCELLED
        assert run.fence == before[0][run_id]["fence"] + 1, "a cancel raises the fence by one"
        note_outcome(f"cancel: cancelled ({model.state})")
        self.assert_unchanged(before, except_runs=[run_id])
        previous_state, previous_owner = model.state, model.owner
        model.state = RunState.CANCELLED
        model.fence += 1
        self.end_lease(model)
        model.events.append(
            ExpectedEvent(
                "cancelled",
                model.fence,
                None,
                {
                    "previous_state": previous_state.value,
                    "previous_owner": previous_owner,
                    "reason": reason,
                },
            )
        )

    @precondition(has_runs)
    @rule(data=st.data())
    def retry(self, data: st.DataObject) -> None:
        model = self.pick_run(data, lambda model: model.state is RunState.DEAD, "dead")
        run_id = model.run_id
        before = self.snapshot()
        if model.state is not RunState.DEAD:
            with pytest.raises(InvalidTransition):
                self.run(self.store.retry(run_id))
            note_outcome("retry: refused")
            self.assert_unchanged(before)
            return
        run = self.run(self.store.retry(run_id))
        assert run.state is RunState.QUEUED
        assert run.attempt == 0
        note_outcome("retry: requeued")
        self.assert_unchanged(before, except_runs=[run_id])
        model.state = RunState.QUEUED
        model.attempt = 0
        model.due = True
        model.events.append(
            ExpectedEvent("requeued", model.fence, None, {"previous_error": model.error})
        )

    # -- rules: time --------------------------------------------------------------------------
    @precondition(has_unexpired_leases)
    @rule(data=st.data())
    def expire(self, data: st.DataObject) -> None:
        """Time passes for one running run: its lease is now in the past."""
        running = [
            run_id
            for run_id, model in self.model.items()
            if model.state is RunState.RUNNING and not model.expired
        ]
        run_id = data.draw(st.sampled_from(running), label="expire the lease of")
        self.expire_lease(self.model[run_id])

    def expire_lease(self, model: ModelRun) -> None:
        status = self.execute(
            "UPDATE runs SET lease_until = clock_timestamp() - interval '1 second' "
            "WHERE run_id = $1 AND state = 'running'",
            model.run_id,
        )
        assert status == "UPDATE 1"
        model.expired = True

    @precondition(has_pending_retries)
    @rule(data=st.data())
    def make_due(self, data: st.DataObject) -> None:
        """Time passes for one waiting run: its retry is now due."""
        waiting = [
            run_id
            for run_id, model in self.model.items()
            if model.state is RunState.WAITING and not model.due
        ]
        model = self.model[data.draw(st.sampled_from(waiting), label="make due")]
        status = self.execute(
            "UPDATE runs SET available_at = clock_timestamp() - interval '1 second' "
            "WHERE run_id = $1 AND state = 'waiting'",
            model.run_id,
        )
        assert status == "UPDATE 1"
        model.due = True

    # -- invariants ---------------------------------------------------------------------------
    @invariant()
    def database_matches_model(self) -> None:
        async def read() -> tuple[list[asyncpg.Record], list[asyncpg.Record]]:
            async with self.env.pool.acquire() as connection:
                rows = await connection.fetch("SELECT *, clock_timestamp() AS db_now FROM runs")
                events = await connection.fetch(
                    "SELECT run_id, kind, fence, worker_id, details FROM run_events "
                    "ORDER BY event_id"
                )
            return rows, events

        rows, events = self.run(read())
        timelines: dict[str, list[asyncpg.Record]] = {}
        for event in events:
            timelines.setdefault(event["run_id"], []).append(event)
        assert {row["run_id"] for row in rows} == set(self.model)
        owners = 0
        for row in rows:
            model = self.model[row["run_id"]]
            self.check_row(row, model)
            self.check_timeline(timelines.get(model.run_id, []), model)
            owners += self.check_one_owner(row, model)
        assert owners == sum(
            model.state is RunState.RUNNING and not model.expired for model in self.model.values()
        )

    def check_row(self, row: asyncpg.Record, model: ModelRun) -> None:
        run_id, now = model.run_id, row["db_now"]
        run = Run.from_record(row)
        assert run.state is model.state, f"{run_id}: {run.state} but the model says {model.state}"
        assert run.fence >= self.highest_fence_seen.get(run_id, 0), f"{run_id}: fence went down"
        self.highest_fence_seen[run_id] = run.fence
        assert run.fence == model.fence
        assert run.attempt == model.attempt
        assert 0 <= run.attempt <= run.max_attempts == model.max_attempts
        assert run.checkpoint_version == model.version
        assert run.step == model.step
        assert run.checkpoint == model.checkpoint
        assert run.result == model.result
        assert run.error == model.error
        assert run.agent == model.agent
        assert run.input == model.input
        assert run.idempotency_key == model.idempotency_key
        assert run.lease_owner == model.owner
        running = run.state is RunState.RUNNING
        assert (run.lease_owner is not None) == running, f"{run_id}: owner set iff running"
        assert (run.lease_until is not None) == running, f"{run_id}: lease set iff running"
        if run.lease_until is not None:
            assert (run.lease_until < now) == model.expired
        assert (run.finished_at is not None) == run.state.terminal
        if run.state is RunState.QUEUED:
            assert run.available_at <= now, f"{run_id}: a queued run must be due at once"
        if run.state is RunState.WAITING:
            assert (run.available_at <= now) == model.due

    def check_timeline(self, events: list[asyncpg.Record], model: ModelRun) -> None:
        actual = [(event["kind"], event["fence"], event["worker_id"]) for event in events]
        expected = [(event.kind, event.fence, event.worker_id) for event in model.events]
        assert actual == expected, f"{model.run_id}: timeline differs from the model"
        for stored, wanted in zip(events, model.events, strict=True):
            details = stored["details"]
            for key, value in wanted.details.items():
                assert details.get(key) == value, (
                    f"{model.run_id}: {wanted.kind} event has {key}={details.get(key)!r}, "
                    f"expected {value!r}"
                )

    def check_one_owner(self, row: asyncpg.Record, model: ModelRun) -> int:
        """How many granted leases the row honours at this instant: at most one."""
        honoured = [
            lease
            for lease in self.issued
            if lease.run_id == model.run_id
            and row["state"] == "running"
            and row["lease_owner"] == lease.worker_id
            and row["fence"] == lease.fence
            and row["lease_until"] > row["db_now"]
        ]
        assert len(honoured) <= 1, f"{model.run_id}: several owners {honoured}"
        assert len(model.granted_fences) == len(set(model.granted_fences))
        return len(honoured)


SHRINK_SECONDS = 60
"""Hypothesis would shrink for five minutes; each attempt replays a run on the database."""


@pytest.mark.timeout(60 + 2 * SHRINK_SECONDS)
def test_run_state_machine_matches_model(
    database_factory: DatabaseFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Passing takes 15-30 s. A failure must still be reported (shrunk) before the test's timeout
    # fires: a timeout inside Hypothesis is seen as just another failure and loses the report.
    monkeypatch.setattr(hypothesis_engine, "MAX_SHRINKING_SECONDS", SHRINK_SECONDS, raising=False)
    with LoopThread() as loop:
        dsn = loop.run(database_factory.create())
        try:
            pool = loop.run(
                create_pool(
                    Settings(database_url=dsn), application_name="state-machine", max_size=4
                )
            )
            try:
                RunStateMachine.environment = Environment(
                    loop, pool, RunStore(pool, backoff=BACKOFF)
                )
                run_state_machine_as_test(RunStateMachine, settings=STATE_MACHINE_SETTINGS)
            finally:
                RunStateMachine.environment = None
                loop.run(pool.close())
        finally:
            loop.run(database_factory.drop(dsn))
