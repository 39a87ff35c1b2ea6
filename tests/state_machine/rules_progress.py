"""Rules of the run state machine: step commits, finishes and failed attempts."""

from __future__ import annotations

import pytest
from hypothesis import event as note_outcome
from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule

from orchestrator.db.store import RunFinish, StepCommit, StepEvent
from orchestrator.models import JSON, CommitResult, RunState
from state_machine.base import RunMachineBase
from state_machine.model import (
    CHECKPOINTS,
    EXTRA_EVENTS,
    FINAL_CHECKPOINTS,
    STEP_NAMES,
    VERSION_OFFSETS,
    Boom,
    ExpectedEvent,
    ModelRun,
    refusal,
)


class ProgressRules(RunMachineBase):
    """Step commits (alone, in a transaction, rolled back, grouped), finishes, failed attempts."""

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

    @precondition(RunMachineBase.has_leases)
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

    @precondition(RunMachineBase.has_leases)
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

    @precondition(RunMachineBase.has_leases)
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

    @precondition(RunMachineBase.has_leases)
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

    @precondition(RunMachineBase.has_leases)
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
