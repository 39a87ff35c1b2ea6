-- Forks that keep their receipts (docs/child-runs.md). An agent that keeps its checkpoints
-- (Agent(keep_checkpoints=True)) records each step commit's checkpoint in run_checkpoints, at
-- the end of the commit's transaction, after the effects it requested. A fork starts a new run
-- from one of them (or from the start); the effects the run had confirmed before that point are
-- copied into the fork as receipts, which its steps read and no dispatcher sends again.
--
-- Expand only: new columns, a new table and functions.

ALTER TABLE runs
    ADD COLUMN forked_from text,
    ADD COLUMN forked_at_version bigint;

CREATE TABLE run_checkpoints (
    run_id text NOT NULL REFERENCES runs (run_id) ON DELETE CASCADE,
    version bigint NOT NULL,
    step text NOT NULL,
    checkpoint jsonb,
    agent_version text,
    fence bigint NOT NULL,
    at timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (run_id, version)
);

-- Start run p_new_run_id from version p_version of run p_run_id's checkpoints (0: from the
-- start), audited (operate). The effects p_run_id had confirmed before that point are copied
-- into the fork as receipts; a fork is refused while an effect requested before that point is
-- not settled (it may yet be sent: the fork could send it a second time).
CREATE FUNCTION orchestrator_fork_run(
    p_run_id text, p_version bigint, p_new_run_id text, p_principal text, p_via text,
    p_typed_by text,
    OUT run_id text, OUT forked_from text, OUT version bigint, OUT step text,
    OUT receipts integer, OUT audit_seq bigint, OUT principal text
) LANGUAGE plpgsql SECURITY DEFINER SET search_path FROM CURRENT AS $$
#variable_conflict use_column
DECLARE
    who record;
    source runs;
    point run_checkpoints;
    until_at timestamptz := '-infinity';
    unsettled text;
    kept text;
BEGIN
    IF p_run_id IS NULL OR p_version IS NULL OR p_version < 0
       OR NOT orchestrator_submission_is_valid(p_new_run_id, 'fork', '{}'::jsonb, NULL) THEN
        RAISE EXCEPTION 'a fork needs a run, a checkpoint version of 0 or more (0: the start) '
                        'and a new run id'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    SELECT * INTO who FROM orchestrator_decider(p_principal, p_via, p_typed_by, 'operate');
    SELECT * INTO source FROM runs AS r WHERE r.run_id = p_run_id FOR SHARE;
    IF source.run_id IS NULL THEN
        RAISE EXCEPTION 'no run %', p_run_id USING ERRCODE = 'no_data_found';
    END IF;
    IF p_version > 0 THEN
        SELECT * INTO point FROM run_checkpoints AS c
        WHERE c.run_id = p_run_id AND c.version = p_version;
        IF point.run_id IS NULL THEN
            SELECT string_agg(c.version::text, ', ' ORDER BY c.version) INTO kept
            FROM run_checkpoints AS c WHERE c.run_id = p_run_id;
            RAISE EXCEPTION 'run % kept no checkpoint version % (kept: %; an agent keeps them '
                            'with Agent(keep_checkpoints=True))', p_run_id, p_version,
                            coalesce(kept, 'none')
                USING ERRCODE = 'invalid_parameter_value';
        END IF;
        until_at := point.at;
    END IF;
    SELECT string_agg(e.effect_key || ' (' || e.status || ')', ', ' ORDER BY e.effect_key)
    INTO unsettled
    FROM effects AS e
    WHERE e.run_id = p_run_id AND e.created_at < until_at
      AND e.status IN ('accepted', 'dispatching', 'uncertain', 'parked', 'awaiting_approval');
    IF unsettled IS NOT NULL THEN
        RAISE EXCEPTION 'run % has effects before that point that are not settled: %; settle '
                        'them first (the fork could send them a second time)',
                        p_run_id, unsettled
            USING ERRCODE = 'object_not_in_prerequisite_state';
    END IF;
    INSERT INTO runs (run_id, agent, input, max_attempts, available_at, step, checkpoint,
                      checkpoint_version, agent_version, started_version, concurrency_key,
                      priority, forked_from, forked_at_version)
    VALUES (p_new_run_id, source.agent, source.input, source.max_attempts, clock_timestamp(),
            point.step, point.checkpoint, p_version, point.agent_version,
            CASE WHEN p_version > 0 THEN source.started_version END, source.concurrency_key,
            source.priority, p_run_id, p_version);
    INSERT INTO effects (run_id, effect_key, kind, policy, fence, status, payload,
                         idempotency_key, external_id, result, error, attempts, available_at,
                         ever_dispatched, created_at, updated_at, settled_at, payload_sha256,
                         requires_approval, approved_sha256, decided_by, decided_at,
                         decision_note)
    SELECT p_new_run_id, e.effect_key, e.kind, e.policy, 0, e.status, e.payload,
           -- Unique per record; a receipt is never sent, so no vendor sees this key.
           e.idempotency_key || '@' || p_new_run_id, e.external_id, e.result, e.error, e.attempts, e.available_at,
           e.ever_dispatched, e.created_at, clock_timestamp(), e.settled_at, e.payload_sha256,
           e.requires_approval, e.approved_sha256, e.decided_by, e.decided_at, e.decision_note
    FROM effects AS e
    WHERE e.run_id = p_run_id AND e.created_at < until_at AND e.status = 'confirmed';
    GET DIAGNOSTICS receipts = ROW_COUNT;
    INSERT INTO run_events (run_id, kind, fence, details)
    VALUES (p_new_run_id, 'submitted', 0,
            jsonb_build_object('agent', source.agent, 'forked_from', p_run_id,
                               'at_version', p_version, 'receipts', receipts,
                               'by', who.principal)),
           (p_run_id, 'forked', source.fence,
            jsonb_build_object('fork', p_new_run_id, 'at_version', p_version,
                               'receipts', receipts, 'by', who.principal));
    run_id := p_new_run_id;
    forked_from := p_run_id;
    version := p_version;
    step := point.step;
    principal := who.principal;
    audit_seq := orchestrator_audit_decision(
        who.principal, who.via, 'fork', p_run_id, NULL,
        jsonb_build_object('fork', p_new_run_id, 'at_version', p_version,
                           'receipts', receipts),
        p_typed_by);
    PERFORM pg_notify('orchestrator_runs', source.agent);
END
$$;
REVOKE ALL ON FUNCTION orchestrator_fork_run(text, bigint, text, text, text, text) FROM PUBLIC;
