-- A fenced cutover of an agent to a version of its code (docs/upgrades.md): from the moment it
-- commits, only workers running that version claim or commit runs of the agent. Every run an
-- older worker holds is taken from it in the same transaction (its fence raised, its lease
-- ended, due at once), so its next commit or effect request is refused at the boundary, as a
-- cancel's is; no draining is needed.

CREATE TABLE agent_cutovers (
    agent text PRIMARY KEY CHECK (agent ~ '^[A-Za-z][A-Za-z0-9_.-]{0,63}$'),
    version text NOT NULL CHECK (version ~ '^[A-Za-z0-9][A-Za-z0-9._+-]{0,63}$'),
    set_by text NOT NULL,
    set_at timestamptz NOT NULL DEFAULT clock_timestamp()
);

-- Cut agent p_agent over to version p_version (an operator's audited decision): returns how
-- many runs were taken from workers of another version. A cutover to a lower version number
-- than the agent's cutover in force is refused (versions that are not whole numbers do not
-- order, and are taken as they come).
CREATE FUNCTION orchestrator_cutover(
    p_agent text, p_version text, p_principal text, p_via text, p_typed_by text,
    OUT agent text, OUT version text, OUT previous text, OUT runs_cut integer,
    OUT audit_seq bigint, OUT principal text
) LANGUAGE plpgsql SECURITY DEFINER SET search_path FROM CURRENT AS $$
#variable_conflict use_column
DECLARE
    who record;
BEGIN
    IF p_agent IS NULL OR p_agent !~ '^[A-Za-z][A-Za-z0-9_.-]{0,63}$'
       OR p_version IS NULL OR p_version !~ '^[A-Za-z0-9][A-Za-z0-9._+-]{0,63}$' THEN
        RAISE EXCEPTION 'a cutover needs an agent name and a version (a whole number from 1, or '
                        '1-64 letters, digits and ._+-)'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    SELECT * INTO who FROM orchestrator_decider(p_principal, p_via, p_typed_by, 'operate');
    SELECT c.version INTO previous FROM agent_cutovers AS c WHERE c.agent = p_agent FOR UPDATE;
    IF previous ~ '^[0-9]{1,18}$' AND p_version ~ '^[0-9]{1,18}$'
       AND p_version::bigint < previous::bigint THEN
        RAISE EXCEPTION 'agent % is cut over to version % already: a cutover to the older '
                        'version % is refused', p_agent, previous, p_version
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    INSERT INTO agent_cutovers AS c (agent, version, set_by)
    VALUES (p_agent, p_version, who.principal)
    ON CONFLICT (agent) DO UPDATE
    SET version = excluded.version, set_by = excluded.set_by, set_at = clock_timestamp();
    WITH target AS (
        SELECT r.run_id, r.lease_owner AS previous_owner
        FROM runs AS r
        WHERE r.agent = p_agent AND r.state = 'running'
          AND NOT EXISTS (
              SELECT 1 FROM workers AS w
              WHERE w.worker_id = r.lease_owner
                AND w.agent_versions -> p_agent ->> 0 = p_version)
        FOR UPDATE
    ), cut AS (
        UPDATE runs AS r
        SET state = 'queued', fence = greatest(r.fence + 1, (SELECT fence_floor())),
            lease_owner = NULL, lease_until = NULL, available_at = clock_timestamp(),
            updated_at = clock_timestamp()
        FROM target AS t
        WHERE r.run_id = t.run_id
        RETURNING r.run_id, r.fence, t.previous_owner
    ), logged AS (
        INSERT INTO run_events (run_id, kind, fence, details)
        SELECT c.run_id, 'cut_over', c.fence,
               jsonb_build_object('to_version', p_version, 'previous_owner', c.previous_owner,
                                  'by', who.principal)
        FROM cut AS c
    ), fenced AS (
        -- The effect boundary learns the new fence too: the old owner's requests are stale.
        INSERT INTO effect_fences (run_id, fence)
        SELECT c.run_id, c.fence FROM cut AS c
        ON CONFLICT (run_id) DO UPDATE
        SET fence = greatest(effect_fences.fence, EXCLUDED.fence), updated_at = clock_timestamp()
    ), told AS (
        -- The old owner stops the step at once (it could commit nothing anyway).
        SELECT pg_notify('orchestrator_cancel', c.run_id) FROM cut AS c
    )
    SELECT count(*) INTO runs_cut FROM cut WHERE (SELECT count(*) FROM told) >= 0;
    agent := p_agent;
    version := p_version;
    principal := who.principal;
    audit_seq := orchestrator_audit_decision(
        who.principal, who.via, 'agent_cutover', NULL, NULL,
        jsonb_build_object('agent', p_agent, 'version', p_version, 'previous', previous,
                           'runs_cut', runs_cut),
        p_typed_by);
    PERFORM pg_notify('orchestrator_runs', p_agent);  -- the new version's workers claim now
END
$$;
REVOKE ALL ON FUNCTION orchestrator_cutover(text, text, text, text, text) FROM PUBLIC;
