-- A dispatcher's claim reads only effects of the kinds it serves.
--
-- The claim read its candidates in the order of effects_due and effects_dispatching, with kind
-- only a filter: a backlog of a kind that this dispatcher does not serve (a vendor that is down,
-- a kind served by another dispatcher, or by none) was read past on every claim, so each claim
-- grew with that backlog. Keyed by kind first, each kind's candidates are read from their own
-- range of the index, in time order, up to the claim's limit.
--
-- Building them holds writes to effects (accepting an effect waits) for the build: about a
-- second per million effects waiting or in dispatch (the indexes are partial: settled effects
-- are not in them).
CREATE INDEX effects_due_by_kind ON effects (kind, available_at)
    WHERE status IN ('accepted', 'uncertain');
CREATE INDEX effects_dispatching_by_kind ON effects (kind, dispatcher_until)
    WHERE status = 'dispatching';
DROP INDEX effects_due;
DROP INDEX effects_dispatching;

-- The claim probes those indexes once per kind it serves, each kind once. Estimated as one row
-- (a dispatcher serves a few kinds; PostgreSQL would guess ten for an array parameter), the
-- claim keeps one generic plan instead of being planned afresh on every claim; plpgsql, so that
-- the estimate is not lost to inlining.
CREATE FUNCTION claim_kinds(p_kinds text[]) RETURNS SETOF text
LANGUAGE plpgsql IMMUTABLE ROWS 1 AS $$
BEGIN
    RETURN QUERY SELECT DISTINCT k FROM unnest(p_kinds) AS k;
END
$$;
