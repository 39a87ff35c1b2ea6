"""Rules of the run state machine: operators' cancels and retries, and time passing."""

from __future__ import annotations

import pytest
from hypothesis import event as note_outcome
from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule

from orchestrator.errors import InvalidTransition
from orchestrator.models import RunState
from state_machine.base import RunMachineBase
from state_machine.model import ACTIVE_STATES, ExpectedEvent


class OperatorRules(RunMachineBase):
    """An operator cancelling any run, or retrying a dead one."""

    @precondition(RunMachineBase.has_runs)
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

    @precondition(RunMachineBase.has_runs)
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


class TimeRules(RunMachineBase):
    """Time passing: a running run's lease expires, or a waiting run's retry comes due."""

    @precondition(RunMachineBase.has_unexpired_leases)
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

    @precondition(RunMachineBase.has_pending_retries)
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
