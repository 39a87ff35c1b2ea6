-- The orchestrator schema as migrations 0001..N produce it (generated: do not edit).
-- Regenerate: python -m orchestrator.db.schema_snapshot > sql/schema.sql
CREATE SCHEMA orchestrator;
CREATE FUNCTION orchestrator.audit_append(p_principal text, p_via text, p_action text, p_run_id text, p_effect_key text, p_detail jsonb) RETURNS bigint
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path TO 'orchestrator', 'pg_temp'
    AS $$
DECLARE
    last_seq bigint;
    last_sha text;
    new_seq bigint;
    new_at timestamptz := clock_timestamp();
    principal_name text := coalesce(p_principal, session_user);
    via_name text := coalesce(p_via, 'database-role');
    detail_doc jsonb := coalesce(p_detail, '{}'::jsonb);
BEGIN
    PERFORM pg_advisory_xact_lock(hashtext('orchestrator.audit_log'),
                                  hashtext(current_schema()));
    SELECT seq, sha256 INTO last_seq, last_sha FROM audit_log ORDER BY seq DESC LIMIT 1;
    new_seq := coalesce(last_seq, 0) + 1;
    last_sha := coalesce(last_sha, repeat('0', 64));
    INSERT INTO audit_log (seq, at, db_user, principal, via, action, run_id, effect_key, detail,
                           prev_sha256, sha256)
    VALUES (new_seq, new_at, session_user, principal_name, via_name, p_action, p_run_id,
            p_effect_key, detail_doc, last_sha,
            encode(sha256(convert_to(audit_row_text(
                last_sha, new_seq, new_at, session_user, principal_name, via_name, p_action,
                p_run_id, p_effect_key, detail_doc), 'UTF8')), 'hex'));
    RETURN new_seq;
END
$$;
CREATE FUNCTION orchestrator.audit_log_is_append_only() RETURNS trigger
    LANGUAGE plpgsql
    AS $$
BEGIN
    RAISE EXCEPTION 'the audit log is append-only: % refused', TG_OP
        USING HINT = 'decisions are appended by audit_append(); nothing may change or remove one';
END
$$;
CREATE FUNCTION orchestrator.audit_row_text(p_prev text, p_seq bigint, p_at timestamp with time zone, p_db_user text, p_principal text, p_via text, p_action text, p_run_id text, p_effect_key text, p_detail jsonb) RETURNS text
    LANGUAGE sql IMMUTABLE
    AS $$
    SELECT concat_ws(E'\n', p_prev, p_seq::text,
                     ((extract(epoch FROM p_at) * 1000000)::bigint)::text, p_db_user,
                     p_principal, p_via, p_action, coalesce(p_run_id, ''),
                     coalesce(p_effect_key, ''), p_detail::text)
$$;
CREATE FUNCTION orchestrator.claim_kinds(p_kinds text[]) RETURNS SETOF text
    LANGUAGE plpgsql IMMUTABLE ROWS 1
    AS $$
BEGIN
    RETURN QUERY SELECT DISTINCT k FROM unnest(p_kinds) AS k;
END
$$;
CREATE FUNCTION orchestrator.fence_epoch() RETURNS bigint
    LANGUAGE plpgsql
    AS $_$
DECLARE
    offset_text text;
    epoch bigint;
BEGIN
    SELECT nullif(substr(setting, length('orchestrator.fence_epoch_offset=') + 1), '')
    INTO offset_text
    FROM pg_catalog.pg_db_role_setting AS s, unnest(s.setconfig) AS setting
    WHERE s.setdatabase = (SELECT oid FROM pg_catalog.pg_database
                           WHERE datname = current_database())
      AND s.setrole = 0 AND setting LIKE 'orchestrator.fence\_epoch\_offset=%';
    IF offset_text IS NOT NULL AND offset_text !~ '^\s*[0-9]{1,7}\s*$' THEN
        RAISE EXCEPTION 'orchestrator.fence_epoch_offset is %, not a whole number from 0 to 8388607',
            quote_literal(offset_text)
            USING HINT = 'ALTER DATABASE ... SET orchestrator.fence_epoch_offset = ''N'' with N '
                         'the highest epoch restored (docs/high-availability.md), or RESET it';
    END IF;
    epoch := ('x' || substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8))::bit(32)::bigint - 1
             + coalesce(offset_text::bigint, 0);
    IF epoch > 8388607 THEN
        RAISE EXCEPTION 'fence epoch % is past 8388607: fences would not fit in a bigint', epoch
            USING HINT = 'lower orchestrator.fence_epoch_offset (docs/high-availability.md)';
    END IF;
    RETURN epoch;
END
$_$;
CREATE FUNCTION orchestrator.fence_epoch_of(fence bigint) RETURNS bigint
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
    AS $$
    SELECT fence >> 40
$$;
CREATE FUNCTION orchestrator.fence_floor() RETURNS bigint
    LANGUAGE sql
    SET search_path TO 'orchestrator'
    AS $$
    SELECT fence_epoch() << 40
$$;
CREATE FUNCTION orchestrator.orchestrator_accept_effect(p_run_id text, p_effect_key text, p_fence bigint, p_kind text, p_policy text, p_payload jsonb, p_idempotency_key text, p_worker_id text, p_requires_approval boolean, p_approval_seconds double precision, OUT outcome text, OUT accepted_fence bigint, OUT status text, OUT run_state text, OUT run_fence bigint) RETURNS record
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path TO 'orchestrator', 'pg_temp'
    AS $$
DECLARE
    high_water bigint;
    run_born_epoch bigint;
    existing effects%ROWTYPE;
    digest text := encode(sha256(convert_to(p_payload::text, 'UTF8')), 'hex');
    first_status text := CASE WHEN p_requires_approval THEN 'awaiting_approval'
                              ELSE 'accepted' END;
    expires timestamptz := CASE WHEN p_requires_approval
                                THEN clock_timestamp() + make_interval(secs => p_approval_seconds)
                           END;
BEGIN
    SELECT r.fence, r.state, r.born_epoch INTO run_fence, run_state, run_born_epoch
    FROM runs AS r WHERE r.run_id = p_run_id FOR SHARE;
    IF NOT FOUND THEN
        outcome := 'unknown_run';
        RETURN;
    END IF;
    SELECT f.fence INTO high_water FROM effect_fences AS f WHERE f.run_id = p_run_id FOR UPDATE;
    accepted_fence := greatest(coalesce(high_water, run_fence), run_fence);
    IF p_fence < accepted_fence THEN
        outcome := 'stale';
        INSERT INTO run_events (run_id, kind, fence, worker_id, details)
        VALUES (p_run_id, 'stale_fence_rejected', p_fence, p_worker_id,
                jsonb_build_object('effect_key', p_effect_key, 'accepted_fence', accepted_fence,
                                   'run_state', run_state));
        RETURN;
    END IF;
    IF p_fence > accepted_fence OR run_state <> 'running' THEN
        outcome := CASE WHEN p_fence > accepted_fence THEN 'future_fence' ELSE 'not_running' END;
        INSERT INTO run_events (run_id, kind, fence, worker_id, details)
        VALUES (p_run_id, 'effect_refused', p_fence, p_worker_id,
                jsonb_build_object('effect_key', p_effect_key, 'reason', outcome,
                                   'current_fence', run_fence, 'run_state', run_state));
        RETURN;
    END IF;
    IF high_water IS NULL THEN
        INSERT INTO effect_fences (run_id, fence) VALUES (p_run_id, p_fence);
    ELSIF p_fence > high_water THEN
        UPDATE effect_fences SET fence = p_fence, updated_at = clock_timestamp()
        WHERE run_id = p_run_id;
    END IF;
    SELECT * INTO existing FROM effects AS e
    WHERE e.run_id = p_run_id AND e.effect_key = p_effect_key FOR UPDATE;
    IF NOT FOUND THEN
        -- A run born before the server's last promotion, or a fence granted before it, may
        -- have had this effect accepted and sent on the lost timeline (a commit retried on the
        -- promoted server after the lost one answered too late): look it up before sending.
        INSERT INTO effects (run_id, effect_key, kind, policy, fence, status, payload,
                             idempotency_key, payload_sha256, requires_approval,
                             approval_expires_at, lookup_first)
        VALUES (p_run_id, p_effect_key, p_kind, p_policy, p_fence, first_status, p_payload,
                p_idempotency_key, digest, p_requires_approval, expires,
                run_born_epoch < fence_epoch_of(p_fence)
                OR fence_epoch_of(p_fence) < fence_epoch());
        INSERT INTO run_events (run_id, kind, fence, worker_id, details)
        VALUES (p_run_id, 'effect_accepted', p_fence, p_worker_id,
                jsonb_build_object('effect_key', p_effect_key, 'kind', p_kind,
                                   'policy', p_policy));
        IF p_requires_approval THEN
            INSERT INTO run_events (run_id, kind, fence, worker_id, details)
            VALUES (p_run_id, 'approval_requested', p_fence, p_worker_id,
                    jsonb_build_object('effect_key', p_effect_key, 'payload_sha256', digest,
                                       'expires_at', expires));
        ELSE
            PERFORM pg_notify('orchestrator_effects_due', p_kind);
        END IF;
        outcome := 'accepted';
        status := first_status;
        RETURN;
    END IF;
    IF existing.kind <> p_kind OR existing.policy <> p_policy THEN
        outcome := 'conflict';
        status := existing.status;
        RETURN;
    END IF;
    IF existing.policy = 'replaceable' AND existing.status IN ('accepted', 'awaiting_approval')
       AND NOT existing.ever_dispatched AND existing.fence < p_fence THEN
        UPDATE effects AS e
        SET fence = p_fence, payload = p_payload, payload_sha256 = digest,
            status = first_status, requires_approval = p_requires_approval,
            approval_expires_at = expires, approved_sha256 = NULL, decided_by = NULL,
            decided_at = NULL, decision_note = NULL, updated_at = clock_timestamp()
        WHERE e.run_id = p_run_id AND e.effect_key = p_effect_key;
        INSERT INTO run_events (run_id, kind, fence, worker_id, details)
        VALUES (p_run_id, 'effect_superseded', existing.fence, p_worker_id,
                jsonb_build_object('effect_key', p_effect_key, 'by_fence', p_fence,
                                   'superseded_payload', existing.payload));
        outcome := 'replaced';
        status := first_status;
        RETURN;
    END IF;
    outcome := 'existing';
    status := existing.status;
END
$$;
CREATE FUNCTION orchestrator.orchestrator_audit_decision(p_principal text, p_via text, p_action text, p_run_id text, p_effect_key text, p_detail jsonb, p_typed_by text) RETURNS bigint
    LANGUAGE sql
    SET search_path TO 'orchestrator', 'pg_temp'
    AS $$
    SELECT audit_append(p_principal, p_via, p_action, p_run_id, p_effect_key,
                        coalesce(p_detail, '{}'::jsonb)
                        || CASE WHEN p_typed_by IS NULL THEN '{}'::jsonb
                                ELSE jsonb_build_object('note', p_typed_by) END)
$$;
CREATE FUNCTION orchestrator.orchestrator_backfill_schedule(p_name text, p_slots timestamp with time zone[], p_run_ids text[], p_principal text, p_via text, p_typed_by text, OUT started_runs text[], OUT audit_seq bigint, OUT principal text) RETURNS SETOF record
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path TO 'orchestrator'
    AS $$
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
CREATE FUNCTION orchestrator.orchestrator_budget_amounts_are_positive() RETURNS trigger
    LANGUAGE plpgsql
    AS $$
BEGIN
    RAISE EXCEPTION 'a budget''s amounts are finite and never negative (% of run %: cost %)',
        NEW.kind, NEW.run_id, NEW.cost USING ERRCODE = 'check_violation';
END
$$;
CREATE FUNCTION orchestrator.orchestrator_caller_owns_schema() RETURNS boolean
    LANGUAGE sql STABLE
    SET search_path TO 'orchestrator', 'pg_temp'
    AS $$
    SELECT pg_has_role(session_user, n.nspowner, 'USAGE')
    FROM pg_namespace AS n WHERE n.nspname = current_schema()
$$;
CREATE FUNCTION orchestrator.orchestrator_cancel_run(p_run_id text, p_reason text, p_principal text, p_via text, p_typed_by text) RETURNS TABLE(run_id text, fence bigint, previous_state text, previous_owner text, notified bigint, audit_seq bigint, principal text)
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path TO 'orchestrator'
    AS $$
#variable_conflict use_column
DECLARE
    who record;
    done record;
BEGIN
    SELECT * INTO who FROM orchestrator_decider(p_principal, p_via, p_typed_by, 'operate');
    IF p_reason IS NOT NULL AND length(p_reason) > 2000 THEN
        RAISE EXCEPTION 'a cancel''s reason must be at most 2000 characters'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    SELECT * INTO done FROM orchestrator_cancel_tree(
        p_run_id,
        jsonb_build_object('reason', p_reason, 'by', who.principal, 'via', who.via,
                           'typed_by', p_typed_by)) AS t;
    IF done.run_id IS NULL THEN
        RETURN;
    END IF;
    run_id := done.run_id;
    fence := done.fence;
    previous_state := done.previous_state;
    previous_owner := done.previous_owner;
    notified := done.notified;
    principal := who.principal;
    audit_seq := orchestrator_audit_decision(
        who.principal, who.via, 'cancel', done.run_id, NULL,
        jsonb_strip_nulls(jsonb_build_object(
            'reason', p_reason,
            'descendants_cancelled', CASE WHEN done.descendants > 0 THEN done.descendants END)),
        p_typed_by);
    RETURN NEXT;
END
$$;
CREATE FUNCTION orchestrator.orchestrator_cancel_tree(p_run_id text, p_details jsonb, OUT run_id text, OUT fence bigint, OUT previous_state text, OUT previous_owner text, OUT notified bigint, OUT descendants integer) RETURNS SETOF record
    LANGUAGE plpgsql
    SET search_path TO 'orchestrator'
    AS $$
#variable_conflict use_column
DECLARE
    done record;
BEGIN
    -- The root, then its unfinished descendants. A child's final commit locks the child, then
    -- (trigger runs_child_ended) its parent: the opposite order. So the descendants are taken
    -- without waiting, and when one is busy everything taken here is let go for a moment (its
    -- commit can then end) and taken again; after many tries the cancel waits like any
    -- statement.
    FOR try_number IN 1..300 LOOP
        BEGIN
            PERFORM 1 FROM runs AS r
            WHERE r.run_id = p_run_id AND r.state IN ('queued', 'running', 'waiting')
            FOR UPDATE;
            IF NOT FOUND THEN
                RETURN;
            END IF;
            PERFORM 1 FROM runs AS r
            WHERE r.run_id IN (
                WITH RECURSIVE tree AS (
                    SELECT p_run_id AS run_id, 0 AS level
                    UNION ALL
                    SELECT c.run_id, t.level + 1
                    FROM runs AS c JOIN tree AS t ON c.parent_run_id = t.run_id
                    WHERE t.level < 64
                )
                SELECT tree.run_id FROM tree WHERE tree.level > 0)
              AND r.state IN ('queued', 'running', 'waiting')
            FOR UPDATE NOWAIT;
            EXIT;
        EXCEPTION WHEN lock_not_available THEN
            PERFORM pg_sleep(0.01);  -- the savepoint's rollback let the root go too
        END;
    END LOOP;
    WITH RECURSIVE tree AS (
        SELECT p_run_id AS run_id, 0 AS level
        UNION ALL
        SELECT c.run_id, t.level + 1 FROM runs AS c JOIN tree AS t ON c.parent_run_id = t.run_id
        WHERE t.level < 64
    ), target AS (
        SELECT r.run_id, r.state AS previous_state, r.lease_owner AS previous_owner,
               t.level
        FROM runs AS r JOIN tree AS t ON t.run_id = r.run_id
        WHERE r.state IN ('queued', 'running', 'waiting')
        ORDER BY t.level
        FOR UPDATE OF r
    ), cancelled AS (
        UPDATE runs AS r
        SET state = 'cancelled', fence = greatest(r.fence + 1, (SELECT fence_floor())),
            lease_owner = NULL, lease_until = NULL,
            wait = NULL, updated_at = clock_timestamp(), finished_at = clock_timestamp()
        FROM target AS t
        WHERE r.run_id = t.run_id
        RETURNING r.run_id, r.fence, t.previous_state, t.previous_owner, r.watched, t.level
    ), logged AS (
        INSERT INTO run_events (run_id, kind, fence, details)
        SELECT c.run_id, 'cancelled', c.fence,
               jsonb_strip_nulls(coalesce(p_details, '{}'::jsonb) || jsonb_build_object(
                   'previous_state', c.previous_state, 'previous_owner', c.previous_owner,
                   'with_ancestor', CASE WHEN c.level > 0 THEN p_run_id END))
        FROM cancelled AS c
    ), fenced AS (
        -- The effect boundary learns the new fences too: the old owners' requests are stale.
        INSERT INTO effect_fences (run_id, fence)
        SELECT c.run_id, c.fence FROM cancelled AS c
        ON CONFLICT (run_id) DO UPDATE
        SET fence = greatest(effect_fences.fence, EXCLUDED.fence), updated_at = clock_timestamp()
    ), withdrawn AS (
        -- Effects not yet handed to a vendor, and approvals still pending, are withdrawn:
        -- nobody will send them now, and approving one afterwards is refused.
        UPDATE effects AS e
        SET status = 'rejected', settled_at = clock_timestamp(), updated_at = clock_timestamp(),
            error = jsonb_build_object('type', 'RunCancelled',
                                       'message', 'the run was cancelled before this was sent')
        FROM cancelled AS c
        WHERE e.run_id = c.run_id AND e.status IN ('accepted', 'awaiting_approval')
        RETURNING e.run_id, e.effect_key, e.fence,
                  e.requires_approval AND e.decided_at IS NULL AS pending_approval
    ), withdrawn_logged AS (
        INSERT INTO run_events (run_id, kind, fence, details)
        SELECT w.run_id, 'approval_withdrawn', w.fence,
               jsonb_build_object('effect_key', w.effect_key, 'reason', 'the run was cancelled')
        FROM withdrawn AS w WHERE w.pending_approval
    ), told AS (
        SELECT pg_notify('orchestrator_cancel', c.run_id) FROM cancelled AS c
        UNION ALL
        SELECT pg_notify('orchestrator_finished', c.run_id) FROM cancelled AS c WHERE c.watched
    )
    SELECT c.run_id, c.fence, c.previous_state, c.previous_owner,
           (SELECT count(*) FROM told) AS notified,
           (SELECT count(*) - 1 FROM cancelled)::integer AS descendants
    INTO done FROM cancelled AS c WHERE c.level = 0;
    IF done.run_id IS NULL THEN
        RETURN;
    END IF;
    run_id := done.run_id;
    fence := done.fence;
    previous_state := done.previous_state;
    previous_owner := done.previous_owner;
    notified := done.notified;
    descendants := done.descendants;
    RETURN NEXT;
END
$$;
CREATE FUNCTION orchestrator.orchestrator_carve_budgets(p_parent text, p_fence bigint, p_worker text, p_parent_limits jsonb, p_children jsonb) RETURNS integer
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path TO 'orchestrator'
    AS $$
DECLARE
    b run_budgets%ROWTYPE;
    want record;
    missing text;
    over text;
BEGIN
    IF p_children IS NULL OR jsonb_typeof(p_children) <> 'array'
       OR jsonb_array_length(p_children) > 1000 THEN
        RAISE EXCEPTION 'children to carve budgets for must be a JSON array of at most 1000'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    PERFORM 1 FROM runs AS r
    WHERE r.run_id = p_parent AND r.lease_owner = p_worker AND r.fence = p_fence
      AND r.state = 'running' AND r.lease_until > clock_timestamp()
    FOR UPDATE;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    IF p_parent_limits IS NOT NULL AND jsonb_typeof(p_parent_limits) = 'object' THEN
        INSERT INTO run_budgets (run_id, turns_limit, tool_calls_limit, input_tokens_limit,
                                 output_tokens_limit, cost_limit)
        VALUES (p_parent, (p_parent_limits ->> 'turns')::bigint,
                (p_parent_limits ->> 'tool_calls')::bigint,
                (p_parent_limits ->> 'input_tokens')::bigint,
                (p_parent_limits ->> 'output_tokens')::bigint,
                (p_parent_limits ->> 'cost_usd')::numeric)
        ON CONFLICT (run_id) DO NOTHING;
    END IF;
    SELECT * INTO b FROM run_budgets WHERE run_id = p_parent FOR UPDATE;
    SELECT coalesce(sum(greatest((c -> 'budget' ->> 'turns')::bigint, 0)), 0) AS turns,
           coalesce(sum(greatest((c -> 'budget' ->> 'tool_calls')::bigint, 0)), 0) AS tool_calls,
           coalesce(sum(greatest((c -> 'budget' ->> 'input_tokens')::bigint, 0)), 0)
               AS input_tokens,
           coalesce(sum(greatest((c -> 'budget' ->> 'output_tokens')::bigint, 0)), 0)
               AS output_tokens,
           coalesce(sum(greatest((c -> 'budget' ->> 'cost_usd')::numeric, 0)), 0) AS cost,
           count(*) AS children
    INTO want FROM jsonb_array_elements(p_children) AS c;
    IF b.run_id IS NOT NULL THEN
        SELECT string_agg(DISTINCT d.name, ', ') INTO missing
        FROM jsonb_array_elements(p_children) AS c,
             (VALUES ('turns', b.turns_limit IS NOT NULL),
                     ('tool_calls', b.tool_calls_limit IS NOT NULL),
                     ('input_tokens', b.input_tokens_limit IS NOT NULL),
                     ('output_tokens', b.output_tokens_limit IS NOT NULL),
                     ('cost_usd', b.cost_limit IS NOT NULL)) AS d(name, limited)
        WHERE d.limited AND (c -> 'budget' ->> d.name) IS NULL;
        IF missing IS NOT NULL THEN
            RAISE EXCEPTION 'run % has a budget: each child must carve its % from it '
                            '(Child(budget=Budget(...)))', p_parent, missing
                USING ERRCODE = 'invalid_parameter_value';
        END IF;
        over := CASE
            WHEN b.turns_limit IS NOT NULL AND b.turns_spent + b.turns_reserved
                 + b.turns_carved + want.turns > b.turns_limit THEN 'turns'
            WHEN b.tool_calls_limit IS NOT NULL AND b.tool_calls_spent + b.tool_calls_carved
                 + want.tool_calls > b.tool_calls_limit THEN 'tool_calls'
            WHEN b.input_tokens_limit IS NOT NULL AND b.input_tokens_spent
                 + b.input_tokens_reserved + b.input_tokens_carved + want.input_tokens
                 > b.input_tokens_limit THEN 'input_tokens'
            WHEN b.output_tokens_limit IS NOT NULL AND b.output_tokens_spent
                 + b.output_tokens_reserved + b.output_tokens_carved + want.output_tokens
                 > b.output_tokens_limit THEN 'output_tokens'
            WHEN b.cost_limit IS NOT NULL AND b.cost_spent + b.cost_reserved + b.cost_carved
                 + want.cost > b.cost_limit THEN 'cost_usd'
        END;
        IF over IS NOT NULL THEN
            RAISE EXCEPTION 'the children''s budgets would pass run %''s limit on %: %',
                            p_parent, over, 'carve less, or top the parent up'
                USING ERRCODE = 'invalid_parameter_value';
        END IF;
        UPDATE run_budgets
        SET turns_carved = turns_carved + want.turns,
            tool_calls_carved = tool_calls_carved + want.tool_calls,
            input_tokens_carved = input_tokens_carved + want.input_tokens,
            output_tokens_carved = output_tokens_carved + want.output_tokens,
            cost_carved = cost_carved + want.cost, updated_at = clock_timestamp()
        WHERE run_id = p_parent;
    END IF;
    -- Each child's own budget: the limits carved for it (its agent's Budget does not widen it).
    INSERT INTO run_budgets (run_id, turns_limit, tool_calls_limit, input_tokens_limit,
                             output_tokens_limit, cost_limit)
    SELECT c ->> 'run_id', (c -> 'budget' ->> 'turns')::bigint,
           (c -> 'budget' ->> 'tool_calls')::bigint, (c -> 'budget' ->> 'input_tokens')::bigint,
           (c -> 'budget' ->> 'output_tokens')::bigint, (c -> 'budget' ->> 'cost_usd')::numeric
    FROM jsonb_array_elements(p_children) AS c
    JOIN runs AS r ON r.run_id = c ->> 'run_id' AND r.parent_run_id = p_parent
    ON CONFLICT (run_id) DO NOTHING;
    IF b.run_id IS NOT NULL THEN
        INSERT INTO budget_carves (child_run_id, parent_run_id, turns, tool_calls, input_tokens,
                                   output_tokens, cost)
        SELECT c ->> 'run_id', p_parent,
               coalesce((c -> 'budget' ->> 'turns')::bigint, 0),
               coalesce((c -> 'budget' ->> 'tool_calls')::bigint, 0),
               coalesce((c -> 'budget' ->> 'input_tokens')::bigint, 0),
               coalesce((c -> 'budget' ->> 'output_tokens')::bigint, 0),
               coalesce((c -> 'budget' ->> 'cost_usd')::numeric, 0)
        FROM jsonb_array_elements(p_children) AS c
        JOIN runs AS r ON r.run_id = c ->> 'run_id' AND r.parent_run_id = p_parent
        ON CONFLICT (child_run_id) DO NOTHING;
    END IF;
    RETURN want.children;
END
$$;
CREATE FUNCTION orchestrator.orchestrator_change_schedule(p_name text, p_change text, p_next timestamp with time zone, p_principal text, p_via text, p_typed_by text, OUT schedule_id text, OUT audit_seq bigint, OUT principal text) RETURNS SETOF record
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path TO 'orchestrator'
    AS $$
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
CREATE FUNCTION orchestrator.orchestrator_child_ended() RETURNS trigger
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path TO 'orchestrator'
    AS $$
DECLARE
    parent record;
BEGIN
    PERFORM orchestrator_settle_carve(NEW.run_id);
    UPDATE runs AS p
    SET children_awaited = p.children_awaited - 1,
        available_at = CASE WHEN p.children_awaited <= 1 THEN clock_timestamp()
                            ELSE p.available_at END,
        updated_at = clock_timestamp()
    WHERE p.run_id = NEW.parent_run_id AND p.state = 'waiting' AND p.children_awaited > 0
      AND p.wait -> 'children' ? NEW.child_key
    RETURNING p.agent, p.children_awaited INTO parent;
    IF parent.children_awaited = 0 THEN
        PERFORM pg_notify('orchestrator_runs', parent.agent);
    END IF;
    RETURN NULL;
END
$$;
CREATE FUNCTION orchestrator.orchestrator_child_limits(OUT per_commit integer, OUT per_parent integer, OUT depth integer) RETURNS record
    LANGUAGE sql IMMUTABLE
    AS $$ SELECT 1000, 10000, 16 $$;
CREATE FUNCTION orchestrator.orchestrator_children_ended(p_parent text, p_wait jsonb) RETURNS integer
    LANGUAGE sql STABLE
    SET search_path TO 'orchestrator'
    AS $$
    SELECT count(*)::integer FROM runs AS c
    WHERE c.parent_run_id = p_parent
      AND c.child_key IN (SELECT jsonb_array_elements_text(p_wait -> 'children'))
      AND c.state IN ('succeeded', 'failed', 'cancelled', 'dead')
$$;
CREATE TABLE orchestrator.schedules (
    schedule_id text NOT NULL,
    name text NOT NULL,
    agent text NOT NULL,
    cron text,
    every_seconds bigint,
    timezone text DEFAULT 'UTC'::text NOT NULL,
    overlap text DEFAULT 'skip'::text NOT NULL,
    catch_up text DEFAULT 'latest'::text NOT NULL,
    catch_up_seconds integer DEFAULT 60 NOT NULL,
    catch_up_limit integer DEFAULT 100 NOT NULL,
    jitter_seconds integer DEFAULT 0 NOT NULL,
    starts_at timestamp with time zone NOT NULL,
    ends_at timestamp with time zone,
    input jsonb DEFAULT '{}'::jsonb NOT NULL,
    concurrency_key text,
    priority integer DEFAULT 0 NOT NULL,
    max_attempts integer DEFAULT 5 NOT NULL,
    paused boolean DEFAULT false NOT NULL,
    next_fire_at timestamp with time zone,
    buffered_slot timestamp with time zone,
    missed jsonb,
    fence bigint DEFAULT 0 NOT NULL,
    lease_owner text,
    lease_until timestamp with time zone,
    created_by text NOT NULL,
    created_at timestamp with time zone DEFAULT clock_timestamp() NOT NULL,
    updated_at timestamp with time zone DEFAULT clock_timestamp() NOT NULL,
    CONSTRAINT schedules_catch_up CHECK ((catch_up = ANY (ARRAY['none'::text, 'latest'::text, 'all'::text]))),
    CONSTRAINT schedules_lease CHECK (((lease_owner IS NULL) = (lease_until IS NULL))),
    CONSTRAINT schedules_numbers CHECK ((((every_seconds IS NULL) OR ((every_seconds >= 1) AND (every_seconds <= 31622400))) AND ((catch_up_seconds >= 0) AND (catch_up_seconds <= 31622400)) AND ((catch_up_limit >= 1) AND (catch_up_limit <= 1000)) AND ((jitter_seconds >= 0) AND (jitter_seconds <= 86400)) AND ((max_attempts >= 1) AND (max_attempts <= 1000)) AND ((priority >= '-1000'::integer) AND (priority <= 1000)))),
    CONSTRAINT schedules_one_calendar CHECK (((cron IS NULL) <> (every_seconds IS NULL))),
    CONSTRAINT schedules_overlap CHECK ((overlap = ANY (ARRAY['skip'::text, 'buffer_one'::text, 'allow_all'::text, 'cancel_running'::text]))),
    CONSTRAINT schedules_window CHECK (((ends_at IS NULL) OR (ends_at > starts_at)))
);
CREATE FUNCTION orchestrator.orchestrator_claim_schedules(p_worker text, p_lease_seconds double precision, p_limit integer) RETURNS SETOF orchestrator.schedules
    LANGUAGE sql SECURITY DEFINER
    SET search_path TO 'orchestrator'
    AS $$
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
    lease_until = clock_timestamp() + make_interval(secs => least(greatest(p_lease_seconds, 1), 3600))
FROM due
WHERE s.schedule_id = due.schedule_id AND p_worker IS NOT NULL AND length(p_worker) <= 200
RETURNING s.*
$$;
CREATE FUNCTION orchestrator.orchestrator_clear_limit(p_agent text, p_key_pattern text, p_per text, p_principal text, p_via text, p_typed_by text, OUT cleared integer, OUT audit_seq bigint, OUT principal text) RETURNS record
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path TO 'orchestrator'
    AS $$
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
CREATE FUNCTION orchestrator.orchestrator_clear_rate_limit(p_name text, p_principal text, p_via text, p_typed_by text, OUT cleared text, OUT audit_seq bigint, OUT principal text) RETURNS record
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path TO 'orchestrator'
    AS $$
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
CREATE FUNCTION orchestrator.orchestrator_create_schedule(p_schedule_id text, p_name text, p_agent text, p_cron text, p_every_seconds bigint, p_timezone text, p_overlap text, p_catch_up text, p_catch_up_seconds integer, p_catch_up_limit integer, p_jitter_seconds integer, p_starts_at timestamp with time zone, p_ends_at timestamp with time zone, p_input jsonb, p_concurrency_key text, p_priority integer, p_max_attempts integer, p_next timestamp with time zone, p_principal text, p_via text, p_typed_by text, OUT schedule_id text, OUT audit_seq bigint, OUT principal text) RETURNS record
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path TO 'orchestrator'
    AS $_$
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
$_$;
CREATE FUNCTION orchestrator.orchestrator_cutover(p_agent text, p_version text, p_principal text, p_via text, p_typed_by text, OUT agent text, OUT version text, OUT previous text, OUT runs_cut integer, OUT audit_seq bigint, OUT principal text) RETURNS record
    LANGUAGE sql SECURITY DEFINER
    SET search_path TO 'orchestrator'
    AS $$
    SELECT c.agent, c.version, c.previous, c.runs_cut, c.audit_seq, c.principal
    FROM orchestrator_cutover(p_agent, p_version, false, p_principal, p_via, p_typed_by) AS c
$$;
CREATE FUNCTION orchestrator.orchestrator_cutover(p_agent text, p_version text, p_drain boolean, p_principal text, p_via text, p_typed_by text, OUT agent text, OUT version text, OUT previous text, OUT drain boolean, OUT runs_cut integer, OUT runs_draining integer, OUT audit_seq bigint, OUT principal text) RETURNS record
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path TO 'orchestrator'
    AS $_$
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
$_$;
CREATE FUNCTION orchestrator.orchestrator_decide_approval(p_run_id text, p_effect_key text, p_decision text, p_note text, p_payload_sha256 text, p_run_fence bigint, p_principal text, p_via text, p_typed_by text, OUT run_id text, OUT effect_key text, OUT status text, OUT payload_sha256 text, OUT approval_expires_at timestamp with time zone, OUT decided_by text, OUT decided_at timestamp with time zone, OUT requires_approval boolean, OUT run_state text, OUT run_fence bigint, OUT decided boolean, OUT now timestamp with time zone, OUT audit_seq bigint, OUT principal text) RETURNS SETOF record
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path TO 'orchestrator', 'pg_temp'
    AS $$
#variable_conflict use_column
DECLARE
    who record;
    target effects%ROWTYPE;
    approving boolean := p_decision = 'approved';
BEGIN
    IF p_decision IS NULL OR p_decision NOT IN ('approved', 'denied') THEN
        RAISE EXCEPTION 'a decision is approved or denied, not %', coalesce(p_decision, 'null')
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF p_note IS NOT NULL AND length(p_note) > 2000 THEN
        RAISE EXCEPTION 'a decision''s note must be at most 2000 characters'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    SELECT * INTO who FROM orchestrator_decider(p_principal, p_via, p_typed_by, 'decide');
    -- The run's row first, as commits and cancels lock it: the same lock order, and a fence
    -- that cannot move while the decision is taken.
    SELECT r.state, r.fence INTO run_state, run_fence
    FROM runs AS r WHERE r.run_id = p_run_id FOR NO KEY UPDATE;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    SELECT * INTO target FROM effects AS e
    WHERE e.run_id = p_run_id AND e.effect_key = p_effect_key FOR UPDATE;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    now := clock_timestamp();
    decided := target.status = 'awaiting_approval'
        AND run_state IN ('queued', 'running', 'waiting')
        AND (p_payload_sha256 IS NULL OR target.payload_sha256 = p_payload_sha256)
        AND (p_run_fence IS NULL OR run_fence = p_run_fence)
        AND (target.approval_expires_at IS NULL OR target.approval_expires_at > now);
    run_id := target.run_id;
    effect_key := target.effect_key;
    status := target.status;
    payload_sha256 := target.payload_sha256;
    approval_expires_at := target.approval_expires_at;
    decided_by := target.decided_by;
    decided_at := target.decided_at;
    requires_approval := target.requires_approval;
    principal := who.principal;
    IF NOT decided THEN
        RETURN NEXT;
        RETURN;
    END IF;
    UPDATE effects AS e
    SET status = CASE WHEN approving THEN 'accepted' ELSE 'rejected' END,
        approved_sha256 = CASE WHEN approving THEN e.payload_sha256 END,
        decided_by = who.principal, decided_at = now, decision_note = p_note,
        settled_at = CASE WHEN approving THEN NULL ELSE now END,
        error = CASE WHEN approving THEN NULL ELSE jsonb_build_object(
            'type', 'Denied', 'by', who.principal,
            'message', 'denied by reviewer' || coalesce(': ' || p_note, '')) END,
        available_at = now, updated_at = now
    WHERE e.run_id = target.run_id AND e.effect_key = target.effect_key;
    INSERT INTO run_events (run_id, kind, fence, details)
    VALUES (target.run_id,
            CASE WHEN approving THEN 'approval_granted' ELSE 'approval_denied' END,
            target.fence,
            jsonb_build_object('effect_key', target.effect_key, 'by', who.principal,
                               'via', who.via, 'typed_by', p_typed_by, 'note', p_note,
                               'payload_sha256', target.payload_sha256,
                               'run_fence', run_fence));
    IF approving THEN
        PERFORM pg_notify('orchestrator_effects_due', target.kind);
    ELSE
        PERFORM orchestrator_wake_for_effect(target.run_id, target.effect_key);
    END IF;
    PERFORM pg_notify('orchestrator_effects', target.run_id);
    audit_seq := orchestrator_audit_decision(
        who.principal, who.via, CASE WHEN approving THEN 'approve' ELSE 'deny' END,
        target.run_id, target.effect_key,
        jsonb_build_object('payload_sha256', target.payload_sha256, 'run_fence', run_fence,
                           'decision_note', p_note),
        p_typed_by);
    RETURN NEXT;
END
$$;
CREATE FUNCTION orchestrator.orchestrator_decider(p_principal text, p_via text, p_typed_by text, p_permission text, OUT principal text, OUT via text) RETURNS record
    LANGUAGE plpgsql STABLE
    SET search_path TO 'orchestrator', 'pg_temp'
    AS $$
DECLARE
    found_role text;
    found_kind text;
    found_disabled timestamptz;
BEGIN
    IF p_typed_by IS NOT NULL AND length(p_typed_by) NOT BETWEEN 1 AND 200 THEN
        RAISE EXCEPTION 'a typed name must be 1-200 characters (it is kept as a note)'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF p_principal IS NULL THEN
        IF p_via IS NOT NULL AND p_via <> 'database-role' THEN
            RAISE EXCEPTION 'a decision that names no principal is the database role''s, not %',
                p_via USING ERRCODE = 'invalid_parameter_value';
        END IF;
        principal := session_user;
        via := 'database-role';
        RETURN;
    END IF;
    IF NOT has_function_privilege(session_user, 'orchestrator_may_vouch()', 'EXECUTE') THEN
        RAISE EXCEPTION 'role % may not name who decides (it named %): its decisions are '
                        'recorded as the role itself', session_user, p_principal
            USING ERRCODE = 'insufficient_privilege',
                  HINT = 'pass no principal; only the console role vouches for people';
    END IF;
    IF p_via = 'shared-token' THEN
        IF p_principal <> 'shared-token' OR p_permission NOT IN ('read', 'decide', 'operate')
        THEN
            RAISE EXCEPTION 'the shared token decides as shared-token, and only to decide or '
                            'operate' USING ERRCODE = 'insufficient_privilege';
        END IF;
        principal := p_principal;
        via := p_via;
        RETURN;
    END IF;
    IF p_via IS NULL OR p_via NOT IN ('oidc', 'proxy-header', 'token') THEN
        RAISE EXCEPTION 'a named principal is established by oidc, proxy-header or token, not %',
            coalesce(p_via, 'nothing') USING ERRCODE = 'invalid_parameter_value';
    END IF;
    SELECT p.role, p.kind, p.disabled_at INTO found_role, found_kind, found_disabled
    FROM principals AS p WHERE p.name = p_principal;
    IF NOT FOUND OR found_disabled IS NOT NULL OR found_kind <> 'person' THEN
        RAISE EXCEPTION '% is not an enabled person of orchestrator users', p_principal
            USING ERRCODE = 'insufficient_privilege';
    END IF;
    IF NOT orchestrator_role_allows(found_role, p_permission) THEN
        RAISE EXCEPTION '% (%) may not %', p_principal, found_role, p_permission
            USING ERRCODE = 'insufficient_privilege';
    END IF;
    principal := p_principal;
    via := p_via;
END
$$;
CREATE FUNCTION orchestrator.orchestrator_declare_limits(p_agent text, p_limits jsonb, p_by text) RETURNS integer
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path TO 'orchestrator'
    AS $_$
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
$_$;
CREATE FUNCTION orchestrator.orchestrator_expire_approvals(p_limit integer) RETURNS TABLE(run_id text, effect_key text, notified bigint)
    LANGUAGE sql SECURITY DEFINER
    SET search_path TO 'orchestrator', 'pg_temp'
    AS $_$
WITH expired AS (
    UPDATE effects AS e
    SET status = 'rejected', decided_by = 'expiry', decided_at = clock_timestamp(),
        settled_at = clock_timestamp(), updated_at = clock_timestamp(),
        error = jsonb_build_object('type', 'ApprovalExpired', 'message',
                                   'denied: nobody approved it before it expired')
    -- The run's row with the effect's (skipping either if locked): never waiting for a lock
    -- while holding another, so never in a deadlock with a commit or a cancel.
    FROM (SELECT e.run_id, e.effect_key FROM effects AS e JOIN runs AS r ON r.run_id = e.run_id
          WHERE e.status = 'awaiting_approval' AND e.approval_expires_at <= clock_timestamp()
          ORDER BY e.approval_expires_at LIMIT $1 FOR NO KEY UPDATE OF r, e SKIP LOCKED) AS due
    WHERE e.run_id = due.run_id AND e.effect_key = due.effect_key
    RETURNING e.run_id, e.effect_key, e.fence, e.approval_expires_at
), logged AS (
    INSERT INTO run_events (run_id, kind, fence, details)
    SELECT run_id, 'approval_expired', fence,
           jsonb_build_object('effect_key', effect_key, 'expired_at', approval_expires_at)
    FROM expired
), woken AS (
    UPDATE runs AS r
    SET available_at = CASE WHEN r.state = 'waiting' AND r.wait -> 'effects' ? x.effect_key
                            THEN clock_timestamp() ELSE r.available_at END
    FROM expired AS x
    WHERE r.run_id = x.run_id AND r.state IN ('running', 'waiting')
    RETURNING r.agent, r.available_at <= clock_timestamp() AND r.state = 'waiting' AS due
), told AS (
    SELECT pg_notify('orchestrator_effects', run_id) FROM expired
    UNION ALL
    SELECT pg_notify('orchestrator_runs', agent) FROM woken WHERE due
)
SELECT run_id, effect_key, (SELECT count(*) FROM told) AS notified FROM expired
$_$;
CREATE FUNCTION orchestrator.orchestrator_fire_schedule(p_schedule_id text, p_worker text, p_fence bigint, p_slots timestamp with time zone[], p_available_at timestamp with time zone[], p_run_ids text[], p_next timestamp with time zone, p_missed jsonb, OUT decided_slot timestamp with time zone, OUT decision text, OUT started_run text) RETURNS SETOF record
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path TO 'orchestrator'
    AS $$
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
CREATE FUNCTION orchestrator.orchestrator_fork_run(p_run_id text, p_version bigint, p_new_run_id text, p_principal text, p_via text, p_typed_by text, OUT run_id text, OUT forked_from text, OUT version bigint, OUT step text, OUT receipts integer, OUT audit_seq bigint, OUT principal text) RETURNS record
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path TO 'orchestrator'
    AS $$
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
CREATE FUNCTION orchestrator.orchestrator_held_by(p_agent text, p_key text) RETURNS text
    LANGUAGE sql STABLE
    SET search_path TO 'orchestrator'
    AS $$
    SELECT orchestrator_limit_name(l)
    FROM flow_limits AS l
    WHERE l.agent = p_agent AND orchestrator_key_matches(p_key, l.key_pattern, l.per)
      AND orchestrator_running(l.agent, l.key_pattern, l.per, p_key) >= l.max_running
    ORDER BY l.max_running, l.per DESC, l.key_pattern
    LIMIT 1
$$;
CREATE FUNCTION orchestrator.orchestrator_hold_run(p_run_id text, p_kind text, p_reason text, p_until timestamp with time zone) RETURNS void
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path TO 'orchestrator'
    AS $$
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
CREATE FUNCTION orchestrator.orchestrator_key_matches(p_key text, p_pattern text, p_per text) RETURNS boolean
    LANGUAGE sql IMMUTABLE
    AS $$
    SELECT CASE
        WHEN p_key IS NULL THEN p_pattern = '*' AND p_per = 'all'
        ELSE p_key LIKE replace(replace(replace(replace(p_pattern, '\', '\\'), '%', '\%'),
                                        '_', '\_'), '*', '%')
    END
$$;
CREATE TABLE orchestrator.flow_limits (
    agent text NOT NULL,
    key_pattern text NOT NULL,
    per text NOT NULL,
    max_running integer NOT NULL,
    set_by text NOT NULL,
    set_at timestamp with time zone DEFAULT clock_timestamp() NOT NULL,
    declared boolean DEFAULT false NOT NULL,
    CONSTRAINT flow_limits_agent_check CHECK ((agent ~ '^[A-Za-z][A-Za-z0-9_.-]{0,63}$'::text)),
    CONSTRAINT flow_limits_key_pattern_check CHECK (((length(key_pattern) >= 1) AND (length(key_pattern) <= 200))),
    CONSTRAINT flow_limits_max_running_check CHECK (((max_running >= 0) AND (max_running <= 1000000))),
    CONSTRAINT flow_limits_per_check CHECK ((per = ANY (ARRAY['all'::text, 'key'::text])))
);
CREATE FUNCTION orchestrator.orchestrator_limit_name(p_limit orchestrator.flow_limits) RETURNS text
    LANGUAGE sql IMMUTABLE
    AS $$
    SELECT format('%s %s keys %s: at most %s running', p_limit.agent,
                  CASE WHEN p_limit.per = 'key' THEN 'per key,' ELSE 'in all,' END,
                  p_limit.key_pattern, p_limit.max_running)
$$;
CREATE FUNCTION orchestrator.orchestrator_limit_slot(p_limit orchestrator.flow_limits, p_agent text, p_key text) RETURNS text
    LANGUAGE sql IMMUTABLE
    AS $$
    SELECT p_limit.per || chr(31) || p_agent || chr(31) || length(p_limit.key_pattern)::text
           || chr(31) || p_limit.key_pattern
           || CASE WHEN p_limit.per = 'key' THEN chr(31) || p_key ELSE '' END
$$;
CREATE FUNCTION orchestrator.orchestrator_lock_slot(p_slot text) RETURNS boolean
    LANGUAGE sql
    AS $$
    SELECT pg_try_advisory_xact_lock(hashtextextended(p_slot || chr(31) || current_schema(), 0))
$$;
CREATE FUNCTION orchestrator.orchestrator_may_vouch() RETURNS boolean
    LANGUAGE sql IMMUTABLE
    AS $$SELECT true$$;
CREATE FUNCTION orchestrator.orchestrator_output_limits(OUT event_bytes integer, OUT batch_events integer, OUT run_events bigint, OUT run_bytes bigint) RETURNS record
    LANGUAGE sql IMMUTABLE
    AS $$ SELECT 65536, 1000, 100000::bigint, 67108864::bigint $$;
CREATE FUNCTION orchestrator.orchestrator_parent_failed() RETURNS trigger
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path TO 'orchestrator'
    AS $$
DECLARE
    child record;
BEGIN
    FOR child IN
        SELECT r.run_id FROM runs AS r
        WHERE r.parent_run_id = NEW.run_id AND r.cancel_with_parent
          AND r.state IN ('queued', 'running', 'waiting')
        ORDER BY r.run_id
    LOOP
        PERFORM orchestrator_cancel_tree(
            child.run_id,
            jsonb_build_object('reason', format('its parent %s %s', NEW.run_id, NEW.state),
                               'by', 'orchestrator'));
    END LOOP;
    RETURN NULL;
END
$$;
CREATE FUNCTION orchestrator.orchestrator_plan_claim(p_agents text[], p_max integer, p_include_expired boolean, p_run_id text, p_after text) RETURNS TABLE(run_id text, next_key text, held_back integer)
    LANGUAGE plpgsql
    SET search_path TO 'orchestrator'
    SET plan_cache_mode TO 'force_generic_plan'
    AS $$
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
CREATE FUNCTION orchestrator.orchestrator_purge_finished(p_cutoff timestamp with time zone, p_batch integer) RETURNS TABLE(runs bigint, other_rows bigint, audit_seq bigint, principal text)
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path TO 'orchestrator', 'pg_temp'
    AS $$
#variable_conflict use_column
DECLARE
    done record;
BEGIN
    IF p_cutoff IS NULL OR p_batch IS NULL OR p_batch NOT BETWEEN 1 AND 10000 THEN
        RAISE EXCEPTION 'a purge needs a cutoff and a batch of 1-10000 runs'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF p_cutoff > clock_timestamp() - interval '1 hour'
       AND NOT orchestrator_caller_owns_schema() THEN
        RAISE EXCEPTION 'role % may purge only runs that finished at least an hour ago, not '
                        'before %', session_user, p_cutoff
            USING ERRCODE = 'insufficient_privilege',
                  HINT = 'serve --retention takes 1h or more; the schema''s owner purges '
                         'younger runs with `orchestrator runs purge`';
    END IF;
    WITH doomed AS MATERIALIZED (
        SELECT r.run_id FROM runs AS r
        WHERE r.state IN ('succeeded', 'failed', 'cancelled', 'dead') AND r.finished_at < p_cutoff
          AND NOT EXISTS (
              SELECT 1 FROM effects AS e
              WHERE e.run_id = r.run_id AND e.status NOT IN ('confirmed', 'failed', 'rejected'))
        ORDER BY r.finished_at
        LIMIT p_batch
        FOR UPDATE OF r SKIP LOCKED
    ), events AS (
        DELETE FROM run_events AS x WHERE x.run_id IN (SELECT d.run_id FROM doomed AS d)
        RETURNING 1
    ), messages AS (
        DELETE FROM run_messages AS x WHERE x.run_id IN (SELECT d.run_id FROM doomed AS d)
        RETURNING 1
    ), effects_gone AS (
        DELETE FROM effects AS x WHERE x.run_id IN (SELECT d.run_id FROM doomed AS d)
        RETURNING 1
    ), fences AS (
        DELETE FROM effect_fences AS x WHERE x.run_id IN (SELECT d.run_id FROM doomed AS d)
        RETURNING 1
    ), signals AS (
        DELETE FROM run_signals AS x WHERE x.run_id IN (SELECT d.run_id FROM doomed AS d)
        RETURNING 1
    ), budgets AS (
        DELETE FROM run_budgets AS x WHERE x.run_id IN (SELECT d.run_id FROM doomed AS d)
        RETURNING 1
    ), ledger AS (
        DELETE FROM budget_ledger AS x WHERE x.run_id IN (SELECT d.run_id FROM doomed AS d)
        RETURNING 1
    ), traces AS (
        DELETE FROM run_traces AS x WHERE x.run_id IN (SELECT d.run_id FROM doomed AS d)
        RETURNING 1
    ), gone AS (
        DELETE FROM runs AS x WHERE x.run_id IN (SELECT d.run_id FROM doomed AS d)
        RETURNING x.run_id
    )
    SELECT (SELECT count(*) FROM gone) AS runs,
           (SELECT coalesce(jsonb_agg(g.run_id ORDER BY g.run_id), '[]') FROM gone AS g)
               AS run_ids,
           (SELECT count(*) FROM events) + (SELECT count(*) FROM messages)
           + (SELECT count(*) FROM effects_gone) + (SELECT count(*) FROM fences)
           + (SELECT count(*) FROM signals) + (SELECT count(*) FROM budgets)
           + (SELECT count(*) FROM ledger) + (SELECT count(*) FROM traces) AS other_rows
    INTO done;
    runs := done.runs;
    other_rows := done.other_rows;
    principal := session_user;
    IF done.runs > 0 THEN
        audit_seq := orchestrator_audit_decision(
            NULL, NULL, 'purge', NULL, NULL,
            jsonb_build_object('cutoff', p_cutoff, 'runs', done.runs,
                               'other_rows', done.other_rows, 'run_ids', done.run_ids), NULL);
    END IF;
    RETURN NEXT;
END
$$;
CREATE FUNCTION orchestrator.orchestrator_rate_pause(p_name text, p_seconds double precision, p_by text, OUT paused_until timestamp with time zone) RETURNS timestamp with time zone
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path TO 'orchestrator'
    AS $_$
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
$_$;
CREATE FUNCTION orchestrator.orchestrator_rate_settle(p_name text, p_tokens bigint) RETURNS void
    LANGUAGE sql SECURITY DEFINER
    SET search_path TO 'orchestrator'
    AS $$
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
CREATE FUNCTION orchestrator.orchestrator_rate_take(p_name text, p_requests integer, p_tokens bigint, p_run_id text, p_fence bigint, OUT granted integer, OUT wait_seconds double precision) RETURNS record
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path TO 'orchestrator'
    AS $$
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
CREATE FUNCTION orchestrator.orchestrator_reserve_budget(p_run_id text, p_worker_id text, p_fence bigint, p_limits jsonb, p_turns bigint, p_input_tokens bigint, p_output_tokens bigint, p_cost numeric, OUT outcome text, OUT exhausted_by text, OUT tool_calls_left bigint) RETURNS record
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path TO 'orchestrator'
    AS $$
DECLARE
    b run_budgets%ROWTYPE;
BEGIN
    PERFORM 1 FROM runs
    WHERE run_id = p_run_id AND lease_owner = p_worker_id AND fence = p_fence
      AND lease_until > clock_timestamp()
    FOR UPDATE;
    IF NOT FOUND THEN
        outcome := 'not_owner';
        RETURN;
    END IF;
    INSERT INTO run_budgets (run_id, turns_limit, tool_calls_limit, input_tokens_limit,
                             output_tokens_limit, cost_limit)
    VALUES (p_run_id, (p_limits ->> 'turns')::bigint, (p_limits ->> 'tool_calls')::bigint,
            (p_limits ->> 'input_tokens')::bigint, (p_limits ->> 'output_tokens')::bigint,
            (p_limits ->> 'cost_usd')::numeric)
    ON CONFLICT (run_id) DO NOTHING;
    SELECT * INTO b FROM run_budgets WHERE run_id = p_run_id FOR UPDATE;
    IF b.reserved_fence IS NOT NULL AND b.reserved_fence < p_fence THEN
        INSERT INTO budget_ledger (run_id, kind, fence, turns, input_tokens, output_tokens, cost,
                                   details)
        VALUES (p_run_id, 'forfeit', b.reserved_fence, b.turns_reserved, b.input_tokens_reserved,
                b.output_tokens_reserved, b.cost_reserved,
                jsonb_build_object('reason', 'the attempt that reserved it never settled'));
        UPDATE run_budgets
        SET turns_spent = turns_spent + turns_reserved,
            input_tokens_spent = input_tokens_spent + input_tokens_reserved,
            output_tokens_spent = output_tokens_spent + output_tokens_reserved,
            cost_spent = cost_spent + cost_reserved,
            turns_reserved = 0, input_tokens_reserved = 0, output_tokens_reserved = 0,
            cost_reserved = 0, reserved_fence = NULL
        WHERE run_id = p_run_id
        RETURNING * INTO b;
    END IF;
    exhausted_by := CASE
        WHEN b.turns_limit IS NOT NULL
             AND b.turns_spent + b.turns_reserved + b.turns_carved + p_turns > b.turns_limit
            THEN 'turns'
        WHEN b.input_tokens_limit IS NOT NULL
             AND b.input_tokens_spent + b.input_tokens_reserved + b.input_tokens_carved
                 + p_input_tokens > b.input_tokens_limit THEN 'input_tokens'
        WHEN b.output_tokens_limit IS NOT NULL
             AND b.output_tokens_spent + b.output_tokens_reserved + b.output_tokens_carved
                 + p_output_tokens > b.output_tokens_limit THEN 'output_tokens'
        WHEN b.cost_limit IS NOT NULL
             AND b.cost_spent + b.cost_reserved + b.cost_carved + p_cost > b.cost_limit
            THEN 'cost_usd'
        WHEN b.tool_calls_limit IS NOT NULL
             AND b.tool_calls_spent + b.tool_calls_carved >= b.tool_calls_limit
            THEN 'tool_calls'
    END;
    IF exhausted_by IS NOT NULL THEN
        INSERT INTO budget_ledger (run_id, kind, fence, turns, input_tokens, output_tokens, cost,
                                   details)
        VALUES (p_run_id, 'refused', p_fence, p_turns, p_input_tokens, p_output_tokens, p_cost,
                jsonb_build_object('exhausted_by', exhausted_by));
        outcome := 'exhausted';
        RETURN;
    END IF;
    UPDATE run_budgets
    SET turns_reserved = turns_reserved + p_turns,
        input_tokens_reserved = input_tokens_reserved + p_input_tokens,
        output_tokens_reserved = output_tokens_reserved + p_output_tokens,
        cost_reserved = cost_reserved + p_cost, reserved_fence = p_fence,
        updated_at = clock_timestamp()
    WHERE run_id = p_run_id;
    INSERT INTO budget_ledger (run_id, kind, fence, turns, input_tokens, output_tokens, cost)
    VALUES (p_run_id, 'reserve', p_fence, p_turns, p_input_tokens, p_output_tokens, p_cost);
    tool_calls_left := b.tool_calls_limit - b.tool_calls_spent - b.tool_calls_carved;
    outcome := 'reserved';
END
$$;
CREATE FUNCTION orchestrator.orchestrator_resolve_effect(p_run_id text, p_effect_key text, p_sent boolean, p_external_id text, p_principal text, p_via text, p_typed_by text, OUT status text, OUT audit_seq bigint, OUT principal text) RETURNS SETOF record
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path TO 'orchestrator', 'pg_temp'
    AS $$
#variable_conflict use_column
DECLARE
    who record;
    resolved record;
BEGIN
    IF p_sent IS NULL THEN
        RAISE EXCEPTION 'say what you found: sent or not sent'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF p_external_id IS NOT NULL AND length(p_external_id) NOT BETWEEN 1 AND 500 THEN
        RAISE EXCEPTION 'an external id must be 1-500 characters'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    SELECT * INTO who FROM orchestrator_decider(p_principal, p_via, p_typed_by, 'operate');
    PERFORM 1 FROM runs AS r WHERE r.run_id = p_run_id FOR NO KEY UPDATE;  -- lock order
    UPDATE effects AS e
    SET status = CASE WHEN p_sent THEN 'confirmed' ELSE 'accepted' END,
        external_id = coalesce(p_external_id, e.external_id), updated_at = clock_timestamp(),
        available_at = clock_timestamp(),
        settled_at = CASE WHEN p_sent THEN clock_timestamp() END,
        result = CASE WHEN p_sent THEN NULL ELSE e.result END,
        error = CASE WHEN p_sent THEN NULL ELSE e.error END
    WHERE e.run_id = p_run_id AND e.effect_key = p_effect_key AND e.status = 'parked'
    RETURNING e.run_id, e.effect_key, e.fence, e.status, e.kind INTO resolved;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    INSERT INTO run_events (run_id, kind, fence, details)
    VALUES (resolved.run_id, 'effect_resolved', resolved.fence,
            jsonb_build_object('effect_key', resolved.effect_key, 'decision', resolved.status,
                               'by', who.principal, 'via', who.via, 'typed_by', p_typed_by));
    PERFORM pg_notify('orchestrator_effects', resolved.run_id);
    IF p_sent THEN
        PERFORM orchestrator_wake_for_effect(resolved.run_id, resolved.effect_key);
    ELSE
        PERFORM pg_notify('orchestrator_effects_due', resolved.kind);
    END IF;
    status := resolved.status;
    principal := who.principal;
    audit_seq := orchestrator_audit_decision(
        who.principal, who.via, CASE WHEN p_sent THEN 'resolve_sent' ELSE 'resolve_not_sent' END,
        resolved.run_id, resolved.effect_key,
        jsonb_build_object('external_id', p_external_id), p_typed_by);
    RETURN NEXT;
END
$$;
CREATE FUNCTION orchestrator.orchestrator_retry_run(p_run_id text, p_principal text, p_via text, p_typed_by text, OUT run_id text, OUT notified bigint, OUT audit_seq bigint, OUT principal text) RETURNS SETOF record
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path TO 'orchestrator', 'pg_temp'
    AS $$
#variable_conflict use_column
DECLARE
    who record;
    done record;
BEGIN
    SELECT * INTO who FROM orchestrator_decider(p_principal, p_via, p_typed_by, 'operate');
    UPDATE runs AS r
    SET state = 'queued', attempt = 0, available_at = clock_timestamp(), finished_at = NULL,
        updated_at = clock_timestamp()
    WHERE r.run_id = p_run_id AND r.state = 'dead'
    RETURNING r.run_id, r.fence, r.agent, r.error INTO done;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    INSERT INTO run_events (run_id, kind, fence, details)
    VALUES (done.run_id, 'requeued', done.fence,
            jsonb_build_object('previous_error', done.error, 'by', who.principal,
                               'via', who.via, 'typed_by', p_typed_by));
    PERFORM pg_notify('orchestrator_runs', done.agent);
    run_id := done.run_id;
    notified := 1;
    principal := who.principal;
    audit_seq := orchestrator_audit_decision(
        who.principal, who.via, 'retry', done.run_id, NULL, '{}'::jsonb, p_typed_by);
    RETURN NEXT;
END
$$;
CREATE FUNCTION orchestrator.orchestrator_role_allows(p_role text, p_permission text) RETURNS boolean
    LANGUAGE sql IMMUTABLE
    AS $$
    SELECT CASE p_role
        WHEN 'admin' THEN p_permission IN ('read', 'see_payloads', 'decide', 'operate',
                                           'administer')
        WHEN 'operator' THEN p_permission IN ('read', 'see_payloads', 'operate')
        WHEN 'approver' THEN p_permission IN ('read', 'decide')
        WHEN 'viewer' THEN p_permission = 'read'
        ELSE false
    END
$$;
CREATE FUNCTION orchestrator.orchestrator_running(p_agent text, p_pattern text, p_per text, p_key text) RETURNS integer
    LANGUAGE plpgsql STABLE
    SET search_path TO 'orchestrator'
    AS $$
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
CREATE FUNCTION orchestrator.orchestrator_send_signal(p_run_id text, p_name text, p_data jsonb, p_idempotency_key text, p_principal text, p_via text, p_typed_by text, OUT state text, OUT seq bigint, OUT sent_at timestamp with time zone, OUT audit_seq bigint, OUT principal text) RETURNS record
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path TO 'orchestrator', 'pg_temp'
    AS $_$
#variable_conflict use_column
DECLARE
    who record;
    target record;
    bumped record;
BEGIN
    IF p_name IS NULL OR p_name !~ '^[A-Za-z][A-Za-z0-9_.:-]{0,99}$'
       OR (p_idempotency_key IS NOT NULL AND length(p_idempotency_key) NOT BETWEEN 1 AND 200)
       OR (p_data IS NOT NULL AND octet_length(p_data::text) > 524288) THEN
        RAISE EXCEPTION 'a signal needs a name of 1-100 letters, digits and _ . : - starting '
                        'with a letter, data of at most 512 KiB and a key of 1-200 characters'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    SELECT * INTO who FROM orchestrator_decider(p_principal, p_via, p_typed_by, 'operate');
    principal := who.principal;
    SELECT r.run_id, r.state, r.agent INTO target FROM runs AS r
    WHERE r.run_id = p_run_id FOR UPDATE;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    state := target.state;
    IF target.state NOT IN ('queued', 'running', 'waiting') THEN
        RETURN;
    END IF;
    INSERT INTO run_signals (run_id, name, data, idempotency_key)
    VALUES (p_run_id, p_name, coalesce(p_data, 'null'::jsonb), p_idempotency_key)
    ON CONFLICT DO NOTHING
    RETURNING run_signals.seq, run_signals.sent_at INTO seq, sent_at;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    UPDATE runs AS r
    SET signals_pending = r.signals_pending + 1,
        available_at = CASE
            WHEN r.state = 'waiting' AND r.wait IS NOT NULL
                 AND coalesce(r.wait -> 'signals', '[]'::jsonb) ? p_name THEN clock_timestamp()
            ELSE r.available_at END,
        updated_at = clock_timestamp()
    WHERE r.run_id = p_run_id
    RETURNING r.agent, r.fence,
              r.state = 'waiting' AND r.available_at <= clock_timestamp() AS woken
    INTO bumped;
    INSERT INTO run_events (run_id, kind, fence, details)
    VALUES (p_run_id, 'signal_received', bumped.fence,
            jsonb_build_object('name', p_name, 'seq', seq, 'idempotency_key', p_idempotency_key,
                               'woke_the_run', bumped.woken, 'by', who.principal,
                               'via', who.via));
    PERFORM pg_notify('orchestrator_signals', p_run_id);
    IF bumped.woken THEN
        PERFORM pg_notify('orchestrator_runs', bumped.agent);
    END IF;
    audit_seq := orchestrator_audit_decision(
        who.principal, who.via, 'signal', p_run_id, NULL,
        jsonb_build_object('name', p_name, 'seq', seq, 'idempotency_key', p_idempotency_key),
        p_typed_by);
END
$_$;
CREATE FUNCTION orchestrator.orchestrator_set_limit(p_agent text, p_key_pattern text, p_per text, p_max_running integer, p_principal text, p_via text, p_typed_by text, OUT agent text, OUT key_pattern text, OUT per text, OUT max_running integer, OUT previous integer, OUT audit_seq bigint, OUT principal text) RETURNS record
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path TO 'orchestrator'
    AS $_$
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
$_$;
CREATE FUNCTION orchestrator.orchestrator_set_rate_limit(p_name text, p_requests integer, p_tokens bigint, p_per_seconds double precision, p_principal text, p_via text, p_typed_by text, OUT name text, OUT requests integer, OUT tokens bigint, OUT per_seconds double precision, OUT audit_seq bigint, OUT principal text) RETURNS record
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path TO 'orchestrator'
    AS $_$
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
$_$;
CREATE FUNCTION orchestrator.orchestrator_settle_budgets(p_run_ids text[], p_fences bigint[], p_turns bigint[], p_tool_calls bigint[], p_input_tokens bigint[], p_output_tokens bigint[], p_costs numeric[]) RETURNS SETOF text
    LANGUAGE sql SECURITY DEFINER
    SET search_path TO 'orchestrator', 'pg_temp'
    AS $$
WITH input AS (
    SELECT u.run_id, u.fence, greatest(u.turns, 0) AS turns,
           greatest(u.tool_calls, 0) AS tool_calls, greatest(u.input_tokens, 0) AS input_tokens,
           greatest(u.output_tokens, 0) AS output_tokens, greatest(u.cost, 0) AS cost
    FROM unnest(p_run_ids, p_fences, p_turns, p_tool_calls, p_input_tokens, p_output_tokens,
                p_costs) AS u(run_id, fence, turns, tool_calls, input_tokens, output_tokens, cost)
    JOIN runs AS r ON r.run_id = u.run_id AND r.fence = u.fence
), settled AS (
    UPDATE run_budgets AS b
    SET turns_spent = least(b.turns_spent::numeric + u.turns, 2 ^ 62::numeric)::bigint,
        tool_calls_spent = least(b.tool_calls_spent::numeric + u.tool_calls,
                                 2 ^ 62::numeric)::bigint,
        input_tokens_spent = least(b.input_tokens_spent::numeric + u.input_tokens,
                                   2 ^ 62::numeric)::bigint,
        output_tokens_spent = least(b.output_tokens_spent::numeric + u.output_tokens,
                                    2 ^ 62::numeric)::bigint,
        cost_spent = b.cost_spent + u.cost,
        turns_reserved = 0, input_tokens_reserved = 0, output_tokens_reserved = 0,
        cost_reserved = 0, reserved_fence = NULL, updated_at = clock_timestamp()
    FROM input AS u
    WHERE b.run_id = u.run_id AND b.reserved_fence = u.fence
    RETURNING u.*
)
INSERT INTO budget_ledger (run_id, kind, fence, turns, tool_calls, input_tokens, output_tokens,
                           cost)
SELECT run_id, 'settle', fence, turns, tool_calls, input_tokens, output_tokens, cost
FROM settled
RETURNING run_id
$$;
CREATE FUNCTION orchestrator.orchestrator_settle_carve(p_child text) RETURNS void
    LANGUAGE plpgsql
    SET search_path TO 'orchestrator'
    AS $$
DECLARE
    carve budget_carves%ROWTYPE;
    spent run_budgets%ROWTYPE;
BEGIN
    UPDATE budget_carves SET settled_at = clock_timestamp()
    WHERE child_run_id = p_child AND settled_at IS NULL
    RETURNING * INTO carve;
    IF carve.child_run_id IS NULL THEN
        RETURN;
    END IF;
    SELECT * INTO spent FROM run_budgets WHERE run_id = p_child;
    UPDATE run_budgets AS p
    SET turns_carved = p.turns_carved - carve.turns,
        tool_calls_carved = p.tool_calls_carved - carve.tool_calls,
        input_tokens_carved = p.input_tokens_carved - carve.input_tokens,
        output_tokens_carved = p.output_tokens_carved - carve.output_tokens,
        cost_carved = p.cost_carved - carve.cost,
        turns_spent = p.turns_spent + coalesce(spent.turns_spent + spent.turns_reserved, 0),
        tool_calls_spent = p.tool_calls_spent + coalesce(spent.tool_calls_spent, 0),
        input_tokens_spent = p.input_tokens_spent
            + coalesce(spent.input_tokens_spent + spent.input_tokens_reserved, 0),
        output_tokens_spent = p.output_tokens_spent
            + coalesce(spent.output_tokens_spent + spent.output_tokens_reserved, 0),
        cost_spent = p.cost_spent + coalesce(spent.cost_spent + spent.cost_reserved, 0),
        updated_at = clock_timestamp()
    WHERE p.run_id = carve.parent_run_id;
END
$$;
CREATE FUNCTION orchestrator.orchestrator_sign_in(p_name text, p_via text, p_token_id text, p_role text, OUT name text, OUT kind text, OUT role text, OUT audit_seq bigint) RETURNS record
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path TO 'orchestrator', 'pg_temp'
    AS $_$
#variable_conflict use_column
DECLARE
    known principals%ROWTYPE;
    exists_already boolean;
BEGIN
    IF p_via IS NULL OR p_via NOT IN ('token', 'oidc')
       OR (p_via = 'token') <> (p_token_id IS NOT NULL)
       OR (p_role IS NOT NULL AND (p_via <> 'oidc'
                                   OR p_role NOT IN ('viewer', 'approver', 'operator', 'admin')))
    THEN
        RAISE EXCEPTION 'a sign-in is by token (with its id) or by oidc (with an optional role)'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    SELECT * INTO known FROM principals AS p WHERE p.name = p_name FOR UPDATE;
    exists_already := FOUND;
    IF exists_already AND (known.disabled_at IS NOT NULL OR known.kind <> 'person')
       OR NOT exists_already AND p_role IS NULL THEN
        RAISE EXCEPTION '% is not an enabled person of orchestrator users', p_name
            USING ERRCODE = 'insufficient_privilege';
    END IF;
    IF p_via = 'token' THEN
        IF NOT EXISTS (
            SELECT 1 FROM access_tokens AS t
            WHERE t.token_id = p_token_id AND t.principal = p_name AND t.revoked_at IS NULL
              AND (t.expires_at IS NULL OR t.expires_at > clock_timestamp())) THEN
            RAISE EXCEPTION 'token % does not sign % in', p_token_id, p_name
                USING ERRCODE = 'insufficient_privilege';
        END IF;
    ELSIF p_role IS NULL OR known.role IN (p_role, 'admin') THEN
        NULL;  -- signed in with the role they hold
    ELSIF p_role = 'admin' THEN
        RAISE EXCEPTION 'an OpenID Connect sign-in does not make % an admin', p_name
            USING ERRCODE = 'insufficient_privilege',
                  HINT = 'an admin adds admins with `orchestrator users add NAME --role admin`';
    ELSIF NOT exists_already THEN
        IF p_name IS NULL OR p_name !~ '^[A-Za-z0-9][A-Za-z0-9._@+-]{0,199}$' THEN
            RAISE EXCEPTION 'cannot name a person %', p_name
                USING ERRCODE = 'invalid_parameter_value';
        END IF;
        INSERT INTO principals (name, kind, role, created_by)
        VALUES (p_name, 'person', p_role, p_name) RETURNING * INTO known;
        PERFORM audit_append(p_name, 'oidc', 'principal_added', NULL, NULL,
                             jsonb_build_object('name', p_name, 'kind', 'person',
                                                'role', p_role));
    ELSE
        UPDATE principals AS p SET role = p_role, updated_at = clock_timestamp()
        WHERE p.name = p_name RETURNING * INTO known;
        PERFORM audit_append(p_name, 'oidc', 'principal_changed', NULL, NULL,
                             jsonb_build_object('name', p_name, 'kind', 'person',
                                                'role', p_role));
    END IF;
    name := known.name;
    kind := known.kind;
    role := known.role;
    audit_seq := audit_append(known.name, p_via, 'sign_in', NULL, NULL,
                              jsonb_build_object('role', known.role, 'token_id', p_token_id));
END
$_$;
CREATE FUNCTION orchestrator.orchestrator_spawn_children(p_parent text, p_fence bigint, p_worker text, p_children jsonb) RETURNS TABLE(child_key text, run_id text, created boolean)
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path TO 'orchestrator'
    AS $_$
#variable_conflict use_column
DECLARE
    parent runs;
    limits record;
    spawned integer;
BEGIN
    SELECT * INTO limits FROM orchestrator_child_limits();
    IF p_children IS NULL OR jsonb_typeof(p_children) <> 'array' THEN
        RAISE EXCEPTION 'children must be a JSON array' USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF jsonb_array_length(p_children) > limits.per_commit THEN
        RAISE EXCEPTION 'a commit spawns at most % children, not %', limits.per_commit,
                        jsonb_array_length(p_children)
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    SELECT * INTO parent FROM runs AS r
    WHERE r.run_id = p_parent AND r.lease_owner = p_worker AND r.fence = p_fence
      AND r.state = 'running' AND r.lease_until > clock_timestamp()
    FOR UPDATE;
    IF parent.run_id IS NULL THEN
        RETURN;  -- not the owner: the caller's commit is refused
    END IF;
    IF parent.depth + 1 > limits.depth THEN
        RAISE EXCEPTION 'run % is % levels deep: a child may be at most % levels below its root',
                        p_parent, parent.depth, limits.depth
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF EXISTS (
        SELECT 1 FROM jsonb_array_elements(p_children) AS c(child)
        WHERE jsonb_typeof(c.child) <> 'object'
           OR NOT coalesce(c.child ->> 'key' ~ '^[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}$', false)
           OR NOT orchestrator_submission_is_valid(c.child ->> 'run_id', c.child ->> 'agent',
                                                   c.child -> 'input', NULL)
           OR coalesce((c.child ->> 'max_attempts')::integer, 5) NOT BETWEEN 1 AND 100
           OR coalesce((c.child ->> 'priority')::integer, 0) NOT BETWEEN -1000 AND 1000
           OR length(c.child ->> 'concurrency_key') > 200
           OR length(c.child ->> 'traceparent') > 200
    ) THEN
        RAISE EXCEPTION 'a child needs a run id, an agent name, JSON input, a key of 1-128 '
                        'letters, digits and _.:-, 1-100 attempts, a priority of -1000 to 1000 '
                        'and a concurrency key of at most 200 characters'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF (SELECT count(DISTINCT c.child ->> 'key') FROM jsonb_array_elements(p_children) AS c(child))
       <> jsonb_array_length(p_children) THEN
        RAISE EXCEPTION 'two children of one commit have the same key'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF (SELECT count(*) FROM runs AS r WHERE r.parent_run_id = p_parent)
       + jsonb_array_length(p_children) > limits.per_parent THEN
        RAISE EXCEPTION 'run % would have more than % children', p_parent, limits.per_parent
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    RETURN QUERY
    WITH wanted AS (
        SELECT c.child, c.ord FROM jsonb_array_elements(p_children) WITH ORDINALITY AS c(child, ord)
    ), inserted AS (
        INSERT INTO runs AS r (run_id, agent, input, max_attempts, available_at, concurrency_key,
                               priority, parent_run_id, child_key, root_run_id, depth,
                               cancel_with_parent)
        SELECT w.child ->> 'run_id', w.child ->> 'agent', w.child -> 'input',
               coalesce((w.child ->> 'max_attempts')::integer, 5), clock_timestamp(),
               coalesce(w.child ->> 'concurrency_key', parent.concurrency_key),
               coalesce((w.child ->> 'priority')::integer, 0),
               p_parent, w.child ->> 'key', coalesce(parent.root_run_id, p_parent),
               parent.depth + 1, coalesce((w.child ->> 'cancel_with_parent')::boolean, false)
        FROM wanted AS w ORDER BY w.ord
        ON CONFLICT DO NOTHING
        RETURNING r.run_id, r.child_key, r.agent, r.fence
    ), logged AS (
        INSERT INTO run_events (run_id, kind, fence, worker_id, details)
        SELECT i.run_id, 'submitted', i.fence, p_worker,
               jsonb_build_object('agent', i.agent, 'parent_run_id', p_parent,
                                  'child_key', i.child_key, 'parent_fence', p_fence)
        FROM inserted AS i
    ), traced AS (
        -- The spawning step's span is the parent of the child's trace, as a submitter's is.
        INSERT INTO run_traces (run_id, fence, traceparent)
        SELECT i.run_id, 0, w.child ->> 'traceparent'
        FROM inserted AS i JOIN wanted AS w ON w.child ->> 'key' = i.child_key
        WHERE w.child ->> 'traceparent' IS NOT NULL
    ), told AS (
        INSERT INTO run_events (run_id, kind, fence, worker_id, details)
        SELECT p_parent, 'spawned', p_fence, p_worker,
               jsonb_build_object('children', jsonb_agg(jsonb_build_object(
                   'key', i.child_key, 'run_id', i.run_id, 'agent', i.agent)))
        FROM inserted AS i HAVING count(*) > 0
    ), woken AS (
        SELECT pg_notify('orchestrator_runs', a.agent)
        FROM (SELECT DISTINCT i.agent FROM inserted AS i) AS a
    )
    SELECT w.child ->> 'key', coalesce(i.run_id, existing.run_id), i.run_id IS NOT NULL
    FROM wanted AS w
    LEFT JOIN inserted AS i ON i.child_key = w.child ->> 'key'
    LEFT JOIN runs AS existing
        ON i.run_id IS NULL AND existing.parent_run_id = p_parent
       AND existing.child_key = w.child ->> 'key'
    WHERE (SELECT count(*) FROM woken) >= 0
    ORDER BY w.ord;
END
$_$;
CREATE FUNCTION orchestrator.orchestrator_standby_positions(OUT wal_end pg_lsn, OUT wal_flushed pg_lsn, OUT in_recovery boolean, OUT physical_slots integer, OUT idle_slots integer, OUT standbys integer, OUT hidden integer, OUT least_flushed pg_lsn, OUT most_flushed pg_lsn, OUT least_replayed pg_lsn, OUT most_replayed pg_lsn) RETURNS record
    LANGUAGE sql SECURITY DEFINER
    SET search_path TO 'orchestrator'
    AS $$
WITH physical AS (
    SELECT r.flush_lsn, r.replay_lsn
    FROM pg_catalog.pg_stat_replication AS r
    WHERE r.state IN ('streaming', 'catchup')
      AND NOT EXISTS (
          SELECT FROM pg_catalog.pg_replication_slots AS s
          WHERE s.active_pid = r.pid AND s.slot_type = 'logical'
      )
), slots AS (
    SELECT count(*)::integer AS physical_slots,
           count(*) FILTER (WHERE NOT active)::integer AS idle_slots
    FROM pg_catalog.pg_replication_slots
    WHERE slot_type = 'physical'
)
SELECT CASE WHEN pg_catalog.pg_is_in_recovery() THEN NULL
            WHEN pg_catalog.current_setting('synchronous_commit') = 'off'
                THEN pg_catalog.pg_current_wal_insert_lsn()
            ELSE pg_catalog.pg_current_wal_flush_lsn() END,
       CASE WHEN NOT pg_catalog.pg_is_in_recovery()
            THEN pg_catalog.pg_current_wal_flush_lsn() END,
       pg_catalog.pg_is_in_recovery(),
       (SELECT physical_slots FROM slots),
       (SELECT idle_slots FROM slots),
       count(*) FILTER (WHERE flush_lsn IS NOT NULL)::integer,
       count(*) FILTER (WHERE flush_lsn IS NULL)::integer,
       min(flush_lsn), max(flush_lsn), min(replay_lsn), max(replay_lsn)
FROM physical
$$;
CREATE FUNCTION orchestrator.orchestrator_start_scheduled_run(s orchestrator.schedules, p_slot timestamp with time zone, p_run_id text, p_available_at timestamp with time zone, p_how text) RETURNS text
    LANGUAGE plpgsql
    SET search_path TO 'orchestrator'
    AS $$
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
CREATE FUNCTION orchestrator.orchestrator_stream_append(p_run_id text, p_worker text, p_fence bigint, p_base_version bigint, p_events jsonb, p_max_events bigint, p_max_bytes bigint, OUT status text, OUT last_seq bigint) RETURNS record
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path TO 'orchestrator'
    AS $_$
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
$_$;
CREATE FUNCTION orchestrator.orchestrator_stream_read(p_run_id text, p_after bigint, p_limit integer) RETURNS TABLE(seq bigint, fence bigint, base_version bigint, kind text, data jsonb, created_at timestamp with time zone)
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path TO 'orchestrator'
    AS $$
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
CREATE TABLE orchestrator.run_streams (
    run_id text NOT NULL,
    last_seq bigint DEFAULT 0 NOT NULL,
    open_fence bigint,
    open_from bigint,
    events bigint DEFAULT 0 NOT NULL,
    bytes bigint DEFAULT 0 NOT NULL,
    truncated boolean DEFAULT false NOT NULL,
    updated_at timestamp with time zone DEFAULT clock_timestamp() NOT NULL
);
CREATE TABLE orchestrator.runs (
    run_id text NOT NULL,
    agent text NOT NULL,
    state text DEFAULT 'queued'::text NOT NULL,
    input jsonb NOT NULL,
    fence bigint DEFAULT 0 NOT NULL,
    lease_owner text,
    lease_until timestamp with time zone,
    attempt integer DEFAULT 0 NOT NULL,
    max_attempts integer DEFAULT 5 NOT NULL,
    available_at timestamp with time zone DEFAULT clock_timestamp() NOT NULL,
    step text,
    checkpoint jsonb,
    checkpoint_version bigint DEFAULT 0 NOT NULL,
    result jsonb,
    error jsonb,
    idempotency_key text,
    created_at timestamp with time zone DEFAULT clock_timestamp() NOT NULL,
    updated_at timestamp with time zone DEFAULT clock_timestamp() NOT NULL,
    finished_at timestamp with time zone,
    wait jsonb,
    signals_pending integer DEFAULT 0 NOT NULL,
    watched boolean DEFAULT false NOT NULL,
    wake_streak integer DEFAULT 0 NOT NULL,
    born_epoch bigint DEFAULT orchestrator.fence_epoch() NOT NULL,
    concurrency_key text,
    priority integer DEFAULT 0 NOT NULL,
    started_version text,
    agent_version text,
    parent_run_id text,
    child_key text,
    root_run_id text,
    depth integer DEFAULT 0 NOT NULL,
    children_awaited integer,
    cancel_with_parent boolean DEFAULT false NOT NULL,
    forked_from text,
    forked_at_version bigint,
    schedule_id text,
    schedule_slot timestamp with time zone,
    CONSTRAINT runs_agent_version_check CHECK (((agent_version IS NULL) OR ((length(agent_version) >= 1) AND (length(agent_version) <= 64)))),
    CONSTRAINT runs_attempt_check CHECK ((attempt >= 0)),
    CONSTRAINT runs_child_has_parent_check CHECK (((parent_run_id IS NULL) = (child_key IS NULL))),
    CONSTRAINT runs_child_key_check CHECK (((child_key IS NULL) OR (child_key ~ '^[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}$'::text))),
    CONSTRAINT runs_concurrency_key_check CHECK (((concurrency_key IS NULL) OR ((length(concurrency_key) >= 1) AND (length(concurrency_key) <= 200)))),
    CONSTRAINT runs_fence_check CHECK ((fence >= 0)),
    CONSTRAINT runs_lease_matches_state CHECK (((state = 'running'::text) = ((lease_owner IS NOT NULL) AND (lease_until IS NOT NULL)))),
    CONSTRAINT runs_max_attempts_check CHECK ((max_attempts >= 1)),
    CONSTRAINT runs_priority_check CHECK (((priority >= '-1000'::integer) AND (priority <= 1000))),
    CONSTRAINT runs_signals_pending_check CHECK ((signals_pending >= 0)),
    CONSTRAINT runs_started_version_check CHECK (((started_version IS NULL) OR ((length(started_version) >= 1) AND (length(started_version) <= 64)))),
    CONSTRAINT runs_state_check CHECK ((state = ANY (ARRAY['queued'::text, 'running'::text, 'waiting'::text, 'succeeded'::text, 'failed'::text, 'cancelled'::text, 'dead'::text]))),
    CONSTRAINT runs_wake_streak_check CHECK ((wake_streak >= 0))
)
WITH (fillfactor='70');
CREATE FUNCTION orchestrator.orchestrator_stream_retract(p_stream orchestrator.run_streams, p_run orchestrator.runs) RETURNS orchestrator.run_streams
    LANGUAGE plpgsql
    SET search_path TO 'orchestrator'
    AS $_$
DECLARE
    first_seq bigint;
    last_seq bigint;
    retracted bigint;
    stream run_streams := p_stream;
    committed bigint;
BEGIN
    SELECT coalesce(max((e.details ->> 'version')::bigint), 0) INTO committed
    FROM run_events AS e
    WHERE e.run_id = stream.run_id AND e.fence = stream.open_fence
      AND e.kind IN ('checkpoint', 'succeeded', 'failed')
      -- A commit's events are the worker's words: one that is not a version is not a commit.
      AND e.details ->> 'version' ~ '^[0-9]{1,18}$';
    SELECT min(o.seq), max(o.seq), count(*) INTO first_seq, last_seq, retracted
    FROM run_output AS o
    WHERE o.run_id = stream.run_id AND o.seq >= stream.open_from
      AND o.fence = stream.open_fence AND o.kind IN ('text', 'progress')
      AND o.base_version >= committed;
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
$_$;
CREATE FUNCTION orchestrator.orchestrator_stream_seal(p_run_id text) RETURNS boolean
    LANGUAGE plpgsql
    SET search_path TO 'orchestrator'
    AS $$
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
CREATE FUNCTION orchestrator.orchestrator_submission_is_valid(p_run_id text, p_agent text, p_input jsonb, p_idempotency_key text) RETURNS boolean
    LANGUAGE plpgsql IMMUTABLE
    AS $_$
BEGIN
    IF p_run_id IS NULL OR p_run_id !~ '^[A-Za-z][A-Za-z0-9_.:-]{0,127}$'
       OR p_agent IS NULL OR p_agent !~ '^[A-Za-z][A-Za-z0-9_.-]{0,63}$' OR p_input IS NULL
       OR (p_idempotency_key IS NOT NULL AND length(p_idempotency_key) NOT BETWEEN 1 AND 200)
    THEN
        RAISE EXCEPTION 'a run needs a well-formed run id, agent name and input'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    RETURN true;
END
$_$;
CREATE FUNCTION orchestrator.orchestrator_submit_run(p_run_id text, p_agent text, p_input jsonb, p_max_attempts integer, p_idempotency_key text, p_not_before timestamp with time zone, p_traceparent text) RETURNS SETOF orchestrator.runs
    LANGUAGE sql SECURITY DEFINER
    SET search_path TO 'orchestrator', 'pg_temp'
    AS $$
WITH inserted AS (
    INSERT INTO runs (run_id, agent, input, max_attempts, idempotency_key, available_at)
    SELECT p_run_id, p_agent, p_input, coalesce(p_max_attempts, 5), p_idempotency_key,
           coalesce(p_not_before, clock_timestamp())
    WHERE orchestrator_submission_is_valid(p_run_id, p_agent, p_input, p_idempotency_key)
    ON CONFLICT DO NOTHING
    RETURNING *
), logged AS (
    INSERT INTO run_events (run_id, kind, fence, details)
    SELECT run_id, 'submitted', fence,
           jsonb_build_object('agent', agent, 'max_attempts', max_attempts,
                              'idempotency_key', idempotency_key, 'not_before', p_not_before)
    FROM inserted
), traced AS (
    INSERT INTO run_traces (run_id, fence, traceparent)
    SELECT run_id, 0, p_traceparent FROM inserted WHERE p_traceparent IS NOT NULL
), woken AS (
    SELECT pg_notify('orchestrator_runs', agent) FROM inserted
)
SELECT inserted.* FROM inserted WHERE (SELECT count(*) FROM woken) >= 0
$$;
CREATE FUNCTION orchestrator.orchestrator_submit_run(p_run_id text, p_agent text, p_input jsonb, p_max_attempts integer, p_idempotency_key text, p_not_before timestamp with time zone, p_traceparent text, p_concurrency_key text, p_priority integer) RETURNS SETOF orchestrator.runs
    LANGUAGE sql SECURITY DEFINER
    SET search_path TO 'orchestrator'
    AS $$
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
CREATE FUNCTION orchestrator.orchestrator_top_up_budget(p_run_id text, p_added jsonb, p_principal text, p_via text, p_typed_by text, OUT run_id text, OUT notified bigint, OUT audit_seq bigint, OUT principal text) RETURNS SETOF record
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path TO 'orchestrator', 'pg_temp'
    AS $_$
#variable_conflict use_column
DECLARE
    who record;
    amount record;
    raised text;
    woken record;
BEGIN
    IF p_added IS NULL OR jsonb_typeof(p_added) <> 'object' OR p_added = '{}'::jsonb THEN
        RAISE EXCEPTION 'a top-up names at least one of turns, tool_calls, input_tokens, '
                        'output_tokens, cost_usd' USING ERRCODE = 'invalid_parameter_value';
    END IF;
    FOR amount IN SELECT key, value FROM jsonb_each(p_added) LOOP
        IF amount.key NOT IN ('turns', 'tool_calls', 'input_tokens', 'output_tokens',
                              'cost_usd')
           OR jsonb_typeof(amount.value) NOT IN ('number', 'string')
           OR (amount.value #>> '{}') !~ '^[0-9]{1,30}(\.[0-9]{1,30})?$'
           OR (amount.value #>> '{}')::numeric <= 0
           OR (amount.key <> 'cost_usd' AND (amount.value #>> '{}') !~ '^[0-9]{1,19}$') THEN
            RAISE EXCEPTION 'a top-up''s % must be a number above 0 (whole for counts), not %',
                amount.key, amount.value USING ERRCODE = 'invalid_parameter_value';
        END IF;
    END LOOP;
    SELECT * INTO who FROM orchestrator_decider(p_principal, p_via, p_typed_by, 'operate');
    -- The run's row first, as commits and reservations lock it (the same lock order).
    PERFORM 1 FROM runs AS r WHERE r.run_id = p_run_id FOR UPDATE;
    UPDATE run_budgets AS b
    SET turns_limit = least(b.turns_limit::numeric
                            + coalesce((p_added ->> 'turns')::numeric, 0),
                            2 ^ 62::numeric)::bigint,
        tool_calls_limit = least(b.tool_calls_limit::numeric
                                 + coalesce((p_added ->> 'tool_calls')::numeric, 0),
                                 2 ^ 62::numeric)::bigint,
        input_tokens_limit = least(b.input_tokens_limit::numeric
                                   + coalesce((p_added ->> 'input_tokens')::numeric, 0),
                                   2 ^ 62::numeric)::bigint,
        output_tokens_limit = least(b.output_tokens_limit::numeric
                                    + coalesce((p_added ->> 'output_tokens')::numeric, 0),
                                    2 ^ 62::numeric)::bigint,
        cost_limit = b.cost_limit + coalesce((p_added ->> 'cost_usd')::numeric, 0),
        updated_at = clock_timestamp()
    WHERE b.run_id = p_run_id
    RETURNING b.run_id INTO raised;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    INSERT INTO budget_ledger (run_id, kind, turns, tool_calls, input_tokens, output_tokens, cost,
                               details)
    VALUES (raised,
            'top_up', least(coalesce((p_added ->> 'turns')::numeric, 0), 2 ^ 62::numeric),
            least(coalesce((p_added ->> 'tool_calls')::numeric, 0), 2 ^ 62::numeric),
            least(coalesce((p_added ->> 'input_tokens')::numeric, 0), 2 ^ 62::numeric),
            least(coalesce((p_added ->> 'output_tokens')::numeric, 0), 2 ^ 62::numeric),
            coalesce((p_added ->> 'cost_usd')::numeric, 0), p_added);
    UPDATE runs AS r
    SET available_at = CASE WHEN r.state = 'waiting' AND r.wait ->> 'reason' = 'budget'
                            THEN clock_timestamp() ELSE r.available_at END
    WHERE r.run_id = raised AND r.state IN ('running', 'waiting')
    RETURNING r.agent, r.fence,
              r.available_at <= clock_timestamp() AND r.state = 'waiting' AS due
    INTO woken;
    INSERT INTO run_events (run_id, kind, fence, details)
    VALUES (raised, 'budget_topped_up', woken.fence,
            p_added || jsonb_build_object('woke_the_run', woken.due, 'by', who.principal,
                                          'via', who.via));
    notified := 0;
    IF woken.due THEN
        PERFORM pg_notify('orchestrator_runs', woken.agent);
        notified := 1;
    END IF;
    run_id := raised;
    principal := who.principal;
    audit_seq := orchestrator_audit_decision(
        who.principal, who.via, 'top_up', raised, NULL, p_added, p_typed_by);
    RETURN NEXT;
END
$_$;
CREATE FUNCTION orchestrator.orchestrator_wake_for_effect(p_run_id text, p_effect_key text) RETURNS void
    LANGUAGE plpgsql
    SET search_path TO 'orchestrator', 'pg_temp'
    AS $$
DECLARE
    woken record;
BEGIN
    UPDATE runs AS r
    SET available_at = CASE WHEN r.state = 'waiting' AND r.wait -> 'effects' ? p_effect_key
                            THEN clock_timestamp() ELSE r.available_at END
    WHERE r.run_id = p_run_id AND r.state IN ('running', 'waiting')
    RETURNING r.agent, r.available_at <= clock_timestamp() AND r.state = 'waiting' AS due
    INTO woken;
    IF woken.due THEN
        PERFORM pg_notify('orchestrator_runs', woken.agent);
    END IF;
END
$$;
CREATE FUNCTION orchestrator.runs_fence_moves_only_by_claim() RETURNS trigger
    LANGUAGE plpgsql
    SET search_path TO 'orchestrator', 'pg_temp'
    AS $$
BEGIN
    IF pg_has_role(current_user, (SELECT relowner FROM pg_class WHERE oid = TG_RELID), 'USAGE')
    THEN
        RETURN NEW;
    END IF;
    IF NEW.fence > OLD.fence + 1 AND NEW.fence = fence_floor() AND NEW.state = 'running'
       AND ((OLD.state IN ('queued', 'waiting') AND OLD.available_at <= clock_timestamp())
            OR (OLD.state = 'running' AND OLD.lease_until < clock_timestamp())) THEN
        RETURN NEW;
    END IF;
    RAISE EXCEPTION 'run %: only a claim may move its fence (from % to % refused for role %)',
        OLD.run_id, OLD.fence, NEW.fence, current_user
        USING ERRCODE = 'insufficient_privilege',
              HINT = 'a claim raises the fence of a due or expired run by one; a cancel '
                     '(orchestrator_cancel_run) raises it too; nothing lowers it';
END
$$;
CREATE TABLE orchestrator.access_tokens (
    token_id text NOT NULL,
    principal text NOT NULL,
    sha256 text NOT NULL,
    description text,
    scope jsonb,
    created_at timestamp with time zone DEFAULT clock_timestamp() NOT NULL,
    created_by text NOT NULL,
    expires_at timestamp with time zone,
    revoked_at timestamp with time zone,
    revoked_by text,
    last_used_at timestamp with time zone,
    CONSTRAINT access_tokens_sha256_check CHECK ((sha256 ~ '^[0-9a-f]{64}$'::text)),
    CONSTRAINT access_tokens_token_id_check CHECK ((token_id ~ '^[a-z0-9]{12}$'::text))
);
CREATE TABLE orchestrator.agent_cutovers (
    agent text NOT NULL,
    version text NOT NULL,
    set_by text NOT NULL,
    set_at timestamp with time zone DEFAULT clock_timestamp() NOT NULL,
    drain boolean DEFAULT false NOT NULL,
    CONSTRAINT agent_cutovers_agent_check CHECK ((agent ~ '^[A-Za-z][A-Za-z0-9_.-]{0,63}$'::text)),
    CONSTRAINT agent_cutovers_version_check CHECK ((version ~ '^[A-Za-z0-9][A-Za-z0-9._+-]{0,63}$'::text))
);
CREATE TABLE orchestrator.audit_log (
    seq bigint NOT NULL,
    at timestamp with time zone NOT NULL,
    db_user text NOT NULL,
    principal text NOT NULL,
    via text NOT NULL,
    action text NOT NULL,
    run_id text,
    effect_key text,
    detail jsonb NOT NULL,
    prev_sha256 text NOT NULL,
    sha256 text NOT NULL,
    CONSTRAINT audit_log_seq_check CHECK ((seq > 0))
);
CREATE TABLE orchestrator.budget_carves (
    child_run_id text NOT NULL,
    parent_run_id text NOT NULL,
    turns bigint DEFAULT 0 NOT NULL,
    tool_calls bigint DEFAULT 0 NOT NULL,
    input_tokens bigint DEFAULT 0 NOT NULL,
    output_tokens bigint DEFAULT 0 NOT NULL,
    cost numeric DEFAULT 0 NOT NULL,
    carved_at timestamp with time zone DEFAULT clock_timestamp() NOT NULL,
    settled_at timestamp with time zone
);
CREATE TABLE orchestrator.budget_ledger (
    run_id text NOT NULL,
    entry bigint NOT NULL,
    kind text NOT NULL,
    fence bigint,
    turns bigint DEFAULT 0 NOT NULL,
    tool_calls bigint DEFAULT 0 NOT NULL,
    input_tokens bigint DEFAULT 0 NOT NULL,
    output_tokens bigint DEFAULT 0 NOT NULL,
    cost numeric DEFAULT 0 NOT NULL,
    details jsonb DEFAULT '{}'::jsonb NOT NULL,
    at timestamp with time zone DEFAULT clock_timestamp() NOT NULL,
    CONSTRAINT budget_ledger_kind_check CHECK ((kind = ANY (ARRAY['reserve'::text, 'settle'::text, 'forfeit'::text, 'top_up'::text, 'refused'::text])))
);
ALTER TABLE orchestrator.budget_ledger ALTER COLUMN entry ADD GENERATED ALWAYS AS IDENTITY (
    SEQUENCE NAME orchestrator.budget_ledger_entry_seq
    START WITH 1
    INCREMENT BY 1
    NO MINVALUE
    NO MAXVALUE
    CACHE 1
);
CREATE TABLE orchestrator.cutover_drains (
    run_id text NOT NULL,
    fence bigint NOT NULL,
    to_version text NOT NULL,
    since timestamp with time zone DEFAULT clock_timestamp() NOT NULL
);
CREATE TABLE orchestrator.effect_fences (
    run_id text NOT NULL,
    fence bigint NOT NULL,
    updated_at timestamp with time zone DEFAULT clock_timestamp() NOT NULL
);
CREATE TABLE orchestrator.effects (
    run_id text NOT NULL,
    effect_key text NOT NULL,
    kind text NOT NULL,
    policy text NOT NULL,
    fence bigint NOT NULL,
    status text NOT NULL,
    payload jsonb NOT NULL,
    idempotency_key text NOT NULL,
    external_id text,
    result jsonb,
    error jsonb,
    attempts integer DEFAULT 0 NOT NULL,
    available_at timestamp with time zone DEFAULT clock_timestamp() NOT NULL,
    dispatcher text,
    dispatcher_until timestamp with time zone,
    ever_dispatched boolean DEFAULT false NOT NULL,
    created_at timestamp with time zone DEFAULT clock_timestamp() NOT NULL,
    updated_at timestamp with time zone DEFAULT clock_timestamp() NOT NULL,
    settled_at timestamp with time zone,
    payload_sha256 text,
    requires_approval boolean DEFAULT false NOT NULL,
    approval_expires_at timestamp with time zone,
    approved_sha256 text,
    decided_by text,
    decided_at timestamp with time zone,
    decision_note text,
    lookup_first boolean DEFAULT false NOT NULL,
    known_epoch bigint DEFAULT orchestrator.fence_epoch() NOT NULL,
    CONSTRAINT effects_policy_check CHECK ((policy = ANY (ARRAY['irreversible'::text, 'replaceable'::text]))),
    CONSTRAINT effects_status_check CHECK ((status = ANY (ARRAY['accepted'::text, 'dispatching'::text, 'uncertain'::text, 'confirmed'::text, 'failed'::text, 'rejected'::text, 'parked'::text, 'awaiting_approval'::text])))
);
CREATE TABLE orchestrator.orchestrator_schema_migrations (
    version integer NOT NULL,
    name text NOT NULL,
    applied_at timestamp with time zone DEFAULT clock_timestamp() NOT NULL,
    contracts boolean DEFAULT false NOT NULL
);
CREATE TABLE orchestrator.principals (
    name text NOT NULL,
    kind text NOT NULL,
    role text NOT NULL,
    created_at timestamp with time zone DEFAULT clock_timestamp() NOT NULL,
    created_by text NOT NULL,
    updated_at timestamp with time zone DEFAULT clock_timestamp() NOT NULL,
    disabled_at timestamp with time zone,
    CONSTRAINT principals_kind_check CHECK ((kind = ANY (ARRAY['person'::text, 'service'::text]))),
    CONSTRAINT principals_name_check CHECK ((name ~ '^[A-Za-z0-9][A-Za-z0-9._@+-]{0,199}$'::text)),
    CONSTRAINT principals_role_check CHECK ((role = ANY (ARRAY['viewer'::text, 'approver'::text, 'operator'::text, 'admin'::text])))
);
CREATE TABLE orchestrator.rate_limits (
    name text NOT NULL,
    requests integer,
    tokens bigint,
    per_seconds double precision NOT NULL,
    requests_left double precision DEFAULT 0 NOT NULL,
    tokens_left double precision DEFAULT 0 NOT NULL,
    refilled_at timestamp with time zone DEFAULT clock_timestamp() NOT NULL,
    paused_until timestamp with time zone,
    paused_by text,
    set_by text NOT NULL,
    set_at timestamp with time zone DEFAULT clock_timestamp() NOT NULL,
    CONSTRAINT rate_limits_name_check CHECK ((name ~ '^[A-Za-z0-9][A-Za-z0-9_.:/@+-]{0,199}$'::text)),
    CONSTRAINT rate_limits_per_seconds_check CHECK (((per_seconds >= (0.001)::double precision) AND (per_seconds <= (604800)::double precision))),
    CONSTRAINT rate_limits_requests_check CHECK (((requests >= 1) AND (requests <= 1000000000))),
    CONSTRAINT rate_limits_tokens_check CHECK (((tokens >= 1) AND (tokens <= '1000000000000'::bigint)))
);
CREATE TABLE orchestrator.run_budgets (
    run_id text NOT NULL,
    turns_limit bigint,
    tool_calls_limit bigint,
    input_tokens_limit bigint,
    output_tokens_limit bigint,
    cost_limit numeric,
    turns_spent bigint DEFAULT 0 NOT NULL,
    tool_calls_spent bigint DEFAULT 0 NOT NULL,
    input_tokens_spent bigint DEFAULT 0 NOT NULL,
    output_tokens_spent bigint DEFAULT 0 NOT NULL,
    cost_spent numeric DEFAULT 0 NOT NULL,
    turns_reserved bigint DEFAULT 0 NOT NULL,
    input_tokens_reserved bigint DEFAULT 0 NOT NULL,
    output_tokens_reserved bigint DEFAULT 0 NOT NULL,
    cost_reserved numeric DEFAULT 0 NOT NULL,
    reserved_fence bigint,
    updated_at timestamp with time zone DEFAULT clock_timestamp() NOT NULL,
    turns_carved bigint DEFAULT 0 NOT NULL,
    tool_calls_carved bigint DEFAULT 0 NOT NULL,
    input_tokens_carved bigint DEFAULT 0 NOT NULL,
    output_tokens_carved bigint DEFAULT 0 NOT NULL,
    cost_carved numeric DEFAULT 0 NOT NULL
);
CREATE TABLE orchestrator.run_checkpoints (
    run_id text NOT NULL,
    version bigint NOT NULL,
    step text NOT NULL,
    checkpoint jsonb,
    agent_version text,
    fence bigint NOT NULL,
    at timestamp with time zone DEFAULT clock_timestamp() NOT NULL
);
CREATE TABLE orchestrator.run_events (
    event_id bigint NOT NULL,
    run_id text NOT NULL,
    at timestamp with time zone DEFAULT clock_timestamp() NOT NULL,
    kind text NOT NULL,
    fence bigint,
    worker_id text,
    details jsonb DEFAULT '{}'::jsonb NOT NULL
);
ALTER TABLE orchestrator.run_events ALTER COLUMN event_id ADD GENERATED ALWAYS AS IDENTITY (
    SEQUENCE NAME orchestrator.run_events_event_id_seq
    START WITH 1
    INCREMENT BY 1
    NO MINVALUE
    NO MAXVALUE
    CACHE 1
);
CREATE TABLE orchestrator.run_holds (
    run_id text NOT NULL,
    fence bigint NOT NULL,
    kind text NOT NULL,
    reason text NOT NULL,
    since timestamp with time zone DEFAULT clock_timestamp() NOT NULL,
    until timestamp with time zone,
    CONSTRAINT run_holds_kind_check CHECK ((kind = ANY (ARRAY['limit'::text, 'rate'::text]))),
    CONSTRAINT run_holds_reason_check CHECK ((length(reason) <= 500))
);
CREATE TABLE orchestrator.run_messages (
    run_id text NOT NULL,
    seq integer NOT NULL,
    turn integer NOT NULL,
    role text NOT NULL,
    body jsonb NOT NULL,
    usage jsonb,
    fence bigint NOT NULL,
    at timestamp with time zone DEFAULT clock_timestamp() NOT NULL,
    CONSTRAINT run_messages_role_check CHECK ((role = ANY (ARRAY['system'::text, 'user'::text, 'assistant'::text, 'tool'::text]))),
    CONSTRAINT run_messages_seq_check CHECK ((seq >= 0)),
    CONSTRAINT run_messages_turn_check CHECK ((turn >= 0))
);
CREATE TABLE orchestrator.run_output (
    run_id text NOT NULL,
    seq bigint NOT NULL,
    fence bigint NOT NULL,
    base_version bigint NOT NULL,
    kind text NOT NULL,
    data jsonb NOT NULL,
    created_at timestamp with time zone DEFAULT clock_timestamp() NOT NULL,
    CONSTRAINT run_output_kind_check CHECK ((kind = ANY (ARRAY['text'::text, 'progress'::text, 'retracted'::text, 'truncated'::text])))
);
CREATE TABLE orchestrator.run_signals (
    run_id text NOT NULL,
    seq bigint NOT NULL,
    name text NOT NULL,
    data jsonb NOT NULL,
    idempotency_key text,
    sent_at timestamp with time zone DEFAULT clock_timestamp() NOT NULL,
    consumed_at timestamp with time zone,
    consumed_fence bigint
);
ALTER TABLE orchestrator.run_signals ALTER COLUMN seq ADD GENERATED ALWAYS AS IDENTITY (
    SEQUENCE NAME orchestrator.run_signals_seq_seq
    START WITH 1
    INCREMENT BY 1
    NO MINVALUE
    NO MAXVALUE
    CACHE 1
);
CREATE TABLE orchestrator.run_traces (
    run_id text NOT NULL,
    fence bigint NOT NULL,
    traceparent text NOT NULL,
    worker_id text,
    at timestamp with time zone DEFAULT clock_timestamp() NOT NULL,
    CONSTRAINT run_traces_fence_check CHECK ((fence >= 0)),
    CONSTRAINT run_traces_traceparent_check CHECK ((length(traceparent) <= 128))
);
CREATE TABLE orchestrator.schedule_slots (
    schedule_id text NOT NULL,
    slot timestamp with time zone NOT NULL,
    outcome text NOT NULL,
    run_id text,
    fence bigint NOT NULL,
    decided_by text NOT NULL,
    decided_at timestamp with time zone DEFAULT clock_timestamp() NOT NULL,
    CONSTRAINT schedule_slots_outcome CHECK ((outcome = ANY (ARRAY['fired'::text, 'skipped'::text, 'buffered'::text, 'backfilled'::text]))),
    CONSTRAINT schedule_slots_run CHECK (((run_id IS NOT NULL) = (outcome = ANY (ARRAY['fired'::text, 'backfilled'::text]))))
);
CREATE SEQUENCE orchestrator.worker_session_keys
    AS integer
    START WITH 1
    INCREMENT BY 1
    NO MINVALUE
    NO MAXVALUE
    CACHE 1
    CYCLE;
CREATE TABLE orchestrator.workers (
    worker_id text NOT NULL,
    session_key integer NOT NULL,
    host text NOT NULL,
    pid integer NOT NULL,
    agents text[] NOT NULL,
    started_at timestamp with time zone DEFAULT clock_timestamp() NOT NULL,
    server_started_at timestamp with time zone,
    last_renewal_at timestamp with time zone,
    agent_versions jsonb
);
ALTER TABLE ONLY orchestrator.access_tokens
    ADD CONSTRAINT access_tokens_pkey PRIMARY KEY (token_id);
ALTER TABLE ONLY orchestrator.access_tokens
    ADD CONSTRAINT access_tokens_sha256_key UNIQUE (sha256);
ALTER TABLE ONLY orchestrator.agent_cutovers
    ADD CONSTRAINT agent_cutovers_pkey PRIMARY KEY (agent);
ALTER TABLE ONLY orchestrator.audit_log
    ADD CONSTRAINT audit_log_pkey PRIMARY KEY (seq);
ALTER TABLE ONLY orchestrator.budget_carves
    ADD CONSTRAINT budget_carves_pkey PRIMARY KEY (child_run_id);
ALTER TABLE ONLY orchestrator.budget_ledger
    ADD CONSTRAINT budget_ledger_pkey PRIMARY KEY (run_id, entry);
ALTER TABLE ONLY orchestrator.cutover_drains
    ADD CONSTRAINT cutover_drains_pkey PRIMARY KEY (run_id);
ALTER TABLE ONLY orchestrator.effect_fences
    ADD CONSTRAINT effect_fences_pkey PRIMARY KEY (run_id);
ALTER TABLE ONLY orchestrator.effects
    ADD CONSTRAINT effects_idempotency_key_key UNIQUE (idempotency_key);
ALTER TABLE ONLY orchestrator.effects
    ADD CONSTRAINT effects_pkey PRIMARY KEY (run_id, effect_key);
ALTER TABLE ONLY orchestrator.flow_limits
    ADD CONSTRAINT flow_limits_pkey PRIMARY KEY (agent, key_pattern, per);
ALTER TABLE ONLY orchestrator.orchestrator_schema_migrations
    ADD CONSTRAINT orchestrator_schema_migrations_pkey PRIMARY KEY (version);
ALTER TABLE orchestrator.principals
    ADD CONSTRAINT principals_name_not_reserved CHECK ((name <> 'shared-token'::text)) NOT VALID;
ALTER TABLE ONLY orchestrator.principals
    ADD CONSTRAINT principals_pkey PRIMARY KEY (name);
ALTER TABLE ONLY orchestrator.rate_limits
    ADD CONSTRAINT rate_limits_pkey PRIMARY KEY (name);
ALTER TABLE ONLY orchestrator.run_budgets
    ADD CONSTRAINT run_budgets_pkey PRIMARY KEY (run_id);
ALTER TABLE ONLY orchestrator.run_checkpoints
    ADD CONSTRAINT run_checkpoints_pkey PRIMARY KEY (run_id, version);
ALTER TABLE ONLY orchestrator.run_events
    ADD CONSTRAINT run_events_pkey PRIMARY KEY (event_id);
ALTER TABLE ONLY orchestrator.run_holds
    ADD CONSTRAINT run_holds_pkey PRIMARY KEY (run_id);
ALTER TABLE ONLY orchestrator.run_messages
    ADD CONSTRAINT run_messages_pkey PRIMARY KEY (run_id, seq);
ALTER TABLE ONLY orchestrator.run_output
    ADD CONSTRAINT run_output_pkey PRIMARY KEY (run_id, seq);
ALTER TABLE ONLY orchestrator.run_signals
    ADD CONSTRAINT run_signals_pkey PRIMARY KEY (run_id, seq);
ALTER TABLE ONLY orchestrator.run_streams
    ADD CONSTRAINT run_streams_pkey PRIMARY KEY (run_id);
ALTER TABLE ONLY orchestrator.run_traces
    ADD CONSTRAINT run_traces_pkey PRIMARY KEY (run_id, fence);
ALTER TABLE ONLY orchestrator.runs
    ADD CONSTRAINT runs_pkey PRIMARY KEY (run_id);
ALTER TABLE ONLY orchestrator.schedule_slots
    ADD CONSTRAINT schedule_slots_pkey PRIMARY KEY (schedule_id, slot);
ALTER TABLE ONLY orchestrator.schedules
    ADD CONSTRAINT schedules_name_key UNIQUE (name);
ALTER TABLE ONLY orchestrator.schedules
    ADD CONSTRAINT schedules_pkey PRIMARY KEY (schedule_id);
ALTER TABLE ONLY orchestrator.workers
    ADD CONSTRAINT workers_pkey PRIMARY KEY (worker_id);
ALTER TABLE ONLY orchestrator.workers
    ADD CONSTRAINT workers_session_key_key UNIQUE (session_key);
CREATE INDEX access_tokens_of_principal ON orchestrator.access_tokens USING btree (principal);
CREATE INDEX audit_log_of_run ON orchestrator.audit_log USING btree (run_id, seq) WHERE (run_id IS NOT NULL);
CREATE INDEX effects_awaiting_approval ON orchestrator.effects USING btree (approval_expires_at) WHERE (status = 'awaiting_approval'::text);
CREATE INDEX effects_dispatching_by_kind ON orchestrator.effects USING btree (kind, dispatcher_until) WHERE (status = 'dispatching'::text);
CREATE INDEX effects_due_by_kind ON orchestrator.effects USING btree (kind, available_at) WHERE (status = ANY (ARRAY['accepted'::text, 'uncertain'::text]));
CREATE INDEX effects_parked ON orchestrator.effects USING btree (run_id) WHERE (status = 'parked'::text);
CREATE INDEX run_events_run ON orchestrator.run_events USING btree (run_id, event_id);
CREATE INDEX run_events_submitted ON orchestrator.run_events USING btree (event_id) WHERE (kind = 'submitted'::text);
CREATE UNIQUE INDEX run_signals_key ON orchestrator.run_signals USING btree (run_id, idempotency_key) WHERE (idempotency_key IS NOT NULL);
CREATE INDEX run_signals_unconsumed ON orchestrator.run_signals USING btree (run_id, name, seq) WHERE (consumed_at IS NULL);
CREATE UNIQUE INDEX runs_children ON orchestrator.runs USING btree (parent_run_id, child_key) WHERE (parent_run_id IS NOT NULL);
CREATE INDEX runs_due_keyed ON orchestrator.runs USING btree (agent, concurrency_key COLLATE "C", priority DESC, available_at) WHERE ((state = ANY (ARRAY['queued'::text, 'waiting'::text])) AND (concurrency_key IS NOT NULL));
CREATE INDEX runs_due_plain ON orchestrator.runs USING btree (agent, available_at) WHERE ((state = ANY (ARRAY['queued'::text, 'waiting'::text])) AND (concurrency_key IS NULL));
CREATE INDEX runs_finished ON orchestrator.runs USING btree (finished_at) WHERE (state = ANY (ARRAY['succeeded'::text, 'failed'::text, 'cancelled'::text, 'dead'::text]));
CREATE UNIQUE INDEX runs_idempotency_key ON orchestrator.runs USING btree (idempotency_key) WHERE (idempotency_key IS NOT NULL);
CREATE INDEX runs_leased_keyed ON orchestrator.runs USING btree (agent, concurrency_key) WHERE ((lease_owner IS NOT NULL) AND (concurrency_key IS NOT NULL));
CREATE INDEX runs_owner ON orchestrator.runs USING btree (lease_owner) WHERE (state = 'running'::text);
CREATE INDEX runs_running ON orchestrator.runs USING btree (agent) WHERE (state = 'running'::text);
CREATE INDEX runs_schedule_unfinished ON orchestrator.runs USING btree (schedule_id) WHERE ((schedule_id IS NOT NULL) AND (state = ANY (ARRAY['queued'::text, 'running'::text, 'waiting'::text])));
CREATE INDEX schedules_buffered ON orchestrator.schedules USING btree (schedule_id) WHERE ((buffered_slot IS NOT NULL) AND (NOT paused));
CREATE INDEX schedules_due ON orchestrator.schedules USING btree (next_fire_at) WHERE ((NOT paused) AND (next_fire_at IS NOT NULL));
CREATE TRIGGER audit_log_append_only BEFORE DELETE OR UPDATE ON orchestrator.audit_log FOR EACH ROW EXECUTE FUNCTION orchestrator.audit_log_is_append_only();
CREATE TRIGGER audit_log_no_truncate BEFORE TRUNCATE ON orchestrator.audit_log FOR EACH STATEMENT EXECUTE FUNCTION orchestrator.audit_log_is_append_only();
CREATE TRIGGER budget_ledger_amounts_are_positive BEFORE INSERT ON orchestrator.budget_ledger FOR EACH ROW WHEN (((new.turns < 0) OR (new.tool_calls < 0) OR (new.input_tokens < 0) OR (new.output_tokens < 0) OR (new.cost < (0)::numeric) OR (new.cost = ANY (ARRAY['NaN'::numeric, 'Infinity'::numeric])))) EXECUTE FUNCTION orchestrator.orchestrator_budget_amounts_are_positive();
CREATE TRIGGER runs_child_ended AFTER UPDATE OF state ON orchestrator.runs FOR EACH ROW WHEN (((new.parent_run_id IS NOT NULL) AND (new.state = ANY (ARRAY['succeeded'::text, 'failed'::text, 'cancelled'::text, 'dead'::text])) AND (old.state IS DISTINCT FROM new.state))) EXECUTE FUNCTION orchestrator.orchestrator_child_ended();
CREATE TRIGGER runs_fence_guard BEFORE UPDATE OF fence ON orchestrator.runs FOR EACH ROW WHEN (((new.fence IS DISTINCT FROM old.fence) AND (NOT ((new.fence = (old.fence + 1)) AND (new.state = 'running'::text) AND (((old.state = ANY (ARRAY['queued'::text, 'waiting'::text])) AND (old.available_at <= clock_timestamp())) OR ((old.state = 'running'::text) AND (old.lease_until < clock_timestamp()))))))) EXECUTE FUNCTION orchestrator.runs_fence_moves_only_by_claim();
CREATE TRIGGER runs_parent_failed AFTER UPDATE OF state ON orchestrator.runs FOR EACH ROW WHEN (((new.state = ANY (ARRAY['failed'::text, 'dead'::text])) AND (old.state IS DISTINCT FROM new.state))) EXECUTE FUNCTION orchestrator.orchestrator_parent_failed();
ALTER TABLE ONLY orchestrator.access_tokens
    ADD CONSTRAINT access_tokens_principal_fkey FOREIGN KEY (principal) REFERENCES orchestrator.principals(name) ON DELETE CASCADE;
ALTER TABLE ONLY orchestrator.budget_carves
    ADD CONSTRAINT budget_carves_child_run_id_fkey FOREIGN KEY (child_run_id) REFERENCES orchestrator.runs(run_id) ON DELETE CASCADE;
ALTER TABLE ONLY orchestrator.cutover_drains
    ADD CONSTRAINT cutover_drains_run_id_fkey FOREIGN KEY (run_id) REFERENCES orchestrator.runs(run_id) ON DELETE CASCADE;
ALTER TABLE ONLY orchestrator.run_checkpoints
    ADD CONSTRAINT run_checkpoints_run_id_fkey FOREIGN KEY (run_id) REFERENCES orchestrator.runs(run_id) ON DELETE CASCADE;
ALTER TABLE ONLY orchestrator.run_holds
    ADD CONSTRAINT run_holds_run_id_fkey FOREIGN KEY (run_id) REFERENCES orchestrator.runs(run_id) ON DELETE CASCADE;
ALTER TABLE ONLY orchestrator.run_output
    ADD CONSTRAINT run_output_run_id_fkey FOREIGN KEY (run_id) REFERENCES orchestrator.run_streams(run_id) ON DELETE CASCADE;
ALTER TABLE ONLY orchestrator.run_streams
    ADD CONSTRAINT run_streams_run_id_fkey FOREIGN KEY (run_id) REFERENCES orchestrator.runs(run_id) ON DELETE CASCADE;
ALTER TABLE ONLY orchestrator.schedule_slots
    ADD CONSTRAINT schedule_slots_schedule_id_fkey FOREIGN KEY (schedule_id) REFERENCES orchestrator.schedules(schedule_id) ON DELETE CASCADE;
