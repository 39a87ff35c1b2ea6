-- The effect boundary accepts an effect only for a run that exists, under the run's current
-- fence, while the run is running. Before, it took any fence at or above its high-water mark:
-- one request with a fence the run never had (1,000,000 for a run at fence 1) raised the mark
-- past the live owner, whose every later effect and commit was then refused. And a request for a
-- run id it did not know was recorded and sent.
--
-- Outcomes (besides accepted, replaced, existing and conflict, unchanged):
--   unknown_run   no such run: nothing is recorded;
--   stale         the fence is older than the run's current fence (the run was claimed again,
--                 or cancelled, since): a stale_fence_rejected event;
--   future_fence  the fence is above the run's current fence: no claim ever granted it;
--   not_running   the fence is current but the run is not running (queued, waiting, finished);
--                 both of these last two leave an effect_refused event.
-- run_state and run_fence tell the caller what is true now, so a refusal can say so.
--
-- Locks: the run's row first (FOR SHARE), then the boundary's row, the order cancel_run takes
-- them in (it updates the run, then raises the boundary's fence); the other order deadlocks.

DROP FUNCTION orchestrator_accept_effect(text, text, bigint, text, text, jsonb, text, text);

CREATE FUNCTION orchestrator_accept_effect(
    p_run_id text, p_effect_key text, p_fence bigint, p_kind text, p_policy text,
    p_payload jsonb, p_idempotency_key text, p_worker_id text,
    OUT outcome text, OUT accepted_fence bigint, OUT status text,
    OUT run_state text, OUT run_fence bigint
) LANGUAGE plpgsql AS $$
DECLARE
    high_water bigint;
    existing effects%ROWTYPE;
BEGIN
    SELECT r.fence, r.state INTO run_fence, run_state
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
        INSERT INTO effects (run_id, effect_key, kind, policy, fence, status, payload,
                             idempotency_key)
        VALUES (p_run_id, p_effect_key, p_kind, p_policy, p_fence, 'accepted', p_payload,
                p_idempotency_key);
        INSERT INTO run_events (run_id, kind, fence, worker_id, details)
        VALUES (p_run_id, 'effect_accepted', p_fence, p_worker_id,
                jsonb_build_object('effect_key', p_effect_key, 'kind', p_kind,
                                   'policy', p_policy));
        PERFORM pg_notify('orchestrator_effects_due', p_kind);
        outcome := 'accepted';
        status := 'accepted';
        RETURN;
    END IF;
    IF existing.kind <> p_kind OR existing.policy <> p_policy THEN
        outcome := 'conflict';
        status := existing.status;
        RETURN;
    END IF;
    IF existing.policy = 'replaceable' AND existing.status = 'accepted'
       AND NOT existing.ever_dispatched AND existing.fence < p_fence THEN
        UPDATE effects AS e
        SET fence = p_fence, payload = p_payload, updated_at = clock_timestamp()
        WHERE e.run_id = p_run_id AND e.effect_key = p_effect_key;
        INSERT INTO run_events (run_id, kind, fence, worker_id, details)
        VALUES (p_run_id, 'effect_superseded', existing.fence, p_worker_id,
                jsonb_build_object('effect_key', p_effect_key, 'by_fence', p_fence,
                                   'superseded_payload', existing.payload));
        outcome := 'replaced';
        status := 'accepted';
        RETURN;
    END IF;
    outcome := 'existing';
    status := existing.status;
END
$$;

-- A high-water mark above its run's fence can only be a fence the run never had, accepted by
-- the old rule; lowered to the run's fence, so that the run's owner can act again.
UPDATE effect_fences AS f SET fence = r.fence, updated_at = clock_timestamp()
FROM runs AS r
WHERE r.run_id = f.run_id AND f.fence > r.fence;
