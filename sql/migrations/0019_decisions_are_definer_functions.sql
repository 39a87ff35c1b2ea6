-- Every decision is a SECURITY DEFINER function that appends its own audit row (invariant 13).
--
-- Until now a decision (approve, deny, resolve, signal, top-up, cancel) was a plain statement on
-- the console role's column grants, audited by the Python store in the same transaction, and
-- audit_append took the principal from whoever called it: the worker role could append a row
-- naming alice, the console role could approve by a direct UPDATE with no row at all, and the
-- worker could reset a budget's spent counters. Now:
--
-- * each decision, a run's submission, a console sign-in and a worker's purge is a function that
--   runs as the schema owner, checks who decides, does exactly its one thing and appends its
--   audit row itself; `db grant` takes direct writes on those tables away from every role but
--   the owner, and audit_append from everyone but the owner;
-- * a function records the role that connected (session_user, via database-role) unless the
--   caller names a principal, which only a role holding EXECUTE on orchestrator_may_vouch() may
--   (the console, which signs people in); the principal it names must be an enabled person whose
--   role allows the decision;
-- * a budget's spent counters only grow: reservations and settlements are definer functions
--   too, and no amount that changes a budget may be negative.
--
-- Every SECURITY DEFINER function here, and every helper one calls that reads a table, has its
-- search_path fixed to this schema then pg_temp (a caller's temporary table can never stand in
-- for one of ours), and EXECUTE revoked from PUBLIC; the pure helpers (orchestrator_role_allows,
-- orchestrator_submission_is_valid) and the triggers' functions need neither.
--
-- A budget's amounts are finite and never negative (a trigger on the ledger), and the fence
-- epoch comes from the database's own setting, never a session's, since definer functions run
-- with the caller's session settings. What the worker and the dispatcher may still write by
-- hand, and why it is left to their grants (triggers on the claim and settle paths cost those
-- paths a few per cent), is in docs/database-roles.md.

SELECT set_config('search_path', current_setting('search_path') || ', pg_temp', true);

-- The capability to name who decides: a role granted EXECUTE on this may pass a principal to
-- the decision functions (the console vouches for the people it signed in). Calling it does
-- nothing; holding the privilege is what counts.
CREATE FUNCTION orchestrator_may_vouch() RETURNS boolean LANGUAGE sql IMMUTABLE AS 'SELECT true';
REVOKE ALL ON FUNCTION orchestrator_may_vouch() FROM PUBLIC;

-- What each role may do: the same table as orchestrator.access (a test keeps the two equal).
CREATE FUNCTION orchestrator_role_allows(p_role text, p_permission text) RETURNS boolean
LANGUAGE sql IMMUTABLE AS $$
    SELECT CASE p_role
        WHEN 'admin' THEN p_permission IN ('read', 'see_payloads', 'decide', 'operate',
                                           'administer')
        WHEN 'operator' THEN p_permission IN ('read', 'see_payloads', 'operate')
        WHEN 'approver' THEN p_permission IN ('read', 'decide')
        WHEN 'viewer' THEN p_permission = 'read'
        ELSE false
    END
$$;

-- Whether the role that connected acts for the schema's owner (the migrator, a superuser).
CREATE FUNCTION orchestrator_caller_owns_schema() RETURNS boolean LANGUAGE sql STABLE
    SET search_path FROM CURRENT AS $$
    SELECT pg_has_role(session_user, n.nspowner, 'USAGE')
    FROM pg_namespace AS n WHERE n.nspname = current_schema()
$$;
REVOKE ALL ON FUNCTION orchestrator_caller_owns_schema() FROM PUBLIC;

-- Who a decision is recorded as. No principal: the role that connected, which only
-- PostgreSQL's own authentication establishes. A named principal: only from a role that may
-- vouch, and only an enabled person whose role allows the decision (or the console's shared
-- token). Refusals are SQLSTATE 42501 and change nothing.
CREATE FUNCTION orchestrator_decider(
    p_principal text, p_via text, p_typed_by text, p_permission text,
    OUT principal text, OUT via text
) LANGUAGE plpgsql STABLE SET search_path FROM CURRENT AS $$
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
REVOKE ALL ON FUNCTION orchestrator_decider(text, text, text, text) FROM PUBLIC;

-- The audit row of a decision, with what the person typed kept as a note.
CREATE FUNCTION orchestrator_audit_decision(
    p_principal text, p_via text, p_action text, p_run_id text, p_effect_key text,
    p_detail jsonb, p_typed_by text
) RETURNS bigint LANGUAGE sql SET search_path FROM CURRENT AS $$
    SELECT audit_append(p_principal, p_via, p_action, p_run_id, p_effect_key,
                        coalesce(p_detail, '{}'::jsonb)
                        || CASE WHEN p_typed_by IS NULL THEN '{}'::jsonb
                                ELSE jsonb_build_object('note', p_typed_by) END)
$$;
REVOKE ALL ON FUNCTION orchestrator_audit_decision(text, text, text, text, text, jsonb, text)
    FROM PUBLIC;

-- audit_append appends what it is given: only the owner (and so the functions below) may.
REVOKE ALL ON FUNCTION audit_append(text, text, text, text, text, jsonb) FROM PUBLIC;

-- Submit a run (queries.sql's submit_run was this statement): the console and clients submit
-- without a write privilege on runs, run_events or run_traces, so they cannot write a timeline
-- event or a run's state otherwise. No row: the run id or the idempotency key is taken.
CREATE FUNCTION orchestrator_submission_is_valid(
    p_run_id text, p_agent text, p_input jsonb, p_idempotency_key text
) RETURNS boolean LANGUAGE plpgsql IMMUTABLE AS $$
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
$$;

-- One statement, as the submit was before (a procedure of several would cost each submit more).
CREATE FUNCTION orchestrator_submit_run(
    p_run_id text, p_agent text, p_input jsonb, p_max_attempts integer, p_idempotency_key text,
    p_not_before timestamptz, p_traceparent text
) RETURNS SETOF runs LANGUAGE sql SECURITY DEFINER SET search_path FROM CURRENT AS $$
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
REVOKE ALL ON FUNCTION orchestrator_submit_run(text, text, jsonb, integer, text, timestamptz, text)
    FROM PUBLIC;

-- Cancel a run, audited (it was migration 0017's function without the audit row).
DROP FUNCTION orchestrator_cancel_run(text, text, text);
CREATE FUNCTION orchestrator_cancel_run(
    p_run_id text, p_reason text, p_principal text, p_via text, p_typed_by text
) RETURNS TABLE (run_id text, fence bigint, previous_state text, previous_owner text,
                 notified bigint, audit_seq bigint, principal text)
LANGUAGE plpgsql SECURITY DEFINER SET search_path FROM CURRENT AS $$
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
    WITH target AS (
        SELECT r.run_id, r.state AS previous_state, r.lease_owner AS previous_owner
        FROM runs AS r
        WHERE r.run_id = p_run_id AND r.state IN ('queued', 'running', 'waiting')
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
        SELECT c.run_id, 'cancelled', c.fence,
               jsonb_build_object('previous_state', c.previous_state,
                                  'previous_owner', c.previous_owner, 'reason', p_reason,
                                  'by', who.principal, 'via', who.via, 'typed_by', p_typed_by)
        FROM cancelled AS c
    ), fenced AS (
        -- The effect boundary learns the new fence too: the old owner's requests are now stale.
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
           (SELECT count(*) FROM told) AS notified
    INTO done FROM cancelled AS c;
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
        jsonb_build_object('reason', p_reason), p_typed_by);
    RETURN NEXT;
END
$$;
REVOKE ALL ON FUNCTION orchestrator_cancel_run(text, text, text, text, text) FROM PUBLIC;

-- Requeue a dead-lettered run with a fresh set of attempts (queries.sql's requeue_dead was this
-- statement), audited.
CREATE FUNCTION orchestrator_retry_run(
    p_run_id text, p_principal text, p_via text, p_typed_by text,
    OUT run_id text, OUT notified bigint, OUT audit_seq bigint, OUT principal text
) RETURNS SETOF record LANGUAGE plpgsql SECURITY DEFINER SET search_path FROM CURRENT AS $$
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
REVOKE ALL ON FUNCTION orchestrator_retry_run(text, text, text, text) FROM PUBLIC;

-- Wake a run that waits for one of its effects to settle (see queries.sql's WAKING A WAITING
-- RUN: the run's row is updated whether it waits or still runs, so a park not yet committed
-- sees the wake).
CREATE FUNCTION orchestrator_wake_for_effect(p_run_id text, p_effect_key text) RETURNS void
LANGUAGE plpgsql SET search_path FROM CURRENT AS $$
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
REVOKE ALL ON FUNCTION orchestrator_wake_for_effect(text, text) FROM PUBLIC;

-- A person's decision on an effect awaiting approval, bound to the payload they saw
-- (queries.sql's decide_approval was this statement): refused, with nothing decided, when it
-- does not await approval, its run is no longer live, it has expired, its payload is not the one
-- p_payload_sha256 names, or the run's fence has moved on from p_run_fence. Approved: sendable,
-- for this payload's hash only. Denied: rejected, the run woken. No row: no such effect.
CREATE FUNCTION orchestrator_decide_approval(
    p_run_id text, p_effect_key text, p_decision text, p_note text, p_payload_sha256 text,
    p_run_fence bigint, p_principal text, p_via text, p_typed_by text,
    OUT run_id text, OUT effect_key text, OUT status text, OUT payload_sha256 text,
    OUT approval_expires_at timestamptz, OUT decided_by text, OUT decided_at timestamptz,
    OUT requires_approval boolean, OUT run_state text, OUT run_fence bigint,
    OUT decided boolean, OUT now timestamptz, OUT audit_seq bigint, OUT principal text
) RETURNS SETOF record LANGUAGE plpgsql SECURITY DEFINER SET search_path FROM CURRENT AS $$
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
REVOKE ALL ON FUNCTION orchestrator_decide_approval(text, text, text, text, text, bigint, text,
                                                    text, text) FROM PUBLIC;

-- A person decided a parked effect (queries.sql's resolve_parked_effect was this statement):
-- sent (confirmed, with the external id if given) or not sent (sent again under the same
-- idempotency key). The record keeps the outcome only: who resolved it is in the timeline and
-- the audit trail, and the park's error is cleared from a confirmed one. No row: not parked.
CREATE FUNCTION orchestrator_resolve_effect(
    p_run_id text, p_effect_key text, p_sent boolean, p_external_id text, p_principal text,
    p_via text, p_typed_by text,
    OUT status text, OUT audit_seq bigint, OUT principal text
) RETURNS SETOF record LANGUAGE plpgsql SECURITY DEFINER SET search_path FROM CURRENT AS $$
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
REVOKE ALL ON FUNCTION orchestrator_resolve_effect(text, text, boolean, text, text, text, text)
    FROM PUBLIC;

-- A signal to a run (queries.sql's send_signal was this statement), stored once per
-- idempotency key, counted on the run, the run woken if it waits for a signal of that name, and
-- audited. state NULL: no such run; seq NULL: not stored (the run has finished or the key was
-- used).
CREATE FUNCTION orchestrator_send_signal(
    p_run_id text, p_name text, p_data jsonb, p_idempotency_key text, p_principal text,
    p_via text, p_typed_by text,
    OUT state text, OUT seq bigint, OUT sent_at timestamptz, OUT audit_seq bigint,
    OUT principal text
) RETURNS record LANGUAGE plpgsql SECURITY DEFINER SET search_path FROM CURRENT AS $$
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
$$;
REVOKE ALL ON FUNCTION orchestrator_send_signal(text, text, jsonb, text, text, text, text)
    FROM PUBLIC;

-- Raise a run's budget limits (queries.sql's top_up_budget was this statement), audited. Each
-- amount must be above 0 (a negative one would lower a limit: invariant 12), at least one must
-- be given, and nothing but the five dimensions. No row: the run has no budget.
CREATE FUNCTION orchestrator_top_up_budget(
    p_run_id text, p_added jsonb, p_principal text, p_via text, p_typed_by text,
    OUT run_id text, OUT notified bigint, OUT audit_seq bigint, OUT principal text
) RETURNS SETOF record LANGUAGE plpgsql SECURITY DEFINER SET search_path FROM CURRENT AS $$
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
$$;
REVOKE ALL ON FUNCTION orchestrator_top_up_budget(text, jsonb, text, text, text) FROM PUBLIC;

-- A budget's reservation runs as the owner now: a worker may not write run_budgets or the
-- ledger directly (it could reset what a run has spent). A negative amount would shrink the
-- reservation, so it is refused.
ALTER FUNCTION orchestrator_reserve_budget(text, text, bigint, jsonb, bigint, bigint, bigint,
                                           numeric)
    SECURITY DEFINER SET search_path FROM CURRENT;
REVOKE ALL ON FUNCTION orchestrator_reserve_budget(text, text, bigint, jsonb, bigint, bigint,
                                                   bigint, numeric) FROM PUBLIC;
CREATE FUNCTION orchestrator_budget_amounts_are_positive() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'a budget''s amounts are finite and never negative (% of run %: cost %)',
        NEW.kind, NEW.run_id, NEW.cost USING ERRCODE = 'check_violation';
END
$$;
-- NaN would stick in a spent counter for good (no top-up raises a limit past it).
CREATE TRIGGER budget_ledger_amounts_are_positive BEFORE INSERT ON budget_ledger FOR EACH ROW
    WHEN (NEW.turns < 0 OR NEW.tool_calls < 0 OR NEW.input_tokens < 0 OR NEW.output_tokens < 0
          OR NEW.cost < 0 OR NEW.cost IN ('NaN'::numeric, 'Infinity'::numeric))
    EXECUTE FUNCTION orchestrator_budget_amounts_are_positive();

-- In a turn's commit, each run's reservation under its current fence becomes what the turn
-- spent (queries.sql's settle_budgets was this statement): spent counters only grow, and only
-- the run's current fence settles. Counts saturate at 2^62 (budgets.MAX_AMOUNT).
CREATE FUNCTION orchestrator_settle_budgets(
    p_run_ids text[], p_fences bigint[], p_turns bigint[], p_tool_calls bigint[],
    p_input_tokens bigint[], p_output_tokens bigint[], p_costs numeric[]
) RETURNS SETOF text LANGUAGE sql SECURITY DEFINER SET search_path FROM CURRENT AS $$
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
REVOKE ALL ON FUNCTION orchestrator_settle_budgets(text[], bigint[], bigint[], bigint[],
                                                   bigint[], bigint[], numeric[]) FROM PUBLIC;

-- A retention purge (migration 0017's function), now with a floor and an audit row. A role that
-- does not own the schema (a worker's retention chore) may delete only runs that finished at
-- least an hour ago: a client may still be reading a run that finished seconds earlier. Every
-- batch that deleted runs appends its own purge row, naming the role that connected and the runs
-- it deleted.
DROP FUNCTION orchestrator_purge_finished(timestamptz, integer);
CREATE FUNCTION orchestrator_purge_finished(p_cutoff timestamptz, p_batch integer)
RETURNS TABLE (runs bigint, other_rows bigint, audit_seq bigint, principal text)
LANGUAGE plpgsql SECURITY DEFINER SET search_path FROM CURRENT AS $$
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
REVOKE ALL ON FUNCTION orchestrator_purge_finished(timestamptz, integer) FROM PUBLIC;

-- A console sign-in, audited. By personal token: the token must be the person's and still
-- work. By OpenID Connect with a role from the provider's groups (p_role): the person is added,
-- or their role changed, as their own audited sign-in; but admins are made and unmade only with
-- `orchestrator users` (a mapping to admin signs in only someone who is an admin already), a
-- disabled person stays out, and a service is never signed in. Refusals are SQLSTATE 42501.
CREATE FUNCTION orchestrator_sign_in(
    p_name text, p_via text, p_token_id text, p_role text,
    OUT name text, OUT kind text, OUT role text, OUT audit_seq bigint
) RETURNS record LANGUAGE plpgsql SECURITY DEFINER SET search_path FROM CURRENT AS $$
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
$$;
REVOKE ALL ON FUNCTION orchestrator_sign_in(text, text, text, text) FROM PUBLIC;

-- The epoch from the database's own orchestrator.fence_epoch_offset (ALTER DATABASE ... SET),
-- never from a session's SET or a role's default: any role could set those, and a definer
-- function (a cancel, a submission) would otherwise grant fences or stamp epochs from them.
CREATE OR REPLACE FUNCTION fence_epoch() RETURNS bigint LANGUAGE plpgsql VOLATILE AS $$
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
$$;

-- shared-token names the console's shared token in the audit trail: no person may carry it.
ALTER TABLE principals ADD CONSTRAINT principals_name_not_reserved
    CHECK (name <> 'shared-token') NOT VALID;
