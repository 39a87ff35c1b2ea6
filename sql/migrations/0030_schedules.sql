-- Cron schedules fired once per slot (docs/schedules.md). A schedule is leased like a run: a
-- scheduler (any `serve` process) claims a due schedule with fence = fence + 1, works out its
-- slots, and fires them in one transaction that checks it still holds that lease and fence. A
-- slot's decision (fired, skipped, buffered, backfilled) is a row keyed by the schedule and the
-- slot's instant, written with the slot's run, so no failover, second scheduler or restart can
-- start a second run for a slot, and a stale lease holder can change nothing.
--
-- Expand only: new tables, new columns on runs and new functions.

CREATE TABLE schedules (
    schedule_id text PRIMARY KEY,
    name text NOT NULL UNIQUE,
    agent text NOT NULL,
    cron text,
    every_seconds bigint,
    timezone text NOT NULL DEFAULT 'UTC',
    overlap text NOT NULL DEFAULT 'skip',
    catch_up text NOT NULL DEFAULT 'latest',
    catch_up_seconds integer NOT NULL DEFAULT 60,
    catch_up_limit integer NOT NULL DEFAULT 100,
    jitter_seconds integer NOT NULL DEFAULT 0,
    starts_at timestamptz NOT NULL,
    ends_at timestamptz,
    input jsonb NOT NULL DEFAULT '{}'::jsonb,
    concurrency_key text,
    priority integer NOT NULL DEFAULT 0,
    max_attempts integer NOT NULL DEFAULT 5,
    paused boolean NOT NULL DEFAULT false,
    next_fire_at timestamptz,
    buffered_slot timestamptz,
    missed jsonb,
    fence bigint NOT NULL DEFAULT 0,
    lease_owner text,
    lease_until timestamptz,
    created_by text NOT NULL,
    created_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    updated_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    CONSTRAINT schedules_one_calendar CHECK ((cron IS NULL) <> (every_seconds IS NULL)),
    CONSTRAINT schedules_overlap CHECK (overlap IN ('skip', 'buffer_one', 'allow_all',
                                                    'cancel_running')),
    CONSTRAINT schedules_catch_up CHECK (catch_up IN ('none', 'latest', 'all')),
    CONSTRAINT schedules_numbers CHECK (
        (every_seconds IS NULL OR every_seconds BETWEEN 1 AND 31622400)
        AND catch_up_seconds BETWEEN 0 AND 31622400 AND catch_up_limit BETWEEN 1 AND 1000
        AND jitter_seconds BETWEEN 0 AND 86400 AND max_attempts BETWEEN 1 AND 1000
        AND priority BETWEEN -1000 AND 1000),
    CONSTRAINT schedules_window CHECK (ends_at IS NULL OR ends_at > starts_at),
    CONSTRAINT schedules_lease CHECK ((lease_owner IS NULL) = (lease_until IS NULL))
);
CREATE INDEX schedules_due ON schedules (next_fire_at)
    WHERE NOT paused AND next_fire_at IS NOT NULL;
CREATE INDEX schedules_buffered ON schedules (schedule_id)
    WHERE buffered_slot IS NOT NULL AND NOT paused;

CREATE TABLE schedule_slots (
    schedule_id text NOT NULL REFERENCES schedules (schedule_id) ON DELETE CASCADE,
    slot timestamptz NOT NULL,
    outcome text NOT NULL,
    run_id text,
    fence bigint NOT NULL,
    decided_by text NOT NULL,
    decided_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (schedule_id, slot),
    CONSTRAINT schedule_slots_outcome CHECK (
        outcome IN ('fired', 'skipped', 'buffered', 'backfilled')),
    CONSTRAINT schedule_slots_run CHECK ((run_id IS NOT NULL) = (outcome IN ('fired', 'backfilled')))
);

-- A run a schedule started carries the schedule and its slot; the partial index finds a
-- schedule's unfinished runs (its overlap policy asks) without reading its history.
ALTER TABLE runs
    ADD COLUMN schedule_id text,
    ADD COLUMN schedule_slot timestamptz;
CREATE INDEX runs_schedule_unfinished ON runs (schedule_id)
    WHERE schedule_id IS NOT NULL AND state IN ('queued', 'running', 'waiting');

-- Create a schedule, audited (operate). Its first slot (p_next, at or after both its start and
-- the database's now) was worked out by the caller from the calendar.
CREATE FUNCTION orchestrator_create_schedule(
    p_schedule_id text, p_name text, p_agent text, p_cron text, p_every_seconds bigint,
    p_timezone text, p_overlap text, p_catch_up text, p_catch_up_seconds integer,
    p_catch_up_limit integer, p_jitter_seconds integer, p_starts_at timestamptz,
    p_ends_at timestamptz, p_input jsonb, p_concurrency_key text, p_priority integer,
    p_max_attempts integer, p_next timestamptz, p_principal text, p_via text, p_typed_by text,
    OUT schedule_id text, OUT audit_seq bigint, OUT principal text
) LANGUAGE plpgsql SECURITY DEFINER SET search_path FROM CURRENT AS $$
DECLARE
    who record;
    made schedules;
BEGIN
    IF p_schedule_id IS NULL OR p_schedule_id !~ '^sch_[a-z0-9]{1,64}$'
       OR p_name IS NULL OR p_name !~ '^[A-Za-z][A-Za-z0-9_.-]{0,99}$'
       OR p_agent IS NULL OR p_agent !~ '^[A-Za-z][A-Za-z0-9_.-]{0,63}$'
       OR (p_cron IS NOT NULL AND length(p_cron) NOT BETWEEN 1 AND 200)
       OR p_timezone IS NULL OR length(p_timezone) NOT BETWEEN 1 AND 64
       OR p_starts_at IS NULL OR isfinite(p_starts_at) IS NOT TRUE
       OR (p_ends_at IS NOT NULL AND isfinite(p_ends_at) IS NOT TRUE)
       OR (p_next IS NOT NULL AND isfinite(p_next) IS NOT TRUE)
       OR p_input IS NULL
       OR (p_concurrency_key IS NOT NULL AND length(p_concurrency_key) NOT BETWEEN 1 AND 200)
    THEN
        RAISE EXCEPTION 'a schedule needs a well-formed id, name, agent, calendar, time zone, '
                        'start and input' USING ERRCODE = 'invalid_parameter_value';
    END IF;
    SELECT * INTO who FROM orchestrator_decider(p_principal, p_via, p_typed_by, 'operate');
    IF EXISTS (SELECT 1 FROM schedules AS x WHERE x.name = p_name) THEN
        RAISE EXCEPTION 'a schedule named ''%'' exists: delete it first or pick another name', p_name
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    BEGIN
        INSERT INTO schedules (schedule_id, name, agent, cron, every_seconds, timezone, overlap,
                               catch_up, catch_up_seconds, catch_up_limit, jitter_seconds,
                               starts_at, ends_at, input, concurrency_key, priority,
                               max_attempts, next_fire_at, created_by)
        VALUES (p_schedule_id, p_name, p_agent, p_cron, p_every_seconds, p_timezone,
                coalesce(p_overlap, 'skip'), coalesce(p_catch_up, 'latest'),
                coalesce(p_catch_up_seconds, 60), coalesce(p_catch_up_limit, 100),
                coalesce(p_jitter_seconds, 0), p_starts_at, p_ends_at, p_input,
                p_concurrency_key, coalesce(p_priority, 0), coalesce(p_max_attempts, 5), p_next,
                who.principal)
        RETURNING * INTO made;
    EXCEPTION WHEN unique_violation THEN  -- two creates of one name racing
        RAISE EXCEPTION 'a schedule named ''%'' exists: delete it first or pick another name',
                        p_name USING ERRCODE = 'invalid_parameter_value';
    END;
    schedule_id := made.schedule_id;
    principal := who.principal;
    audit_seq := orchestrator_audit_decision(
        who.principal, who.via, 'schedule_create', NULL, NULL,
        jsonb_strip_nulls(jsonb_build_object(
            'schedule', p_name, 'schedule_id', p_schedule_id, 'agent', p_agent, 'cron', p_cron,
            'every_seconds', p_every_seconds, 'timezone', p_timezone,
            'overlap', made.overlap, 'catch_up', made.catch_up)),
        p_typed_by);
END
$$;
REVOKE ALL ON FUNCTION orchestrator_create_schedule(
    text, text, text, text, bigint, text, text, text, integer, integer, integer, timestamptz,
    timestamptz, jsonb, text, integer, integer, timestamptz, text, text, text) FROM PUBLIC;

-- Pause, resume or delete a schedule, audited (operate). Resuming starts from p_next (the first
-- slot after the database's now): the slots of the pause are not fired (backfill them). No row:
-- there is no schedule of that name (or, to resume, none paused).
CREATE FUNCTION orchestrator_change_schedule(
    p_name text, p_change text, p_next timestamptz, p_principal text, p_via text,
    p_typed_by text, OUT schedule_id text, OUT audit_seq bigint, OUT principal text
) RETURNS SETOF record LANGUAGE plpgsql SECURITY DEFINER SET search_path FROM CURRENT AS $$
DECLARE
    who record;
    changed schedules;
BEGIN
    IF p_change IS NULL OR p_change NOT IN ('pause', 'resume', 'delete')
       OR (p_next IS NOT NULL AND isfinite(p_next) IS NOT TRUE) THEN
        RAISE EXCEPTION 'a schedule change is pause, resume or delete'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    SELECT * INTO who FROM orchestrator_decider(p_principal, p_via, p_typed_by, 'operate');
    IF p_change = 'delete' THEN
        DELETE FROM schedules AS s WHERE s.name = p_name RETURNING * INTO changed;
    ELSE
        -- A resume hands the schedule to whichever scheduler claims it next: the lease of one
        -- that claimed it before the pause is ended (a raised fence would only come with it).
        UPDATE schedules AS s
        SET paused = (p_change = 'pause'),
            next_fire_at = CASE WHEN p_change = 'resume' THEN p_next ELSE s.next_fire_at END,
            lease_owner = NULL, lease_until = NULL, fence = s.fence + 1,
            updated_at = clock_timestamp()
        WHERE s.name = p_name AND (p_change = 'pause' OR s.paused)
        RETURNING * INTO changed;
    END IF;
    IF changed.schedule_id IS NULL THEN
        RETURN;
    END IF;
    schedule_id := changed.schedule_id;
    principal := who.principal;
    audit_seq := orchestrator_audit_decision(
        who.principal, who.via, 'schedule_' || p_change, NULL, NULL,
        jsonb_build_object('schedule', p_name, 'schedule_id', changed.schedule_id), p_typed_by);
    RETURN NEXT;
END
$$;
REVOKE ALL ON FUNCTION orchestrator_change_schedule(text, text, timestamptz, text, text, text)
    FROM PUBLIC;

-- Start a scheduled run (the caller holds the schedule's row lock and has recorded the slot).
CREATE FUNCTION orchestrator_start_scheduled_run(
    s schedules, p_slot timestamptz, p_run_id text, p_available_at timestamptz, p_how text
) RETURNS text LANGUAGE plpgsql SET search_path FROM CURRENT AS $$
DECLARE
    started text;
BEGIN
    INSERT INTO runs (run_id, agent, input, max_attempts, idempotency_key, available_at,
                      concurrency_key, priority, schedule_id, schedule_slot)
    SELECT p_run_id, s.agent, s.input, s.max_attempts,
           'schedule:' || s.schedule_id || ':' || extract(epoch FROM p_slot)::numeric::text,
           greatest(p_available_at, clock_timestamp()), s.concurrency_key, s.priority,
           s.schedule_id, p_slot
    WHERE orchestrator_submission_is_valid(p_run_id, s.agent, s.input, NULL)
    ON CONFLICT DO NOTHING
    RETURNING run_id INTO started;
    IF started IS NULL THEN
        RETURN NULL;  -- the slot's run exists already (its key is taken)
    END IF;
    INSERT INTO run_events (run_id, kind, fence, details)
    VALUES (started, 'submitted', 0, jsonb_strip_nulls(jsonb_build_object(
        'agent', s.agent, 'max_attempts', s.max_attempts, 'schedule', s.name,
        'schedule_id', s.schedule_id, 'slot', p_slot, 'how', p_how,
        'not_before', CASE WHEN p_available_at > p_slot THEN p_available_at END,
        'concurrency_key', s.concurrency_key,
        'priority', CASE WHEN s.priority <> 0 THEN s.priority END)));
    PERFORM pg_notify('orchestrator_runs', s.agent);
    RETURN started;
END
$$;
REVOKE ALL ON FUNCTION orchestrator_start_scheduled_run(schedules, timestamptz, text,
                                                        timestamptz, text) FROM PUBLIC;

-- A scheduler claims due schedules: those whose next slot has come, and those holding a
-- buffered slot whose running run has ended. Each claim raises the fence; the lease is short
-- (the fire follows at once: `serve` asks for its run lease, at most 10 s) and a stale holder's
-- fire is refused.
CREATE FUNCTION orchestrator_claim_schedules(
    p_worker text, p_lease_seconds double precision, p_limit integer
) RETURNS SETOF schedules LANGUAGE sql SECURITY DEFINER SET search_path FROM CURRENT AS $$
WITH due AS (
    -- Leased schedules are left out inside each subquery, before its LIMIT: otherwise the
    -- oldest due schedules, claimed by a process that then stopped, would fill every other
    -- process's claim until their lease ran out.
    SELECT s.schedule_id FROM schedules AS s
    WHERE s.schedule_id IN (
        (SELECT d.schedule_id FROM schedules AS d
         -- The bound read once, so it is the index condition: a volatile call compared row by
         -- row would read every schedule while none is due.
         WHERE NOT d.paused AND d.next_fire_at <= (SELECT clock_timestamp())
           AND (d.lease_until IS NULL OR d.lease_until < clock_timestamp())
         ORDER BY d.next_fire_at LIMIT greatest(least(p_limit, 1000), 0))
        UNION ALL
        (SELECT b.schedule_id FROM schedules AS b
         WHERE b.buffered_slot IS NOT NULL AND NOT b.paused
           AND (b.lease_until IS NULL OR b.lease_until < clock_timestamp())
           AND NOT EXISTS (SELECT 1 FROM runs AS r
                           WHERE r.schedule_id = b.schedule_id
                             AND r.state IN ('queued', 'running', 'waiting'))
         LIMIT greatest(least(p_limit, 1000), 0)))
      AND (s.lease_until IS NULL OR s.lease_until < clock_timestamp())
    LIMIT greatest(least(p_limit, 1000), 0)
    FOR UPDATE SKIP LOCKED
)
UPDATE schedules AS s
SET fence = s.fence + 1, lease_owner = p_worker,
    lease_until = clock_timestamp() + make_interval(secs => least(greatest(p_lease_seconds, 1), 3600))
FROM due
WHERE s.schedule_id = due.schedule_id AND p_worker IS NOT NULL AND length(p_worker) <= 200
RETURNING s.*
$$;
REVOKE ALL ON FUNCTION orchestrator_claim_schedules(text, double precision, integer) FROM PUBLIC;

-- Fire a claimed schedule's slots under its lease and fence, in one transaction: each slot is
-- decided by the overlap policy (a run of the schedule still unfinished: skip the slot, buffer
-- one, allow it, or cancel the unfinished ones first) and recorded once, with its run. Then the
-- cursor moves to p_next (NULL: the schedule has ended) and the lease is let go. Returns the
-- slots decided; one row 'not_held', and nothing changed, when the caller no longer holds the
-- lease under p_fence. A backfill locks the schedule's row too, so the two never decide a slot at once.
CREATE FUNCTION orchestrator_fire_schedule(
    p_schedule_id text, p_worker text, p_fence bigint, p_slots timestamptz[],
    p_available_at timestamptz[], p_run_ids text[], p_next timestamptz, p_missed jsonb,
    OUT decided_slot timestamptz, OUT decision text, OUT started_run text
) RETURNS SETOF record LANGUAGE plpgsql SECURITY DEFINER SET search_path FROM CURRENT AS $$
DECLARE
    s schedules;
    i integer;
    busy boolean;
    unfinished record;
BEGIN
    IF coalesce(cardinality(p_slots), 0) > 1000
       OR coalesce(cardinality(p_slots), 0) <> coalesce(cardinality(p_available_at), 0)
       OR coalesce(cardinality(p_run_ids), 0) <> coalesce(cardinality(p_slots), 0) + 1
       OR (p_next IS NOT NULL AND isfinite(p_next) IS NOT TRUE) THEN
        RAISE EXCEPTION 'a fire names at most 1000 slots, one start and one run id for each, '
                        'and one run id more' USING ERRCODE = 'invalid_parameter_value';
    END IF;
    SELECT * INTO s FROM schedules AS x
    WHERE x.schedule_id = p_schedule_id AND x.lease_owner = p_worker AND x.fence = p_fence
      AND x.lease_until > clock_timestamp() AND NOT x.paused
    FOR UPDATE;
    IF NOT FOUND THEN
        decision := 'not_held';  -- a newer claim decides; nothing here changed
        RETURN NEXT;
        RETURN;
    END IF;
    busy := EXISTS (SELECT 1 FROM runs AS r WHERE r.schedule_id = s.schedule_id
                    AND r.state IN ('queued', 'running', 'waiting'));
    -- A slot buffered behind a run that has ended starts first.
    IF s.buffered_slot IS NOT NULL AND NOT busy THEN
        decided_slot := s.buffered_slot;
        decision := 'fired';
        started_run := orchestrator_start_scheduled_run(
            s, decided_slot, p_run_ids[cardinality(p_run_ids)], decided_slot, 'buffered');
        UPDATE schedule_slots AS x
        SET outcome = 'fired', run_id = started_run, fence = p_fence, decided_by = p_worker,
            decided_at = clock_timestamp()
        WHERE x.schedule_id = s.schedule_id AND x.slot = decided_slot AND x.outcome = 'buffered'
          AND started_run IS NOT NULL;
        s.buffered_slot := NULL;
        busy := true;
        IF started_run IS NOT NULL THEN
            RETURN NEXT;
        END IF;
    END IF;
    FOR i IN 1..coalesce(cardinality(p_slots), 0) LOOP
        decided_slot := p_slots[i];
        started_run := NULL;
        IF decided_slot IS NULL OR isfinite(decided_slot) IS NOT TRUE
           OR EXISTS (SELECT 1 FROM schedule_slots AS x
                      WHERE x.schedule_id = s.schedule_id AND x.slot = decided_slot) THEN
            CONTINUE;  -- decided before (a backfill, or a fire this one must not repeat)
        END IF;
        IF busy AND s.overlap = 'skip' THEN
            decision := 'skipped';
        ELSIF busy AND s.overlap = 'buffer_one' THEN
            decision := CASE WHEN s.buffered_slot IS NULL THEN 'buffered' ELSE 'skipped' END;
        ELSE
            decision := 'fired';
        END IF;
        IF decision = 'buffered' THEN
            s.buffered_slot := decided_slot;
        ELSIF decision = 'fired' THEN
            IF busy AND s.overlap = 'cancel_running' THEN
                FOR unfinished IN
                    SELECT r.run_id FROM runs AS r
                    WHERE r.schedule_id = s.schedule_id
                      AND r.state IN ('queued', 'running', 'waiting')
                    ORDER BY r.run_id
                LOOP
                    PERFORM orchestrator_cancel_tree(unfinished.run_id, jsonb_build_object(
                        'reason', 'the schedule''s next slot started (overlap: cancel_running)',
                        'by', 'schedule ' || s.name, 'slot', decided_slot));
                END LOOP;
            END IF;
            started_run := orchestrator_start_scheduled_run(s, decided_slot, p_run_ids[i],
                                                            p_available_at[i], 'scheduled');
            IF started_run IS NULL THEN
                CONTINUE;  -- the slot's run exists though its record is gone
            END IF;
            busy := true;
        END IF;
        INSERT INTO schedule_slots (schedule_id, slot, outcome, run_id, fence, decided_by)
        VALUES (s.schedule_id, decided_slot, decision, started_run, p_fence, p_worker);
        RETURN NEXT;
    END LOOP;
    -- Every thousandth claim trims the schedule's records to its newest 10,000 slots; an older
    -- slot's run still holds its idempotency key until retention purges it.
    IF p_fence % 1000 = 0 THEN
        DELETE FROM schedule_slots AS x
        WHERE x.schedule_id = s.schedule_id
          AND x.slot < (SELECT y.slot FROM schedule_slots AS y
                        WHERE y.schedule_id = s.schedule_id
                        ORDER BY y.slot DESC OFFSET 10000 LIMIT 1);
    END IF;
    UPDATE schedules AS x
    SET next_fire_at = p_next, buffered_slot = s.buffered_slot,
        missed = coalesce(p_missed, x.missed),
        lease_owner = NULL, lease_until = NULL, updated_at = clock_timestamp()
    WHERE x.schedule_id = s.schedule_id;
END
$$;
REVOKE ALL ON FUNCTION orchestrator_fire_schedule(text, text, bigint, timestamptz[],
                                                  timestamptz[], text[], timestamptz, jsonb)
    FROM PUBLIC;

-- Backfill: start the slots p_slots of a past window (worked out by the caller), each once,
-- audited (operate). A slot that has a run already (fired before, or backfilled) is left; one
-- skipped or buffered before starts now. The overlap policy does not apply: a backfill asks for
-- every slot of its window. No row when there is no schedule of that name.
CREATE FUNCTION orchestrator_backfill_schedule(
    p_name text, p_slots timestamptz[], p_run_ids text[], p_principal text, p_via text,
    p_typed_by text,
    OUT started_runs text[], OUT audit_seq bigint, OUT principal text
) RETURNS SETOF record LANGUAGE plpgsql SECURITY DEFINER SET search_path FROM CURRENT AS $$
DECLARE
    who record;
    s schedules;
    i integer;
    backfilled_slot timestamptz;
    started_run text;
BEGIN
    IF coalesce(cardinality(p_slots), 0) > 10000
       OR coalesce(cardinality(p_slots), 0) <> coalesce(cardinality(p_run_ids), 0) THEN
        RAISE EXCEPTION 'a backfill names at most 10000 slots and one run id for each'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    SELECT * INTO who FROM orchestrator_decider(p_principal, p_via, p_typed_by, 'operate');
    SELECT * INTO s FROM schedules AS x WHERE x.name = p_name FOR UPDATE;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    FOR i IN 1..coalesce(cardinality(p_slots), 0) LOOP
        backfilled_slot := p_slots[i];
        IF backfilled_slot IS NULL OR isfinite(backfilled_slot) IS NOT TRUE
           OR backfilled_slot > clock_timestamp() THEN
            RAISE EXCEPTION 'a backfill starts slots of the past, not %', backfilled_slot
                USING ERRCODE = 'invalid_parameter_value';
        END IF;
        IF EXISTS (SELECT 1 FROM schedule_slots AS x WHERE x.schedule_id = s.schedule_id
                   AND x.slot = backfilled_slot AND x.run_id IS NOT NULL) THEN
            CONTINUE;
        END IF;
        started_run := orchestrator_start_scheduled_run(s, backfilled_slot, p_run_ids[i],
                                                        clock_timestamp(), 'backfill');
        IF started_run IS NULL THEN
            CONTINUE;  -- its run exists though its slot record is gone
        END IF;
        INSERT INTO schedule_slots AS x (schedule_id, slot, outcome, run_id, fence, decided_by)
        VALUES (s.schedule_id, backfilled_slot, 'backfilled', started_run, s.fence,
                who.principal)
        ON CONFLICT (schedule_id, slot) DO UPDATE
        SET outcome = 'backfilled', run_id = EXCLUDED.run_id, decided_by = EXCLUDED.decided_by,
            decided_at = clock_timestamp();
        IF s.buffered_slot = backfilled_slot THEN
            UPDATE schedules AS x SET buffered_slot = NULL WHERE x.schedule_id = s.schedule_id;
        END IF;
        started_runs := started_runs || started_run;
    END LOOP;
    started_runs := coalesce(started_runs, ARRAY[]::text[]);
    principal := who.principal;
    audit_seq := orchestrator_audit_decision(
        who.principal, who.via, 'schedule_backfill', NULL, NULL,
        jsonb_build_object('schedule', p_name, 'schedule_id', s.schedule_id,
                           'from', p_slots[1], 'to', p_slots[cardinality(p_slots)],
                           'slots', coalesce(cardinality(p_slots), 0),
                           'started', cardinality(started_runs)),
        p_typed_by);
    RETURN NEXT;
END
$$;
REVOKE ALL ON FUNCTION orchestrator_backfill_schedule(text, timestamptz[], text[], text, text,
                                                      text) FROM PUBLIC;
