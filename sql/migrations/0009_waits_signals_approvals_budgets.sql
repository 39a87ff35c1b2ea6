-- Waiting without a lease: signals, approvals bound to a payload, budgets, timers.
--
-- A run that waits is in state 'waiting' with no lease and no worker; what it waits for is in
-- runs.wait ({"signals": [...], "effects": [...], "until": ..., "reason": ...}) and it is due
-- (available_at) only when that happens: a matching signal, its awaited effects all settled, an
-- approval decided, its budget topped up, or its timer. A backoff after a failed attempt is a
-- wait with runs.wait NULL. Waiting runs sit at the far end of runs_due (available_at is
-- 'infinity' until woken), so claims do not read them.

ALTER TABLE runs
    ADD COLUMN wait jsonb,
    ADD COLUMN signals_pending integer NOT NULL DEFAULT 0 CHECK (signals_pending >= 0),
    ADD COLUMN watched boolean NOT NULL DEFAULT false;
-- watched: a client waits for this run's end; its final statement NOTIFYs orchestrator_finished.

-- Signals: durable, in order, delivered to the run's next step and consumed in that step's fenced
-- commit (exactly once into the run). The same idempotency key twice is one signal.
CREATE TABLE run_signals (
    run_id          text        NOT NULL,
    seq             bigint      GENERATED ALWAYS AS IDENTITY,
    name            text        NOT NULL,
    data            jsonb       NOT NULL,
    idempotency_key text,
    sent_at         timestamptz NOT NULL DEFAULT clock_timestamp(),
    consumed_at     timestamptz,
    consumed_fence  bigint,
    PRIMARY KEY (run_id, seq)
);
CREATE UNIQUE INDEX run_signals_key ON run_signals (run_id, idempotency_key)
    WHERE idempotency_key IS NOT NULL;

-- Approvals: an effect that needs a person's decision is recorded 'awaiting_approval' with the
-- hash of its payload; the dispatcher sends it only once approved for that very hash.
ALTER TABLE effects DROP CONSTRAINT effects_status_check;
ALTER TABLE effects ADD CONSTRAINT effects_status_check CHECK (status IN (
    'accepted', 'dispatching', 'uncertain', 'confirmed', 'failed', 'rejected', 'parked',
    'awaiting_approval'));
ALTER TABLE effects
    ADD COLUMN payload_sha256 text,
    ADD COLUMN requires_approval boolean NOT NULL DEFAULT false,
    ADD COLUMN approval_expires_at timestamptz,
    ADD COLUMN approved_sha256 text,
    ADD COLUMN decided_by text,
    ADD COLUMN decided_at timestamptz,
    ADD COLUMN decision_note text;
UPDATE effects SET payload_sha256 = encode(sha256(convert_to(payload::text, 'UTF8')), 'hex');
CREATE INDEX effects_awaiting_approval ON effects (approval_expires_at)
    WHERE status = 'awaiting_approval';

-- Budgets: limits, what was spent, and what the attempt in flight has reserved (its fence).
-- A reservation left by an earlier fence counts as spent: that attempt may have been billed.
CREATE TABLE run_budgets (
    run_id               text        PRIMARY KEY,
    turns_limit          bigint,
    tool_calls_limit     bigint,
    input_tokens_limit   bigint,
    output_tokens_limit  bigint,
    cost_limit           numeric,
    turns_spent          bigint      NOT NULL DEFAULT 0,
    tool_calls_spent     bigint      NOT NULL DEFAULT 0,
    input_tokens_spent   bigint      NOT NULL DEFAULT 0,
    output_tokens_spent  bigint      NOT NULL DEFAULT 0,
    cost_spent           numeric     NOT NULL DEFAULT 0,
    turns_reserved       bigint      NOT NULL DEFAULT 0,
    input_tokens_reserved  bigint    NOT NULL DEFAULT 0,
    output_tokens_reserved bigint    NOT NULL DEFAULT 0,
    cost_reserved        numeric     NOT NULL DEFAULT 0,
    reserved_fence       bigint,
    updated_at           timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE TABLE budget_ledger (
    run_id        text        NOT NULL,
    entry         bigint      GENERATED ALWAYS AS IDENTITY,
    kind          text        NOT NULL CHECK (kind IN ('reserve', 'settle', 'forfeit', 'top_up',
                                                       'refused')),
    fence         bigint,
    turns         bigint      NOT NULL DEFAULT 0,
    tool_calls    bigint      NOT NULL DEFAULT 0,
    input_tokens  bigint      NOT NULL DEFAULT 0,
    output_tokens bigint      NOT NULL DEFAULT 0,
    cost          numeric     NOT NULL DEFAULT 0,
    details       jsonb       NOT NULL DEFAULT '{}'::jsonb,
    at            timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (run_id, entry)
);

-- The boundary's rule, now with approvals: a request may ask for a person's approval (expiring
-- after p_approval_seconds); it is then recorded 'awaiting_approval' with its payload's hash. A
-- replaceable record awaiting approval may be replaced by a newer fence like an accepted one; its
-- new payload needs a new approval.
DROP FUNCTION orchestrator_accept_effect(text, text, bigint, text, text, jsonb, text, text);

CREATE FUNCTION orchestrator_accept_effect(
    p_run_id text, p_effect_key text, p_fence bigint, p_kind text, p_policy text,
    p_payload jsonb, p_idempotency_key text, p_worker_id text,
    p_requires_approval boolean, p_approval_seconds double precision,
    OUT outcome text, OUT accepted_fence bigint, OUT status text,
    OUT run_state text, OUT run_fence bigint
) LANGUAGE plpgsql SET search_path FROM CURRENT AS $$
DECLARE
    high_water bigint;
    existing effects%ROWTYPE;
    digest text := encode(sha256(convert_to(p_payload::text, 'UTF8')), 'hex');
    first_status text := CASE WHEN p_requires_approval THEN 'awaiting_approval'
                              ELSE 'accepted' END;
    expires timestamptz := CASE WHEN p_requires_approval
                                THEN clock_timestamp() + make_interval(secs => p_approval_seconds)
                           END;
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
                             idempotency_key, payload_sha256, requires_approval,
                             approval_expires_at)
        VALUES (p_run_id, p_effect_key, p_kind, p_policy, p_fence, first_status, p_payload,
                p_idempotency_key, digest, p_requires_approval, expires);
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

-- The budget's reservation, as one decision: only the run's current owner may reserve; a
-- reservation left by an earlier fence is forfeited (counted as spent: that attempt may have been
-- billed); the request is refused when spent + reserved + requested would pass a limit.
-- Outcomes: 'reserved' (with the tool calls the run may still make, NULL: no limit), 'exhausted'
-- (the dimension named in exhausted_by), 'not_owner'.
CREATE FUNCTION orchestrator_reserve_budget(
    p_run_id text, p_worker_id text, p_fence bigint, p_limits jsonb,
    p_turns bigint, p_input_tokens bigint, p_output_tokens bigint, p_cost numeric,
    OUT outcome text, OUT exhausted_by text, OUT tool_calls_left bigint
) LANGUAGE plpgsql SET search_path FROM CURRENT AS $$
DECLARE
    b run_budgets%ROWTYPE;
BEGIN
    PERFORM 1 FROM runs
    WHERE run_id = p_run_id AND lease_owner = p_worker_id AND fence = p_fence
      AND state = 'running' AND lease_until > clock_timestamp()
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
