-- A drained cutover (docs/upgrades.md), the gentle alternative to taking runs at once: from the
-- moment it commits, workers of other versions claim nothing of the agent, but each run one of
-- them holds may still commit the step it is in, under the fence it had. That commit (or a
-- final one) is the last: the worker gives the run back in the same transaction
-- (queries.sql: release_drained), and a worker of the new version claims it.
--
-- Expand only: a new table, a new column, a new overload. Workers of a release before this one
-- do not know a drain: their commits of a drained run are refused as after a plain cutover, and
-- the run is claimed by the new version once their lease ends.

ALTER TABLE agent_cutovers ADD COLUMN drain boolean NOT NULL DEFAULT false;

-- The runs a drain lets finish their step: (run, the fence its holder had at the cutover). A
-- row whose fence is no longer the run's allows nothing (the run was claimed again since).
CREATE TABLE cutover_drains (
    run_id text PRIMARY KEY REFERENCES runs (run_id) ON DELETE CASCADE,
    fence bigint NOT NULL,
    to_version text NOT NULL,
    since timestamptz NOT NULL DEFAULT clock_timestamp()
);

-- Cut agent p_agent over to version p_version (an operator's audited decision). p_drain false:
-- the runs workers of another version hold are taken from them at once (runs_cut); true: they
-- finish the step they are in first (runs_draining). A cutover to a lower version number than
-- the agent's cutover in force is refused (versions that are not whole numbers do not order,
-- and are taken as they come).
CREATE FUNCTION orchestrator_cutover(
    p_agent text, p_version text, p_drain boolean, p_principal text, p_via text,
    p_typed_by text,
    OUT agent text, OUT version text, OUT previous text, OUT drain boolean,
    OUT runs_cut integer, OUT runs_draining integer, OUT audit_seq bigint, OUT principal text
) LANGUAGE plpgsql SECURITY DEFINER SET search_path FROM CURRENT AS $$
#variable_conflict use_column
DECLARE
    who record;
    draining_only boolean := coalesce(p_drain, false);
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
    drain := draining_only;
    INSERT INTO agent_cutovers AS c (agent, version, set_by, drain)
    VALUES (p_agent, p_version, who.principal, draining_only)
    ON CONFLICT (agent) DO UPDATE
    SET version = excluded.version, set_by = excluded.set_by, set_at = clock_timestamp(),
        drain = excluded.drain;
    -- Rows of runs claimed again since, or ended, allow nothing: drop them.
    DELETE FROM cutover_drains AS d
    USING runs AS r
    WHERE r.run_id = d.run_id AND r.agent = p_agent
      AND (r.fence <> d.fence OR r.state <> 'running');
    runs_cut := 0;
    runs_draining := 0;
    IF draining_only THEN
        WITH target AS (
            SELECT r.run_id, r.fence, r.lease_owner
            FROM runs AS r
            WHERE r.agent = p_agent AND r.state = 'running'
              AND NOT EXISTS (
                  SELECT 1 FROM workers AS w
                  WHERE w.worker_id = r.lease_owner
                    AND w.agent_versions -> p_agent ->> 0 = p_version)
            FOR UPDATE
        ), draining AS (
            INSERT INTO cutover_drains AS d (run_id, fence, to_version)
            SELECT t.run_id, t.fence, p_version FROM target AS t
            ON CONFLICT (run_id) DO UPDATE
            SET fence = excluded.fence, to_version = excluded.to_version,
                since = clock_timestamp()
            RETURNING d.run_id, d.fence
        ), logged AS (
            INSERT INTO run_events (run_id, kind, fence, details)
            SELECT d.run_id, 'draining', d.fence,
                   jsonb_build_object('to_version', p_version, 'owner', t.lease_owner,
                                      'by', who.principal)
            FROM draining AS d JOIN target AS t USING (run_id)
        )
        SELECT count(*) INTO runs_draining FROM draining;
    ELSE
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
            -- Not the run's failure: the attempt the old worker made is not counted.
            UPDATE runs AS r
            SET state = 'queued', fence = greatest(r.fence + 1, (SELECT fence_floor())),
                lease_owner = NULL, lease_until = NULL, available_at = clock_timestamp(),
                attempt = greatest(r.attempt - 1, 0), updated_at = clock_timestamp()
            FROM target AS t
            WHERE r.run_id = t.run_id
            RETURNING r.run_id, r.fence, t.previous_owner
        ), undrained AS (
            DELETE FROM cutover_drains AS d USING cut AS c WHERE d.run_id = c.run_id
        ), logged AS (
            INSERT INTO run_events (run_id, kind, fence, details)
            SELECT c.run_id, 'cut_over', c.fence,
                   jsonb_build_object('to_version', p_version, 'previous_owner',
                                      c.previous_owner, 'by', who.principal)
            FROM cut AS c
        ), fenced AS (
            -- The effect boundary learns the new fence too: the old owner's requests are stale.
            INSERT INTO effect_fences (run_id, fence)
            SELECT c.run_id, c.fence FROM cut AS c
            ON CONFLICT (run_id) DO UPDATE
            SET fence = greatest(effect_fences.fence, EXCLUDED.fence),
                updated_at = clock_timestamp()
        ), told AS (
            -- The old owner stops the step at once (it could commit nothing anyway).
            SELECT pg_notify('orchestrator_cancel', c.run_id) FROM cut AS c
        )
        SELECT count(*) INTO runs_cut FROM cut WHERE (SELECT count(*) FROM told) >= 0;
    END IF;
    agent := p_agent;
    version := p_version;
    principal := who.principal;
    audit_seq := orchestrator_audit_decision(
        who.principal, who.via, 'agent_cutover', NULL, NULL,
        jsonb_build_object('agent', p_agent, 'version', p_version, 'previous', previous,
                           'drain', draining_only, 'runs_cut', runs_cut,
                           'runs_draining', runs_draining),
        p_typed_by);
    PERFORM pg_notify('orchestrator_runs', p_agent);  -- the new version's workers claim now
END
$$;
REVOKE ALL ON FUNCTION orchestrator_cutover(text, text, boolean, text, text, text) FROM PUBLIC;

-- The previous release's cutover: the same, without draining.
CREATE OR REPLACE FUNCTION orchestrator_cutover(
    p_agent text, p_version text, p_principal text, p_via text, p_typed_by text,
    OUT agent text, OUT version text, OUT previous text, OUT runs_cut integer,
    OUT audit_seq bigint, OUT principal text
) LANGUAGE sql SECURITY DEFINER SET search_path FROM CURRENT AS $$
    SELECT c.agent, c.version, c.previous, c.runs_cut, c.audit_seq, c.principal
    FROM orchestrator_cutover(p_agent, p_version, false, p_principal, p_via, p_typed_by) AS c
$$;
