"""The invariant of the run state machine: the database matches the model after every step."""

from __future__ import annotations

import asyncpg
from hypothesis.stateful import invariant

from orchestrator.models import Run, RunState
from state_machine.base import RunMachineBase
from state_machine.model import ModelRun


class ModelInvariants(RunMachineBase):
    """Every run's row and timeline match the model, and no run honours two leases at once."""

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
