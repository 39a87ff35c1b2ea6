-- Flow control, second part (docs/flow-control.md): limits an agent declares in its code, runs
-- held back and why, and rate limits shared by every worker and dispatcher (requests and tokens
-- per interval, for a model or an effect kind).

-- A limit an agent's code declares (Agent(limits=...)), written by the `serve` processes that
-- run it; an operator's `limits set` on the same agent, keys and per replaces it and is never
-- overwritten by code (declared false).
ALTER TABLE flow_limits ADD COLUMN declared boolean NOT NULL DEFAULT false;

-- Why a run is held back, for its timeline: the one hold in force per run, rewritten only when
-- it changes (a new fence, another limit), so a run passed over by claim after claim records
-- one event. A queued run's hold is judged afresh when it is read (orchestrator_held_by); a
-- running run's rate wait shows while its holder keeps renewing `until`.
CREATE TABLE run_holds (
    run_id text PRIMARY KEY REFERENCES runs (run_id) ON DELETE CASCADE,
    fence bigint NOT NULL,
    kind text NOT NULL CHECK (kind IN ('limit', 'rate')),
    reason text NOT NULL CHECK (length(reason) <= 500),
    since timestamptz NOT NULL DEFAULT clock_timestamp(),
    until timestamptz
);

-- A limit's name in holds, metrics and timelines.
CREATE FUNCTION orchestrator_limit_name(p_limit flow_limits) RETURNS text
LANGUAGE sql IMMUTABLE AS $$
    SELECT format('%s %s keys %s: at most %s running', p_limit.agent,
                  CASE WHEN p_limit.per = 'key' THEN 'per key,' ELSE 'in all,' END,
                  p_limit.key_pattern, p_limit.max_running)
$$;

-- Record that a run is held back (kind 'limit' or 'rate', by which limit), with a 'held_back'
-- event in its timeline when this is news for the run's fence. Read first: a claim that passes
-- the same run over again writes nothing.
CREATE FUNCTION orchestrator_hold_run(
    p_run_id text, p_kind text, p_reason text, p_until timestamptz
) RETURNS void LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path FROM CURRENT AS $$
DECLARE
    run_fence bigint;
    stamp timestamptz := clock_timestamp();
BEGIN
    SELECT r.fence INTO run_fence FROM runs AS r WHERE r.run_id = p_run_id;
    IF NOT FOUND OR EXISTS (
        SELECT FROM run_holds AS h
        WHERE h.run_id = p_run_id AND h.fence = run_fence AND h.kind = p_kind
          AND h.reason = p_reason
          AND (p_until IS NULL OR h.until >= p_until - interval '1 second')
    ) THEN
        RETURN;
    END IF;
    WITH held AS (
        INSERT INTO run_holds AS h (run_id, fence, kind, reason, since, until)
        VALUES (p_run_id, run_fence, p_kind, p_reason, stamp, p_until)
        ON CONFLICT (run_id) DO UPDATE
        SET fence = excluded.fence, kind = excluded.kind, reason = excluded.reason,
            until = excluded.until,
            since = CASE WHEN (h.fence, h.kind, h.reason)
                              = (excluded.fence, excluded.kind, excluded.reason)
                         THEN h.since ELSE excluded.since END
        RETURNING h.since = stamp AS news
    )
    INSERT INTO run_events (run_id, kind, fence, details)
    SELECT p_run_id, 'held_back', run_fence,
           jsonb_strip_nulls(jsonb_build_object('by', p_kind, 'limit', p_reason,
                                                'until', p_until))
    FROM held WHERE held.news;
END
$$;
REVOKE ALL ON FUNCTION orchestrator_hold_run(text, text, text, timestamptz) FROM PUBLIC;

-- The first limit that holds back a due run of agent with key now (NULL: none is full).
CREATE FUNCTION orchestrator_held_by(p_agent text, p_key text) RETURNS text
LANGUAGE sql STABLE SET search_path FROM CURRENT AS $$
    SELECT orchestrator_limit_name(l)
    FROM flow_limits AS l
    WHERE l.agent = p_agent AND orchestrator_key_matches(p_key, l.key_pattern, l.per)
      AND orchestrator_running(l.agent, l.key_pattern, l.per, p_key) >= l.max_running
    ORDER BY l.max_running, l.per DESC, l.key_pattern
    LIMIT 1
$$;

-- The planner of migration 0021, which now also records the runs it passes over for a full
-- limit (orchestrator_hold_run) and says in its last row how many (held_back); it walks a
-- window's keys in one statement and counts a key's leases inline, not through
-- orchestrator_running (docs/performance.md: a quarter more keyed claims per second).
DROP FUNCTION orchestrator_plan_claim(text[], integer, boolean, text, text);
CREATE FUNCTION orchestrator_plan_claim(
    p_agents text[], p_max integer, p_include_expired boolean, p_run_id text, p_after text
) RETURNS TABLE (run_id text, next_key text, held_back integer)
LANGUAGE plpgsql VOLATILE SET search_path FROM CURRENT AS $$
#variable_conflict use_column
DECLARE
    candidate record;
    lim flow_limits;
    limits flow_limits[];
    under text[];
    agent_index integer := 1;
    found_keys text[];
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
    held integer := 0;
    marked jsonb := '{}'::jsonb;
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
        -- The next window: keys with due runs, one index probe each ('' sorts before any key),
        -- walked in one statement (a recursive loose index scan) rather than one per key.
        WHILE NOT keys_done AND cardinality(turn_keys) < p_max - taken LOOP
            WITH RECURSIVE walk(key, n) AS (
                (SELECT r.concurrency_key COLLATE "C", 1
                 FROM runs AS r
                 WHERE r.agent = p_agents[agent_index] AND r.state IN ('queued', 'waiting')
                   AND r.concurrency_key IS NOT NULL
                   AND r.concurrency_key COLLATE "C" > coalesce(last_key, '')
                   AND r.concurrency_key COLLATE "C"
                       <= CASE WHEN wrapped THEN coalesce(p_after, chr(1114111))
                               ELSE chr(1114111) END
                   AND r.available_at <= clock_timestamp()
                 ORDER BY r.concurrency_key COLLATE "C"
                 LIMIT 1)
                UNION ALL
                SELECT (SELECT r.concurrency_key COLLATE "C"
                        FROM runs AS r
                        WHERE r.agent = p_agents[agent_index]
                          AND r.state IN ('queued', 'waiting')
                          AND r.concurrency_key IS NOT NULL
                          AND r.concurrency_key COLLATE "C" > w.key
                          AND r.concurrency_key COLLATE "C"
                              <= CASE WHEN wrapped THEN coalesce(p_after, chr(1114111))
                                      ELSE chr(1114111) END
                          AND r.available_at <= clock_timestamp()
                        ORDER BY r.concurrency_key COLLATE "C"
                        LIMIT 1), w.n + 1
                FROM walk AS w
                WHERE w.key IS NOT NULL AND w.n < p_max - taken - cardinality(turn_keys)
            )
            SELECT coalesce(array_agg(w.key::text ORDER BY w.n), '{}') INTO found_keys
            FROM walk AS w WHERE w.key IS NOT NULL;
            IF cardinality(found_keys) > 0 THEN
                turn_agents := turn_agents
                               || array_fill(p_agents[agent_index], ARRAY[cardinality(found_keys)]);
                turn_keys := turn_keys || found_keys;
                last_key := found_keys[cardinality(found_keys)];
            END IF;
            EXIT WHEN cardinality(turn_keys) >= p_max - taken;
            IF NOT wrapped THEN
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
                    IF lim.per = 'key' THEN  -- orchestrator_running's per-key count, inline
                        SELECT lim.max_running - count(*) INTO free FROM runs AS c
                        WHERE c.agent = candidate.agent
                          AND c.concurrency_key = candidate.concurrency_key
                          AND c.lease_owner IS NOT NULL
                          AND c.lease_until > clock_timestamp() - interval '1 second';
                    ELSE
                        free := lim.max_running
                                - orchestrator_running(candidate.agent, lim.key_pattern, 'all',
                                                       NULL);
                    END IF;
                    left_of := left_of || jsonb_build_object(slot, free);
                END IF;
                IF (left_of ->> slot)::integer <= 0 THEN
                    ok := false;
                    -- The first run this claim passes over for a full limit: its timeline says
                    -- so, once per claim of it (orchestrator_hold_run).
                    IF NOT marked ? slot THEN
                        marked := marked || jsonb_build_object(slot, true);
                        held := held + 1;
                        PERFORM orchestrator_hold_run(
                            candidate.run_id, 'limit', orchestrator_limit_name(lim), NULL);
                    END IF;
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
            held_back := NULL;
            RETURN NEXT;
        END LOOP;
        EXIT WHEN taken >= p_max OR keys_done OR window_number >= 10;
    END LOOP;
    run_id := NULL;
    next_key := last_key;
    held_back := held;
    RETURN NEXT;
END
$$;
-- An operator's limit replaces one the agent's code declared (declared false), and code never
-- overwrites it (orchestrator_declare_limits).
CREATE OR REPLACE FUNCTION orchestrator_set_limit(
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
    SET max_running = excluded.max_running, set_by = excluded.set_by, declared = false,
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

-- The limits an agent's code declares, written by each `serve` process that runs it: declared
-- rows of the agent not in p_limits are removed, the others set; a limit an operator set for the
-- same agent, keys and per is left as it is. p_limits: [{key_pattern, per, max_running}, ...].
-- Returns how many rows changed (0 when the code declares what the table holds).
CREATE FUNCTION orchestrator_declare_limits(p_agent text, p_limits jsonb, p_by text)
RETURNS integer LANGUAGE plpgsql SECURITY DEFINER SET search_path FROM CURRENT AS $$
DECLARE
    removed integer;
    written integer;
BEGIN
    IF p_agent IS NULL OR p_agent !~ '^[A-Za-z][A-Za-z0-9_.-]{0,63}$'
       OR p_limits IS NULL OR jsonb_typeof(p_limits) <> 'array'
       OR p_by IS NULL OR length(p_by) NOT BETWEEN 1 AND 200 THEN
        RAISE EXCEPTION 'declared limits need an agent name, a JSON array of limits and who '
                        'declares them' USING ERRCODE = 'invalid_parameter_value';
    END IF;
    DELETE FROM flow_limits AS l
    WHERE l.agent = p_agent AND l.declared
      AND (l.key_pattern, l.per) NOT IN (
          SELECT d.key_pattern, d.per
          FROM jsonb_to_recordset(p_limits) AS d(key_pattern text, per text, max_running integer)
          WHERE d.key_pattern IS NOT NULL AND d.per IS NOT NULL);
    GET DIAGNOSTICS removed = ROW_COUNT;
    INSERT INTO flow_limits AS l (agent, key_pattern, per, max_running, set_by, declared)
    SELECT p_agent, d.key_pattern, d.per, d.max_running, p_by, true
    FROM jsonb_to_recordset(p_limits) AS d(key_pattern text, per text, max_running integer)
    ON CONFLICT ON CONSTRAINT flow_limits_pkey DO UPDATE
    SET max_running = excluded.max_running, set_by = excluded.set_by, set_at = clock_timestamp()
    WHERE l.declared AND l.max_running <> excluded.max_running;
    GET DIAGNOSTICS written = ROW_COUNT;
    IF removed + written > 0 THEN
        PERFORM pg_notify('orchestrator_runs', p_agent);
    END IF;
    RETURN removed + written;
END
$$;
REVOKE ALL ON FUNCTION orchestrator_declare_limits(text, jsonb, text) FROM PUBLIC;

-- A rate limit shared by every worker and dispatcher: at most `requests` requests and `tokens`
-- tokens (either may be NULL: not limited) per `per_seconds`, as a token bucket that holds one
-- interval's worth (a burst of one interval, then the steady rate). Named for what it limits:
-- 'model:NAME' is charged by the model calls to NAME, 'effect:KIND' by the dispatcher's sends of
-- that kind, any other name by the steps that take it themselves. paused_until: a provider
-- answered 429 with Retry-After, so nobody sends until then; a row with neither limit only
-- carries such a pause.
CREATE TABLE rate_limits (
    name text PRIMARY KEY CHECK (name ~ '^[A-Za-z0-9][A-Za-z0-9_.:/@+-]{0,199}$'),
    requests integer CHECK (requests BETWEEN 1 AND 1000000000),
    tokens bigint CHECK (tokens BETWEEN 1 AND 1000000000000),
    per_seconds double precision NOT NULL CHECK (per_seconds BETWEEN 0.001 AND 604800),
    requests_left double precision NOT NULL DEFAULT 0,
    tokens_left double precision NOT NULL DEFAULT 0,
    refilled_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    paused_until timestamptz,
    paused_by text,
    set_by text NOT NULL,
    set_at timestamptz NOT NULL DEFAULT clock_timestamp()
);

-- Take up to p_requests requests and p_tokens tokens of rate limit p_name: how many requests
-- are granted (all, when there is no such limit) and, when not all, how long until the next
-- may be (the caller waits that long and asks again). Tokens are taken with the first request
-- granted, all or none (a model call takes one request and its estimated tokens), and may
-- overdraw the bucket: orchestrator_rate_settle corrects the estimate when the answer says
-- what the call cost. p_run_id, p_fence: the run that waits, whose timeline and listing say
-- so while it waits (only if the run holds that fence's lease).
CREATE FUNCTION orchestrator_rate_take(
    p_name text, p_requests integer, p_tokens bigint, p_run_id text, p_fence bigint,
    OUT granted integer, OUT wait_seconds double precision
) LANGUAGE plpgsql SECURITY DEFINER SET search_path FROM CURRENT AS $$
DECLARE
    lim rate_limits;
    stamp timestamptz := clock_timestamp();
    elapsed double precision;
    requests_free double precision;
    tokens_free double precision;
    tokens_needed double precision;
BEGIN
    IF p_name IS NULL OR p_requests IS NULL OR p_requests NOT BETWEEN 1 AND 1000000
       OR p_tokens IS NULL OR p_tokens NOT BETWEEN 0 AND 1000000000000 THEN
        RAISE EXCEPTION 'a rate limit is taken by name, 1 to 1000000 requests and 0 to '
                        '1000000000000 tokens' USING ERRCODE = 'invalid_parameter_value';
    END IF;
    SELECT * INTO lim FROM rate_limits AS l WHERE l.name = p_name FOR UPDATE;
    IF NOT FOUND THEN
        granted := p_requests;
        wait_seconds := 0;
        RETURN;
    END IF;
    elapsed := greatest(0, extract(epoch FROM stamp - lim.refilled_at));
    requests_free := CASE WHEN lim.requests IS NULL THEN 0 ELSE least(
        lim.requests, lim.requests_left + elapsed * lim.requests / lim.per_seconds) END;
    tokens_free := CASE WHEN lim.tokens IS NULL THEN 0 ELSE least(
        lim.tokens, lim.tokens_left + elapsed * lim.tokens / lim.per_seconds) END;
    tokens_needed := CASE WHEN lim.tokens IS NULL THEN 0 ELSE least(p_tokens, lim.tokens) END;
    IF lim.paused_until > stamp THEN
        granted := 0;
        wait_seconds := extract(epoch FROM lim.paused_until - stamp);
    ELSE
        granted := CASE WHEN lim.requests IS NULL THEN p_requests
                        ELSE least(p_requests, floor(requests_free)::integer) END;
        IF granted > 0 AND tokens_free < tokens_needed THEN
            granted := 0;
        END IF;
        wait_seconds := 0;
        IF granted < p_requests THEN
            wait_seconds := greatest(
                CASE WHEN lim.requests IS NULL THEN 0
                     ELSE (1 - (requests_free - granted)) * lim.per_seconds / lim.requests END,
                CASE WHEN lim.tokens IS NULL OR granted > 0 THEN 0
                     ELSE (tokens_needed - tokens_free) * lim.per_seconds / lim.tokens END,
                0.001);
        END IF;
    END IF;
    UPDATE rate_limits AS l
    SET requests_left = CASE WHEN lim.requests IS NULL THEN 0 ELSE requests_free - granted END,
        tokens_left = tokens_free - CASE WHEN granted > 0 AND lim.tokens IS NOT NULL
                                         THEN p_tokens ELSE 0 END,
        refilled_at = stamp
    WHERE l.name = p_name;
    IF p_run_id IS NOT NULL AND granted < p_requests AND EXISTS (
        SELECT FROM runs AS r
        WHERE r.run_id = p_run_id AND r.fence = p_fence AND r.state = 'running'
    ) THEN
        PERFORM orchestrator_hold_run(p_run_id, 'rate', 'rate limit ' || p_name,
                                      stamp + make_interval(secs => wait_seconds));
    END IF;
END
$$;
REVOKE ALL ON FUNCTION orchestrator_rate_take(text, integer, bigint, text, bigint) FROM PUBLIC;

-- What a call cost beyond (or below) the tokens taken for it: p_tokens more (fewer when
-- negative) are counted against the bucket, which never holds more than one interval's worth.
CREATE FUNCTION orchestrator_rate_settle(p_name text, p_tokens bigint)
RETURNS void LANGUAGE sql SECURITY DEFINER SET search_path FROM CURRENT AS $$
    UPDATE rate_limits AS l
    SET tokens_left = least(l.tokens::double precision,
                            l.tokens_left + greatest(0, extract(epoch FROM clock_timestamp()
                                                                 - l.refilled_at))
                                            * l.tokens / l.per_seconds
                            - p_tokens),
        requests_left = CASE WHEN l.requests IS NULL THEN 0 ELSE least(
            l.requests::double precision,
            l.requests_left + greatest(0, extract(epoch FROM clock_timestamp() - l.refilled_at))
                              * l.requests / l.per_seconds) END,
        refilled_at = clock_timestamp()
    WHERE l.name = p_name AND l.tokens IS NOT NULL
      AND p_tokens BETWEEN -1000000000000 AND 1000000000000 AND p_tokens <> 0
$$;
REVOKE ALL ON FUNCTION orchestrator_rate_settle(text, bigint) FROM PUBLIC;

-- A provider answered 429 with Retry-After: nobody takes p_name for p_seconds (at most an
-- hour), whether or not an operator set a limit of that name (then a row holds the pause
-- alone). A later pause never shortens an earlier one.
CREATE FUNCTION orchestrator_rate_pause(
    p_name text, p_seconds double precision, p_by text, OUT paused_until timestamptz
) LANGUAGE plpgsql SECURITY DEFINER SET search_path FROM CURRENT AS $$
#variable_conflict use_column
BEGIN
    IF p_name IS NULL OR p_name !~ '^[A-Za-z0-9][A-Za-z0-9_.:/@+-]{0,199}$'
       OR p_seconds IS NULL OR NOT (p_seconds >= 0 AND p_seconds <= 3600)
       OR p_by IS NULL OR length(p_by) NOT BETWEEN 1 AND 200 THEN
        RAISE EXCEPTION 'a pause needs a rate limit name, 0 to 3600 seconds and who asks'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    INSERT INTO rate_limits AS l (name, per_seconds, paused_until, paused_by, set_by)
    VALUES (p_name, 60, clock_timestamp() + make_interval(secs => p_seconds), p_by, p_by)
    ON CONFLICT (name) DO UPDATE
    SET paused_until = greatest(l.paused_until, excluded.paused_until),
        paused_by = CASE WHEN l.paused_until >= excluded.paused_until THEN l.paused_by
                         ELSE excluded.paused_by END
    RETURNING l.paused_until INTO paused_until;
END
$$;
REVOKE ALL ON FUNCTION orchestrator_rate_pause(text, double precision, text) FROM PUBLIC;

-- An operator sets or clears a rate limit, audited like every decision. Setting keeps what is
-- left of the current interval (never more than the new limit); a new limit starts full.
CREATE FUNCTION orchestrator_set_rate_limit(
    p_name text, p_requests integer, p_tokens bigint, p_per_seconds double precision,
    p_principal text, p_via text, p_typed_by text,
    OUT name text, OUT requests integer, OUT tokens bigint, OUT per_seconds double precision,
    OUT audit_seq bigint, OUT principal text
) LANGUAGE plpgsql SECURITY DEFINER SET search_path FROM CURRENT AS $$
#variable_conflict use_column
DECLARE
    who record;
BEGIN
    IF p_name IS NULL OR p_name !~ '^[A-Za-z0-9][A-Za-z0-9_.:/@+-]{0,199}$'
       OR (p_requests IS NULL AND p_tokens IS NULL)
       OR p_requests NOT BETWEEN 1 AND 1000000000 OR p_tokens NOT BETWEEN 1 AND 1000000000000
       OR p_per_seconds IS NULL OR NOT (p_per_seconds >= 0.001 AND p_per_seconds <= 604800) THEN
        RAISE EXCEPTION 'a rate limit needs a name, requests (1 to 1000000000) or tokens (1 to '
                        '1000000000000) or both, per 0.001 to 604800 seconds'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    SELECT * INTO who FROM orchestrator_decider(p_principal, p_via, p_typed_by, 'operate');
    INSERT INTO rate_limits AS l (name, requests, tokens, per_seconds, requests_left,
                                  tokens_left, set_by)
    VALUES (p_name, p_requests, p_tokens, p_per_seconds, coalesce(p_requests, 0),
            coalesce(p_tokens, 0), who.principal)
    ON CONFLICT (name) DO UPDATE
    SET requests = excluded.requests, tokens = excluded.tokens,
        per_seconds = excluded.per_seconds,
        requests_left = CASE WHEN l.requests IS NULL THEN excluded.requests_left
                             ELSE least(l.requests_left, excluded.requests_left) END,
        tokens_left = CASE WHEN l.tokens IS NULL THEN excluded.tokens_left
                           ELSE least(l.tokens_left, excluded.tokens_left) END,
        set_by = excluded.set_by, set_at = clock_timestamp();
    name := p_name;
    requests := p_requests;
    tokens := p_tokens;
    per_seconds := p_per_seconds;
    principal := who.principal;
    audit_seq := orchestrator_audit_decision(
        who.principal, who.via, 'rate_limit_set', NULL, NULL,
        jsonb_strip_nulls(jsonb_build_object('name', p_name, 'requests', p_requests,
                                             'tokens', p_tokens, 'per_seconds', p_per_seconds)),
        p_typed_by);
END
$$;
REVOKE ALL ON FUNCTION orchestrator_set_rate_limit(text, integer, bigint, double precision, text,
                                                   text, text) FROM PUBLIC;

CREATE FUNCTION orchestrator_clear_rate_limit(
    p_name text, p_principal text, p_via text, p_typed_by text,
    OUT cleared text, OUT audit_seq bigint, OUT principal text
) LANGUAGE plpgsql SECURITY DEFINER SET search_path FROM CURRENT AS $$
#variable_conflict use_column
DECLARE
    who record;
BEGIN
    SELECT * INTO who FROM orchestrator_decider(p_principal, p_via, p_typed_by, 'operate');
    DELETE FROM rate_limits AS l WHERE l.name = p_name RETURNING l.name INTO cleared;
    IF NOT FOUND THEN
        RETURN;  -- no such limit: nothing changed, nothing audited
    END IF;
    principal := who.principal;
    audit_seq := orchestrator_audit_decision(
        who.principal, who.via, 'rate_limit_cleared', NULL, NULL,
        jsonb_build_object('name', p_name), p_typed_by);
END
$$;
REVOKE ALL ON FUNCTION orchestrator_clear_rate_limit(text, text, text, text) FROM PUBLIC;
