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

The machine is composed of one mixin per area, each on ``RunMachineBase`` (state, plumbing,
pickers, shared model transitions; ``state_machine_base.py``): submits, claims and leases
(``state_machine_rules_claims.py``), progress (``state_machine_rules_progress.py``), operators
and time (``state_machine_rules_operators.py``) and the invariant (``state_machine_invariants.py``).
The model and constants are in ``state_machine_model.py``.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis.internal.conjecture import engine as hypothesis_engine
from hypothesis.stateful import RuleBasedStateMachine, run_state_machine_as_test

from orchestrator.backoff import Backoff
from orchestrator.db.connections import create_pool
from orchestrator.db.store import RunStore
from orchestrator.settings import Settings
from orchestrator.testing import DatabaseFactory
from state_machine.invariants import ModelInvariants
from state_machine.model import Environment, LoopThread
from state_machine.rules_claims import ClaimRules, LeaseRules, SubmitRules
from state_machine.rules_operators import OperatorRules, TimeRules
from state_machine.rules_progress import ProgressRules

pytestmark = pytest.mark.slow

BACKOFF = Backoff(base_seconds=3600.0, max_seconds=7200.0)
"""The shortest retry delay is a tenth of the base: six minutes, so no retry comes due by itself."""

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


class RunStateMachine(
    SubmitRules,
    ClaimRules,
    LeaseRules,
    ProgressRules,
    OperatorRules,
    TimeRules,
    ModelInvariants,
    RuleBasedStateMachine,
):
    """The run state machine: the rules of every area, checked by the model's invariant."""


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
