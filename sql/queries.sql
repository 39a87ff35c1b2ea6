-- Named queries used by orchestrator.db.store and orchestrator.effects.store. Each block: a
-- "-- name --" header, a "-- params:" line, comment lines saying what the statement guarantees,
-- then one statement. Tables are unqualified: every connection's search_path names the
-- orchestrator schema (ORCHESTRATOR_SCHEMA). Lease checks use clock_timestamp(), the database
-- clock at the moment of the check: never a worker's clock, and never the transaction's start.
--
-- BATCHED WRITES. renew_leases, commit_steps and finish_runs join a batch (unnest of array
-- parameters) to runs and must reach each run through runs_pkey, one lookup per batch row,
-- whatever the planner's statistics say. So the batch is a MATERIALIZED CTE that also carries
-- the owner and `now` (clock_timestamp() as the statement reads its batch), and every condition
-- on a run compares it with a batch column, leaving the planner no condition on runs alone to
-- misjudge. "Running" is said as `lease_owner = owner AND lease_until > now`, which the
-- runs_lease_matches_state CHECK makes equivalent to state = 'running' plus those conditions
-- (docs/performance.md tells what the plain form cost; tests/test_store.py checks the plans).
-- The single-run statements (renew_lease, commit_step, fail_attempt, release_lease) say
-- "running" the same way: with `state = 'running'` in their WHERE the partial indexes
-- runs_owner and runs_running match too, and a generic plan read every running run of the owner
-- instead of one primary-key lookup.
--
-- WAKING A WAITING RUN. A run parks (park_runs) in the transaction of its step's commit, which
-- locks the run's row first. Whatever wakes a run (a signal, an effect settling, a decision, a
-- top-up) updates the run's row whether it is waiting or still running, and computes the wake
-- from the row it updates: an UPDATE whose WHERE only matched waiting rows would not see a run
-- whose park is not yet committed, and the wake would be lost. Updating the row instead waits for
-- the park's transaction and re-reads the row as parked; a wake that commits first is seen by
-- park_runs, which runs later in its transaction and finds the signal or settled effect.

-- submit_run --
-- params: $1 run_id text, $2 agent text, $3 input jsonb, $4 max_attempts int, $5 idempotency_key text,
--         $6 not_before timestamptz (NULL: now), $7 traceparent text (NULL: not submitted in a trace),
--         $8 concurrency_key text (NULL: none), $9 priority int
-- Insert a queued run and its "submitted" event, and wake claimers; the run is due at $6 (a
-- scheduled run) or at once. The submitter's trace context, if any, is kept as the run's fence-0
-- trace row. Returns no row when the run id or the idempotency key is already taken.
-- The statement is orchestrator_submit_run (migration 0019): clients submit without any write
-- privilege on runs, run_events or run_traces.
SELECT * FROM orchestrator_submit_run($1, $2, $3, $4, $5, $6, $7, $8, $9)

-- get_run --
-- params: $1 run_id text
-- One run by id.
SELECT * FROM runs WHERE run_id = $1

-- get_run_by_idempotency_key --
-- params: $1 idempotency_key text
-- The run a submit idempotency key already created.
SELECT * FROM runs WHERE idempotency_key = $1

-- claim --
-- params: $1 worker_id text, $2 agents text[], $3 max_runs int, $4 lease_seconds float8,
--         $5 include_expired bool, $6 run_id text (NULL: any due run of $2),
--         $7 after_key text (the last concurrency key this claimer served; NULL: none),
--         $8 versions jsonb ({agent: [agent versions its checkpoints may be written under]};
--            NULL: any; matched by jsonb_exists, not the ? operator, whose estimate of 0.1%
--            made a claim read and sort every due run instead of walking the index in order)
-- Claim up to $3 runs for worker $1, each with a lease of $4 seconds: runs of the agents $2 that
-- are due (queued, or waiting and past available_at) and, if $5, running runs whose lease has
-- expired by the database clock; or, when $6 names a run, that run alone if it is due or its
-- lease expired. Finding expired leases reads every running run of the agents (there is
-- deliberately no index on lease_until, which would make renewals non-HOT), so a busy claimer
-- passes $5 false most of the time. Each claim raises the fence (by one within a server's epoch)
-- and counts an attempt; an expired run that already used its last attempt is dead-lettered instead (a poison
-- run must not crash workers forever). SKIP LOCKED lets concurrent claimers pass each other;
-- after taking a row lock PostgreSQL re-checks the WHERE clause on the newest row version, so a
-- run another worker has just claimed is skipped, never claimed twice. Due runs are found by
-- an index range on runs_due_plain up to the clock read once (`(SELECT clock_timestamp())`: a
-- value the index can use, where a volatile call is only a filter): the runs waiting for later
-- (a timer, a signal: due at 'infinity') lie past that range and are never read.
-- Versions (migrations 0023, 0024, docs/upgrades.md): a run whose checkpoint was written under an
-- agent version not among $8's for its agent is not claimed (a run no step has committed yet
-- is), nor a run of an agent cut over to a version other than the claimer's own (the first of
-- $8's).
-- Flow control (migration 0021, docs/flow-control.md): when one of the agents has a limit, or a
-- due run with a concurrency key, orchestrator_plan_claim picks the runs (keys in turns, every
-- limit locked and counted) and this statement claims those; otherwise the plain path below,
-- which reads no limit and no key, claims as it always did.
WITH flow AS MATERIALIZED (
    SELECT EXISTS (
               SELECT FROM flow_limits
               WHERE agent = ANY($2::text[])
                  OR agent = (SELECT agent FROM runs WHERE run_id = $6::text)
           )
           OR EXISTS (
               -- In runs_due_keyed's order, so that it is read through that index: a bare EXISTS
               -- was planned as a scan of the table, which read every run of the other agents
               -- whenever this one had no keyed run.
               SELECT FROM unnest($2::text[]) AS a(agent)
               CROSS JOIN LATERAL (
                   SELECT FROM runs
                   WHERE agent = a.agent AND state IN ('queued', 'waiting')
                     AND concurrency_key IS NOT NULL
                     AND available_at <= (SELECT clock_timestamp())
                   ORDER BY concurrency_key COLLATE "C"
                   LIMIT 1
               ) AS keyed
           ) AS planned
), expired AS (
    SELECT run_id, lease_owner AS previous_owner, lease_until AS previous_lease_until,
           attempt >= max_attempts AS exhausted, wait
    FROM runs AS r
    WHERE $6::text IS NULL AND $5::boolean AND state = 'running' AND agent = ANY($2::text[])
      AND lease_until < clock_timestamp() AND NOT (SELECT planned FROM flow)
      AND (r.agent_version IS NULL OR $8::jsonb IS NULL
           OR jsonb_exists($8::jsonb -> r.agent, r.agent_version))
      AND NOT EXISTS (SELECT 1 FROM agent_cutovers AS c WHERE c.agent = r.agent
                        AND c.version IS DISTINCT FROM ($8::jsonb -> r.agent ->> 0))
    LIMIT $3
    FOR UPDATE SKIP LOCKED
), due AS (
    -- One index-ordered probe of runs_due per agent (a single `agent = ANY(...)` scan would
    -- read and sort every due run of those agents on every claim), then the oldest overall.
    SELECT d.run_id, NULL::text AS previous_owner, NULL::timestamptz AS previous_lease_until,
           false AS exhausted, d.wait
    FROM unnest($2::text[]) AS a(agent)
    CROSS JOIN LATERAL (
        SELECT run_id, available_at, wait
        FROM runs AS r
        WHERE $6::text IS NULL AND state IN ('queued', 'waiting') AND agent = a.agent
          AND concurrency_key IS NULL AND available_at <= (SELECT clock_timestamp())
          AND NOT (SELECT planned FROM flow)
          AND (r.agent_version IS NULL OR $8::jsonb IS NULL
               OR jsonb_exists($8::jsonb -> r.agent, r.agent_version))
          AND NOT EXISTS (SELECT 1 FROM agent_cutovers AS c WHERE c.agent = a.agent
                            AND c.version IS DISTINCT FROM ($8::jsonb -> a.agent ->> 0))
        ORDER BY available_at
        LIMIT $3
        FOR UPDATE SKIP LOCKED
    ) AS d
    ORDER BY d.available_at
    LIMIT $3
), named AS (
    SELECT run_id,
           CASE WHEN state = 'running' THEN lease_owner END AS previous_owner,
           CASE WHEN state = 'running' THEN lease_until END AS previous_lease_until,
           state = 'running' AND attempt >= max_attempts AS exhausted, wait
    FROM runs AS r
    WHERE run_id = $6::text AND NOT (SELECT planned FROM flow)
      AND ((state IN ('queued', 'waiting') AND available_at <= clock_timestamp())
           OR (state = 'running' AND lease_until < clock_timestamp()))
      AND (r.agent_version IS NULL OR $8::jsonb IS NULL
           OR jsonb_exists($8::jsonb -> r.agent, r.agent_version))
      AND NOT EXISTS (SELECT 1 FROM agent_cutovers AS c WHERE c.agent = r.agent
                        AND c.version IS DISTINCT FROM ($8::jsonb -> r.agent ->> 0))
    FOR UPDATE SKIP LOCKED
), plan AS MATERIALIZED (
    SELECT p.run_id, p.next_key, p.held_back
    FROM orchestrator_plan_claim($2::text[], $3::integer, $5::boolean, $6::text, $7::text) AS p
    WHERE (SELECT planned FROM flow)
), planned AS (
    SELECT run_id,
           CASE WHEN state = 'running' THEN lease_owner END AS previous_owner,
           CASE WHEN state = 'running' THEN lease_until END AS previous_lease_until,
           state = 'running' AND attempt >= max_attempts AS exhausted, wait
    FROM runs AS r
    -- One index scan of the planned ids: an IN over the plan was planned as an aggregate and a
    -- join, a fifth of a keyed claim of 50 on a session that plans each claim (performance.md).
    WHERE run_id = ANY(ARRAY(SELECT plan.run_id FROM plan WHERE plan.run_id IS NOT NULL))
      AND ((state IN ('queued', 'waiting') AND available_at <= clock_timestamp())
           OR (state = 'running' AND lease_until < clock_timestamp()))
      AND (r.agent_version IS NULL OR $8::jsonb IS NULL
           OR jsonb_exists($8::jsonb -> r.agent, r.agent_version))
      AND NOT EXISTS (SELECT 1 FROM agent_cutovers AS c WHERE c.agent = r.agent
                        AND c.version IS DISTINCT FROM ($8::jsonb -> r.agent ->> 0))
    FOR UPDATE SKIP LOCKED
), picked AS (
    SELECT *
    FROM (SELECT * FROM expired UNION ALL SELECT * FROM due UNION ALL SELECT * FROM named
          UNION ALL SELECT * FROM planned) AS candidates
    LIMIT $3
), claimed AS (
    UPDATE runs AS r
    SET state = 'running', lease_owner = $1,
        lease_until = clock_timestamp() + make_interval(secs => $4),
        -- One more than before, or the first fence of this server's epoch after a failover
        -- (migration 0015): never one the lost timeline may have granted.
        fence = greatest(r.fence + 1, (SELECT fence_floor())), attempt = r.attempt + 1,
        updated_at = clock_timestamp()
    FROM picked AS p
    WHERE r.run_id = p.run_id AND NOT p.exhausted
    RETURNING r.run_id, r.agent, r.input, r.fence, r.lease_until, r.attempt, r.max_attempts,
              r.step, r.checkpoint, r.checkpoint_version, r.agent_version, p.previous_owner,
              p.previous_lease_until, clock_timestamp() AS claimed_at, p.wait,
              -- The run's unconsumed signals for its first step (only runs that have some; at
              -- most 100, the rest go to the steps after it): the signals a waiting run waits
              -- for come first, so any number of other signals ahead of them cannot hide them.
              CASE WHEN r.signals_pending > 0 THEN (
                  SELECT jsonb_agg(jsonb_build_object(
                             'seq', s.seq, 'name', s.name, 'data', s.data,
                             'idempotency_key', s.idempotency_key, 'sent_at', s.sent_at)
                         ORDER BY s.seq)
                  FROM (SELECT ARRAY(SELECT jsonb_array_elements_text(p.wait -> 'signals'))
                            AS names) AS w
                  CROSS JOIN LATERAL (
                      SELECT * FROM ((SELECT s.*, true AS awaited FROM run_signals AS s
                                      WHERE s.run_id = r.run_id AND s.consumed_at IS NULL
                                        AND s.name = ANY(w.names)
                                      ORDER BY s.seq LIMIT 100)
                                     UNION ALL
                                     (SELECT s.*, false FROM run_signals AS s
                                      WHERE s.run_id = r.run_id AND s.consumed_at IS NULL
                                        AND s.name <> ALL(w.names)
                                      ORDER BY s.seq LIMIT 100)) AS u
                      ORDER BY awaited DESC, seq LIMIT 100) AS s
              ) END AS signals, r.signals_pending
), dead AS (
    UPDATE runs AS r
    SET state = 'dead', lease_owner = NULL, lease_until = NULL, updated_at = clock_timestamp(),
        finished_at = clock_timestamp(),
        error = jsonb_build_object(
            'type', 'LeaseExpired',
            'message', format('the lease of %s expired during attempt %s of %s',
                              p.previous_owner, r.attempt, r.max_attempts))
    FROM picked AS p
    WHERE r.run_id = p.run_id AND p.exhausted
    RETURNING r.run_id, r.fence, r.attempt, p.previous_owner, p.previous_lease_until, r.watched
), logged AS (
    INSERT INTO run_events (run_id, kind, fence, worker_id, details)
    SELECT run_id, 'claimed', fence, $1,
           jsonb_build_object('lease_until', lease_until, 'attempt', attempt,
                              'checkpoint_version', checkpoint_version,
                              'previous_owner', previous_owner,
                              'previous_lease_until', previous_lease_until)
    FROM claimed
    UNION ALL
    SELECT run_id, 'dead_lettered', fence, $1,
           jsonb_build_object('reason', 'lease expired on the last attempt', 'attempt', attempt,
                              'previous_owner', previous_owner,
                              'previous_lease_until', previous_lease_until)
    FROM dead
), finished_told AS (
    SELECT pg_notify('orchestrator_finished', run_id) FROM dead WHERE watched
)
SELECT 'claimed' AS outcome, run_id, agent, input, fence, lease_until, attempt, max_attempts, step,
       checkpoint, checkpoint_version, previous_owner, previous_lease_until, claimed_at, wait,
       signals, signals_pending, NULL AS next_key, NULL::integer AS held_back, agent_version
FROM claimed
UNION ALL
SELECT 'dead_lettered', run_id, NULL, NULL, fence, NULL, attempt, NULL, NULL, NULL, NULL,
       previous_owner, previous_lease_until, NULL, NULL, NULL, NULL, NULL, NULL, NULL
FROM dead
WHERE (SELECT count(*) FROM finished_told) >= 0
UNION ALL
-- Where the plan's turn over the keys ended: the claimer's next claim goes on from there; and
-- how many runs it passed over for a full limit.
SELECT 'next_key', NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL,
       NULL, NULL, NULL, plan.next_key, plan.held_back, NULL
FROM plan
WHERE plan.run_id IS NULL

-- renew_lease --
-- params: $1 run_id text, $2 worker_id text, $3 fence bigint, $4 lease_seconds float8
-- Extend one lease by $4 seconds, only for the same owner ($2) and fence ($3) of a running run
-- whose lease has not yet expired: a renewal must never revive an owner that was replaced. A
-- renewal that held is stamped on the worker's row (`workers list`'s last renewal).
WITH renewed AS (
    UPDATE runs
    SET lease_until = clock_timestamp() + make_interval(secs => $4), updated_at = clock_timestamp()
    WHERE run_id = $1 AND lease_owner = $2 AND fence = $3
      AND lease_until > clock_timestamp()
    RETURNING run_id, lease_until
), stamped AS (
    UPDATE workers SET last_renewal_at = clock_timestamp()
    WHERE worker_id = $2 AND EXISTS (SELECT 1 FROM renewed)
)
SELECT run_id, lease_until FROM renewed

-- renew_leases --
-- params: $1 run_ids text[], $2 fences bigint[], $3 lease_seconds float8[], $4 worker_id text
-- Extend many leases of owner $4 in one statement: $1 run ids, $2 their fences, $3 their lease
-- seconds. Each run's own owner, fence, running state and expiry conditions are checked (see
-- BATCHED WRITES); the rows returned are the leases that held. When any held, the worker's row
-- is stamped once (`workers list`'s last renewal).
WITH batch AS MATERIALIZED (
    SELECT l.run_id, l.fence, l.lease_seconds, $4::text AS owner, clock_timestamp() AS now
    FROM unnest($1::text[], $2::bigint[], $3::float8[]) AS l(run_id, fence, lease_seconds)
), renewed AS (
    UPDATE runs AS r
    SET lease_until = clock_timestamp() + make_interval(secs => l.lease_seconds),
        updated_at = clock_timestamp()
    FROM batch AS l
    WHERE r.run_id = ANY($1::text[]) AND r.run_id = l.run_id AND r.lease_owner = l.owner
      AND r.fence = l.fence AND r.lease_until > l.now
    RETURNING r.run_id, r.lease_until
), stamped AS (
    UPDATE workers SET last_renewal_at = clock_timestamp()
    WHERE worker_id = $4 AND EXISTS (SELECT 1 FROM renewed)
)
SELECT run_id, lease_until FROM renewed

-- commit_step --
-- params: $1 run_id text, $2 worker_id text, $3 fence bigint, $4 expected_version bigint,
--         $5 next_step text, $6 checkpoint jsonb, $7 events jsonb,
--         $8 agent_version text (the version of the agent's code that wrote $6; NULL: unknown)
-- Commit a step: next step $5, checkpoint $6, checkpoint version + 1, and the events $7 (a JSON
-- array of {kind, details}), only while worker $2 still owns run $1 with fence $3, the lease is
-- unexpired and the stored checkpoint version is still $4. No row returned: nothing committed.
-- The attempt counter restarts at 1: attempts count claims since the last committed progress.
WITH committed AS (
    UPDATE runs
    SET step = $5, checkpoint = $6, checkpoint_version = checkpoint_version + 1, attempt = 1,
        wait = NULL, updated_at = clock_timestamp(),
        agent_version = coalesce($8::text, agent_version),
        started_version = coalesce(started_version, $8::text)
    WHERE run_id = $1 AND lease_owner = $2 AND fence = $3
      AND lease_until > clock_timestamp() AND checkpoint_version = $4
      AND (NOT EXISTS (SELECT 1 FROM agent_cutovers AS c
                       WHERE c.agent = runs.agent AND c.version IS DISTINCT FROM $8::text)
           OR EXISTS (SELECT 1 FROM cutover_drains AS d
                      WHERE d.run_id = runs.run_id AND d.fence = runs.fence))
    RETURNING run_id, fence, checkpoint_version, lease_until,
              EXISTS (SELECT 1 FROM cutover_drains AS d
                      WHERE d.run_id = runs.run_id AND d.fence = runs.fence) AS drained
), logged AS (
    INSERT INTO run_events (run_id, kind, fence, worker_id, details)
    SELECT c.run_id, e.kind, c.fence, $2, e.details
    FROM committed AS c, jsonb_to_recordset($7::jsonb) AS e(kind text, details jsonb)
)
SELECT checkpoint_version, lease_until, 0 AS signals_pending, drained FROM committed

-- fail_attempt --
-- params: $1 run_id text, $2 worker_id text, $3 fence bigint, $4 error jsonb,
--         $5 backoff_base_seconds float8, $6 backoff_max_seconds float8
-- Record a failed attempt of run $1 by owner $2 with fence $3: error $4. While attempts remain
-- the run waits (exponential backoff from $5 seconds, capped at $6, with full jitter so runs that
-- failed together do not retry together) and then becomes claimable again; after the last
-- attempt it is dead-lettered. Only the current, unexpired owner may do this.
WITH failed AS (
    UPDATE runs
    SET state = CASE WHEN attempt >= max_attempts THEN 'dead' ELSE 'waiting' END,
        available_at = clock_timestamp() + make_interval(
            secs => least($6::float8, $5::float8 * power(2, greatest(attempt - 1, 0)))
                    * (0.1 + 0.9 * random())),
        error = $4, lease_owner = NULL, lease_until = NULL, updated_at = clock_timestamp(),
        finished_at = CASE WHEN attempt >= max_attempts THEN clock_timestamp() END
    WHERE run_id = $1 AND lease_owner = $2 AND fence = $3
      AND lease_until > clock_timestamp()
    RETURNING run_id, fence, state, attempt, max_attempts, available_at, agent, watched
), told AS (
    SELECT pg_notify('orchestrator_finished', run_id) FROM failed
    WHERE watched AND state = 'dead'
), logged AS (
    INSERT INTO run_events (run_id, kind, fence, worker_id, details)
    SELECT run_id, CASE WHEN state = 'dead' THEN 'dead_lettered' ELSE 'retry_scheduled' END,
           fence, $2,
           jsonb_build_object('error', $4::jsonb, 'attempt', attempt,
                              'max_attempts', max_attempts, 'retry_at',
                              CASE WHEN state = 'waiting' THEN available_at END)
    FROM failed
)
SELECT state, available_at, attempt FROM failed WHERE (SELECT count(*) FROM told) >= 0

-- release_lease --
-- params: $1 run_id text, $2 worker_id text, $3 fence bigint, $4 reason text
-- Give a run back on graceful shutdown: queued again at once, fence unchanged, and the attempt
-- not counted (the run did not fail; its worker is leaving). Only the current, unexpired owner.
WITH released AS (
    UPDATE runs
    SET state = 'queued', lease_owner = NULL, lease_until = NULL,
        attempt = greatest(attempt - 1, 0), available_at = clock_timestamp(),
        updated_at = clock_timestamp()
    WHERE run_id = $1 AND lease_owner = $2 AND fence = $3
      AND lease_until > clock_timestamp()
    RETURNING run_id, fence, agent
), logged AS (
    INSERT INTO run_events (run_id, kind, fence, worker_id, details)
    SELECT run_id, 'released', fence, $2, jsonb_build_object('reason', $4::text) FROM released
), woken AS (
    SELECT pg_notify('orchestrator_runs', agent) FROM released
)
SELECT run_id, (SELECT count(*) FROM woken) AS notified FROM released

-- cancel_run --
-- params: $1 run_id text, $2 reason text, $3 principal text (NULL: the database role that
--         connected), $4 via text, $5 typed_by text (a note)
-- Cancel a run that has not finished: state cancelled, fence + 1 (so the owner's renewals,
-- commits and effect requests with the old fence are all rejected, at the boundary too), lease
-- cleared, undispatched effects withdrawn, the owner told through NOTIFY, the audit row
-- appended. Returns no row when the run is already finished or does not exist.
-- The statement is orchestrator_cancel_run (migration 0019): it raises the fence, so it runs as
-- the schema owner, and it checks who decides (only the console may name a principal).
SELECT run_id, fence, previous_state, previous_owner, notified, audit_seq, principal
FROM orchestrator_cancel_run($1, $2, $3, $4, $5)

-- requeue_dead --
-- params: $1 run_id text, $2 principal text (NULL: the database role that connected), $3 via
--         text, $4 typed_by text (a note)
-- Put a dead-lettered run back in the queue with a fresh set of attempts, audited
-- (orchestrator_retry_run, migration 0019). No row: the run is not dead.
SELECT run_id, notified, audit_seq, principal FROM orchestrator_retry_run($1, $2, $3, $4)

-- record_event --
-- params: $1 run_id text, $2 kind text, $3 fence bigint, $4 worker_id text, $5 details jsonb
-- Append one event. Safe for any worker, even one that lost its lease: it changes no run state.
INSERT INTO run_events (run_id, kind, fence, worker_id, details)
VALUES ($1, $2, $3, $4, $5)
RETURNING event_id

-- record_attempt_traces --
-- params: $1 run_ids text[], $2 fences bigint[], $3 traceparents text[], $4 worker_id text
-- Keep each new attempt's trace context and return, for the new attempt's span links, the run's
-- earlier ones: the submitter's (fence 0) and the latest 20 attempts' (a run woken many times
-- has an attempt per wake; the one before is what a takeover needs). The read does not see this
-- statement's own rows. A row already there (a retried statement) is left alone.
WITH kept AS (
    INSERT INTO run_traces (run_id, fence, traceparent, worker_id)
    SELECT t.run_id, t.fence, t.traceparent, $4
    FROM unnest($1::text[], $2::bigint[], $3::text[]) AS t(run_id, fence, traceparent)
    ON CONFLICT DO NOTHING
)
SELECT e.run_id, e.fence, e.traceparent, e.worker_id
FROM unnest($1::text[]) AS r(run_id)
CROSS JOIN LATERAL (
    (SELECT * FROM run_traces AS t WHERE t.run_id = r.run_id AND t.fence = 0)
    UNION ALL
    (SELECT * FROM run_traces AS t WHERE t.run_id = r.run_id AND t.fence > 0
     ORDER BY t.fence DESC LIMIT 20)
) AS e
ORDER BY e.run_id, e.fence

-- run_traces --
-- params: $1 run_id text
-- A run's trace contexts: the submitter's (fence 0) and each attempt's, in fence order.
SELECT run_id, fence, traceparent, worker_id FROM run_traces WHERE run_id = $1 ORDER BY fence

-- run_fence --
-- params: $1 run_id text
-- A run's current fence (what a refusal tells a stale owner).
SELECT fence FROM runs WHERE run_id = $1

-- run_agent --
-- params: $1 run_id text
-- A run's agent (set when it is submitted, never changed): what a scoped proxy token is checked
-- against.
SELECT agent FROM runs WHERE run_id = $1

-- attempt_trace --
-- params: $1 run_id text, $2 fence bigint
-- The trace context of the attempt that held fence $2 (the one that requested an effect).
SELECT traceparent FROM run_traces WHERE run_id = $1 AND fence = $2

-- list_runs --
-- params: $1 states text[] (NULL: any), $2 agent text (NULL: any), $3 limit int,
--         $4 submitted_after timestamptz (NULL: any), $5 submitted_before timestamptz (NULL: any),
--         $6 parent_run_id text (NULL: any; a run's children, by the index runs_children)
-- Runs, newest first, optionally filtered by state, agent and submission time. "Newest" is
-- submission order: each run's "submitted" event, written with the run (see migration 0004:
-- there is no index on runs.created_at, which every claim and finish would have had to write).
-- held_back: why a due run is not claimed (no registered worker may claim the version of the agent
-- that wrote its checkpoint: docs/upgrades.md; or a full limit), or the rate limit a running run
-- waits for (docs/flow-control.md).
SELECT r.*,
       CASE WHEN r.state IN ('queued', 'waiting') AND r.available_at <= clock_timestamp()
                 AND r.agent_version IS NOT NULL
                 AND NOT EXISTS (
                     SELECT 1 FROM workers AS w
                     WHERE (w.agent_versions -> r.agent) ? r.agent_version
                       AND NOT EXISTS (
                           SELECT 1 FROM agent_cutovers AS c
                           WHERE c.agent = r.agent
                             AND c.version IS DISTINCT FROM w.agent_versions -> r.agent ->> 0))
            THEN format('no worker serves version %s of %s', r.agent_version, r.agent)
            WHEN r.state IN ('queued', 'waiting') AND r.available_at <= clock_timestamp()
            THEN orchestrator_held_by(r.agent, r.concurrency_key)
            WHEN r.state = 'running'
            THEN (SELECT h.reason FROM run_holds AS h
                  WHERE h.run_id = r.run_id AND h.kind = 'rate' AND h.fence = r.fence
                    AND h.until >= clock_timestamp() - interval '2 seconds') END AS held_back
FROM run_events AS e JOIN runs AS r ON r.run_id = e.run_id
WHERE e.kind = 'submitted'
  AND ($1::text[] IS NULL OR r.state = ANY($1::text[])) AND ($2::text IS NULL OR r.agent = $2)
  AND ($4::timestamptz IS NULL OR e.at >= $4) AND ($5::timestamptz IS NULL OR e.at < $5)
  AND ($6::text IS NULL OR r.parent_run_id = $6)
ORDER BY e.event_id DESC
LIMIT $3

-- run_events --
-- params: $1 run_id text, $2 after_event_id bigint, $3 limit int (NULL: all)
-- The timeline of one run after event $2, oldest first: a page of it, or all of it.
SELECT event_id, run_id, at, kind, fence, worker_id, details
FROM run_events
WHERE run_id = $1 AND event_id > $2
ORDER BY event_id
LIMIT $3

-- run_events_tail --
-- params: $1 run_id text, $2 limit int, $3 kinds text[] (NULL: every kind)
-- The newest $2 events of one run (of the kinds $3), oldest first, and how many it has in all
-- (of those kinds): what a run's page shows of a timeline that may hold 100,000 events.
SELECT t.*, (SELECT count(*) FROM run_events
             WHERE run_id = $1 AND ($3::text[] IS NULL OR kind = ANY($3::text[]))) AS total
FROM (SELECT event_id, run_id, at, kind, fence, worker_id, details
      FROM run_events
      WHERE run_id = $1 AND ($3::text[] IS NULL OR kind = ANY($3::text[]))
      ORDER BY event_id DESC
      LIMIT $2) AS t
ORDER BY t.event_id

-- run_attempt_events --
-- params: $1 run_id text, $2 attempts int, $3 endings text[] (the kinds that end an attempt),
--         $4 tallied text[] (the kinds counted per attempt)
-- What a run's newest $2 attempts are built from, in one pass over its timeline: their claims
-- and the events that may end them, as they are; then one row per fence and tallied kind, with
-- NULL event_id and the count in details ({"count": n}).
WITH recent AS (
    SELECT fence FROM run_events WHERE run_id = $1 AND kind = 'claimed'
    ORDER BY event_id DESC LIMIT $2
), relevant AS (
    SELECT event_id, run_id, at, kind, fence, worker_id, details
    FROM run_events
    WHERE run_id = $1 AND fence >= (SELECT coalesce(min(fence), 0) FROM recent)
      AND (kind = 'claimed' OR kind = ANY($3::text[]) OR kind = ANY($4::text[]))
)
SELECT event_id, run_id, at, kind, fence, worker_id, details
FROM relevant WHERE NOT kind = ANY($4::text[])
UNION ALL
SELECT NULL, $1, NULL, kind, fence, NULL, jsonb_build_object('count', count(*))
FROM relevant WHERE kind = ANY($4::text[])
GROUP BY fence, kind

-- database_now --
-- params: none
-- The database clock: the only clock lease expiry is judged by.
SELECT clock_timestamp()

-- next_session_key --
-- params: none
-- A fresh advisory-lock key for a worker's liveness session.
SELECT nextval('worker_session_keys')::integer

-- hold_session_lock --
-- params: $1 lock_namespace int, $2 session_key int
-- Take the liveness lock (namespace $1, key $2) for the life of this session.
SELECT pg_try_advisory_lock($1, $2)

-- register_worker --
-- params: $1 worker_id text, $2 session_key int, $3 host text, $4 pid int, $5 agents text[],
--         $6 agent_versions jsonb ({agent: version}; NULL: unknown)
-- Record a live worker: id $1, liveness key $2, host $3, pid $4, agents $5 and their versions
-- $6, under this server instance (a worker registers again, with a new key, when its liveness
-- session was lost).
INSERT INTO workers (worker_id, session_key, host, pid, agents, server_started_at,
                     agent_versions)
VALUES ($1, $2, $3, $4, $5, pg_postmaster_start_time(), $6::jsonb)
ON CONFLICT (worker_id) DO UPDATE
SET session_key = EXCLUDED.session_key, host = EXCLUDED.host, pid = EXCLUDED.pid,
    agents = EXCLUDED.agents, started_at = clock_timestamp(),
    server_started_at = EXCLUDED.server_started_at, agent_versions = EXCLUDED.agent_versions

-- unregister_worker --
-- params: $1 worker_id text
-- Forget a worker that is shutting down cleanly.
DELETE FROM workers WHERE worker_id = $1

-- expire_dead_owners --
-- params: $1 lock_namespace int, $2 reregister_grace_seconds float8
-- Dead-session takeover: end at once the leases of workers whose liveness lock (namespace $1) is
-- no longer held by any session, i.e. whose process is gone, and forget those workers. A worker
-- registered under an earlier server instance lost its lock to the restart, not to its death:
-- it is judged only once the server has been up for $2 seconds, time enough to register again
-- (migration 0006). The fence
-- is not raised here; the next claim raises it. This is safe even if the judgement were wrong,
-- because every commit and effect is fenced: a worker that is somehow still alive can no longer
-- renew (its lease has expired) and its commits are refused once another worker claims.
WITH live_locks AS (
    SELECT objid::bigint AS session_key
    FROM pg_locks
    WHERE locktype = 'advisory' AND granted AND classid::bigint = $1::bigint
      AND objsubid = 2
      AND database = (SELECT oid FROM pg_database WHERE datname = current_database())
), dead AS (
    DELETE FROM workers AS w
    WHERE NOT EXISTS (SELECT 1 FROM live_locks AS l WHERE l.session_key = w.session_key)
      AND w.started_at < clock_timestamp() - interval '1 second'
      AND (w.server_started_at IS NOT DISTINCT FROM pg_postmaster_start_time()
           OR pg_postmaster_start_time() < clock_timestamp() - make_interval(secs => $2))
    RETURNING w.worker_id
), expired AS (
    UPDATE runs AS r
    SET lease_until = clock_timestamp(), updated_at = clock_timestamp()
    FROM dead AS d
    WHERE r.lease_owner = d.worker_id AND r.state = 'running'
      AND r.lease_until > clock_timestamp()
    RETURNING r.run_id, r.fence, r.agent, r.lease_owner
), logged AS (
    INSERT INTO run_events (run_id, kind, fence, worker_id, details)
    SELECT run_id, 'owner_session_gone', fence, lease_owner,
           jsonb_build_object('reason', 'the owner''s database session ended (process gone)')
    FROM expired
), woken AS (
    SELECT pg_notify('orchestrator_runs', agent) FROM expired
)
SELECT run_id, fence, lease_owner, (SELECT count(*) FROM woken) AS notified FROM expired


-- expire_unheld_leases --
-- params: $1 worker_id text, $2 held_run_ids text[]
-- A worker back on the database after losing its session (a restart, a cut connection, a
-- failover) ends its leases on runs it is not running ($2: those it is): a claim whose answer
-- was lost on the way, or a run whose final commit a failover took back while its worker moved
-- on. Without this they would wait out their lease. The fence is not raised; the next claim
-- raises it.
WITH expired AS (
    UPDATE runs AS r
    SET lease_until = clock_timestamp(), updated_at = clock_timestamp()
    WHERE r.lease_owner = $1 AND r.state = 'running' AND r.lease_until > clock_timestamp()
      AND NOT (r.run_id = ANY($2::text[]))
    RETURNING r.run_id, r.fence, r.agent, r.lease_owner
), logged AS (
    INSERT INTO run_events (run_id, kind, fence, worker_id, details)
    SELECT run_id, 'lease_abandoned', fence, lease_owner,
           jsonb_build_object('reason', 'its worker came back without it (an answer lost with '
                                        'a connection, or a commit lost in a failover)')
    FROM expired
), woken AS (
    SELECT pg_notify('orchestrator_runs', agent) FROM expired
)
SELECT run_id, fence, (SELECT count(*) FROM woken) AS notified FROM expired


-- commit_steps --
-- params: $1 worker_id text, $2 run_ids text[], $3 fences bigint[],
--         $4 expected_versions bigint[], $5 next_steps text[], $6 checkpoints text[] (JSON),
--         $7 events text[] (JSON arrays), $8 agent_versions text[] (may be empty)
-- Group commit: commit_step for many runs of owner $1 in one statement. Arrays: $2 run ids,
-- $3 fences, $4 expected checkpoint versions, $5 next steps, $6 checkpoints, $7 events (each a
-- JSON array of {kind, details}). JSON arrays travel as text and are cast here: a JSON list
-- inside a jsonb[] parameter would be read as another array dimension. Each run's own owner,
-- fence, running state, expiry and version conditions are checked (see BATCHED WRITES); the
-- rows returned are the runs whose commit took effect.
WITH input AS MATERIALIZED (
    SELECT u.run_id, u.fence, u.expected_version, u.next_step, u.checkpoint::jsonb AS checkpoint,
           u.events::jsonb AS events, u.agent_version, $1::text AS owner,
           clock_timestamp() AS now
    FROM unnest($2::text[], $3::bigint[], $4::bigint[], $5::text[], $6::text[], $7::text[],
                $8::text[])
        AS u(run_id, fence, expected_version, next_step, checkpoint, events, agent_version)
), committed AS (
    UPDATE runs AS r
    SET step = u.next_step, checkpoint = u.checkpoint,
        checkpoint_version = r.checkpoint_version + 1, attempt = 1, wait = NULL,
        updated_at = clock_timestamp(),
        agent_version = coalesce(u.agent_version, r.agent_version),
        started_version = coalesce(r.started_version, u.agent_version)
    FROM input AS u
    WHERE r.run_id = ANY($2::text[]) AND r.run_id = u.run_id AND r.lease_owner = u.owner
      AND r.fence = u.fence AND r.lease_until > u.now
      AND r.checkpoint_version = u.expected_version
      -- No cutover at all is asked once per statement, not once per run.
      AND (NOT EXISTS (SELECT FROM agent_cutovers)
           OR NOT EXISTS (SELECT 1 FROM agent_cutovers AS c
                          WHERE c.agent = r.agent AND c.version IS DISTINCT FROM u.agent_version)
           OR EXISTS (SELECT 1 FROM cutover_drains AS d
                      WHERE d.run_id = r.run_id AND d.fence = r.fence))
    RETURNING r.run_id, r.fence, r.checkpoint_version, r.lease_until, u.events,
              r.signals_pending,
              EXISTS (SELECT 1 FROM cutover_drains AS d
                      WHERE d.run_id = r.run_id AND d.fence = r.fence) AS drained
), logged AS (
    INSERT INTO run_events (run_id, kind, fence, worker_id, details)
    SELECT c.run_id, e.kind, c.fence, $1, e.details
    FROM committed AS c, jsonb_to_recordset(c.events) AS e(kind text, details jsonb)
)
SELECT run_id, checkpoint_version, lease_until, signals_pending, drained FROM committed

-- release_drained --
-- params: $1 worker_id text, $2 run_ids text[]
-- After a drained cutover (migration 0026), the step worker $1 just committed for each run of
-- $2 was its last: in the commit's transaction, after its effects and park, give each run that
-- is still running under the fence the drain let finish back, as a graceful release does
-- (queued at once, fence unchanged, the attempt not counted), for a worker of the version cut
-- over to. Returns the runs given back.
WITH drained AS (
    DELETE FROM cutover_drains AS d WHERE d.run_id = ANY($2::text[])
    RETURNING d.run_id, d.fence, d.to_version
), released AS (
    UPDATE runs AS r
    SET state = 'queued', lease_owner = NULL, lease_until = NULL,
        attempt = greatest(r.attempt - 1, 0), available_at = clock_timestamp(),
        updated_at = clock_timestamp()
    FROM drained AS d
    WHERE r.run_id = d.run_id AND r.fence = d.fence AND r.lease_owner = $1
      AND r.state = 'running'
    RETURNING r.run_id, r.fence, r.agent, d.to_version
), logged AS (
    INSERT INTO run_events (run_id, kind, fence, worker_id, details)
    SELECT run_id, 'released', fence, $1,
           jsonb_build_object('reason', 'drained: the agent is cut over to version '
                                        || to_version)
    FROM released
), woken AS (
    SELECT pg_notify('orchestrator_runs', agent) FROM released
)
SELECT run_id FROM released WHERE (SELECT count(*) FROM woken) >= 0

-- spawn_children --
-- params: $1 parent run_id text, $2 fence bigint, $3 worker_id text, $4 children jsonb
-- The children of a step's commit, in its transaction (orchestrator_spawn_children, migration
-- 0027): one row per child asked for (its key, its run, whether this spawned it); no row when
-- the parent is not the worker's under that fence.
SELECT child_key, run_id, created FROM orchestrator_spawn_children($1, $2, $3, $4)

-- keep_checkpoints --
-- params: $1 run_ids text[], $2 versions bigint[], $3 steps text[], $4 checkpoints text[]
--         (JSON), $5 agent_versions text[], $6 fences bigint[]
-- The checkpoints of step commits whose agents keep them (migration 0029), written last in the
-- commits' transaction, after their effects: a fork from one of them carries exactly the
-- effects requested up to it.
INSERT INTO run_checkpoints (run_id, version, step, checkpoint, agent_version, fence)
SELECT * FROM unnest($1::text[], $2::bigint[], $3::text[], $4::text[]::jsonb[], $5::text[],
                     $6::bigint[])
ON CONFLICT DO NOTHING

-- checkpoint_before_step --
-- params: $1 run_id text, $2 step text
-- The latest kept checkpoint of run $1 from which step $2 was to run next (a fork's --step).
SELECT version FROM run_checkpoints WHERE run_id = $1 AND step = $2
ORDER BY version DESC LIMIT 1

-- fork_run --
-- params: $1 run_id text, $2 version bigint, $3 new run_id text, $4 principal, $5 via,
--         $6 typed_by
SELECT * FROM orchestrator_fork_run($1, $2, $3, $4, $5, $6)

-- carve_budgets --
-- params: $1 parent run_id text, $2 fence bigint, $3 worker_id text, $4 parent limits jsonb,
--         $5 children jsonb ([{run_id, budget}])
-- The budgets of the children a commit created, carved from the parent's, in its transaction
-- (orchestrator_carve_budgets, migration 0028): how many; NULL when the parent is not the
-- worker's under that fence.
SELECT orchestrator_carve_budgets($1, $2, $3, $4, $5)

-- children_of --
-- params: $1 parent run_id text, $2 child keys text[]
-- The children of a run with these keys, as a parent woken from waiting for them reads them.
SELECT child_key, run_id, state, result, error FROM runs
WHERE parent_run_id = $1 AND child_key = ANY($2::text[])

-- finish_runs --
-- params: $1 worker_id text, $2 run_ids text[], $3 fences bigint[],
--         $4 expected_versions bigint[], $5 states text[], $6 results text[] (JSON),
--         $7 errors text[] (JSON), $8 checkpoints text[] (JSON), $9 agent_versions text[]
-- Group commit of final commits: finish each run of owner $1 as $5 ('succeeded' or 'failed')
-- with result $6, error $7 and final checkpoint $8 (NULL keeps the last one), only while the
-- worker still owns it with fence $3, the lease is unexpired and the stored checkpoint version is
-- still $4 (arrays $2.. hold one entry per run; JSON travels as text, as in commit_steps; see
-- BATCHED WRITES). Each finished run gets its event: the final state as kind, the new checkpoint
-- version and any error as details. A state other than succeeded or failed becomes NULL, which
-- the NOT NULL constraint refuses: the whole statement fails instead. The rows returned are the
-- runs that were finished; a single finish is a batch of one. $6, $7 and $8 may be shorter than
-- the other arrays (empty when every entry would be NULL): unnest pads them with NULLs.
WITH input AS MATERIALIZED (
    SELECT u.run_id, u.fence, u.expected_version, u.state, u.result::jsonb AS result,
           u.error::jsonb AS error, u.checkpoint::jsonb AS checkpoint, u.agent_version,
           $1::text AS owner, clock_timestamp() AS now
    FROM unnest($2::text[], $3::bigint[], $4::bigint[], $5::text[], $6::text[], $7::text[],
                $8::text[], $9::text[])
        AS u(run_id, fence, expected_version, state, result, error, checkpoint, agent_version)
), finished AS (
    UPDATE runs AS r
    SET state = CASE WHEN u.state IN ('succeeded', 'failed') THEN u.state END,
        result = u.result, error = u.error,
        checkpoint = coalesce(u.checkpoint, r.checkpoint),
        checkpoint_version = r.checkpoint_version + 1, lease_owner = NULL, lease_until = NULL,
        wait = NULL, updated_at = clock_timestamp(), finished_at = clock_timestamp(),
        -- A failure that keeps the checkpoint ($8 NULL) keeps the version that wrote it.
        agent_version = CASE WHEN u.checkpoint IS NULL THEN r.agent_version
                             ELSE coalesce(u.agent_version, r.agent_version) END,
        started_version = coalesce(r.started_version, u.agent_version)
    FROM input AS u
    WHERE r.run_id = ANY($2::text[]) AND r.run_id = u.run_id AND r.lease_owner = u.owner
      AND r.fence = u.fence AND r.lease_until > u.now
      AND r.checkpoint_version = u.expected_version
      -- No cutover at all is asked once per statement, not once per run.
      AND (NOT EXISTS (SELECT FROM agent_cutovers)
           OR NOT EXISTS (SELECT 1 FROM agent_cutovers AS c
                          WHERE c.agent = r.agent AND c.version IS DISTINCT FROM u.agent_version)
           OR EXISTS (SELECT 1 FROM cutover_drains AS d
                      WHERE d.run_id = r.run_id AND d.fence = r.fence))
    RETURNING r.run_id, r.fence, r.state, r.checkpoint_version, u.error, r.watched
), logged AS (
    INSERT INTO run_events (run_id, kind, fence, worker_id, details)
    SELECT f.run_id, f.state, f.fence, $1,
           jsonb_build_object('version', f.checkpoint_version)
           || CASE WHEN f.error IS NULL THEN '{}'::jsonb
                   ELSE jsonb_build_object('error', f.error) END
    FROM finished AS f
), told AS (
    -- Only runs a client waits for (Client.wait): a NOTIFY per run would be work for nobody.
    SELECT pg_notify('orchestrator_finished', run_id) FROM finished WHERE watched
)
SELECT run_id FROM finished WHERE (SELECT count(*) FROM told) >= 0

-- append_messages --
-- params: $1 run_ids text[], $2 seqs int[], $3 turns int[], $4 roles text[],
--         $5 bodies text[] (JSON), $6 usages text[] (JSON), $7 fences bigint[]
-- Append transcript messages, in the transaction of the commits that produced them (only runs
-- whose commit took effect get theirs). Returns the rows written: a message whose (run, seq) is
-- taken is not written, and its commit is refused by the caller (the transcript is append-only).
INSERT INTO run_messages (run_id, seq, turn, role, body, usage, fence)
SELECT m.run_id, m.seq, m.turn, m.role, m.body::jsonb, m.usage::jsonb, m.fence
FROM unnest($1::text[], $2::int[], $3::int[], $4::text[], $5::text[], $6::text[], $7::bigint[])
    AS m(run_id, seq, turn, role, body, usage, fence)
ON CONFLICT DO NOTHING
RETURNING run_id, seq

-- run_messages --
-- params: $1 run_id text, $2 after_seq int
-- A run's transcript after message $2 (-1: all of it), in order.
SELECT seq, turn, role, body, usage, fence, at
FROM run_messages
WHERE run_id = $1 AND seq > $2
ORDER BY seq

-- accept_effect --
-- params: $1 run_id text, $2 effect_key text, $3 fence bigint, $4 kind text, $5 policy text,
--         $6 payload jsonb, $7 idempotency_key text, $8 worker_id text,
--         $9 requires_approval bool, $10 approval_seconds float8
-- The boundary's rule for one effect request (see orchestrator_accept_effect in migration 0003).
SELECT outcome, accepted_fence, status, run_state, run_fence
FROM orchestrator_accept_effect($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)

-- get_effect --
-- params: $1 run_id text, $2 effect_key text
-- One effect record.
SELECT * FROM effects WHERE run_id = $1 AND effect_key = $2

-- list_effects --
-- params: $1 run_id text (NULL: any), $2 status text (NULL: any), $3 limit int
-- Effect records, newest first, optionally of one run and/or in one status.
SELECT * FROM effects
WHERE ($1::text IS NULL OR run_id = $1) AND ($2::text IS NULL OR status = $2)
ORDER BY created_at DESC, run_id, effect_key
LIMIT $3

-- claim_effects --
-- params: $1 dispatcher_id text, $2 kinds text[], $3 limit int, $4 lease_seconds float8,
--         $5 trust_sync_replication bool, $6 flush_commit bool
-- A dispatcher ($1) claims up to $3 effects of the kinds $2 it has vendors for, with its own
-- lease of $4 seconds: new or uncertain effects that are due, and dispatches whose dispatcher
-- lease expired (that dispatcher may have died after the vendor accepted); an effect that needs
-- approval only once approved for its very payload. previous_status, ever_dispatched and
-- reconcile_first tell the dispatcher whether it may send, or must reconcile first.
-- reconcile_first (a failover's lost timeline may have sent it: lookup_first, or its last claim
-- or acceptance was in an earlier epoch) is answered once, by this claim, and is moot when $5
-- says every commit was synchronously replicated (nothing of a lost timeline was acted on).
-- Each kind the dispatcher serves (claim_kinds: each once, and estimated as one so that the
-- plan stays generic) is read from its own range of the partial indexes
-- (effects_due_by_kind, effects_dispatching_by_kind), in time order, up to $3: a claim reads
-- about $3 rows per kind however long the backlog is, its own kinds' or any other's (one
-- condition over everything would scan and sort every effect on each claim; an index in time
-- order alone would read past every effect of the kinds it does not serve). The rows of a kind
-- that the overall limit leaves out are locked only until this statement ends. The time is read
-- once (here.now) so that it can bound those index scans.
-- $6: the dispatcher waits for a standby to hold this claim before it sends, so the claim is
-- flushed at commit even in a session with synchronous_commit off (which would leave it to the
-- WAL writer, up to wal_writer_delay later); set_config's local value lasts until this
-- statement's own commit.
WITH here AS MATERIALIZED (
    SELECT fence_epoch() AS epoch, clock_timestamp() AS now,
           CASE WHEN $6::boolean AND current_setting('synchronous_commit') = 'off'
                THEN set_config('synchronous_commit', 'local', true) END AS flushed
), due AS (
    SELECT c.*
    FROM claim_kinds($2::text[]) AS k(kind) CROSS JOIN LATERAL (
        SELECT run_id, effect_key, status, ever_dispatched, lookup_first, known_epoch,
               available_at
        FROM effects
        WHERE kind = k.kind AND status IN ('accepted', 'uncertain')
          AND available_at <= (SELECT now FROM here)
          AND (NOT requires_approval OR approved_sha256 = payload_sha256)
        ORDER BY available_at
        LIMIT $3
        FOR UPDATE SKIP LOCKED
    ) AS c
), expired AS (
    SELECT c.*
    FROM claim_kinds($2::text[]) AS k(kind) CROSS JOIN LATERAL (
        SELECT run_id, effect_key, status, ever_dispatched, lookup_first, known_epoch,
               available_at
        FROM effects
        WHERE kind = k.kind AND status = 'dispatching'
          AND dispatcher_until < (SELECT now FROM here)
          AND (NOT requires_approval OR approved_sha256 = payload_sha256)
        ORDER BY dispatcher_until
        LIMIT $3
        FOR UPDATE SKIP LOCKED
    ) AS c
), picked AS (
    SELECT run_id, effect_key, status AS previous_status, ever_dispatched AS sent_before,
           (lookup_first OR known_epoch < (SELECT epoch FROM here)) AND NOT $5::boolean
               AS lookup_first
    FROM (SELECT * FROM due UNION ALL SELECT * FROM expired) AS candidates
    ORDER BY available_at
    LIMIT $3
)
UPDATE effects AS e
SET status = 'dispatching', dispatcher = $1,
    dispatcher_until = clock_timestamp() + make_interval(secs => $4),
    attempts = e.attempts + 1, ever_dispatched = true, lookup_first = false,
    known_epoch = (SELECT epoch FROM here), updated_at = clock_timestamp()
FROM picked AS p
WHERE e.run_id = p.run_id AND e.effect_key = p.effect_key
RETURNING e.*, p.previous_status, p.sent_before, p.lookup_first AS reconcile_first

-- effect_may_dispatch --
-- params: $1 run_id text, $2 effect_key text, $3 dispatcher_id text, $4 fence bigint
-- The re-check right before a vendor call: the effect is still dispatching under this
-- dispatcher ($3) with the fence it claimed ($4) and an unexpired dispatcher lease, and its
-- run has not been cancelled.
SELECT e.status = 'dispatching' AND e.dispatcher = $3 AND e.fence = $4
       AND e.dispatcher_until > clock_timestamp()
       AND (NOT e.requires_approval OR e.approved_sha256 = e.payload_sha256) AS dispatcher_ok,
       coalesce(r.state, '') <> 'cancelled' AS run_ok
FROM effects AS e
LEFT JOIN runs AS r ON r.run_id = e.run_id
WHERE e.run_id = $1 AND e.effect_key = $2

-- effects_may_dispatch --
-- params: $1 dispatcher_id text, $2 run_ids text[], $3 effect_keys text[], $4 fences bigint[]
-- effect_may_dispatch for a batch of effects in one statement, right before their vendor calls:
-- one row per effect asked about that still exists, with the same two answers.
SELECT e.run_id, e.effect_key,
       e.status = 'dispatching' AND e.dispatcher = $1 AND e.fence = u.fence
       AND e.dispatcher_until > clock_timestamp()
       AND (NOT e.requires_approval OR e.approved_sha256 = e.payload_sha256) AS dispatcher_ok,
       coalesce(r.state, '') <> 'cancelled' AS run_ok
FROM unnest($2::text[], $3::text[], $4::bigint[]) AS u(run_id, effect_key, fence)
JOIN effects AS e ON e.run_id = u.run_id AND e.effect_key = u.effect_key
LEFT JOIN runs AS r ON r.run_id = e.run_id

-- settle_effect --
-- params: $1 run_id text, $2 effect_key text, $3 dispatcher_id text, $4 status text,
--         $5 external_id text, $6 result jsonb, $7 error jsonb, $8 retry_after_seconds float8
-- Record what happened at the vendor, only if dispatcher $3 still holds the effect: status $4
-- (confirmed, failed, uncertain, parked, rejected or accepted for a later retry), external id
-- $5, result $6, error $7, next attempt not before $8 seconds from now. Logs the event and
-- wakes the run's step that may be waiting for the outcome.
WITH locked AS (
    -- The run's row first, as commits and cancels lock it (the same lock order).
    SELECT run_id FROM runs WHERE run_id = $1 FOR NO KEY UPDATE
), settled AS (
    UPDATE effects
    SET status = $4, external_id = coalesce($5, external_id), result = $6, error = $7,
        dispatcher = NULL, dispatcher_until = NULL, updated_at = clock_timestamp(),
        available_at = clock_timestamp() + make_interval(secs => $8),
        settled_at = CASE WHEN $4 IN ('confirmed', 'failed', 'rejected')
                          THEN clock_timestamp() END
    WHERE run_id = $1 AND effect_key = $2 AND dispatcher = $3 AND status = 'dispatching'
      AND (SELECT count(*) FROM locked) >= 0
    RETURNING run_id, effect_key, fence, status, external_id, attempts, kind
), logged AS (
    INSERT INTO run_events (run_id, kind, fence, worker_id, details)
    SELECT run_id, 'effect_' || status, fence, $3,
           jsonb_build_object('effect_key', effect_key, 'external_id', external_id,
                              'attempt', attempts, 'error', $7::jsonb)
    FROM settled
    WHERE EXISTS (SELECT 1 FROM runs WHERE runs.run_id = settled.run_id)
), woken AS (
    -- A run parked on this effect is due again (it parks again by itself if others are still
    -- unsettled). See WAKING A WAITING RUN for why the row of a running run is updated too.
    UPDATE runs AS r
    SET available_at = CASE WHEN r.state = 'waiting' AND r.wait -> 'effects' ? s.effect_key
                            THEN clock_timestamp() ELSE r.available_at END
    FROM settled AS s
    WHERE r.run_id = s.run_id AND r.state IN ('running', 'waiting')
      AND s.status IN ('confirmed', 'failed', 'rejected')
    RETURNING r.agent, r.available_at <= clock_timestamp() AND r.state = 'waiting' AS due
), told AS (
    SELECT pg_notify('orchestrator_effects', run_id) FROM settled
    UNION ALL
    SELECT pg_notify('orchestrator_runs', agent) FROM woken WHERE due
)
SELECT status, (SELECT count(*) FROM told) AS notified FROM settled

-- settle_effects --
-- params: $1 dispatcher_id text, $2 run_ids text[], $3 effect_keys text[], $4 statuses text[],
--         $5 external_ids text[], $6 results text[] (JSON), $7 errors text[] (JSON),
--         $8 retry_after_seconds float8[]
-- settle_effect for a batch of effects of dispatcher $1 in one statement (arrays: one entry per
-- effect; JSON travels as text, as in commit_steps). The runs' rows are locked first, as there,
-- but with SKIP LOCKED: a batch never waits for one run's row while holding another's (a
-- worker's group commit locks its runs in its own order). An effect whose run's row was not
-- locked here (another transaction holds it, or the run is gone) is left as it was and not
-- returned: the caller settles it alone with settle_effect. Returns the effects settled.
WITH input AS MATERIALIZED (
    SELECT u.run_id, u.effect_key, u.status, u.external_id, u.result::jsonb AS result,
           u.error::jsonb AS error, u.retry_after, $1::text AS dispatcher
    FROM unnest($2::text[], $3::text[], $4::text[], $5::text[], $6::text[], $7::text[],
                $8::float8[]) AS u(run_id, effect_key, status, external_id, result, error,
                                   retry_after)
), locked AS MATERIALIZED (
    SELECT r.run_id FROM runs AS r WHERE r.run_id = ANY($2::text[])
    ORDER BY r.run_id FOR NO KEY UPDATE SKIP LOCKED
), settled AS (
    UPDATE effects AS e
    SET status = u.status, external_id = coalesce(u.external_id, e.external_id),
        result = u.result, error = u.error, dispatcher = NULL, dispatcher_until = NULL,
        updated_at = clock_timestamp(),
        available_at = clock_timestamp() + make_interval(secs => u.retry_after),
        settled_at = CASE WHEN u.status IN ('confirmed', 'failed', 'rejected')
                          THEN clock_timestamp() END
    FROM input AS u
    WHERE e.run_id = u.run_id AND e.effect_key = u.effect_key AND e.dispatcher = u.dispatcher
      AND e.status = 'dispatching' AND u.run_id IN (SELECT run_id FROM locked)
    RETURNING e.run_id, e.effect_key, e.fence, e.status, e.external_id, e.attempts, e.error
), logged AS (
    INSERT INTO run_events (run_id, kind, fence, worker_id, details)
    SELECT run_id, 'effect_' || status, fence, $1,
           jsonb_build_object('effect_key', effect_key, 'external_id', external_id,
                              'attempt', attempts, 'error', error)
    FROM settled
), woken AS (
    -- As in settle_effect, with every settled effect of a run at once (an UPDATE joins each
    -- row to one source row).
    UPDATE runs AS r
    SET available_at = CASE WHEN r.state = 'waiting' AND r.wait -> 'effects' ?| s.keys
                            THEN clock_timestamp() ELSE r.available_at END
    FROM (SELECT run_id, array_agg(effect_key) AS keys FROM settled
          WHERE status IN ('confirmed', 'failed', 'rejected') GROUP BY run_id) AS s
    WHERE r.run_id = s.run_id AND r.state IN ('running', 'waiting')
    RETURNING r.agent, r.available_at <= clock_timestamp() AND r.state = 'waiting' AS due
), told AS (
    SELECT pg_notify('orchestrator_effects', run_id) FROM settled
    UNION ALL
    SELECT pg_notify('orchestrator_runs', agent) FROM woken WHERE due
)
SELECT run_id, effect_key FROM settled WHERE (SELECT count(*) FROM told) >= 0

-- resolve_parked_effect --
-- params: $1 run_id text, $2 effect_key text, $3 sent boolean, $4 external_id text, $5 principal
--         text (NULL: the database role that connected), $6 via text, $7 typed_by text (a note)
-- A person decided a parked effect: sent (confirmed, external id $4; the record keeps the
-- outcome only) or not sent (sent again with the same idempotency key). Audited
-- (orchestrator_resolve_effect, migration 0019). No row: the effect is not parked.
SELECT status, audit_seq, principal FROM orchestrator_resolve_effect($1, $2, $3, $4, $5, $6, $7)

-- served_agents --
-- params: none
-- The agents that live workers serve right now.
SELECT DISTINCT unnest(agents) AS agent FROM workers ORDER BY 1

-- park_runs --
-- params: $1 worker_id text, $2 run_ids text[], $3 fences bigint[], $4 waits text[] (JSON),
--         $5 untils timestamptz[], $6 progressed boolean[]
-- The runs of owner $1 whose step commit took effect in this transaction wait: no lease, no
-- worker, state waiting, what they wait for in runs.wait. Each is due again at once if what it
-- waits for has already happened (a listed signal unconsumed, every listed effect settled), else
-- at its time $5, else never until woken. The rows are locked by the step commit just before,
-- so a signal or a settlement racing this statement wakes the run after it (they update the run
-- after this transaction ends) or is seen by it. A run that keeps parking due at once (what it
-- waits for has happened, or its time has passed) without progress between its claims ($6
-- false: no signal given to its steps, no step committed before the wait) is not claimed again
-- in a loop: from its fourth such park in a row it is due after 1, 2, 4 ... seconds, at most
-- 60 (runs.wake_streak counts them, up to 1000).
WITH input AS MATERIALIZED (
    SELECT u.run_id, u.fence, u.wait::jsonb AS wait, u.until, u.progressed,
           ARRAY(SELECT jsonb_array_elements_text(u.wait::jsonb -> 'signals')) AS names,
           $1::text AS owner, clock_timestamp() AS now
    FROM unnest($2::text[], $3::bigint[], $4::text[], $5::timestamptz[], $6::boolean[])
        AS u(run_id, fence, wait, until, progressed)
), counted AS (
    -- Of the children it waits for, how many it still needs (counted once, here).
    SELECT u.*,
           CASE WHEN u.wait ? 'children'
                THEN coalesce((u.wait ->> 'need')::integer,
                              jsonb_array_length(u.wait -> 'children'))
                     - orchestrator_children_ended(u.run_id, u.wait) END AS children_left
    FROM input AS u
), judged AS (
    SELECT u.*,
           EXISTS (SELECT 1 FROM run_signals AS s
                   WHERE s.run_id = u.run_id AND s.consumed_at IS NULL AND s.name = ANY(u.names))
           OR (jsonb_array_length(coalesce(u.wait -> 'effects', '[]'::jsonb)) > 0
               AND NOT EXISTS (SELECT 1 FROM effects AS e
                               WHERE e.run_id = u.run_id AND u.wait -> 'effects' ? e.effect_key
                                 AND e.status NOT IN ('confirmed', 'failed', 'rejected')))
           -- Enough of the children it waits for have ended already.
           OR coalesce(u.children_left <= 0, false)
           -- Topped up after the reservation that was refused (before this park): try again.
           OR (u.wait ->> 'reason' = 'budget'
               AND coalesce((SELECT max(entry) FILTER (WHERE kind = 'top_up')
                                    > coalesce(max(entry) FILTER (WHERE kind = 'refused'), 0)
                             FROM budget_ledger AS l WHERE l.run_id = u.run_id), false))
           AS happened
    FROM counted AS u
), spun AS (
    -- Due at once with no progress since the claim: one more park of a spin.
    SELECT j.*, coalesce(j.happened OR j.until <= j.now, false) AND NOT j.progressed AS spinning
    FROM judged AS j
), parked AS (
    UPDATE runs AS r
    SET state = 'waiting', lease_owner = NULL, lease_until = NULL, wait = u.wait, attempt = 0,
        children_awaited = greatest(u.children_left, 0),
        wake_streak = CASE WHEN u.spinning THEN least(r.wake_streak + 1, 1000) ELSE 0 END,
        available_at = CASE
            WHEN u.spinning AND r.wake_streak >= 3
                THEN u.now + make_interval(secs => least(2 ^ least(r.wake_streak - 3, 6), 60))
            WHEN u.happened THEN u.now
            ELSE coalesce(u.until, 'infinity'::timestamptz)
        END,
        updated_at = clock_timestamp()
    FROM spun AS u
    WHERE r.run_id = ANY($2::text[]) AND r.run_id = u.run_id AND r.lease_owner = u.owner
      AND r.fence = u.fence
    RETURNING r.run_id, r.fence, r.agent, r.available_at, r.wake_streak, u.wait, u.now
), logged AS (
    INSERT INTO run_events (run_id, kind, fence, worker_id, details)
    SELECT run_id, 'waiting', fence, $1,
           wait || jsonb_build_object('due_at', CASE WHEN available_at < 'infinity'
                                                     THEN available_at END)
                || CASE WHEN wake_streak > 3
                        THEN jsonb_build_object(
                                 'wake_streak', wake_streak,
                                 'backed_off_seconds', extract(epoch FROM available_at - now))
                        ELSE '{}'::jsonb END
    FROM parked
), woken AS (
    SELECT pg_notify('orchestrator_runs', agent) FROM parked WHERE available_at <= now
)
SELECT run_id FROM parked WHERE (SELECT count(*) FROM woken) >= 0

-- pending_signals --
-- params: $1 run_id text, $2 awaited text[]
-- The signals sent to run $1 and not yet consumed by a committed step, in the order they came
-- (at most 100: a step is given a bounded number; the next step gets the rest), those named in
-- $2 (what a woken run waited for) chosen first, as the claim chooses them.
SELECT * FROM (
    SELECT seq, name, data, idempotency_key, sent_at
    FROM ((SELECT * FROM run_signals
           WHERE run_id = $1 AND consumed_at IS NULL AND name = ANY($2::text[])
           ORDER BY seq LIMIT 100)
          UNION ALL
          (SELECT * FROM run_signals
           WHERE run_id = $1 AND consumed_at IS NULL AND name <> ALL($2::text[])
           ORDER BY seq LIMIT 100)) AS u
    ORDER BY name = ANY($2::text[]) DESC, seq
    LIMIT 100
) AS chosen
ORDER BY seq

-- consume_signals --
-- params: $1 run_ids text[], $2 seqs bigint[], $3 fences bigint[] (one row per signal)
-- The signals a committed step was given are consumed with its commit, in its transaction (only
-- runs whose commit took effect): exactly once into the run, however many times the step ran.
-- The step was given these seqs, not a prefix: a woken run is given the signals it waited for
-- ahead of older ones, which stay for its later steps.
WITH input AS (
    SELECT * FROM unnest($1::text[], $2::bigint[], $3::bigint[]) AS u(run_id, seq, fence)
), consumed AS (
    UPDATE run_signals AS s
    SET consumed_at = clock_timestamp(), consumed_fence = u.fence
    FROM input AS u
    WHERE s.run_id = u.run_id AND s.seq = u.seq AND s.consumed_at IS NULL
    RETURNING s.run_id, s.seq, s.name, u.fence
), counted AS (
    UPDATE runs AS r
    SET signals_pending = greatest(r.signals_pending - c.n, 0)
    FROM (SELECT run_id, count(*)::integer AS n FROM consumed GROUP BY run_id) AS c
    WHERE r.run_id = c.run_id
), logged AS (
    INSERT INTO run_events (run_id, kind, fence, details)
    SELECT run_id, 'signals_consumed', max(fence),
           jsonb_build_object('seqs', jsonb_agg(seq ORDER BY seq),
                              'names', jsonb_agg(name ORDER BY seq))
    FROM consumed GROUP BY run_id
)
SELECT run_id, count(*) AS consumed FROM consumed GROUP BY run_id

-- send_signal --
-- params: $1 run_id text, $2 name text, $3 data jsonb, $4 idempotency_key text, $5 principal
--         text (NULL: the database role that connected), $6 via text, $7 typed_by text
-- A signal to run $1, stored durably (once per idempotency key), counted on the run, the run
-- woken if it waits for a signal of that name, and audited (orchestrator_send_signal, migration
-- 0019). The run's row is locked first, as parking locks it, so a signal and a park never miss
-- each other. Returns the run's state (NULL: no such run) and the new signal's seq (NULL: not
-- stored, the run is finished or the key was used). Data NULL (a signal without data) is stored
-- as JSON null, what the step reads back.
SELECT state, seq, sent_at, audit_seq, principal
FROM orchestrator_send_signal($1, $2, $3, $4, $5, $6, $7)

-- get_signal_by_key --
-- params: $1 run_id text, $2 idempotency_key text
-- The signal an idempotency key already stored for run $1.
SELECT seq, name, data, idempotency_key, sent_at, consumed_at
FROM run_signals WHERE run_id = $1 AND idempotency_key = $2

-- run_signals --
-- params: $1 run_id text, $2 limit int (NULL: all)
-- The newest $2 signals of run $1 (or every one), oldest first, with when and by which fence
-- each was consumed.
SELECT * FROM (
    SELECT seq, name, data, idempotency_key, sent_at, consumed_at, consumed_fence
    FROM run_signals WHERE run_id = $1 ORDER BY seq DESC LIMIT $2
) AS newest
ORDER BY seq

-- watch_run --
-- params: $1 run_id text
-- A client waits for run $1's end: its final statement will NOTIFY orchestrator_finished. The
-- update locks the row, and a claim running meanwhile skips it (SKIP LOCKED): so claimers are
-- woken again for a run that is due.
WITH watched AS (
    UPDATE runs SET watched = true WHERE run_id = $1 AND NOT watched
    RETURNING agent, state IN ('queued', 'waiting') AND available_at <= clock_timestamp() AS due
)
SELECT pg_notify('orchestrator_runs', agent) FROM watched WHERE due

-- list_approvals --
-- params: $1 run_id text (NULL: any), $2 limit int
-- Effects awaiting a person's decision, of runs still live (a run that ended, say past its
-- deadline, left nothing to decide: its requests only wait for their expiry), oldest first.
SELECT e.* FROM effects AS e JOIN runs AS r ON r.run_id = e.run_id
WHERE e.status = 'awaiting_approval' AND ($1::text IS NULL OR e.run_id = $1)
  AND r.state IN ('queued', 'running', 'waiting')
ORDER BY e.created_at, e.run_id, e.effect_key
LIMIT $2

-- decide_approval --
-- params: $1 run_id text, $2 effect_key text, $3 decision text ('approved' | 'denied'),
--         $4 note text, $5 payload_sha256 text (NULL: the current payload), $6 run_fence bigint
--         (NULL: any; else the run's fence when the person looked), $7 principal text (NULL:
--         the database role that connected), $8 via text, $9 typed_by text (a note)
-- A person's decision on an effect awaiting approval, bound to the payload they saw: refused
-- (decided false) when it is not awaiting approval (already decided, withdrawn, or never needed
-- one), its run is no longer live, it has expired, its payload is not the one $5 names, or the
-- run's fence has moved on from $6 (another attempt owns it now: look again). Approved:
-- dispatchable, for this payload's hash only. Denied: rejected, the run woken. Audited
-- (orchestrator_decide_approval, migration 0019). No row: no such effect.
SELECT * FROM orchestrator_decide_approval($1, $2, $3, $4, $5, $6, $7, $8, $9)

-- expire_approvals --
-- params: $1 limit int
-- Approvals nobody gave in time are denied by expiry (at most $1 per call); their runs woken.
-- The statement is orchestrator_expire_approvals (migration 0017), run as the schema owner: a
-- worker runs it as a chore but may not write effects otherwise.
SELECT run_id, effect_key, notified FROM orchestrator_expire_approvals($1)

-- reserve_budget --
-- params: $1 run_id text, $2 worker_id text, $3 fence bigint, $4 limits jsonb, $5 turns bigint,
--         $6 input_tokens bigint, $7 output_tokens bigint, $8 cost numeric
-- Reserve a model turn's worst case, fenced (see orchestrator_reserve_budget in migration 0009).
SELECT outcome, exhausted_by, tool_calls_left
FROM orchestrator_reserve_budget($1, $2, $3, $4, $5, $6, $7, $8)

-- settle_budgets --
-- params: $1 run_ids text[], $2 fences bigint[], $3 turns bigint[], $4 tool_calls bigint[],
--         $5 input_tokens bigint[], $6 output_tokens bigint[], $7 costs numeric[]
-- In the turn's commit (only runs whose commit took effect): the reservation of that fence is
-- replaced by what the turn actually cost. Counts saturate at 2^62 (budgets.MAX_AMOUNT): absurd
-- amounts a model server reports must not overflow bigint and fail the commits batched with it.
-- The statement is orchestrator_settle_budgets (migration 0019): a worker may not write budgets
-- directly, and spent counters only grow.
SELECT orchestrator_settle_budgets($1, $2, $3, $4, $5, $6, $7)

-- top_up_budget --
-- params: $1 run_id text, $2 added jsonb ({turns, tool_calls, input_tokens, output_tokens,
--         cost_usd}, each above 0), $3 principal text (NULL: the database role that connected),
--         $4 via text, $5 typed_by text (a note)
-- Raise run $1's limits by $2 (a dimension without a limit stays without one; a limit saturates
-- at 2^62, budgets.MAX_AMOUNT) and wake the run if it waits for budget; audited
-- (orchestrator_top_up_budget, migration 0019). No row: the run has no budget.
SELECT run_id, notified, audit_seq, principal FROM orchestrator_top_up_budget($1, $2, $3, $4, $5)

-- get_budget --
-- params: $1 run_id text
-- Run $1's budget: limits, spent, reserved.
SELECT * FROM run_budgets WHERE run_id = $1

-- budget_ledger --
-- params: $1 run_id text
-- Every reservation, settlement, forfeit, refusal and top-up of run $1's budget, in order.
SELECT entry, kind, fence, turns, tool_calls, input_tokens, output_tokens, cost, details, at
FROM budget_ledger WHERE run_id = $1 ORDER BY entry

-- purge_finished --
-- params: $1 cutoff timestamptz, $2 batch int
-- Delete up to $2 runs that finished before $1, oldest first, with everything kept for them
-- (events, transcript, effects, signals, budget and ledger, the boundary's fence, trace contexts). A run that
-- still has an effect not settled (accepted, dispatching, uncertain, parked, awaiting approval)
-- is kept: deleting it would lose a side effect in flight. Rows another transaction holds are
-- skipped (SKIP LOCKED), so a purge never waits on a worker. Returns the runs deleted.
-- The statement is orchestrator_purge_finished (migration 0019), run as the schema owner: no
-- other role may delete runs, effects or the boundary's fences directly. A role that does not own
-- the schema (a worker) may purge only runs that finished at least an hour ago. A batch that
-- deleted runs appends its purge row to the audit trail (audit_seq; NULL when none).
SELECT runs, other_rows, audit_seq, principal FROM orchestrator_purge_finished($1, $2)

-- count_purgeable --
-- params: $1 cutoff timestamptz
-- How many runs purge_finished would delete before $1 (for a dry run).
SELECT count(*) FROM runs AS r
WHERE r.state IN ('succeeded', 'failed', 'cancelled', 'dead') AND r.finished_at < $1
  AND NOT EXISTS (
      SELECT 1 FROM effects AS e
      WHERE e.run_id = r.run_id AND e.status NOT IN ('confirmed', 'failed', 'rejected'))

-- list_workers --
-- params: $1 lock_namespace int
-- Registered workers, each alive when its liveness lock (namespace $1) is held by a session,
-- with the runs it holds and when it last renewed a lease (or committed a run it holds now).
WITH live_locks AS (
    SELECT objid::bigint AS session_key
    FROM pg_locks
    WHERE locktype = 'advisory' AND granted AND classid::bigint = $1::bigint
      AND objsubid = 2
      AND database = (SELECT oid FROM pg_database WHERE datname = current_database())
)
SELECT w.worker_id, w.host, w.pid, w.agents, w.started_at,
       EXISTS (SELECT 1 FROM live_locks AS l WHERE l.session_key = w.session_key) AS alive,
       count(r.run_id) AS runs_held,
       greatest(w.last_renewal_at, max(r.updated_at)) AS last_renewal,
       max(r.lease_until) AS leases_until
FROM workers AS w
LEFT JOIN runs AS r ON r.lease_owner = w.worker_id AND r.state = 'running'
GROUP BY w.worker_id
ORDER BY w.worker_id

-- agent_versions --
-- params: $1 lock_namespace int, $2 agent text (NULL: every agent)
-- Each version of each agent that a registered worker serves or that wrote the checkpoint of an
-- unfinished run: the live workers that run that version, the live workers that may claim its
-- runs (they serve it or upgrade from it: workers.agent_versions holds, per agent, the version
-- first, then those it upgrades from; and once the agent is cut over, only workers running the
-- version cut over to claim), and its unfinished runs. Reads every unfinished run (no index
-- names the version): an operator's listing, not a hot path.
WITH live AS (
    SELECT w.worker_id, w.agent_versions
    FROM workers AS w
    WHERE EXISTS (
        SELECT 1 FROM pg_locks AS l
        WHERE l.locktype = 'advisory' AND l.granted AND l.classid::bigint = $1::bigint
          AND l.objsubid = 2 AND l.objid::bigint = w.session_key
          AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
    )
), offered AS (
    SELECT v.key AS agent, c.value AS version, c.ordinality = 1 AS runs_it, l.worker_id,
           NOT EXISTS (SELECT 1 FROM agent_cutovers AS cut
                       WHERE cut.agent = v.key AND cut.version IS DISTINCT FROM v.value ->> 0)
               AS may_claim
    FROM live AS l
    CROSS JOIN LATERAL jsonb_each(coalesce(l.agent_versions, '{}'::jsonb)) AS v
    CROSS JOIN LATERAL jsonb_array_elements_text(
        CASE WHEN jsonb_typeof(v.value) = 'array' THEN v.value ELSE '[]'::jsonb END
    ) WITH ORDINALITY AS c(value, ordinality)
    WHERE $2::text IS NULL OR v.key = $2::text
), served AS (
    SELECT agent, version,
           coalesce(array_agg(DISTINCT worker_id) FILTER (WHERE runs_it), '{}') AS workers,
           coalesce(array_agg(DISTINCT worker_id) FILTER (WHERE may_claim), '{}') AS claimed_by
    FROM offered
    GROUP BY agent, version
), unfinished AS (
    SELECT agent, agent_version AS version, count(*) AS runs
    FROM runs
    WHERE state IN ('queued', 'running', 'waiting') AND agent_version IS NOT NULL
      AND ($2::text IS NULL OR agent = $2::text)
    GROUP BY agent, agent_version
)
SELECT coalesce(s.agent, u.agent) AS agent, coalesce(s.version, u.version) AS version,
       coalesce(s.workers, '{}') AS workers, coalesce(s.claimed_by, '{}') AS claimed_by,
       coalesce(u.runs, 0) AS unfinished_runs
FROM served AS s
FULL JOIN unfinished AS u ON u.agent = s.agent AND u.version = s.version
ORDER BY 1, 2

-- queue_stats --
-- params: (none)
-- Per agent: runs queued, due now (queued or waiting with available_at passed), running,
-- waiting, and how long the oldest due run has been due. Reads only the partial indexes of live
-- runs (runs_due_plain, runs_due_keyed, runs_running), never the finished history.
WITH pending AS (
    SELECT agent,
           count(*) FILTER (WHERE state = 'queued') AS queued,
           count(*) FILTER (WHERE available_at <= clock_timestamp()) AS due,
           count(*) FILTER (WHERE state = 'waiting') AS waiting,
           extract(epoch FROM clock_timestamp() - min(available_at) FILTER (
               WHERE available_at <= clock_timestamp()))::float8 AS oldest_due_seconds
    FROM (SELECT agent, state, available_at FROM runs
          WHERE state IN ('queued', 'waiting') AND concurrency_key IS NULL
          UNION ALL
          SELECT agent, state, available_at FROM runs
          WHERE state IN ('queued', 'waiting') AND concurrency_key IS NOT NULL) AS live
    GROUP BY agent
), running AS (
    SELECT agent, count(*) AS running FROM runs WHERE state = 'running' GROUP BY agent
)
SELECT agent, coalesce(p.queued, 0) AS queued, coalesce(p.due, 0) AS due,
       coalesce(r.running, 0) AS running, coalesce(p.waiting, 0) AS waiting,
       CASE WHEN p.due > 0 THEN p.oldest_due_seconds END AS oldest_due_seconds
FROM pending AS p FULL JOIN running AS r USING (agent)
ORDER BY agent

-- effects_needing_people --
-- params: (none)
-- How many effects are parked for a person or awaiting an approval (partial indexes only).
SELECT (SELECT count(*) FROM effects WHERE status = 'parked') AS parked,
       (SELECT count(*) FROM effects WHERE status = 'awaiting_approval') AS awaiting_approval

-- set_principal --
-- params: $1 name text, $2 kind text, $3 role text, $4 created_by text
-- Add a person or service, or change its kind and role (enabling it again if disabled). Returns
-- the row, whether it was new and whether anything changed (adding a principal again as it is
-- changes nothing, and is not audited).
WITH written AS (
    INSERT INTO principals AS p (name, kind, role, created_by)
    VALUES ($1, $2, $3, coalesce($4::text, session_user))
    ON CONFLICT (name) DO UPDATE
    SET kind = EXCLUDED.kind, role = EXCLUDED.role, updated_at = clock_timestamp(),
        disabled_at = NULL
    WHERE (p.kind, p.role) IS DISTINCT FROM (EXCLUDED.kind, EXCLUDED.role)
       OR p.disabled_at IS NOT NULL
    RETURNING name, kind, role, created_at, created_by, disabled_at, (xmax = 0) AS created
)
SELECT *, true AS changed FROM written
UNION ALL
SELECT name, kind, role, created_at, created_by, disabled_at, false, false
FROM principals WHERE name = $1 AND NOT EXISTS (SELECT 1 FROM written)

-- disable_principal --
-- params: $1 name text
-- Disable a principal: its tokens stop working at once (they are kept for the record).
UPDATE principals SET disabled_at = coalesce(disabled_at, clock_timestamp()),
                      updated_at = clock_timestamp()
WHERE name = $1
RETURNING name, kind, role, created_at, created_by, disabled_at

-- get_principal --
-- params: $1 name text
SELECT name, kind, role, created_at, created_by, disabled_at FROM principals WHERE name = $1

-- list_principals --
-- params: (none)
-- Every principal with how many tokens it holds that still work.
SELECT p.name, p.kind, p.role, p.created_at, p.created_by, p.disabled_at,
       (SELECT count(*) FROM access_tokens AS t
        WHERE t.principal = p.name AND t.revoked_at IS NULL
          AND (t.expires_at IS NULL OR t.expires_at > clock_timestamp())) AS live_tokens
FROM principals AS p
ORDER BY p.name

-- service_tokens_exist --
-- params: (none)
-- Whether an enabled service holds a token that still works; reads only the columns the proxy's
-- role may read (it starts on this answer).
SELECT EXISTS (
    SELECT 1 FROM access_tokens AS t JOIN principals AS p ON p.name = t.principal
    WHERE p.kind = 'service' AND p.disabled_at IS NULL AND t.revoked_at IS NULL
      AND (t.expires_at IS NULL OR t.expires_at > clock_timestamp()))

-- create_token --
-- params: $1 token_id text, $2 principal text, $3 sha256 text, $4 description text,
--         $5 scope jsonb, $6 expires_in_seconds float8 (NULL: never), $7 created_by text
-- Store a new token's hash. No row: the principal does not exist or is disabled.
INSERT INTO access_tokens (token_id, principal, sha256, description, scope, expires_at,
                           created_by)
SELECT $1, p.name, $3, $4, $5,
       clock_timestamp() + make_interval(secs => $6::float8), coalesce($7::text, session_user)
FROM principals AS p
WHERE p.name = $2 AND p.disabled_at IS NULL
RETURNING token_id, principal, description, scope, created_at, created_by, expires_at,
          revoked_at, revoked_by, last_used_at

-- principal_of_session --
-- params: $1 name text, $2 token_id text (NULL: signed in without a token)
-- The person behind a console session, while they are enabled and the token they signed in with
-- (if any) still works: a disable or a revoke ends the session at its next request.
SELECT p.name, p.kind, p.role, p.created_at, p.created_by, p.disabled_at
FROM principals AS p
WHERE p.name = $1 AND p.disabled_at IS NULL AND p.kind = 'person'
  AND ($2::text IS NULL OR EXISTS (
      SELECT 1 FROM access_tokens AS t
      WHERE t.token_id = $2 AND t.principal = p.name AND t.revoked_at IS NULL
        AND (t.expires_at IS NULL OR t.expires_at > clock_timestamp())))

-- sign_in --
-- params: $1 name text, $2 via text ('token' | 'oidc'), $3 token_id text (a token sign-in's),
--         $4 role text (an OpenID Connect sign-in's role from the provider's groups; NULL: none)
-- A console sign-in, audited; with $4, the person is added or their role changed first, as their
-- own audited sign-in (orchestrator_sign_in, migration 0019: never an admin, never a disabled
-- person or a service). Refused with SQLSTATE 42501.
SELECT name, kind, role, audit_seq FROM orchestrator_sign_in($1, $2, $3, $4)

-- authenticate_token --
-- params: $1 sha256 text
-- The principal and scope of a working token (not revoked, not expired, its principal enabled),
-- stamping its last use at most once a minute (a read otherwise).
WITH found AS (
    SELECT t.token_id, t.scope, p.name, p.kind, p.role
    FROM access_tokens AS t JOIN principals AS p ON p.name = t.principal
    WHERE t.sha256 = $1 AND t.revoked_at IS NULL AND p.disabled_at IS NULL
      AND (t.expires_at IS NULL OR t.expires_at > clock_timestamp())
), stamped AS (
    UPDATE access_tokens AS t SET last_used_at = clock_timestamp()
    FROM found AS f
    WHERE t.token_id = f.token_id
      AND (t.last_used_at IS NULL OR t.last_used_at < clock_timestamp() - interval '1 minute')
)
SELECT token_id, scope, name, kind, role FROM found

-- revoke_token --
-- params: $1 token_id text, $2 revoked_by text
-- Revoke a token (kept for the record). Returns the row, revoked now or before.
-- (The CTE's RETURNING, not a read of the table: a read in the same statement sees the row as it
-- was before the UPDATE.)
WITH revoked AS (
    UPDATE access_tokens SET revoked_at = clock_timestamp(),
                         revoked_by = coalesce($2::text, session_user)
    WHERE token_id = $1 AND revoked_at IS NULL
    RETURNING token_id, principal, description, scope, created_at, created_by, expires_at,
              revoked_at, revoked_by, last_used_at
)
SELECT *, true AS revoked_now FROM revoked
UNION ALL
SELECT token_id, principal, description, scope, created_at, created_by, expires_at, revoked_at,
       revoked_by, last_used_at, false
FROM access_tokens WHERE token_id = $1 AND NOT EXISTS (SELECT 1 FROM revoked)

-- list_tokens --
-- params: $1 principal text (NULL: every principal's)
-- Tokens without their hashes, newest first.
SELECT token_id, principal, description, scope, created_at, created_by, expires_at, revoked_at,
       revoked_by, last_used_at
FROM access_tokens
WHERE $1::text IS NULL OR principal = $1
ORDER BY created_at DESC, token_id

-- audit_append --
-- params: $1 principal text (NULL: the connected role), $2 via text, $3 action text,
--         $4 run_id text, $5 effect_key text, $6 detail jsonb
-- Append one decision to the chained audit log (in the caller's transaction); returns its seq
-- and the principal recorded (the connected role when $1 is NULL).
SELECT audit_append($1, $2, $3, $4, $5, $6) AS seq, coalesce($1::text, session_user) AS principal

-- audit_list --
-- params: $1 after_seq bigint, $2 limit int, $3 run_id text (NULL: any), $4 principal text
--         (NULL: any), $5 action text (NULL: any)
-- Audit rows after seq $1, oldest first, with what their hash covers spelled out for a verifier.
SELECT seq, at, db_user, principal, via, action, run_id, effect_key, detail,
       detail::text AS detail_text,
       ((extract(epoch FROM at) * 1000000)::bigint) AS at_micros, prev_sha256, sha256
FROM audit_log
WHERE seq > $1
  AND ($3::text IS NULL OR run_id = $3)
  AND ($4::text IS NULL OR principal = $4)
  AND ($5::text IS NULL OR action = $5)
ORDER BY seq
LIMIT $2

-- list_limits --
-- params: $1 agent text (NULL: every agent)
-- Every limit (of agent $1), with how many runs it counts now (for a per-key limit: the key
-- that has the most) and how many due runs it covers.
SELECT l.agent, l.key_pattern, l.per, l.max_running, l.set_by, l.set_at, l.declared,
       coalesce(CASE WHEN l.per = 'all'
                     THEN orchestrator_running(l.agent, l.key_pattern, 'all', NULL)
                     ELSE (SELECT max(orchestrator_running(l.agent, l.key_pattern, 'key', k.key))
                           FROM (SELECT DISTINCT concurrency_key AS key FROM runs
                                 WHERE agent = l.agent AND state = 'running'
                                   AND orchestrator_key_matches(concurrency_key, l.key_pattern,
                                                                'key')) AS k) END, 0) AS running,
       (SELECT count(*) FROM runs
        WHERE agent = l.agent AND state IN ('queued', 'waiting')
          AND available_at <= clock_timestamp()
          AND orchestrator_key_matches(concurrency_key, l.key_pattern, l.per)) AS backlog
FROM flow_limits AS l
WHERE $1::text IS NULL OR l.agent = $1::text
ORDER BY l.agent, l.per, l.key_pattern

-- set_limit --
-- params: $1 agent, $2 key_pattern, $3 per ('all' | 'key'), $4 max_running, $5 principal,
--         $6 via, $7 typed_by
SELECT * FROM orchestrator_set_limit($1, $2, $3, $4, $5, $6, $7)

-- clear_limit --
-- params: $1 agent, $2 key_pattern, $3 per, $4 principal, $5 via, $6 typed_by
SELECT * FROM orchestrator_clear_limit($1, $2, $3, $4, $5, $6)

-- declare_limits --
-- params: $1 agent, $2 limits jsonb ([{key_pattern, per, max_running}]), $3 by (the worker)
SELECT orchestrator_declare_limits($1, $2::jsonb, $3) AS changed

-- list_rate_limits --
-- params: $1 name text (NULL: every rate limit)
-- Each rate limit, with what is left of it now (the bucket refilled to this instant).
SELECT l.name, l.requests, l.tokens, l.per_seconds, l.set_by, l.set_at,
       CASE WHEN l.paused_until > clock_timestamp() THEN l.paused_until END AS paused_until,
       CASE WHEN l.paused_until > clock_timestamp() THEN l.paused_by END AS paused_by,
       CASE WHEN l.requests IS NOT NULL THEN least(
           l.requests::double precision,
           l.requests_left + greatest(0, extract(epoch FROM clock_timestamp() - l.refilled_at))
                             * l.requests / l.per_seconds) END AS requests_left,
       CASE WHEN l.tokens IS NOT NULL THEN least(
           l.tokens::double precision,
           l.tokens_left + greatest(0, extract(epoch FROM clock_timestamp() - l.refilled_at))
                           * l.tokens / l.per_seconds) END AS tokens_left,
       (SELECT count(*) FROM run_holds AS h JOIN runs AS r ON r.run_id = h.run_id
        WHERE h.kind = 'rate' AND h.reason = 'rate limit ' || l.name AND h.fence = r.fence
          AND r.state = 'running' AND h.until >= clock_timestamp() - interval '2 seconds')
           AS waiting
FROM rate_limits AS l
WHERE $1::text IS NULL OR l.name = $1::text
ORDER BY l.name

-- set_rate_limit --
-- params: $1 name, $2 requests (NULL: not limited), $3 tokens (NULL: not limited),
--         $4 per_seconds, $5 principal, $6 via, $7 typed_by
SELECT * FROM orchestrator_set_rate_limit($1, $2, $3, $4, $5, $6, $7)

-- clear_rate_limit --
-- params: $1 name, $2 principal, $3 via, $4 typed_by
SELECT * FROM orchestrator_clear_rate_limit($1, $2, $3, $4)

-- rate_limit_names --
-- params: none
-- The names of the rate limits there are (and of the pauses 429s left), for a process to know
-- which of its calls and sends to charge.
SELECT name FROM rate_limits

-- take_rate --
-- params: $1 name, $2 requests, $3 tokens, $4 run_id (NULL: none), $5 fence
SELECT granted, wait_seconds FROM orchestrator_rate_take($1, $2, $3, $4, $5)

-- settle_rate --
-- params: $1 name, $2 tokens beyond those taken (negative: fewer)
SELECT orchestrator_rate_settle($1, $2)

-- pause_rate --
-- params: $1 name, $2 seconds, $3 by (who got the 429)
SELECT paused_until FROM orchestrator_rate_pause($1, $2, $3)

-- cutover --
-- params: $1 agent, $2 version, $3 drain boolean, $4 principal, $5 via, $6 typed_by
SELECT * FROM orchestrator_cutover($1, $2, $3::boolean, $4, $5, $6)

-- create_schedule --
-- params: $1 schedule_id, $2 name, $3 agent, $4 cron (NULL: an interval), $5 every_seconds,
--         $6 timezone, $7 overlap, $8 catch_up, $9 catch_up_seconds, $10 catch_up_limit,
--         $11 jitter_seconds, $12 starts_at, $13 ends_at, $14 input jsonb,
--         $15 concurrency_key, $16 priority, $17 max_attempts, $18 first slot, $19 principal,
--         $20 via, $21 typed_by
SELECT * FROM orchestrator_create_schedule($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12,
                                           $13, $14::jsonb, $15, $16, $17, $18, $19, $20, $21)

-- change_schedule --
-- params: $1 name, $2 change ('pause' | 'resume' | 'delete'), $3 next slot (resume), $4 principal,
--         $5 via, $6 typed_by
SELECT * FROM orchestrator_change_schedule($1, $2, $3, $4, $5, $6)

-- backfill_schedule --
-- params: $1 name, $2 slots timestamptz[], $3 run ids text[], $4 principal, $5 via, $6 typed_by
SELECT * FROM orchestrator_backfill_schedule($1, $2, $3, $4, $5, $6)

-- list_schedules --
-- params: $1 name text (NULL: every schedule)
-- Each schedule with its unfinished runs (the partial index runs_schedule_unfinished) and the
-- last slot it decided.
SELECT s.*, clock_timestamp() AS now,
       (SELECT count(*) FROM runs AS r
        WHERE r.schedule_id = s.schedule_id
          AND r.state IN ('queued', 'running', 'waiting')) AS unfinished,
       (SELECT max(x.slot) FROM schedule_slots AS x
        WHERE x.schedule_id = s.schedule_id AND x.run_id IS NOT NULL) AS last_fired
FROM schedules AS s
WHERE $1::text IS NULL OR s.name = $1
ORDER BY s.name

-- schedule_slots --
-- params: $1 schedule_id, $2 newest int
-- The schedule's latest decided slots with their runs' states, newest first.
SELECT x.slot, x.outcome, x.run_id, x.fence, x.decided_by, x.decided_at, r.state AS run_state
FROM schedule_slots AS x LEFT JOIN runs AS r ON r.run_id = x.run_id
WHERE x.schedule_id = $1
ORDER BY x.slot DESC
LIMIT $2

-- claim_schedules --
-- params: $1 worker_id, $2 lease_seconds, $3 limit
SELECT *, clock_timestamp() AS now FROM orchestrator_claim_schedules($1, $2, $3)

-- fire_schedule --
-- params: $1 schedule_id, $2 worker_id, $3 fence, $4 slots timestamptz[], $5 available_at
--         timestamptz[], $6 run ids text[] (one more than slots), $7 next slot, $8 missed jsonb
SELECT * FROM orchestrator_fire_schedule($1, $2, $3, $4, $5, $6, $7, $8::jsonb)

-- next_schedule_due --
-- params: none
-- Seconds until the earliest slot of any schedule that runs (negative: due; NULL: none).
SELECT extract(epoch FROM min(next_fire_at) - clock_timestamp())::float8 AS seconds
FROM schedules WHERE NOT paused AND next_fire_at IS NOT NULL

-- append_output --
-- params: $1 run_id text, $2 worker_id text, $3 fence bigint, $4 base_version bigint,
--         $5 events jsonb, $6 max_events bigint, $7 max_bytes bigint
-- A step's live output (orchestrator_stream_append, migration 0031): written only while worker
-- $2 holds run $1's unexpired lease under fence $3 at checkpoint version $4; the status ('ok',
-- 'stale': nothing written, 'truncated': the run's bound is reached) and the last position.
SELECT status, last_seq FROM orchestrator_stream_append($1, $2, $3, $4, $5, $6, $7)

-- read_output --
-- params: $1 run_id text, $2 after bigint (0: from the start), $3 limit int
-- Run $1's live output after position $2, in order (orchestrator_stream_read, migration 0031):
-- an attempt that has lost the run has its unfinished output retracted first.
SELECT seq, fence, base_version, kind, data, created_at
FROM orchestrator_stream_read($1, $2, $3)
