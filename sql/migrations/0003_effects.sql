-- The fenced effect boundary: effect records, the per-run fence high-water mark, and the
-- acceptance rule as one function, so that every path (a step's commit, the action proxy) runs
-- exactly the same checks inside the caller's transaction.

CREATE TABLE effect_fences (
    run_id     text        PRIMARY KEY,
    fence      bigint      NOT NULL,
    updated_at timestamptz NOT NULL DEFAULT clock_timestamp()
);

CREATE TABLE effects (
    run_id            text        NOT NULL,
    effect_key        text        NOT NULL,
    kind              text        NOT NULL,
    policy            text        NOT NULL CHECK (policy IN ('irreversible', 'replaceable')),
    fence             bigint      NOT NULL,
    status            text        NOT NULL CHECK (status IN (
        'accepted', 'dispatching', 'uncertain', 'confirmed', 'failed', 'rejected', 'parked')),
    payload           jsonb       NOT NULL,
    idempotency_key   text        NOT NULL UNIQUE,
    external_id       text,
    result            jsonb,
    error             jsonb,
    attempts          integer     NOT NULL DEFAULT 0,
    available_at      timestamptz NOT NULL DEFAULT clock_timestamp(),
    dispatcher        text,
    dispatcher_until  timestamptz,
    ever_dispatched   boolean     NOT NULL DEFAULT false,
    created_at        timestamptz NOT NULL DEFAULT clock_timestamp(),
    updated_at        timestamptz NOT NULL DEFAULT clock_timestamp(),
    settled_at        timestamptz,
    PRIMARY KEY (run_id, effect_key)
);

-- Work for dispatchers: new or uncertain effects that are due, and dispatches whose dispatcher
-- lease ran out (the dispatcher died, maybe after the vendor accepted: reconcile, never resend).
CREATE INDEX effects_due ON effects (available_at) WHERE status IN ('accepted', 'uncertain');
CREATE INDEX effects_dispatching ON effects (dispatcher_until) WHERE status = 'dispatching';

-- accept_effect: the boundary's rule for one request, in the caller's transaction.
-- Outcomes: 'accepted' (new record), 'replaced' (a replaceable, never-dispatched record now
-- carries the newer fence and payload), 'existing' (the record stays as it is and its outcome
-- is the answer: an irreversible effect is never sent twice), 'stale' (the fence is older than
-- the boundary's high-water mark, or than the run's current fence: nothing changes but a
-- stale_fence_rejected event), 'conflict' (the key is already used with another kind/policy).
-- Timeline events are written only for runs this database holds (a boundary deployed apart
-- from the runs table keeps its records without them).
CREATE FUNCTION orchestrator_accept_effect(
    p_run_id text, p_effect_key text, p_fence bigint, p_kind text, p_policy text,
    p_payload jsonb, p_idempotency_key text, p_worker_id text,
    OUT outcome text, OUT accepted_fence bigint, OUT status text
) LANGUAGE plpgsql AS $$
DECLARE
    high_water bigint;
    run_fence bigint;
    run_state text;
    existing effects%ROWTYPE;
BEGIN
    SELECT fence INTO high_water FROM effect_fences WHERE run_id = p_run_id FOR UPDATE;
    -- Co-located with the runs table, the boundary also knows the run's current fence: a
    -- request from a replaced owner is stale even before the new owner has asked for anything.
    SELECT r.fence, r.state INTO run_fence, run_state FROM runs AS r WHERE r.run_id = p_run_id;
    accepted_fence := greatest(coalesce(high_water, p_fence), coalesce(run_fence, p_fence));
    IF p_fence < accepted_fence OR (run_state IS NOT NULL AND run_state <> 'running') THEN
        outcome := 'stale';
        INSERT INTO run_events (run_id, kind, fence, worker_id, details)
        SELECT p_run_id, 'stale_fence_rejected', p_fence, p_worker_id,
               jsonb_build_object('effect_key', p_effect_key, 'accepted_fence', accepted_fence,
                                  'run_state', run_state)
        WHERE run_fence IS NOT NULL;
        RETURN;
    END IF;
    IF high_water IS NULL THEN
        INSERT INTO effect_fences (run_id, fence) VALUES (p_run_id, p_fence);
    ELSIF p_fence > high_water THEN
        UPDATE effect_fences SET fence = p_fence, updated_at = clock_timestamp()
        WHERE run_id = p_run_id;
    END IF;
    accepted_fence := p_fence;

    SELECT * INTO existing FROM effects AS e
    WHERE e.run_id = p_run_id AND e.effect_key = p_effect_key FOR UPDATE;
    IF NOT FOUND THEN
        INSERT INTO effects (run_id, effect_key, kind, policy, fence, status, payload,
                             idempotency_key)
        VALUES (p_run_id, p_effect_key, p_kind, p_policy, p_fence, 'accepted', p_payload,
                p_idempotency_key);
        INSERT INTO run_events (run_id, kind, fence, worker_id, details)
        SELECT p_run_id, 'effect_accepted', p_fence, p_worker_id,
               jsonb_build_object('effect_key', p_effect_key, 'kind', p_kind, 'policy', p_policy)
        WHERE run_fence IS NOT NULL;
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
        SELECT p_run_id, 'effect_superseded', existing.fence, p_worker_id,
               jsonb_build_object('effect_key', p_effect_key, 'by_fence', p_fence,
                                  'superseded_payload', existing.payload)
        WHERE run_fence IS NOT NULL;
        outcome := 'replaced';
        status := 'accepted';
        RETURN;
    END IF;
    outcome := 'existing';
    status := existing.status;
END
$$;
