-- The budget's reservation finds the run as the single-run statements of sql/queries.sql do: by
-- its key, with "running" said as owner, fence and unexpired lease (the runs_lease_matches_state
-- CHECK makes that equivalent to state = 'running'). With state = 'running' in the condition the
-- partial indexes runs_owner and runs_running match too, and a generic plan read every running
-- run of the owner instead of one primary-key lookup. Only that condition changes.
CREATE OR REPLACE FUNCTION orchestrator_reserve_budget(
    p_run_id text, p_worker_id text, p_fence bigint, p_limits jsonb,
    p_turns bigint, p_input_tokens bigint, p_output_tokens bigint, p_cost numeric,
    OUT outcome text, OUT exhausted_by text, OUT tool_calls_left bigint
) LANGUAGE plpgsql SET search_path FROM CURRENT AS $$
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
