-- The claim planner of migration 0022, judged in sets (docs/flow-control.md, docs/performance.md).
-- A window's keys are walked with each key's first run (the walk read it anyway), and the slots
-- of every limit those runs are under are locked in the same statement; one more statement, whose
-- snapshot starts after the locks were taken, counts the room and judges every candidate at once.
-- No statement and no loop turn per run. When each key appears once and every limit is per key
-- (the claim of a busy worker over many keys), a run is taken while its key's tightest limit has
-- room; otherwise a key's limits are judged first, in candidate order within the key, then the
-- limits over all keys among the runs their keys' limits let through. The semantics are the
-- planner's:
--
-- - a run is taken only while every limit it is under has room, counted from the leases held now
--   (the lock on a limit's slot is taken before the count is read, so two claimers never count
--   the same room), minus the runs this claim already took under it;
-- - a slot another claimer holds locked is passed over, without a hold;
-- - the first run a claim passes over for a full limit is recorded as held back by it.
--
-- One difference: where two limits over all keys overlap, a run passed over by one still counts
-- as taking room of the other within the window, so a claim may take fewer runs than it could,
-- never more; the next claim takes them.

-- A limit's slot for a run of agent with key: what a claim locks before counting the limit's
-- room (orchestrator_lock_slot), and what its room is known by. The pattern's length comes
-- first, so that no pattern and key can spell another pair's slot (both may hold any character
-- but NUL); cast to text, because text || integer is only stable, and a body less than immutable
-- keeps the function from being inlined into the planner's statements (a call per slot).
CREATE FUNCTION orchestrator_limit_slot(p_limit flow_limits, p_agent text, p_key text)
RETURNS text LANGUAGE sql IMMUTABLE AS $$
    SELECT p_limit.per || chr(31) || p_agent || chr(31) || length(p_limit.key_pattern)::text
           || chr(31) || p_limit.key_pattern
           || CASE WHEN p_limit.per = 'key' THEN chr(31) || p_key ELSE '' END
$$;

-- Try to lock a slot until the transaction ends; every statement that locks one calls this, so
-- that all claimers lock the same key for it. The schema's name is in the hash: advisory locks
-- are per database, and two schemas' claimers must not refuse each other.
CREATE FUNCTION orchestrator_lock_slot(p_slot text) RETURNS boolean
LANGUAGE sql VOLATILE AS $$
    SELECT pg_try_advisory_xact_lock(hashtextextended(p_slot || chr(31) || current_schema(), 0))
$$;

CREATE OR REPLACE FUNCTION orchestrator_plan_claim(
    p_agents text[], p_max integer, p_include_expired boolean, p_run_id text, p_after text
) RETURNS TABLE (run_id text, next_key text, held_back integer)
LANGUAGE plpgsql VOLATILE SET search_path FROM CURRENT
-- Its statements are planned once for any arguments: planned afresh at every claim, as a session
-- left to choose does, they cost more than they run.
SET plan_cache_mode = force_generic_plan AS $$
#variable_conflict use_column
DECLARE
    limits flow_limits[];
    agent_index integer := 1;
    last_key text := p_after;
    wrapped boolean := p_after IS NULL;
    keys_done boolean := p_run_id IS NOT NULL;
    window_number integer := 0;
    found_keys text[];
    found_runs text[];
    turn_agents text[];
    turn_keys text[];
    turn_runs text[];
    per_key integer;
    each_key_once boolean;
    keys_only boolean;
    plain_due boolean;
    candidate_agents text[];
    candidate_keys text[];
    candidate_runs text[];
    locked text[] := '{}';
    refused text[] := '{}';
    taken_slots text[] := '{}';
    marked text[] := '{}';
    picked text[];
    picked_slots text[];
    hold_runs text[];
    hold_slots text[];
    hold_names text[];
    taken integer := 0;
    held integer := 0;
BEGIN
    -- The limits of these agents, read once (most claims find none and check nothing per run);
    -- whether they are all per key; whether any of the agents has a due run without a key (the
    -- first window's candidates then include some): one probe of runs_due_plain per agent.
    SELECT coalesce(array_agg(l ORDER BY l.agent, l.key_pattern, l.per), '{}'),
           NOT coalesce(bool_or(l.per = 'all'), false),
           EXISTS (SELECT FROM unnest(p_agents) AS a(agent)
                   CROSS JOIN LATERAL (
                       SELECT FROM runs AS r
                       WHERE r.agent = a.agent AND r.state IN ('queued', 'waiting')
                         AND r.concurrency_key IS NULL
                         AND r.available_at <= (SELECT clock_timestamp())
                       ORDER BY r.available_at
                       LIMIT 1
                   ) AS due)
    INTO limits, keys_only, plain_due
    FROM flow_limits AS l
    WHERE l.agent = ANY(p_agents)
       OR l.agent = (SELECT r.agent FROM runs AS r WHERE r.run_id = p_run_id);
    LOOP
        window_number := window_number + 1;
        turn_agents := '{}';
        turn_keys := '{}';
        turn_runs := '{}';
        -- The next window: keys with due runs, each with its first run (highest priority, then
        -- oldest: the index's first due entry for the key), one index probe per key, walked in
        -- one statement (a recursive loose index scan); '' sorts before any key.
        WHILE NOT keys_done AND cardinality(turn_keys) < p_max - taken LOOP
            WITH RECURSIVE walk(key, run_id, n) AS (
                (SELECT r.concurrency_key COLLATE "C", r.run_id, 1
                 FROM runs AS r
                 WHERE r.agent = p_agents[agent_index] AND r.state IN ('queued', 'waiting')
                   AND r.concurrency_key IS NOT NULL
                   AND r.concurrency_key COLLATE "C" > coalesce(last_key, '')
                   AND r.concurrency_key COLLATE "C"
                       <= CASE WHEN wrapped THEN coalesce(p_after, chr(1114111))
                               ELSE chr(1114111) END
                   AND r.available_at <= clock_timestamp()
                 ORDER BY r.concurrency_key COLLATE "C", r.priority DESC, r.available_at
                 LIMIT 1)
                UNION ALL
                SELECT next.key, next.run_id, w.n + 1
                FROM walk AS w
                CROSS JOIN LATERAL (
                    SELECT r.concurrency_key COLLATE "C" AS key, r.run_id
                    FROM runs AS r
                    WHERE r.agent = p_agents[agent_index]
                      AND r.state IN ('queued', 'waiting') AND r.concurrency_key IS NOT NULL
                      AND r.concurrency_key COLLATE "C" > w.key
                      AND r.concurrency_key COLLATE "C"
                          <= CASE WHEN wrapped THEN coalesce(p_after, chr(1114111))
                                  ELSE chr(1114111) END
                      AND r.available_at <= clock_timestamp()
                    ORDER BY r.concurrency_key COLLATE "C", r.priority DESC, r.available_at
                    LIMIT 1
                ) AS next
                WHERE w.n < p_max - taken - cardinality(turn_keys)
            ), tried AS (
                -- The slot of every limit these keys' runs are under, locked here: each is
                -- counted by a later statement, whose snapshot starts after its lock was taken.
                SELECT s.slot, orchestrator_lock_slot(s.slot) AS got
                FROM (SELECT DISTINCT orchestrator_limit_slot(l, l.agent, w.key) AS slot
                      FROM walk AS w
                      JOIN unnest(limits) AS l
                        ON l.agent = p_agents[agent_index]
                       AND orchestrator_key_matches(w.key, l.key_pattern, l.per)) AS s
                WHERE s.slot <> ALL(locked) AND s.slot <> ALL(refused)
            )
            SELECT coalesce((SELECT array_agg(w.key::text ORDER BY w.n) FROM walk AS w), '{}'),
                   coalesce((SELECT array_agg(w.run_id ORDER BY w.n) FROM walk AS w), '{}'),
                   locked || coalesce((SELECT array_agg(t.slot) FROM tried AS t WHERE t.got), '{}'),
                   refused
                   || coalesce((SELECT array_agg(t.slot) FROM tried AS t WHERE NOT t.got), '{}')
            INTO found_keys, found_runs, locked, refused;
            IF cardinality(found_keys) > 0 THEN
                turn_agents := turn_agents
                               || array_fill(p_agents[agent_index], ARRAY[cardinality(found_keys)]);
                turn_keys := turn_keys || found_keys;
                turn_runs := turn_runs || found_runs;
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
        -- Enough runs of each key for its turns: a few keys may fill the claim; as many keys as
        -- the claim needs take their first runs, which the walk already read.
        per_key := CASE WHEN cardinality(turn_keys) = 0 THEN p_max
                        ELSE (p_max - taken + cardinality(turn_keys) - 1)
                             / cardinality(turn_keys) END;
        -- As many keys as the claim needs, and no other kind of candidate: the walk's runs.
        each_key_once := per_key = 1
            AND NOT (window_number = 1 AND (p_include_expired OR p_run_id IS NOT NULL
                                            OR plain_due));
        IF each_key_once THEN
            candidate_agents := turn_agents;
            candidate_keys := turn_keys;
            candidate_runs := turn_runs;
        ELSE
            SELECT coalesce(array_agg(c.agent ORDER BY c.pos), '{}'),
                   coalesce(array_agg(c.concurrency_key ORDER BY c.pos), '{}'),
                   coalesce(array_agg(c.run_id ORDER BY c.pos), '{}')
            INTO candidate_agents, candidate_keys, candidate_runs
            FROM (
                SELECT u.*, row_number() OVER (ORDER BY u.turn, u.ord, u.priority DESC,
                                                        u.available_at) AS pos
                FROM (
                    SELECT k.agent, k.key AS concurrency_key, k.run_id, 0 AS priority, k.ord,
                           1::bigint AS turn, NULL::timestamptz AS available_at
                    FROM unnest(turn_agents, turn_keys, turn_runs)
                         WITH ORDINALITY AS k(agent, key, run_id, ord)
                    UNION ALL
                    SELECT k.agent, k.key, d.run_id, d.priority, k.ord,
                           1 + row_number() OVER (PARTITION BY k.ord ORDER BY d.priority DESC,
                                                  d.available_at),
                           d.available_at
                    FROM unnest(turn_agents, turn_keys) WITH ORDINALITY AS k(agent, key, ord)
                    CROSS JOIN LATERAL (
                        SELECT r.run_id, r.priority, r.available_at
                        FROM runs AS r
                        WHERE per_key > 1 AND r.agent = k.agent
                          AND r.concurrency_key COLLATE "C" = k.key
                          AND r.state IN ('queued', 'waiting') AND r.concurrency_key IS NOT NULL
                          AND r.available_at <= clock_timestamp()
                        ORDER BY r.concurrency_key COLLATE "C", r.priority DESC, r.available_at
                        OFFSET 1 LIMIT greatest(per_key - 1, 0)
                    ) AS d
                    UNION ALL
                    SELECT r.agent, NULL, r.run_id, r.priority, 0,
                           row_number() OVER (PARTITION BY r.agent ORDER BY r.available_at),
                           r.available_at
                    FROM unnest(p_agents) AS a(agent)
                    CROSS JOIN LATERAL (
                        SELECT r.run_id, r.agent, r.priority, r.available_at
                        FROM runs AS r
                        WHERE window_number = 1 AND p_run_id IS NULL AND r.agent = a.agent
                          AND r.state IN ('queued', 'waiting') AND r.concurrency_key IS NULL
                          AND r.available_at <= (SELECT clock_timestamp())
                        ORDER BY r.available_at
                        LIMIT CASE WHEN cardinality(turn_keys) <= 1 THEN p_max
                                   ELSE p_max / cardinality(turn_keys) + 1 END
                    ) AS r
                    UNION ALL
                    (SELECT r.agent, r.concurrency_key, r.run_id, r.priority, 0, 0, r.available_at
                     FROM runs AS r
                     WHERE window_number = 1 AND p_run_id IS NULL AND p_include_expired
                       AND r.agent = ANY(p_agents) AND r.state = 'running'
                       AND r.lease_until < clock_timestamp()
                     LIMIT p_max)
                    UNION ALL
                    SELECT r.agent, r.concurrency_key, r.run_id, r.priority, 0, 0, r.available_at
                    FROM runs AS r
                    WHERE p_run_id IS NOT NULL AND r.run_id = p_run_id
                ) AS u
            ) AS c;
            IF cardinality(limits) > 0 THEN
                -- Lock the slot of every limit a candidate is under (each once per claim): a
                -- statement of its own, so that the count below starts after every lock was taken.
                WITH wanted AS (
                    SELECT DISTINCT orchestrator_limit_slot(l, c.agent, c.key) AS slot
                    FROM unnest(candidate_agents, candidate_keys) AS c(agent, key)
                    JOIN unnest(limits) AS l
                      ON l.agent = c.agent AND orchestrator_key_matches(c.key, l.key_pattern, l.per)
                ), tried AS (
                    SELECT w.slot, orchestrator_lock_slot(w.slot) AS got
                    FROM wanted AS w
                    WHERE w.slot <> ALL(locked) AND w.slot <> ALL(refused)
                )
                SELECT locked || coalesce(array_agg(t.slot) FILTER (WHERE t.got), '{}'),
                       refused || coalesce(array_agg(t.slot) FILTER (WHERE NOT t.got), '{}')
                INTO locked, refused
                FROM tried AS t;
            END IF;
        END IF;
        IF cardinality(limits) = 0 THEN
            picked := candidate_runs[1:p_max - taken];
            picked_slots := '{}';
            hold_runs := '{}';
        ELSIF each_key_once AND keys_only THEN
            -- Each key once, under limits per key only: a run is taken while its key has room
            -- under the tightest of them (one count: every such limit counts the key's leases).
            WITH judged AS (
                SELECT c.i, c.run_id, u.slots, u.tightest, u.lim,
                       coalesce(u.busy, false) AS busy,
                       u.tightest IS NOT NULL AND (
                           SELECT count(*) FROM runs AS r
                           WHERE r.agent = c.agent AND r.concurrency_key = c.key
                             AND r.lease_owner IS NOT NULL
                             AND r.lease_until > clock_timestamp() - interval '1 second'
                       ) + cardinality(array_positions(taken_slots, u.tightest)) >= u.most AS full
                FROM unnest(candidate_agents, candidate_keys, candidate_runs)
                     WITH ORDINALITY AS c(agent, key, run_id, i)
                CROSS JOIN LATERAL (
                    SELECT array_agg(m.slot) AS slots, min(m.most) AS most,
                           (array_agg(m.slot ORDER BY m.most))[1] AS tightest,
                           (array_agg(m.lim ORDER BY m.most))[1] AS lim,
                           bool_or(m.slot = ANY(refused)) AS busy
                    FROM (SELECT l AS lim, l.max_running AS most,
                                 orchestrator_limit_slot(l, c.agent, c.key) AS slot
                          FROM unnest(limits) AS l
                          WHERE l.agent = c.agent
                            AND orchestrator_key_matches(c.key, l.key_pattern, l.per)) AS m
                ) AS u
            ), held AS (
                SELECT j.run_id, j.tightest, orchestrator_limit_name(j.lim) AS name
                FROM judged AS j
                WHERE j.full AND NOT j.busy AND j.tightest <> ALL(marked)
            )
            SELECT coalesce(array_agg(j.run_id ORDER BY j.i)
                                FILTER (WHERE NOT j.busy AND NOT j.full), '{}'),
                   coalesce((SELECT array_agg(s) FROM judged AS k, unnest(k.slots) AS s
                             WHERE NOT k.busy AND NOT k.full), '{}'),
                   coalesce((SELECT array_agg(h.run_id) FROM held AS h), '{}'),
                   coalesce((SELECT array_agg(h.tightest) FROM held AS h), '{}'),
                   coalesce((SELECT array_agg(h.name) FROM held AS h), '{}')
            INTO picked, picked_slots, hold_runs, hold_slots, hold_names
            FROM judged AS j;
        ELSE
            -- Count each locked slot's room and judge every candidate at once: a run is taken
            -- while, in candidate order, each slot it is under has room for it.
            WITH candidates AS (
                SELECT c.i, c.agent, c.key, c.run_id
                FROM unnest(candidate_agents, candidate_keys, candidate_runs)
                     WITH ORDINALITY AS c(agent, key, run_id, i)
            ), under AS (
                SELECT c.i, l AS lim, orchestrator_limit_slot(l, c.agent, c.key) AS slot,
                       c.agent, c.key
                FROM candidates AS c
                JOIN unnest(limits) AS l
                  ON l.agent = c.agent AND orchestrator_key_matches(c.key, l.key_pattern, l.per)
            ), room AS (
                SELECT s.slot,
                       (s.lim).max_running
                       - CASE WHEN (s.lim).per = 'key' THEN (
                                 SELECT count(*) FROM runs AS r
                                 WHERE r.agent = s.agent AND r.concurrency_key = s.key
                                   AND r.lease_owner IS NOT NULL
                                   AND r.lease_until > clock_timestamp() - interval '1 second')
                              ELSE orchestrator_running(s.agent, (s.lim).key_pattern, 'all', NULL)
                         END
                       - cardinality(array_positions(taken_slots, s.slot)) AS free
                FROM (SELECT DISTINCT ON (u.slot) u.slot, u.lim, u.agent, u.key
                      FROM under AS u WHERE u.slot = ANY(locked)) AS s
            ), judged_by_key AS (
                -- A key's limits first: within a key, in candidate order.
                SELECT u.i, u.slot, u.lim, u.slot = ANY(refused) AS busy,
                       row_number() OVER (PARTITION BY u.slot ORDER BY u.i)
                       > coalesce(r.free, 0) AS full
                FROM under AS u LEFT JOIN room AS r ON r.slot = u.slot
                WHERE (u.lim).per = 'key'
            ), judged AS (
                -- Then the limits over all keys, among the runs their keys' limits let through.
                SELECT * FROM judged_by_key
                UNION ALL
                SELECT u.i, u.slot, u.lim, u.slot = ANY(refused),
                       row_number() OVER (PARTITION BY u.slot ORDER BY u.i) > coalesce(r.free, 0)
                FROM under AS u LEFT JOIN room AS r ON r.slot = u.slot
                WHERE (u.lim).per = 'all'
                  AND NOT EXISTS (SELECT FROM judged_by_key AS k
                                  WHERE k.i = u.i AND (k.busy OR k.full))
            ), verdicts AS (
                SELECT c.i, c.run_id, NOT coalesce(bool_or(j.busy OR j.full), false) AS ok,
                       (array_agg(j.slot ORDER BY j.slot) FILTER (WHERE j.full AND NOT j.busy))[1]
                           AS full_slot,
                       (array_agg(orchestrator_limit_name(j.lim) ORDER BY j.slot)
                            FILTER (WHERE j.full AND NOT j.busy))[1] AS full_limit
                FROM candidates AS c LEFT JOIN judged AS j ON j.i = c.i
                GROUP BY c.i, c.run_id
            ), kept AS (
                -- ok_so_far: the runs taken up to this one, in candidate order.
                SELECT v.*, count(*) FILTER (WHERE v.ok) OVER (ORDER BY v.i) AS ok_so_far
                FROM verdicts AS v
            ), first_held AS (
                -- The first run passed over for each full limit, up to the last one taken.
                SELECT DISTINCT ON (k.full_slot) k.run_id, k.full_slot, k.full_limit
                FROM kept AS k
                WHERE NOT k.ok AND k.full_slot IS NOT NULL AND k.full_slot <> ALL(marked)
                  AND k.ok_so_far < p_max - taken
                ORDER BY k.full_slot, k.i
            )
            SELECT coalesce((SELECT array_agg(k.run_id ORDER BY k.i) FROM kept AS k
                             WHERE k.ok AND k.ok_so_far <= p_max - taken), '{}'),
                   coalesce((SELECT array_agg(u.slot) FROM under AS u
                             JOIN kept AS k ON k.i = u.i
                             WHERE k.ok AND k.ok_so_far <= p_max - taken), '{}'),
                   coalesce((SELECT array_agg(f.run_id) FROM first_held AS f), '{}'),
                   coalesce((SELECT array_agg(f.full_slot) FROM first_held AS f), '{}'),
                   coalesce((SELECT array_agg(f.full_limit) FROM first_held AS f), '{}')
            INTO picked, picked_slots, hold_runs, hold_slots, hold_names;
        END IF;
        taken_slots := taken_slots || picked_slots;
        -- The first run this claim passes over for each full limit: its timeline says so, once
        -- per claim of it (orchestrator_hold_run writes only when the hold is news).
        IF cardinality(hold_runs) > 0 THEN
            marked := marked || hold_slots;
            held := held + cardinality(hold_runs);
            PERFORM orchestrator_hold_run(h.run_id, 'limit', h.name, NULL)
            FROM unnest(hold_runs, hold_names) AS h(run_id, name);
        END IF;
        taken := taken + cardinality(picked);
        RETURN QUERY SELECT p, NULL::text, NULL::integer FROM unnest(picked) AS p;
        EXIT WHEN taken >= p_max OR keys_done OR window_number >= 10;
    END LOOP;
    run_id := NULL;
    next_key := last_key;
    held_back := held;
    RETURN NEXT;
END
$$;
