-- Flow control for a fleet of runs (docs/flow-control.md): a run may carry a concurrency key
-- (a tenant, a customer) and a priority; limits bound how many runs of an agent run at once, in
-- all or per key; claims are shared fairly across keys.
--
-- A run counts against a limit exactly while it holds a lease: state 'running' and a lease that
-- has not ended (or ended within the last second, so that a renewal in flight at its last
-- instant cannot overfill a limit). Nothing else is counted, so nothing can leak: a killed
-- worker's slot is free when its lease runs out, a run parked in a wait or finished holds none.

ALTER TABLE runs
    ADD COLUMN concurrency_key text,
    ADD COLUMN priority integer NOT NULL DEFAULT 0,
    ADD CONSTRAINT runs_concurrency_key_check
        CHECK (concurrency_key IS NULL OR length(concurrency_key) BETWEEN 1 AND 200),
    ADD CONSTRAINT runs_priority_check CHECK (priority BETWEEN -1000 AND 1000);

-- Due runs without a key are claimed as before, oldest first, by an index that holds no keyed
-- run (a backlog of keyed runs must not be read by every plain claim); keyed ones are found key
-- by key, each key's highest priority first.
CREATE INDEX runs_due_plain ON runs (agent, available_at)
    WHERE state IN ('queued', 'waiting') AND concurrency_key IS NULL;
CREATE INDEX runs_due_keyed
    ON runs (agent, concurrency_key COLLATE "C", priority DESC, available_at)
    WHERE state IN ('queued', 'waiting') AND concurrency_key IS NOT NULL;
DROP INDEX runs_due;
-- A key's runs holding a lease. Only a running run has an owner (runs_lease_matches_state), so
-- the count names the owner, not the state: runs_running, which holds every running run of the
-- agent, cannot serve it. No index names lease_until, so that renewals stay HOT updates.
CREATE INDEX runs_leased_keyed ON runs (agent, concurrency_key)
    WHERE lease_owner IS NOT NULL AND concurrency_key IS NOT NULL;

-- A limit: at most max_running runs of agent whose key matches key_pattern hold a lease at
-- once, in all (per 'all') or for each key apart (per 'key'). key_pattern is a glob ('*' any
-- run; 'tenant-*'); with per 'all', '*' counts the runs without a key too.
CREATE TABLE flow_limits (
    agent text NOT NULL CHECK (agent ~ '^[A-Za-z][A-Za-z0-9_.-]{0,63}$'),
    key_pattern text NOT NULL CHECK (length(key_pattern) BETWEEN 1 AND 200),
    per text NOT NULL CHECK (per IN ('all', 'key')),
    max_running integer NOT NULL CHECK (max_running BETWEEN 0 AND 1000000),
    set_by text NOT NULL,
    set_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (agent, key_pattern, per)
);

-- Whether key (NULL: a run without one) matches a limit's glob.
CREATE FUNCTION orchestrator_key_matches(p_key text, p_pattern text, p_per text)
RETURNS boolean LANGUAGE sql IMMUTABLE AS $$
    SELECT CASE
        WHEN p_key IS NULL THEN p_pattern = '*' AND p_per = 'all'
        ELSE p_key LIKE replace(replace(replace(replace(p_pattern, '\', '\\'), '%', '\%'),
                                        '_', '\_'), '*', '%')
    END
$$;

-- How many runs of agent matching a limit hold a lease now (key: the one key of a 'key' limit,
-- counted through runs_running_keyed).
CREATE FUNCTION orchestrator_running(p_agent text, p_pattern text, p_per text, p_key text)
RETURNS integer LANGUAGE plpgsql STABLE SET search_path FROM CURRENT AS $$
BEGIN
    IF p_per = 'key' THEN
        RETURN (SELECT count(*) FROM runs
                WHERE agent = p_agent AND concurrency_key = p_key AND lease_owner IS NOT NULL
                  AND lease_until > clock_timestamp() - interval '1 second');
    END IF;
    RETURN (SELECT count(*) FROM runs
            WHERE agent = p_agent AND state = 'running'
              AND lease_until > clock_timestamp() - interval '1 second'
              AND orchestrator_key_matches(concurrency_key, p_pattern, 'all'));
END
$$;

-- The runs a claim of up to p_max runs of p_agents may take, in the order to take them, for
-- agents with a limit or keyed runs; its last row (run_id NULL) names the last key it looked at,
-- where the claimer's next claim goes on. Keys take turns: keys with due runs are found one
-- index probe each, in key order (COLLATE "C") after p_after, round to the first key; the runs
-- without a key are one more key; the r-th run of each key before the (r+1)-th of any; within a
-- key, higher priority first, then the oldest. Runs whose lease expired come first, as in the
-- plain claim. When the keys looked at cannot fill the claim (their limits are full), it looks
-- at the next ones, up to ten windows of keys. Every limit a run is under is locked
-- (pg_try_advisory_xact_lock, held to the claim's commit: a key another claimer holds is passed
-- over this time, never waited for), then counted by a statement that starts after the lock
-- was taken, so it sees every claim committed under that lock: two claimers never overfill a
-- limit, and claimers of unrelated keys never wait for each other. p_run_id: that run alone (a
-- takeover), if its limits allow it.
CREATE FUNCTION orchestrator_plan_claim(
    p_agents text[], p_max integer, p_include_expired boolean, p_run_id text, p_after text
) RETURNS TABLE (run_id text, next_key text)
LANGUAGE plpgsql VOLATILE SET search_path FROM CURRENT AS $$
#variable_conflict use_column
DECLARE
    candidate record;
    lim flow_limits;
    limits flow_limits[];
    under text[];
    agent_index integer := 1;
    key_found text;
    last_key text := p_after;
    wrapped boolean := p_after IS NULL;
    keys_done boolean := p_run_id IS NOT NULL;
    window_number integer := 0;
    turn_agents text[];
    turn_keys text[];
    per_key integer;
    left_of jsonb := '{}'::jsonb;
    refused jsonb := '{}'::jsonb;
    slot text;
    free integer;
    ok boolean;
    taken integer := 0;
BEGIN
    -- The limits of these agents, read once (most claims find none and check nothing per run).
    SELECT coalesce(array_agg(l), '{}') INTO limits
    FROM flow_limits AS l
    WHERE l.agent = ANY(p_agents)
       OR l.agent = (SELECT r.agent FROM runs AS r WHERE r.run_id = p_run_id);
    LOOP
        window_number := window_number + 1;
        turn_agents := '{}';
        turn_keys := '{}';
        -- The next window: keys with due runs, one index probe each ('' sorts before any key).
        WHILE NOT keys_done AND cardinality(turn_keys) < p_max - taken LOOP
            SELECT r.concurrency_key INTO key_found
            FROM runs AS r
            WHERE r.agent = p_agents[agent_index] AND r.state IN ('queued', 'waiting')
              AND r.concurrency_key IS NOT NULL
              AND r.concurrency_key COLLATE "C" > coalesce(last_key, '')
              AND r.concurrency_key COLLATE "C"
                  <= CASE WHEN wrapped THEN coalesce(p_after, chr(1114111)) ELSE chr(1114111) END
              AND r.available_at <= clock_timestamp()
            ORDER BY r.concurrency_key COLLATE "C"
            LIMIT 1;
            IF FOUND THEN
                turn_agents := turn_agents || p_agents[agent_index];
                turn_keys := turn_keys || key_found;
                last_key := key_found;
            ELSIF NOT wrapped THEN
                wrapped := true;  -- round again from the first key, up to p_after
                last_key := NULL;
            ELSIF agent_index < cardinality(p_agents) THEN
                agent_index := agent_index + 1;
                last_key := p_after;
                wrapped := p_after IS NULL;
            ELSE
                keys_done := true;
            END IF;
        END LOOP;
        -- Enough runs of each key for its turns: one key alone may fill the claim.
        per_key := CASE WHEN cardinality(turn_keys) <= 1 THEN p_max
                        ELSE p_max / cardinality(turn_keys) + 1 END;
        FOR candidate IN
            WITH keyed AS (
                SELECT k.agent, k.key AS concurrency_key, d.run_id, d.priority, k.ord,
                       row_number() OVER (PARTITION BY k.ord ORDER BY d.priority DESC,
                                          d.available_at) AS turn, d.available_at
                FROM unnest(turn_agents, turn_keys) WITH ORDINALITY AS k(agent, key, ord)
                CROSS JOIN LATERAL (
                    SELECT r.run_id, r.priority, r.available_at
                    FROM runs AS r
                    WHERE r.agent = k.agent AND r.concurrency_key COLLATE "C" = k.key
                      AND r.state IN ('queued', 'waiting') AND r.concurrency_key IS NOT NULL
                      AND r.available_at <= clock_timestamp()
                    ORDER BY r.concurrency_key COLLATE "C", r.priority DESC, r.available_at
                    LIMIT per_key
                ) AS d
            ), plain AS (
                SELECT r.agent, NULL::text AS concurrency_key, r.run_id, r.priority,
                       0::bigint AS ord,
                       row_number() OVER (PARTITION BY r.agent ORDER BY r.available_at) AS turn,
                       r.available_at
                FROM unnest(p_agents) AS a(agent)
                CROSS JOIN LATERAL (
                    SELECT r.run_id, r.agent, r.priority, r.available_at
                    FROM runs AS r
                    WHERE window_number = 1 AND p_run_id IS NULL AND r.agent = a.agent
                      AND r.state IN ('queued', 'waiting') AND r.concurrency_key IS NULL
                      AND r.available_at <= (SELECT clock_timestamp())
                    ORDER BY r.available_at
                    LIMIT per_key
                ) AS r
            ), expired AS (
                SELECT r.agent, r.concurrency_key, r.run_id, r.priority, 0::bigint AS ord,
                       0::bigint AS turn, r.available_at
                FROM runs AS r
                WHERE window_number = 1 AND p_run_id IS NULL AND p_include_expired
                  AND r.agent = ANY(p_agents) AND r.state = 'running'
                  AND r.lease_until < clock_timestamp()
                LIMIT p_max
            ), named AS (
                SELECT r.agent, r.concurrency_key, r.run_id, r.priority, 0::bigint AS ord,
                       0::bigint AS turn, r.available_at
                FROM runs AS r
                WHERE p_run_id IS NOT NULL AND r.run_id = p_run_id
            )
            SELECT * FROM expired UNION ALL SELECT * FROM named
            UNION ALL SELECT * FROM keyed UNION ALL SELECT * FROM plain
            ORDER BY turn, ord, priority DESC, available_at
        LOOP
            EXIT WHEN taken >= p_max;
            ok := true;
            under := '{}';
            FOREACH lim IN ARRAY limits LOOP
                CONTINUE WHEN lim.agent <> candidate.agent
                    OR NOT orchestrator_key_matches(candidate.concurrency_key, lim.key_pattern,
                                                    lim.per);
                slot := lim.per || chr(31) || candidate.agent || chr(31) || lim.key_pattern
                        || CASE WHEN lim.per = 'key' THEN chr(31) || candidate.concurrency_key
                                ELSE '' END;
                IF refused ? slot THEN
                    ok := false;
                    EXIT;
                END IF;
                IF NOT left_of ? slot THEN
                    IF NOT pg_try_advisory_xact_lock(hashtextextended(slot, 0)) THEN
                        refused := refused || jsonb_build_object(slot, true);
                        ok := false;
                        EXIT;
                    END IF;
                    -- A statement of its own: its snapshot starts after the lock was taken.
                    free := lim.max_running
                            - orchestrator_running(candidate.agent, lim.key_pattern, lim.per,
                                                   candidate.concurrency_key);
                    left_of := left_of || jsonb_build_object(slot, free);
                END IF;
                IF (left_of ->> slot)::integer <= 0 THEN
                    ok := false;
                    EXIT;
                END IF;
                under := under || slot;
            END LOOP;
            CONTINUE WHEN NOT ok;
            -- Take one slot of every limit the run is under.
            FOREACH slot IN ARRAY under LOOP
                left_of := jsonb_set(left_of, ARRAY[slot],
                                     to_jsonb((left_of ->> slot)::integer - 1));
            END LOOP;
            taken := taken + 1;
            run_id := candidate.run_id;
            next_key := NULL;
            RETURN NEXT;
        END LOOP;
        EXIT WHEN taken >= p_max OR keys_done OR window_number >= 10;
    END LOOP;
    run_id := NULL;
    next_key := last_key;
    RETURN NEXT;
END
$$;

-- A submission with a concurrency key and a priority (the earlier signature stays for the
-- previous release's clients, until a later release contracts it).
CREATE FUNCTION orchestrator_submit_run(
    p_run_id text, p_agent text, p_input jsonb, p_max_attempts integer, p_idempotency_key text,
    p_not_before timestamptz, p_traceparent text, p_concurrency_key text, p_priority integer
) RETURNS SETOF runs LANGUAGE sql SECURITY DEFINER SET search_path FROM CURRENT AS $$
WITH inserted AS (
    INSERT INTO runs (run_id, agent, input, max_attempts, idempotency_key, available_at,
                      concurrency_key, priority)
    SELECT p_run_id, p_agent, p_input, coalesce(p_max_attempts, 5), p_idempotency_key,
           coalesce(p_not_before, clock_timestamp()), p_concurrency_key, coalesce(p_priority, 0)
    WHERE orchestrator_submission_is_valid(p_run_id, p_agent, p_input, p_idempotency_key)
    ON CONFLICT DO NOTHING
    RETURNING *
), logged AS (
    INSERT INTO run_events (run_id, kind, fence, details)
    SELECT run_id, 'submitted', fence,
           jsonb_strip_nulls(jsonb_build_object(
               'agent', agent, 'max_attempts', max_attempts,
               'idempotency_key', idempotency_key, 'not_before', p_not_before,
               'concurrency_key', concurrency_key,
               'priority', CASE WHEN priority <> 0 THEN priority END))
    FROM inserted
), traced AS (
    INSERT INTO run_traces (run_id, fence, traceparent)
    SELECT run_id, 0, p_traceparent FROM inserted WHERE p_traceparent IS NOT NULL
), woken AS (
    SELECT pg_notify('orchestrator_runs', agent) FROM inserted
)
SELECT inserted.* FROM inserted WHERE (SELECT count(*) FROM woken) >= 0
$$;
REVOKE ALL ON FUNCTION orchestrator_submit_run(text, text, jsonb, integer, text, timestamptz,
                                               text, text, integer) FROM PUBLIC;

-- An operator sets or clears a limit, audited like every decision. A limit takes effect at the
-- next claim; lowering one never stops a running run (it only holds back the next claims).
CREATE FUNCTION orchestrator_set_limit(
    p_agent text, p_key_pattern text, p_per text, p_max_running integer,
    p_principal text, p_via text, p_typed_by text,
    OUT agent text, OUT key_pattern text, OUT per text, OUT max_running integer,
    OUT previous integer, OUT audit_seq bigint, OUT principal text
) LANGUAGE plpgsql SECURITY DEFINER SET search_path FROM CURRENT AS $$
#variable_conflict use_column
DECLARE
    who record;
BEGIN
    IF p_agent IS NULL OR p_agent !~ '^[A-Za-z][A-Za-z0-9_.-]{0,63}$'
       OR p_key_pattern IS NULL OR length(p_key_pattern) NOT BETWEEN 1 AND 200
       OR p_per IS NULL OR p_per NOT IN ('all', 'key')
       OR p_max_running IS NULL OR p_max_running NOT BETWEEN 0 AND 1000000 THEN
        RAISE EXCEPTION 'a limit needs an agent name, a key pattern of 1-200 characters, all '
                        'or key, and a most-running of 0 to 1000000'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    SELECT * INTO who FROM orchestrator_decider(p_principal, p_via, p_typed_by, 'operate');
    SELECT l.max_running INTO previous FROM flow_limits AS l
    WHERE l.agent = p_agent AND l.key_pattern = p_key_pattern AND l.per = p_per FOR UPDATE;
    INSERT INTO flow_limits (agent, key_pattern, per, max_running, set_by)
    VALUES (p_agent, p_key_pattern, p_per, p_max_running, who.principal)
    ON CONFLICT ON CONSTRAINT flow_limits_pkey DO UPDATE
    SET max_running = excluded.max_running, set_by = excluded.set_by,
        set_at = clock_timestamp();
    agent := p_agent;
    key_pattern := p_key_pattern;
    per := p_per;
    max_running := p_max_running;
    principal := who.principal;
    audit_seq := orchestrator_audit_decision(
        who.principal, who.via, 'limit_set', NULL, NULL,
        jsonb_build_object('agent', p_agent, 'key_pattern', p_key_pattern, 'per', p_per,
                           'max_running', p_max_running, 'previous', previous),
        p_typed_by);
    -- Raised: runs held back may be claimable now.
    PERFORM pg_notify('orchestrator_runs', p_agent);
END
$$;
REVOKE ALL ON FUNCTION orchestrator_set_limit(text, text, text, integer, text, text, text)
    FROM PUBLIC;

CREATE FUNCTION orchestrator_clear_limit(
    p_agent text, p_key_pattern text, p_per text, p_principal text, p_via text, p_typed_by text,
    OUT cleared integer, OUT audit_seq bigint, OUT principal text
) LANGUAGE plpgsql SECURITY DEFINER SET search_path FROM CURRENT AS $$
#variable_conflict use_column
DECLARE
    who record;
BEGIN
    SELECT * INTO who FROM orchestrator_decider(p_principal, p_via, p_typed_by, 'operate');
    DELETE FROM flow_limits AS l
    WHERE l.agent = p_agent AND l.key_pattern = p_key_pattern AND l.per = p_per
    RETURNING l.max_running INTO cleared;
    IF NOT FOUND THEN
        RETURN;  -- no such limit: nothing changed, nothing audited
    END IF;
    principal := who.principal;
    audit_seq := orchestrator_audit_decision(
        who.principal, who.via, 'limit_cleared', NULL, NULL,
        jsonb_build_object('agent', p_agent, 'key_pattern', p_key_pattern, 'per', p_per,
                           'max_running', cleared),
        p_typed_by);
    PERFORM pg_notify('orchestrator_runs', p_agent);
END
$$;
REVOKE ALL ON FUNCTION orchestrator_clear_limit(text, text, text, text, text, text) FROM PUBLIC;
