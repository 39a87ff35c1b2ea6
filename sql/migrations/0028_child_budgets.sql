-- Budgets flow down (docs/child-runs.md): a child's budget is carved from its parent's, in the
-- transaction that spawns it. The carve counts against the parent as if spent until the child
-- ends; then what the child spent is charged to the parent and the carve given back. A tree
-- therefore never spends more than its root allows, however its runs interleave.
--
-- Expand only: new columns (zero for every existing row), a new table and functions;
-- orchestrator_reserve_budget keeps its signature.

ALTER TABLE run_budgets
    ADD COLUMN turns_carved bigint NOT NULL DEFAULT 0,
    ADD COLUMN tool_calls_carved bigint NOT NULL DEFAULT 0,
    ADD COLUMN input_tokens_carved bigint NOT NULL DEFAULT 0,
    ADD COLUMN output_tokens_carved bigint NOT NULL DEFAULT 0,
    ADD COLUMN cost_carved numeric NOT NULL DEFAULT 0;

-- Each carve: the child, its parent, what was carved (the child's limits), and when it was
-- settled (charged to the parent and given back).
CREATE TABLE budget_carves (
    child_run_id text PRIMARY KEY REFERENCES runs (run_id) ON DELETE CASCADE,
    parent_run_id text NOT NULL,
    turns bigint NOT NULL DEFAULT 0,
    tool_calls bigint NOT NULL DEFAULT 0,
    input_tokens bigint NOT NULL DEFAULT 0,
    output_tokens bigint NOT NULL DEFAULT 0,
    cost numeric NOT NULL DEFAULT 0,
    carved_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    settled_at timestamptz
);

-- Carve the budgets of the children p_children ([{run_id, key, budget: {turns, tool_calls,
-- input_tokens, output_tokens, cost_usd}}], children this commit created) from run p_parent's,
-- whose limits are p_parent_limits (its agent's Budget; NULL: none), in the transaction of the
-- commit that spawned them, while worker p_worker holds p_parent under fence p_fence. A parent
-- with a budget must carve, for each child, every dimension it limits. Returns the number of
-- children carved for (NULL: not the owner). Raises, with one line and nothing changed, when a
-- carve would pass a limit of the parent's or leaves out a dimension the parent limits.
CREATE FUNCTION orchestrator_carve_budgets(
    p_parent text, p_fence bigint, p_worker text, p_parent_limits jsonb, p_children jsonb
) RETURNS integer
LANGUAGE plpgsql SECURITY DEFINER SET search_path FROM CURRENT AS $$
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
REVOKE ALL ON FUNCTION orchestrator_carve_budgets(text, bigint, text, jsonb, jsonb) FROM PUBLIC;

-- A child ended: charge what it spent (and any reservation it never settled) to the parent
-- whose budget it was carved from, and give the carve back.
CREATE FUNCTION orchestrator_settle_carve(p_child text) RETURNS void
LANGUAGE plpgsql SET search_path FROM CURRENT AS $$
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

-- Migration 0027's trigger function, which now also settles the child's carve first (one
-- trigger per child's end, not two).
CREATE OR REPLACE FUNCTION orchestrator_child_ended() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path FROM CURRENT AS $$
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

-- orchestrator_reserve_budget of migration 0019, which now also counts what the run's children
-- carved from it.
CREATE OR REPLACE FUNCTION orchestrator_reserve_budget(
    p_run_id text, p_worker_id text, p_fence bigint, p_limits jsonb, p_turns bigint,
    p_input_tokens bigint, p_output_tokens bigint, p_cost numeric,
    OUT outcome text, OUT exhausted_by text, OUT tool_calls_left bigint
) LANGUAGE plpgsql SECURITY DEFINER SET search_path FROM CURRENT AS $$
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
