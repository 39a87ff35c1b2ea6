-- Fences that never go backwards across a PostgreSQL failover (docs/high-availability.md).
--
-- A promoted standby may lack the last transactions of the primary it replaces, fences it had
-- granted among them; counting on from the standby's copy would grant those fences again. Every
-- promotion starts a new WAL timeline, and the timeline comes from the server, not from the
-- replicated data: the fence's high bits now carry the epoch (timeline - 1), so the first claim
-- on a promoted server jumps past every fence the lost timeline could have issued. Fences stay
-- one bigint and keep their order; on a server never promoted (epoch 0) nothing changes.

-- The epoch of this server: its WAL insert timeline - 1 (an error on a standby, which grants
-- nothing). pg_walfile_name names the segment on the timeline being written now, so it moves at
-- the promotion itself, not at the checkpoint after it as pg_control_checkpoint() does. A
-- logical restore into a new cluster starts again at timeline 1: the operator then sets
-- orchestrator.fence_epoch_offset (ALTER DATABASE ... SET) to the highest epoch restored.
CREATE FUNCTION fence_epoch() RETURNS bigint LANGUAGE sql VOLATILE AS $$
    SELECT ('x' || substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8))::bit(32)::bigint - 1
           + coalesce(nullif(current_setting('orchestrator.fence_epoch_offset', true), '')::bigint,
                      0)
$$;

-- The epoch a fence was granted in: its bits above the low 40 (a trillion claims per run and
-- epoch).
CREATE FUNCTION fence_epoch_of(fence bigint) RETURNS bigint LANGUAGE sql IMMUTABLE
    PARALLEL SAFE AS $$
    SELECT fence >> 40
$$;

-- The lowest fence a claim may grant on this server: a claim grants
-- greatest(fence + 1, fence_floor()).
CREATE FUNCTION fence_floor() RETURNS bigint LANGUAGE sql VOLATILE
    SET search_path FROM CURRENT AS $$
    SELECT fence_epoch() << 40
$$;

-- The epoch a run was submitted in. A run born before a promotion may have progressed on the
-- lost timeline (its effects sent, there and only there); runs already stored count as epoch 0.
ALTER TABLE runs ADD COLUMN born_epoch bigint NOT NULL DEFAULT 0;
ALTER TABLE runs ALTER COLUMN born_epoch SET DEFAULT fence_epoch();

-- The dispatcher looks this effect up before its first send (cleared by that claim).
ALTER TABLE effects ADD COLUMN lookup_first boolean NOT NULL DEFAULT false;

-- The epoch of the effect's acceptance or its last dispatcher claim: claimed in a later epoch,
-- the lost timeline may have dispatched it after what this copy records.
ALTER TABLE effects ADD COLUMN known_epoch bigint NOT NULL DEFAULT 0;
ALTER TABLE effects ALTER COLUMN known_epoch SET DEFAULT fence_epoch();

CREATE OR REPLACE FUNCTION orchestrator_accept_effect(
    p_run_id text, p_effect_key text, p_fence bigint, p_kind text, p_policy text,
    p_payload jsonb, p_idempotency_key text, p_worker_id text,
    p_requires_approval boolean, p_approval_seconds double precision,
    OUT outcome text, OUT accepted_fence bigint, OUT status text,
    OUT run_state text, OUT run_fence bigint
) LANGUAGE plpgsql SET search_path FROM CURRENT AS $$
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
