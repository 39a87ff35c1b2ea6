"""Deliberately broken builds, for ``tests/test_chaos.py``: the chaos checker must catch each.

``python tests/support/chaos_mutants.py MUTANT ARGS...`` runs ``orchestrator ARGS...`` with the
mutant applied. The database-side mutants (``BOUNDARY_WITHOUT_FENCE_CHECK``,
``FENCES_WITHOUT_EPOCH``, ``CUTOVER_NOT_IN_FORCE``, ``CANCEL_WITHOUT_CASCADE``,
``CHILD_KEYS_NOT_UNIQUE``, and the schedules' ``FIRE_WITHOUT_FENCE_CHECK``,
``SLOTS_NOT_UNIQUE``, ``BUFFERED_START_UNRECORDED``, ``FIRST_SLOT_DROPPED``,
``MISSED_FORGOTTEN``, and live output's ``APPEND_WITHOUT_LEASE_CHECK``,
``STALE_APPENDS_RELABELLED``, ``SEAL_WITHOUT_RETRACTION``, ``RETRACTION_OF_COMMITTED_STEPS``,
``SEAL_ON_EXPIRY``, ``RETRACTION_SKIPS_A_POSITION``, ``PUBLISHER_RETRACTS_ANYTHING``) are SQL the
campaign (or a test) runs after migrating.
"""

from __future__ import annotations

import sys


def resend_uncertain() -> None:
    """The dispatcher sends an effect whose last send may have reached the vendor again without
    looking it up first."""
    from orchestrator.effects.store import ClaimedEffect

    ClaimedEffect.must_reconcile = property(lambda self: False)  # type: ignore[assignment,method-assign]


MUTANTS = {"resend-uncertain": resend_uncertain}


def redefined(function: str, old: str, new: str) -> str:
    """SQL that redefines every ``orchestrator.function`` with ``old`` replaced by ``new``, and
    fails when none has ``old`` (the function changed: the mutant must be updated)."""
    return f"""
DO $$
DECLARE
    function_id oid;
    definition text;
    changed integer := 0;
BEGIN
    FOR function_id IN
        SELECT oid FROM pg_proc
        WHERE proname = '{function}' AND pronamespace = 'orchestrator'::regnamespace
    LOOP
        definition := pg_get_functiondef(function_id);
        IF position({_literal(old)} IN definition) > 0 THEN
            EXECUTE replace(definition, {_literal(old)}, {_literal(new)});
            changed := changed + 1;
        END IF;
    END LOOP;
    IF changed = 0 THEN
        RAISE EXCEPTION '{function} changed: update this mutant';
    END IF;
END $$;
"""


def _literal(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


BOUNDARY_WITHOUT_FENCE_CHECK = redefined(
    "orchestrator_accept_effect", "IF p_fence < accepted_fence THEN", "IF false THEN"
)
"""The effect boundary no longer refuses a fence below its high-water mark."""

FENCES_WITHOUT_EPOCH = """
CREATE OR REPLACE FUNCTION orchestrator.fence_floor() RETURNS bigint LANGUAGE sql VOLATILE AS $$
    SELECT 0::bigint
$$;
"""
"""Claims count on from the promoted server's copy (greatest(fence + 1, 0)), as before fences
carried the WAL timeline's epoch: a fence the lost primary granted is granted again."""

CUTOVER_NOT_IN_FORCE = (
    "CREATE TABLE orchestrator.cutovers_nobody_reads "
    "(LIKE orchestrator.agent_cutovers INCLUDING ALL);"
) + redefined(
    "orchestrator_cutover",
    "INSERT INTO agent_cutovers AS c",
    "INSERT INTO cutovers_nobody_reads AS c",
)
"""A cutover that takes the runs old workers hold but records the version in force where no
claim or commit reads it: old workers go on claiming and committing the agent's runs."""

CANCEL_WITHOUT_CASCADE = redefined(
    "orchestrator_cancel_tree", "ON c.parent_run_id = t.run_id", "ON false"
)
"""A cancel that takes only the run it names, as before trees: the runs below it go on
committing steps and having their effects accepted."""

CHILD_KEYS_NOT_UNIQUE = "DROP INDEX orchestrator.runs_children;" + redefined(
    "orchestrator_spawn_children", "ON CONFLICT DO NOTHING", ""
)
"""A spawn that does not find the child a key already names: a step that names its children
again starts each one a second time."""

FIRE_WITHOUT_FENCE_CHECK = redefined(
    "orchestrator_fire_schedule", " AND x.lease_owner = p_worker AND x.fence = p_fence", ""
) + redefined(
    "orchestrator_fire_schedule",
    "AND x.lease_until > clock_timestamp() AND NOT x.paused",
    "AND NOT x.paused",
)
"""A schedule's fire that no longer checks it still holds the lease and fence its claim took: a
stale lease holder's fire (planned before it stopped) is decided as if it were current."""

SLOTS_NOT_UNIQUE = (
    FIRE_WITHOUT_FENCE_CHECK
    + "ALTER TABLE orchestrator.schedule_slots DROP CONSTRAINT schedule_slots_pkey;"
    + redefined(
        "orchestrator_start_scheduled_run",
        "'schedule:' || s.schedule_id",
        "p_run_id || ':schedule:' || s.schedule_id",
    )
    + redefined(
        "orchestrator_fire_schedule",
        "WHERE x.schedule_id = s.schedule_id AND x.slot = decided_slot) THEN",
        "WHERE false) THEN",
    )
)
"""No fence check, and nothing keeps a slot to one run: no key on the slot records, the run's
idempotency key made unique by its run id, and a fire that does not look for the slot's record:
a stale lease holder's fire starts each slot the newer claim started again."""

BUFFERED_START_UNRECORDED = redefined(
    "orchestrator_fire_schedule", "AND x.outcome = 'buffered'", "AND x.outcome = 'none'"
)
"""A buffered slot's run starts once the running run ends, but its record is not turned from
``buffered`` to ``fired`` with the run: the run has no record of its slot."""

FIRST_SLOT_DROPPED = redefined(
    "orchestrator_fire_schedule",
    "FOR i IN 1..coalesce(cardinality(p_slots), 0) LOOP",
    "FOR i IN 2..coalesce(cardinality(p_slots), 0) LOOP",
)
"""A fire that skips the first (oldest) slot it is given, records nothing of it and moves the
cursor past it: after an outage, the oldest slot caught up is lost."""

MISSED_FORGOTTEN = redefined(
    "orchestrator_fire_schedule", "missed = coalesce(p_missed, x.missed)", "missed = x.missed"
)
"""A fire that drops the summary of the slots its catch-up policy skipped: they are gone
without a word."""

APPEND_WITHOUT_LEASE_CHECK = redefined(
    "orchestrator_stream_append",
    "IF run.state IS DISTINCT FROM 'running' OR run.lease_owner IS DISTINCT FROM p_worker",
    "IF false",
) + redefined(
    "orchestrator_stream_append",
    "OR run.fence IS DISTINCT FROM p_fence OR NOT run.lease_until > clock_timestamp()",
    "OR false",
)
"""An append that no longer checks that its worker holds the run's lease under its fence (only
that the run is at its checkpoint version): an attempt that lost the run goes on adding to its
output."""

STALE_APPENDS_RELABELLED = APPEND_WITHOUT_LEASE_CHECK + redefined(
    "orchestrator_stream_append",
    "VALUES (p_run_id, stream.last_seq, p_fence, p_base_version, item ->> 'kind',",
    "VALUES (p_run_id, stream.last_seq, run.fence, run.checkpoint_version, item ->> 'kind',",
)
"""No fence check, and each event written under the run's fence and version instead of its
publisher's: a stale attempt's output passes for the current attempt's."""

SEAL_WITHOUT_RETRACTION = redefined(
    "orchestrator_stream_retract", "IF retracted > 0 THEN", "IF false THEN"
)
"""A seal (and a new owner's first append) that closes the lost attempt's fence without
retracting anything: its unfinished output stays current."""

RETRACTION_OF_COMMITTED_STEPS = redefined(
    "orchestrator_stream_retract", "AND o.base_version >= committed", ""
)
"""A retraction that takes back everything the lost attempt published, its committed steps'
output too."""

SEAL_ON_EXPIRY = redefined(
    "orchestrator_stream_seal",
    "AND (r.fence <> s.open_fence OR r.state <> 'running')) THEN",
    "AND (r.fence <> s.open_fence OR r.state <> 'running' "
    "OR r.lease_until <= clock_timestamp())) THEN",
) + redefined(
    "orchestrator_stream_seal",
    "OR (run.fence = stream.open_fence AND run.state = 'running') THEN",
    "OR (run.fence = stream.open_fence AND run.state = 'running' "
    "AND run.lease_until > clock_timestamp()) THEN",
)
"""A reader that seals on an expired lease alone: a step whose commit judged its lease just
before the expiry commits after its output was retracted."""

RETRACTION_SKIPS_A_POSITION = redefined(
    "orchestrator_stream_retract",
    "stream.last_seq := stream.last_seq + 1;",
    "stream.last_seq := stream.last_seq + 2;",
)
"""A lost attempt's retraction written one position further on than the next: a gap."""

PUBLISHER_RETRACTS_ANYTHING = redefined(
    "orchestrator_stream_append",
    "AND (o.fence <> p_fence OR o.base_version <> p_base_version)) THEN",
    "AND false) THEN",
)
"""A publisher's retraction accepted for any positions written before it: another attempt's
output, or its own committed steps'."""


if __name__ == "__main__":
    MUTANTS[sys.argv[1]]()
    from orchestrator.cli import main

    sys.argv = ["orchestrator", *sys.argv[2:]]
    main()
