-- Live output (docs/streaming.md, invariant 17): what a step publishes while it runs (a model's
-- streamed tokens, progress), tagged with the fence and the checkpoint version it ran from, read
-- by clients, the console and `runs watch` from a position of their choosing.
--
-- ORDER. Each run's output has one head row (run_streams) that every append and every
-- retraction locks first, so a run's positions (seq) are gap-free and commit in order: a reader
-- resuming after position N can never miss a row that commits later with a smaller number (a
-- global sequence is not commit-ordered).
--
-- FENCED. An append is accepted only while its worker holds the run's lease under its fence,
-- unexpired, judged after the head row is locked; anything else writes nothing. The stream's
-- "open" fence is the one whose output is not settled yet: when another fence appends, or a
-- reader finds the open fence no longer running the run, the open fence's unfinished output
-- (events of steps that never committed: base_version >= the run's checkpoint_version, since a
-- commit from version V moves the run past V) is retracted by one 'retracted' event naming the
-- fence and the positions; output of committed steps is never retracted.
--
-- WHEN A READER RETRACTS. Only on a committed fact that ends the open fence for good: the run's
-- fence moved on (a claim or a cancel) or the run is no longer running under it (a commit that
-- parked or finished it, a failed or released attempt). Then the open fence can never commit
-- again (every commit checks owner, fence and state), so the run's checkpoint_version is final
-- for it and the retraction can never take back a step that commits afterwards. An expired
-- lease alone is not such a fact: a group commit compares lease_until with the time its
-- statement read its batch, and may still commit after waiting on a lock past the expiry, so a
-- seal on expiry alone could retract a step that then commits. An expired but unclaimed
-- attempt's output is retracted at the claim that follows (appends of the expired attempt are
-- refused meanwhile: they check the lease against clock_timestamp()).
--
-- Expand only: two new tables and functions. Output is deleted with its run (retention and
-- purges delete runs; the foreign keys cascade) and bounded per run (orchestrator_output_limits).

CREATE TABLE run_streams (
    run_id text PRIMARY KEY REFERENCES runs (run_id) ON DELETE CASCADE,
    last_seq bigint NOT NULL DEFAULT 0,
    open_fence bigint,
    open_from bigint,
    events bigint NOT NULL DEFAULT 0,
    bytes bigint NOT NULL DEFAULT 0,
    truncated boolean NOT NULL DEFAULT false,
    updated_at timestamptz NOT NULL DEFAULT clock_timestamp()
);

CREATE TABLE run_output (
    run_id text NOT NULL REFERENCES run_streams (run_id) ON DELETE CASCADE,
    seq bigint NOT NULL,
    fence bigint NOT NULL,
    base_version bigint NOT NULL,
    kind text NOT NULL CHECK (kind IN ('text', 'progress', 'retracted', 'truncated')),
    data jsonb NOT NULL,
    created_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (run_id, seq)
);

-- The bounds no caller can raise: one event's data, one append, and a run's whole output
-- (a worker may ask for less, per run: ORCHESTRATOR_OUTPUT_MAX_EVENTS and _BYTES).
CREATE FUNCTION orchestrator_output_limits(OUT event_bytes integer, OUT batch_events integer,
                                           OUT run_events bigint, OUT run_bytes bigint)
LANGUAGE sql IMMUTABLE AS $$ SELECT 65536, 1000, 100000::bigint, 67108864::bigint $$;

-- Retract the unfinished output of p_stream's open fence (events of steps that never
-- committed) with one 'retracted' event, and close the fence. Called with the head row locked
-- and only once the open fence has ended for good (see WHEN A READER RETRACTS); p_run is the
-- run as read after the lock. Returns the head row as it is now (not yet written back).
CREATE FUNCTION orchestrator_stream_retract(p_stream run_streams, p_run runs)
RETURNS run_streams LANGUAGE plpgsql SET search_path FROM CURRENT AS $$
DECLARE
    first_seq bigint;
    last_seq bigint;
    retracted bigint;
    stream run_streams := p_stream;
BEGIN
    SELECT min(o.seq), max(o.seq), count(*) INTO first_seq, last_seq, retracted
    FROM run_output AS o
    WHERE o.run_id = stream.run_id AND o.seq >= stream.open_from
      AND o.fence = stream.open_fence AND o.kind IN ('text', 'progress')
      AND o.base_version >= p_run.checkpoint_version;
    IF retracted > 0 THEN
        stream.last_seq := stream.last_seq + 1;
        INSERT INTO run_output (run_id, seq, fence, base_version, kind, data)
        VALUES (stream.run_id, stream.last_seq, stream.open_fence, p_run.checkpoint_version,
                'retracted',
                jsonb_build_object(
                    'fence', stream.open_fence, 'from_seq', first_seq, 'to_seq', last_seq,
                    'events', retracted,
                    'reason', CASE WHEN p_run.fence > stream.open_fence
                                   THEN 'the attempt lost the run to fence ' || p_run.fence
                                   ELSE 'the attempt ended without committing its step' END));
        PERFORM pg_notify('orchestrator_output', stream.run_id);
    END IF;
    stream.open_fence := NULL;
    stream.open_from := NULL;
    RETURN stream;
END
$$;
REVOKE ALL ON FUNCTION orchestrator_stream_retract(run_streams, runs) FROM PUBLIC;

-- Append p_events (a JSON array of {kind: 'text' | 'progress', data: {...}}) to run p_run_id's
-- output, published by worker p_worker under fence p_fence from checkpoint version
-- p_base_version, in order. An event {kind: 'retracted', data: {from_seq, to_seq, reason}} is the
-- publisher taking back its own output of this step (a model call that failed midway and is
-- tried again): every text or progress event in the range must be of p_fence and
-- p_base_version, or the whole append is refused. Written only while p_worker holds the run's unexpired lease under
-- p_fence and the run is still at p_base_version; otherwise nothing is written and the status
-- is 'stale' (the publisher stops). A newer fence first retracts the unfinished output of the
-- older one. Past the run's bound (p_max_events events, p_max_bytes bytes of data, at most
-- orchestrator_output_limits) one 'truncated' event is written and the rest dropped: status
-- 'truncated'. Bad input raises (one line) and writes nothing.
CREATE FUNCTION orchestrator_stream_append(
    p_run_id text, p_worker text, p_fence bigint, p_base_version bigint, p_events jsonb,
    p_max_events bigint, p_max_bytes bigint,
    OUT status text, OUT last_seq bigint
) LANGUAGE plpgsql SECURITY DEFINER SET search_path FROM CURRENT AS $$
#variable_conflict use_column
DECLARE
    caps record;
    stream run_streams;
    run runs;
    item jsonb;
    size integer;
    max_events bigint;
    max_bytes bigint;
BEGIN
    SELECT * INTO caps FROM orchestrator_output_limits();
    IF p_run_id IS NULL OR length(p_run_id) > 100 OR p_worker IS NULL OR length(p_worker) > 200
       OR p_fence IS NULL OR p_base_version IS NULL OR p_base_version < 0
       OR p_events IS NULL OR jsonb_typeof(p_events) <> 'array'
       OR jsonb_array_length(p_events) NOT BETWEEN 1 AND caps.batch_events THEN
        RAISE EXCEPTION 'an append needs a run, a worker, a fence, a checkpoint version of 0 or '
                        'more and 1-% events', caps.batch_events
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    max_events := least(coalesce(p_max_events, caps.run_events), caps.run_events);
    max_bytes := least(coalesce(p_max_bytes, caps.run_bytes), caps.run_bytes);
    IF max_events < 1 OR max_bytes < 1 THEN
        RAISE EXCEPTION 'a run''s output bound is at least 1 event and 1 byte'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    FOR item IN SELECT value FROM jsonb_array_elements(p_events) LOOP
        IF jsonb_typeof(item) <> 'object' OR (item ->> 'kind') IS NULL
           OR (item ->> 'kind') NOT IN ('text', 'progress', 'retracted')
           OR jsonb_typeof(item -> 'data') IS DISTINCT FROM 'object' THEN
            RAISE EXCEPTION 'an output event is {"kind": "text", "progress" or "retracted", '
                            '"data": {...}}'
                USING ERRCODE = 'invalid_parameter_value';
        END IF;
        IF item ->> 'kind' = 'retracted'
           AND (jsonb_typeof(item -> 'data' -> 'from_seq') IS DISTINCT FROM 'number'
                OR jsonb_typeof(item -> 'data' -> 'to_seq') IS DISTINCT FROM 'number'
                OR (item -> 'data' ->> 'from_seq') !~ '^[1-9][0-9]{0,17}$'
                OR (item -> 'data' ->> 'to_seq') !~ '^[1-9][0-9]{0,17}$'
                OR (item -> 'data' ->> 'from_seq')::bigint > (item -> 'data' ->> 'to_seq')::bigint)
        THEN
            RAISE EXCEPTION 'a retraction names the positions it takes back: '
                            '{"from_seq": N, "to_seq": M, "reason": "..."} with 1 <= N <= M'
                USING ERRCODE = 'invalid_parameter_value';
        END IF;
        IF octet_length((item -> 'data')::text) > caps.event_bytes THEN
            RAISE EXCEPTION 'an output event''s data is at most % bytes, not %',
                            caps.event_bytes, octet_length((item -> 'data')::text)
                USING ERRCODE = 'invalid_parameter_value';
        END IF;
    END LOOP;
    -- The head row first, then the run (see ORDER and WHEN A READER RETRACTS): a retraction
    -- that committed before this lock is followed by a read of the run that sees its reason.
    SELECT * INTO stream FROM run_streams AS s WHERE s.run_id = p_run_id FOR UPDATE;
    IF stream.run_id IS NULL THEN
        IF NOT EXISTS (SELECT 1 FROM runs AS r
                       WHERE r.run_id = p_run_id AND r.lease_owner = p_worker
                         AND r.fence = p_fence AND r.state = 'running'
                         AND r.lease_until > clock_timestamp()) THEN
            status := 'stale';
            RETURN;
        END IF;
        INSERT INTO run_streams (run_id) VALUES (p_run_id) ON CONFLICT DO NOTHING;
        SELECT * INTO stream FROM run_streams AS s WHERE s.run_id = p_run_id FOR UPDATE;
    END IF;
    SELECT * INTO run FROM runs AS r WHERE r.run_id = p_run_id;
    last_seq := stream.last_seq;
    IF run.state IS DISTINCT FROM 'running' OR run.lease_owner IS DISTINCT FROM p_worker
       OR run.fence IS DISTINCT FROM p_fence OR NOT run.lease_until > clock_timestamp()
       OR run.checkpoint_version IS DISTINCT FROM p_base_version THEN
        status := 'stale';
        RETURN;
    END IF;
    IF stream.open_fence IS DISTINCT FROM p_fence THEN
        IF stream.open_fence IS NOT NULL THEN
            stream := orchestrator_stream_retract(stream, run);
        END IF;
        stream.open_fence := p_fence;
        stream.open_from := stream.last_seq + 1;
    END IF;
    -- A publisher's retraction takes back positions written before it, all its own.
    FOR item IN SELECT value FROM jsonb_array_elements(p_events)
                WHERE value ->> 'kind' = 'retracted' LOOP
        IF (item -> 'data' ->> 'to_seq')::bigint > stream.last_seq
           OR EXISTS (SELECT 1 FROM run_output AS o
                      WHERE o.run_id = p_run_id AND o.kind IN ('text', 'progress')
                        AND o.seq BETWEEN (item -> 'data' ->> 'from_seq')::bigint
                                      AND (item -> 'data' ->> 'to_seq')::bigint
                        AND (o.fence <> p_fence OR o.base_version <> p_base_version)) THEN
            RAISE EXCEPTION 'a publisher retracts only what it wrote in this step, not '
                            'positions %-%', item -> 'data' ->> 'from_seq',
                            item -> 'data' ->> 'to_seq'
                USING ERRCODE = 'invalid_parameter_value';
        END IF;
    END LOOP;
    status := CASE WHEN stream.truncated THEN 'truncated' ELSE 'ok' END;
    FOR item IN SELECT value FROM jsonb_array_elements(p_events) LOOP
        IF item ->> 'kind' = 'retracted' THEN
            -- Written even past the bound: a retraction only ever shrinks what readers show.
            stream.last_seq := stream.last_seq + 1;
            INSERT INTO run_output (run_id, seq, fence, base_version, kind, data)
            VALUES (p_run_id, stream.last_seq, p_fence, p_base_version, 'retracted',
                    jsonb_build_object(
                        'fence', p_fence,
                        'from_seq', (item -> 'data' ->> 'from_seq')::bigint,
                        'to_seq', (item -> 'data' ->> 'to_seq')::bigint,
                        'events', (SELECT count(*) FROM run_output AS o
                                   WHERE o.run_id = p_run_id AND o.kind IN ('text', 'progress')
                                     AND o.seq BETWEEN (item -> 'data' ->> 'from_seq')::bigint
                                                   AND (item -> 'data' ->> 'to_seq')::bigint),
                        'reason', left(coalesce(item -> 'data' ->> 'reason', ''), 500)));
            CONTINUE;
        END IF;
        EXIT WHEN stream.truncated;
        size := octet_length((item -> 'data')::text);
        stream.last_seq := stream.last_seq + 1;
        IF stream.events + 1 > max_events OR stream.bytes + size > max_bytes THEN
            INSERT INTO run_output (run_id, seq, fence, base_version, kind, data)
            VALUES (p_run_id, stream.last_seq, p_fence, p_base_version, 'truncated',
                    jsonb_build_object('events', stream.events, 'bytes', stream.bytes,
                                       'max_events', max_events, 'max_bytes', max_bytes));
            stream.truncated := true;
            status := 'truncated';
        ELSE
            INSERT INTO run_output (run_id, seq, fence, base_version, kind, data)
            VALUES (p_run_id, stream.last_seq, p_fence, p_base_version, item ->> 'kind',
                    item -> 'data');
            stream.events := stream.events + 1;
            stream.bytes := stream.bytes + size;
        END IF;
    END LOOP;
    UPDATE run_streams AS s
    SET last_seq = stream.last_seq, open_fence = stream.open_fence,
        open_from = stream.open_from, events = stream.events, bytes = stream.bytes,
        truncated = stream.truncated, updated_at = clock_timestamp()
    WHERE s.run_id = p_run_id;
    last_seq := stream.last_seq;
    PERFORM pg_notify('orchestrator_output', p_run_id);
END
$$;
REVOKE ALL ON FUNCTION orchestrator_stream_append(text, text, bigint, bigint, jsonb, bigint,
                                                  bigint) FROM PUBLIC;

-- If run p_run_id's open fence has ended for good (see WHEN A READER RETRACTS), retract its
-- unfinished output, under the head row's lock: idempotent, so every reader sees the same
-- retraction at the same position. Whether it wrote one.
CREATE FUNCTION orchestrator_stream_seal(p_run_id text)
RETURNS boolean LANGUAGE plpgsql SET search_path FROM CURRENT AS $$
#variable_conflict use_column
DECLARE
    stream run_streams;
    run runs;
    before bigint;
BEGIN
    -- Unlocked look first: most reads find nothing to seal and take no lock.
    IF NOT EXISTS (SELECT 1 FROM run_streams AS s JOIN runs AS r USING (run_id)
                   WHERE s.run_id = p_run_id AND s.open_fence IS NOT NULL
                     AND (r.fence <> s.open_fence OR r.state <> 'running')) THEN
        RETURN false;
    END IF;
    SELECT * INTO stream FROM run_streams AS s WHERE s.run_id = p_run_id FOR UPDATE;
    SELECT * INTO run FROM runs AS r WHERE r.run_id = p_run_id;
    IF stream.open_fence IS NULL OR run.run_id IS NULL
       OR (run.fence = stream.open_fence AND run.state = 'running') THEN
        RETURN false;  -- sealed meanwhile, or the fence still runs the run
    END IF;
    before := stream.last_seq;
    stream := orchestrator_stream_retract(stream, run);
    UPDATE run_streams AS s
    SET last_seq = stream.last_seq, open_fence = NULL, open_from = NULL,
        updated_at = clock_timestamp()
    WHERE s.run_id = p_run_id;
    RETURN stream.last_seq > before;
END
$$;
REVOKE ALL ON FUNCTION orchestrator_stream_seal(text) FROM PUBLIC;

-- Run p_run_id's output after position p_after (0: from the start), at most p_limit events, in
-- order; an open fence that has ended is sealed first, so its retraction is among them. 'no run'
-- for an unknown run.
CREATE FUNCTION orchestrator_stream_read(p_run_id text, p_after bigint, p_limit integer)
RETURNS TABLE (seq bigint, fence bigint, base_version bigint, kind text, data jsonb,
               created_at timestamptz)
LANGUAGE plpgsql SECURITY DEFINER SET search_path FROM CURRENT AS $$
#variable_conflict use_column
BEGIN
    IF p_run_id IS NULL OR length(p_run_id) > 100 OR p_after IS NULL OR p_after < 0
       OR p_limit IS NULL OR p_limit NOT BETWEEN 1 AND 10000 THEN
        RAISE EXCEPTION 'a read needs a run, a position of 0 or more and a limit of 1-10000'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF NOT EXISTS (SELECT 1 FROM runs AS r WHERE r.run_id = p_run_id) THEN
        RAISE EXCEPTION 'no run %', p_run_id USING ERRCODE = 'no_data_found';
    END IF;
    PERFORM orchestrator_stream_seal(p_run_id);
    RETURN QUERY
        SELECT o.seq, o.fence, o.base_version, o.kind, o.data, o.created_at
        FROM run_output AS o
        WHERE o.run_id = p_run_id AND o.seq > p_after
        ORDER BY o.seq
        LIMIT p_limit;
END
$$;
REVOKE ALL ON FUNCTION orchestrator_stream_read(text, bigint, integer) FROM PUBLIC;
