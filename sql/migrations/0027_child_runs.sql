-- Runs that start runs (docs/child-runs.md). A step's commit spawns child runs in its own
-- transaction, under the parent's fence (orchestrator_spawn_children): a stale parent spawns
-- nothing, and a retried step spawns no second child for the same key. A parent waiting for its
-- children is woken when enough of them have ended (trigger runs_child_ended). Cancelling a run
-- cancels its whole subtree in one transaction (orchestrator_cancel_run, redefined).
--
-- Expand only: new columns, an index, functions and a trigger; the previous release's statements
-- read and write runs as before.

ALTER TABLE runs
    ADD COLUMN parent_run_id text,
    ADD COLUMN child_key text,
    ADD COLUMN root_run_id text,
    ADD COLUMN depth integer NOT NULL DEFAULT 0,
    -- While it waits for children: how many of those it needs have yet to end (park_runs sets
    -- it, each child's end counts it down), so a fan-in of N costs N steps, not N squared.
    ADD COLUMN children_awaited integer,
    -- Cancelled (with its subtree) when its parent fails for good: a per-spawn choice.
    ADD COLUMN cancel_with_parent boolean NOT NULL DEFAULT false,
    ADD CONSTRAINT runs_child_key_check
        CHECK (child_key IS NULL OR child_key ~ '^[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}$'),
    ADD CONSTRAINT runs_child_has_parent_check
        CHECK ((parent_run_id IS NULL) = (child_key IS NULL));

-- A parent's children by key: one child per (parent, key), found by the parent's wake-up check.
CREATE UNIQUE INDEX runs_children ON runs (parent_run_id, child_key)
    WHERE parent_run_id IS NOT NULL;

-- Limits a spawn is held to (docs/child-runs.md).
CREATE FUNCTION orchestrator_child_limits(OUT per_commit integer, OUT per_parent integer,
                                          OUT depth integer)
LANGUAGE sql IMMUTABLE AS $$ SELECT 1000, 10000, 16 $$;

-- Spawn the children p_children (a JSON array of {run_id, agent, input, key, max_attempts,
-- concurrency_key, priority}) of run p_parent, in the transaction of the parent's step commit,
-- only while worker p_worker holds p_parent's lease under fence p_fence. A child whose key the
-- parent has already used is not spawned again: its existing run is returned (created false).
-- No row at all: p_parent is not p_worker's under p_fence (nothing spawned). Bad input raises,
-- with one line naming what is wrong; nothing is spawned.
CREATE FUNCTION orchestrator_spawn_children(
    p_parent text, p_fence bigint, p_worker text, p_children jsonb
) RETURNS TABLE (child_key text, run_id text, created boolean)
LANGUAGE plpgsql SECURITY DEFINER SET search_path FROM CURRENT AS $$
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
$$;
REVOKE ALL ON FUNCTION orchestrator_spawn_children(text, bigint, text, jsonb) FROM PUBLIC;

-- How many of the children a waiting parent listed (runs.wait -> 'children') have ended.
CREATE FUNCTION orchestrator_children_ended(p_parent text, p_wait jsonb) RETURNS integer
LANGUAGE sql STABLE SET search_path FROM CURRENT AS $$
    SELECT count(*)::integer FROM runs AS c
    WHERE c.parent_run_id = p_parent
      AND c.child_key IN (SELECT jsonb_array_elements_text(p_wait -> 'children'))
      AND c.state IN ('succeeded', 'failed', 'cancelled', 'dead')
$$;

-- A child ended: count it down on its parent if the parent waits for it, and wake the parent
-- once none it needs is left. The parent's row is locked by the UPDATE, so a child ending while
-- the parent parks is counted by one of the two: the park (park_runs) saw it ended, or this
-- sees the parent waiting, after the park committed. A child that ended twice (dead, retried)
-- may wake the parent early: woken, it reads its children and parks again if need be.
CREATE FUNCTION orchestrator_child_ended() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path FROM CURRENT AS $$
DECLARE
    parent record;
BEGIN
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

CREATE TRIGGER runs_child_ended
    AFTER UPDATE OF state ON runs
    FOR EACH ROW
    WHEN (NEW.parent_run_id IS NOT NULL
          AND NEW.state IN ('succeeded', 'failed', 'cancelled', 'dead')
          AND OLD.state IS DISTINCT FROM NEW.state)
    EXECUTE FUNCTION orchestrator_child_ended();

-- Cancel run p_run_id and its whole unfinished subtree in one transaction (callers decide who
-- may): the fence of each is raised, so that once it commits none of them can commit a step or
-- have an effect accepted at the boundary; their unsent effects are withdrawn. p_details goes
-- into each run's `cancelled` event. No row: p_run_id is not unfinished.
CREATE FUNCTION orchestrator_cancel_tree(
    p_run_id text, p_details jsonb,
    OUT run_id text, OUT fence bigint, OUT previous_state text, OUT previous_owner text,
    OUT notified bigint, OUT descendants integer
) RETURNS SETOF record LANGUAGE plpgsql SET search_path FROM CURRENT AS $$
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
REVOKE ALL ON FUNCTION orchestrator_cancel_tree(text, jsonb) FROM PUBLIC;

-- Cancel a run and its whole subtree, audited (migration 0019's function, for a tree).
CREATE OR REPLACE FUNCTION orchestrator_cancel_run(
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

-- A run failed for good (its step said so, or its last attempt): cancel, with their subtrees,
-- the children it spawned asking to be (Child(cancel_with_parent=True)). The failed run's
-- children do not lock it (it is not waiting), so nothing here waits on them in reverse.
CREATE FUNCTION orchestrator_parent_failed() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path FROM CURRENT AS $$
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

CREATE TRIGGER runs_parent_failed
    AFTER UPDATE OF state ON runs
    FOR EACH ROW
    WHEN (NEW.state IN ('failed', 'dead') AND OLD.state IS DISTINCT FROM NEW.state)
    EXECUTE FUNCTION orchestrator_parent_failed();
