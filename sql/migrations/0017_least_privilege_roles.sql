-- Least-privilege database roles (docs/database-roles.md; `orchestrator db grant` grants them).
--
-- A worker, a dispatcher, the action proxy and the console each get only the table and column
-- privileges their statements need. Where a role must change rows it may not write directly,
-- it calls a SECURITY DEFINER function owned by the schema owner, which does exactly one
-- checked thing: the boundary's rule (accept an effect), a cancel, the expiry of approvals, a
-- retention purge, an audit append. Each such function is executable only by the roles
-- `db grant` names (EXECUTE is revoked from PUBLIC here), and runs with a fixed search_path:
-- this schema, then pg_temp last, so a caller's temporary table can never stand in for one of
-- ours.
--
-- The fence is guarded by a trigger: a role that is not the schema owner may change a run's
-- fence only as a claim does (one up, or to the failover floor, from a due or expired run to a
-- running one). The claim keeps its one statement; the trigger's WHEN clause recognises a
-- claim's row without calling any function, so the claim path pays one expression per row.

SELECT set_config('search_path', current_setting('search_path') || ', pg_temp', true);

-- The boundary's rule runs as the schema owner: a role allowed to request effects (a worker,
-- the proxy) needs no write privilege on effects or effect_fences, so it cannot raise the
-- boundary's fence or rewrite a payload except as the rule allows.
ALTER FUNCTION orchestrator_accept_effect(text, text, bigint, text, text, jsonb, text, text,
                                          boolean, double precision)
    SECURITY DEFINER SET search_path FROM CURRENT;
REVOKE ALL ON FUNCTION orchestrator_accept_effect(text, text, bigint, text, text, jsonb, text,
                                                  text, boolean, double precision) FROM PUBLIC;

ALTER FUNCTION audit_append(text, text, text, text, text, jsonb) SET search_path FROM CURRENT;
REVOKE ALL ON FUNCTION audit_append(text, text, text, text, text, jsonb) FROM PUBLIC;

-- Cancel a run (the statement queries.sql's cancel_run was): raises the fence, so it runs as
-- the schema owner; only roles granted EXECUTE (the console, the owner) may cancel.
CREATE FUNCTION orchestrator_cancel_run(p_run_id text, p_reason text, p_by text)
RETURNS TABLE (run_id text, fence bigint, previous_state text, previous_owner text,
               notified bigint)
LANGUAGE sql SECURITY DEFINER SET search_path FROM CURRENT AS $$
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
$$;
REVOKE ALL ON FUNCTION orchestrator_cancel_run(text, text, text) FROM PUBLIC;

-- Deny by expiry the approvals nobody gave in time (queries.sql's expire_approvals was this
-- statement): any worker runs it as a chore, and a worker may not write effects otherwise.
CREATE FUNCTION orchestrator_expire_approvals(p_limit integer)
RETURNS TABLE (run_id text, effect_key text, notified bigint)
LANGUAGE sql SECURITY DEFINER SET search_path FROM CURRENT AS $$
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
$$;
REVOKE ALL ON FUNCTION orchestrator_expire_approvals(integer) FROM PUBLIC;

-- Delete a batch of finished runs with everything kept for them (queries.sql's purge_finished
-- was this statement): a worker's retention chore runs it, and no role but the owner may
-- delete runs, effects or the boundary's fences directly.
CREATE FUNCTION orchestrator_purge_finished(p_cutoff timestamptz, p_batch integer)
RETURNS TABLE (runs bigint, other_rows bigint)
LANGUAGE sql SECURITY DEFINER SET search_path FROM CURRENT AS $$
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
$$;
REVOKE ALL ON FUNCTION orchestrator_purge_finished(timestamptz, integer) FROM PUBLIC;

-- Called only for a fence change that is not a plain claim (the trigger's WHEN lets those
-- through): the schema owner (and so the definer functions above: a cancel) may; anyone else
-- only as a claim after a failover, which jumps to the new epoch's floor.
CREATE FUNCTION runs_fence_moves_only_by_claim() RETURNS trigger LANGUAGE plpgsql
    SET search_path FROM CURRENT AS $$
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

CREATE TRIGGER runs_fence_guard BEFORE UPDATE OF fence ON runs FOR EACH ROW
    WHEN (NEW.fence IS DISTINCT FROM OLD.fence
          AND NOT (NEW.fence = OLD.fence + 1 AND NEW.state = 'running'
                   AND ((OLD.state IN ('queued', 'waiting')
                         AND OLD.available_at <= clock_timestamp())
                        OR (OLD.state = 'running' AND OLD.lease_until < clock_timestamp()))))
    EXECUTE FUNCTION runs_fence_moves_only_by_claim();
