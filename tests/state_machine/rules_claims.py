"""Rules of the run state machine: submitting runs, claiming them, and using their leases."""

from __future__ import annotations

import pytest
from hypothesis import event as note_outcome
from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule

from orchestrator.errors import IdempotencyConflict
from orchestrator.models import RunState
from state_machine.base import RunMachineBase
from state_machine.model import (
    AGENTS,
    IDEMPOTENCY_KEYS,
    LEASE_SECONDS,
    WORKERS,
    ExpectedEvent,
    ModelRun,
)


class SubmitRules(RunMachineBase):
    """Submitting runs, with and without idempotency keys."""

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


class ClaimRules(RunMachineBase):
    """Claiming one run by id, or a batch of due runs by agent."""

    @precondition(RunMachineBase.has_runs)
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

    @precondition(RunMachineBase.has_runs)
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


class LeaseRules(RunMachineBase):
    """Renewing leases (one or many) and releasing them, with current, stale and forged leases."""

    @precondition(RunMachineBase.has_leases)
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

    @precondition(RunMachineBase.has_leases)
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

    @precondition(RunMachineBase.has_leases)
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
