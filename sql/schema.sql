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
    offset_text text := nullif(current_setting('orchestrator.fence_epoch_offset', true), '');
    epoch bigint;
BEGIN
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
CREATE FUNCTION orchestrator.orchestrator_cancel_run(p_run_id text, p_reason text, p_by text) RETURNS TABLE(run_id text, fence bigint, previous_state text, previous_owner text, notified bigint)
    LANGUAGE sql SECURITY DEFINER
    SET search_path TO 'orchestrator', 'pg_temp'
    AS $_$
WITH target AS (
    SELECT run_id, state AS previous_state, lease_owner AS previous_owner
    FROM runs
    WHERE run_id = $1 AND state IN ('queued', 'running', 'waiting')
    FOR UPDATE
), cancelled AS (
    UPDATE runs AS r
    SET state = 'cancelled', fence = greatest(r.fence + 1, (SELECT fence_floor())),
        lease_owner = NULL, lease_until = NULL,
        wait = NULL, updated_at = clock_timestamp(), finished_at = clock_timestamp()
    FROM target AS t
    WHERE r.run_id = t.run_id
    RETURNING r.run_id, r.fence, t.previous_state, t.previous_owner, r.watched
), logged AS (
    INSERT INTO run_events (run_id, kind, fence, details)
    SELECT run_id, 'cancelled', fence,
           jsonb_build_object('previous_state', previous_state, 'previous_owner', previous_owner,
                              'reason', $2::text, 'by', coalesce($3::text, session_user))
    FROM cancelled
), fenced AS (
    -- The effect boundary learns the new fence too: the old owner's requests are now stale.
    INSERT INTO effect_fences (run_id, fence)
    SELECT run_id, fence FROM cancelled
    ON CONFLICT (run_id) DO UPDATE
    SET fence = greatest(effect_fences.fence, EXCLUDED.fence), updated_at = clock_timestamp()
), withdrawn AS (
    -- Effects not yet handed to a vendor, and approvals still pending, are withdrawn: nobody
    -- will send them now, and approving one afterwards is refused.
    UPDATE effects AS e
    SET status = 'rejected', settled_at = clock_timestamp(), updated_at = clock_timestamp(),
        error = jsonb_build_object('type', 'RunCancelled',
                                   'message', 'the run was cancelled before this was sent')
    FROM cancelled AS c
    WHERE e.run_id = c.run_id AND e.status IN ('accepted', 'awaiting_approval')
    RETURNING e.run_id, e.effect_key, e.fence, e.requires_approval AND e.decided_at IS NULL
        AS pending_approval
), withdrawn_logged AS (
    INSERT INTO run_events (run_id, kind, fence, details)
    SELECT run_id, 'approval_withdrawn', fence,
           jsonb_build_object('effect_key', effect_key, 'reason', 'the run was cancelled')
    FROM withdrawn WHERE pending_approval
), told AS (
    SELECT pg_notify('orchestrator_cancel', run_id) FROM cancelled
    UNION ALL
    SELECT pg_notify('orchestrator_finished', run_id) FROM cancelled WHERE watched
)
SELECT run_id, fence, previous_state, previous_owner, (SELECT count(*) FROM told) AS notified
FROM cancelled
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
CREATE FUNCTION orchestrator.orchestrator_purge_finished(p_cutoff timestamp with time zone, p_batch integer) RETURNS TABLE(runs bigint, other_rows bigint)
    LANGUAGE sql SECURITY DEFINER
    SET search_path TO 'orchestrator', 'pg_temp'
    AS $_$
WITH doomed AS MATERIALIZED (
    SELECT r.run_id FROM runs AS r
    WHERE r.state IN ('succeeded', 'failed', 'cancelled', 'dead') AND r.finished_at < $1
      AND NOT EXISTS (
          SELECT 1 FROM effects AS e
          WHERE e.run_id = r.run_id AND e.status NOT IN ('confirmed', 'failed', 'rejected'))
    ORDER BY r.finished_at
    LIMIT $2
    FOR UPDATE OF r SKIP LOCKED
), events AS (
    DELETE FROM run_events WHERE run_id IN (SELECT run_id FROM doomed) RETURNING 1
), messages AS (
    DELETE FROM run_messages WHERE run_id IN (SELECT run_id FROM doomed) RETURNING 1
), effects_gone AS (
    DELETE FROM effects WHERE run_id IN (SELECT run_id FROM doomed) RETURNING 1
), fences AS (
    DELETE FROM effect_fences WHERE run_id IN (SELECT run_id FROM doomed) RETURNING 1
), signals AS (
    DELETE FROM run_signals WHERE run_id IN (SELECT run_id FROM doomed) RETURNING 1
), budgets AS (
    DELETE FROM run_budgets WHERE run_id IN (SELECT run_id FROM doomed) RETURNING 1
), ledger AS (
    DELETE FROM budget_ledger WHERE run_id IN (SELECT run_id FROM doomed) RETURNING 1
), traces AS (
    DELETE FROM run_traces WHERE run_id IN (SELECT run_id FROM doomed) RETURNING 1
), gone AS (
    DELETE FROM runs WHERE run_id IN (SELECT run_id FROM doomed) RETURNING run_id
)
SELECT (SELECT count(*) FROM gone) AS runs,
       (SELECT count(*) FROM events) + (SELECT count(*) FROM messages)
       + (SELECT count(*) FROM effects_gone) + (SELECT count(*) FROM fences)
       + (SELECT count(*) FROM signals) + (SELECT count(*) FROM budgets)
       + (SELECT count(*) FROM ledger) + (SELECT count(*) FROM traces) AS other_rows
$_$;
CREATE FUNCTION orchestrator.orchestrator_reserve_budget(p_run_id text, p_worker_id text, p_fence bigint, p_limits jsonb, p_turns bigint, p_input_tokens bigint, p_output_tokens bigint, p_cost numeric, OUT outcome text, OUT exhausted_by text, OUT tool_calls_left bigint) RETURNS record
    LANGUAGE plpgsql
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
             AND b.turns_spent + b.turns_reserved + p_turns > b.turns_limit THEN 'turns'
        WHEN b.input_tokens_limit IS NOT NULL
             AND b.input_tokens_spent + b.input_tokens_reserved + p_input_tokens
                 > b.input_tokens_limit THEN 'input_tokens'
        WHEN b.output_tokens_limit IS NOT NULL
             AND b.output_tokens_spent + b.output_tokens_reserved + p_output_tokens
                 > b.output_tokens_limit THEN 'output_tokens'
        WHEN b.cost_limit IS NOT NULL
             AND b.cost_spent + b.cost_reserved + p_cost > b.cost_limit THEN 'cost_usd'
        WHEN b.tool_calls_limit IS NOT NULL
             AND b.tool_calls_spent >= b.tool_calls_limit THEN 'tool_calls'
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
    tool_calls_left := b.tool_calls_limit - b.tool_calls_spent;
    outcome := 'reserved';
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
    applied_at timestamp with time zone DEFAULT clock_timestamp() NOT NULL
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
    updated_at timestamp with time zone DEFAULT clock_timestamp() NOT NULL
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
    CONSTRAINT runs_attempt_check CHECK ((attempt >= 0)),
    CONSTRAINT runs_fence_check CHECK ((fence >= 0)),
    CONSTRAINT runs_lease_matches_state CHECK (((state = 'running'::text) = ((lease_owner IS NOT NULL) AND (lease_until IS NOT NULL)))),
    CONSTRAINT runs_max_attempts_check CHECK ((max_attempts >= 1)),
    CONSTRAINT runs_signals_pending_check CHECK ((signals_pending >= 0)),
    CONSTRAINT runs_state_check CHECK ((state = ANY (ARRAY['queued'::text, 'running'::text, 'waiting'::text, 'succeeded'::text, 'failed'::text, 'cancelled'::text, 'dead'::text]))),
    CONSTRAINT runs_wake_streak_check CHECK ((wake_streak >= 0))
)
WITH (fillfactor='70');
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
    last_renewal_at timestamp with time zone
);
ALTER TABLE ONLY orchestrator.access_tokens
    ADD CONSTRAINT access_tokens_pkey PRIMARY KEY (token_id);
ALTER TABLE ONLY orchestrator.access_tokens
    ADD CONSTRAINT access_tokens_sha256_key UNIQUE (sha256);
ALTER TABLE ONLY orchestrator.audit_log
    ADD CONSTRAINT audit_log_pkey PRIMARY KEY (seq);
ALTER TABLE ONLY orchestrator.budget_ledger
    ADD CONSTRAINT budget_ledger_pkey PRIMARY KEY (run_id, entry);
ALTER TABLE ONLY orchestrator.effect_fences
    ADD CONSTRAINT effect_fences_pkey PRIMARY KEY (run_id);
ALTER TABLE ONLY orchestrator.effects
    ADD CONSTRAINT effects_idempotency_key_key UNIQUE (idempotency_key);
ALTER TABLE ONLY orchestrator.effects
    ADD CONSTRAINT effects_pkey PRIMARY KEY (run_id, effect_key);
ALTER TABLE ONLY orchestrator.orchestrator_schema_migrations
    ADD CONSTRAINT orchestrator_schema_migrations_pkey PRIMARY KEY (version);
ALTER TABLE ONLY orchestrator.principals
    ADD CONSTRAINT principals_pkey PRIMARY KEY (name);
ALTER TABLE ONLY orchestrator.run_budgets
    ADD CONSTRAINT run_budgets_pkey PRIMARY KEY (run_id);
ALTER TABLE ONLY orchestrator.run_events
    ADD CONSTRAINT run_events_pkey PRIMARY KEY (event_id);
ALTER TABLE ONLY orchestrator.run_messages
    ADD CONSTRAINT run_messages_pkey PRIMARY KEY (run_id, seq);
ALTER TABLE ONLY orchestrator.run_signals
    ADD CONSTRAINT run_signals_pkey PRIMARY KEY (run_id, seq);
ALTER TABLE ONLY orchestrator.run_traces
    ADD CONSTRAINT run_traces_pkey PRIMARY KEY (run_id, fence);
ALTER TABLE ONLY orchestrator.runs
    ADD CONSTRAINT runs_pkey PRIMARY KEY (run_id);
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
CREATE INDEX runs_due ON orchestrator.runs USING btree (agent, available_at) WHERE (state = ANY (ARRAY['queued'::text, 'waiting'::text]));
CREATE INDEX runs_finished ON orchestrator.runs USING btree (finished_at) WHERE (state = ANY (ARRAY['succeeded'::text, 'failed'::text, 'cancelled'::text, 'dead'::text]));
CREATE UNIQUE INDEX runs_idempotency_key ON orchestrator.runs USING btree (idempotency_key) WHERE (idempotency_key IS NOT NULL);
CREATE INDEX runs_owner ON orchestrator.runs USING btree (lease_owner) WHERE (state = 'running'::text);
CREATE INDEX runs_running ON orchestrator.runs USING btree (agent) WHERE (state = 'running'::text);
CREATE TRIGGER audit_log_append_only BEFORE DELETE OR UPDATE ON orchestrator.audit_log FOR EACH ROW EXECUTE FUNCTION orchestrator.audit_log_is_append_only();
CREATE TRIGGER audit_log_no_truncate BEFORE TRUNCATE ON orchestrator.audit_log FOR EACH STATEMENT EXECUTE FUNCTION orchestrator.audit_log_is_append_only();
CREATE TRIGGER runs_fence_guard BEFORE UPDATE OF fence ON orchestrator.runs FOR EACH ROW WHEN (((new.fence IS DISTINCT FROM old.fence) AND (NOT ((new.fence = (old.fence + 1)) AND (new.state = 'running'::text) AND (((old.state = ANY (ARRAY['queued'::text, 'waiting'::text])) AND (old.available_at <= clock_timestamp())) OR ((old.state = 'running'::text) AND (old.lease_until < clock_timestamp()))))))) EXECUTE FUNCTION orchestrator.runs_fence_moves_only_by_claim();
ALTER TABLE ONLY orchestrator.access_tokens
    ADD CONSTRAINT access_tokens_principal_fkey FOREIGN KEY (principal) REFERENCES orchestrator.principals(name) ON DELETE CASCADE;
