"""The state, plumbing and helpers every rule of the run state machine shares."""

from __future__ import annotations

from collections.abc import Callable, Coroutine, Sequence
from datetime import datetime
from typing import Any, ClassVar, TypeVar

from hypothesis import strategies as st

from orchestrator.models import ClaimedRun, Lease, RunState
from state_machine.model import (
    VERSION_OFFSETS,
    WORKERS,
    Environment,
    ExpectedEvent,
    ModelRun,
    Snapshot,
)

T = TypeVar("T")


class RunMachineBase:
    """The machine's state and database plumbing, model transitions and pickers shared by rules."""

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

    def expire_lease(self, model: ModelRun) -> None:
        status = self.execute(
            "UPDATE runs SET lease_until = clock_timestamp() - interval '1 second' "
            "WHERE run_id = $1 AND state = 'running'",
            model.run_id,
        )
        assert status == "UPDATE 1"
        model.expired = True

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
