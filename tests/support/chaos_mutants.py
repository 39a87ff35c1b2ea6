"""Deliberately broken builds, for ``tests/test_chaos.py``: the chaos checker must catch each.

``python tests/support/chaos_mutants.py MUTANT ARGS...`` runs ``orchestrator ARGS...`` with the
mutant applied. The database-side mutants (``BOUNDARY_WITHOUT_FENCE_CHECK``,
``FENCES_WITHOUT_EPOCH``, ``CUTOVER_NOT_IN_FORCE``) are SQL the campaign runs after migrating.
"""

from __future__ import annotations

import sys


def resend_uncertain() -> None:
    """The dispatcher sends an effect whose last send may have reached the vendor again without
    looking it up first."""
    from orchestrator.effects.store import ClaimedEffect

    ClaimedEffect.must_reconcile = property(lambda self: False)  # type: ignore[assignment,method-assign]


MUTANTS = {"resend-uncertain": resend_uncertain}

BOUNDARY_WITHOUT_FENCE_CHECK = """
DO $$
DECLARE definition text;
BEGIN
    definition := pg_get_functiondef('orchestrator.orchestrator_accept_effect'::regproc);
    IF position('IF p_fence < accepted_fence THEN' IN definition) = 0 THEN
        RAISE EXCEPTION 'the boundary function changed: update this mutant';
    END IF;
    EXECUTE replace(definition, 'IF p_fence < accepted_fence THEN', 'IF false THEN');
END $$;
"""
"""The effect boundary no longer refuses a fence below its high-water mark."""

FENCES_WITHOUT_EPOCH = """
CREATE OR REPLACE FUNCTION orchestrator.fence_floor() RETURNS bigint LANGUAGE sql VOLATILE AS $$
    SELECT 0::bigint
$$;
"""
"""Claims count on from the promoted server's copy (greatest(fence + 1, 0)), as before fences
carried the WAL timeline's epoch: a fence the lost primary granted is granted again."""

CUTOVER_NOT_IN_FORCE = """
CREATE TABLE orchestrator.cutovers_nobody_reads (LIKE orchestrator.agent_cutovers INCLUDING ALL);
DO $$
DECLARE
    function_id oid;
    definition text;
    changed integer := 0;
BEGIN
    FOR function_id IN
        SELECT oid FROM pg_proc
        WHERE proname = 'orchestrator_cutover' AND pronamespace = 'orchestrator'::regnamespace
    LOOP
        definition := pg_get_functiondef(function_id);
        IF position('INSERT INTO agent_cutovers AS c' IN definition) > 0 THEN
            EXECUTE replace(definition, 'INSERT INTO agent_cutovers AS c',
                            'INSERT INTO cutovers_nobody_reads AS c');
            changed := changed + 1;
        END IF;
    END LOOP;
    IF changed = 0 THEN
        RAISE EXCEPTION 'the cutover function changed: update this mutant';
    END IF;
END $$;
"""
"""A cutover that takes the runs old workers hold but records the version in force where no
claim or commit reads it: old workers go on claiming and committing the agent's runs."""


if __name__ == "__main__":
    MUTANTS[sys.argv[1]]()
    from orchestrator.cli import main

    sys.argv = ["orchestrator", *sys.argv[2:]]
    main()
