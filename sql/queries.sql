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

-- submit_run --
-- params: $1 run_id text, $2 agent text, $3 input jsonb, $4 max_attempts int, $5 idempotency_key text
-- Insert a queued run and its "submitted" event, and wake claimers, in one statement. Returns no
-- row when the run id or the idempotency key is already taken.
WITH inserted AS (
    INSERT INTO runs (run_id, agent, input, max_attempts, idempotency_key)
    VALUES ($1, $2, $3, $4, $5)
    ON CONFLICT DO NOTHING
    RETURNING *
), logged AS (
    INSERT INTO run_events (run_id, kind, fence, details)
    SELECT run_id, 'submitted', fence,
           jsonb_build_object('agent', agent, 'max_attempts', max_attempts,
                              'idempotency_key', idempotency_key)
    FROM inserted
), woken AS (
    SELECT pg_notify('orchestrator_runs', agent) FROM inserted
)
SELECT inserted.*, (SELECT count(*) FROM woken) AS notified FROM inserted

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
--         $5 include_expired bool, $6 run_id text (NULL: any due run of $2)
-- Claim up to $3 runs for worker $1, each with a lease of $4 seconds: runs of the agents $2 that
-- are due (queued, or waiting and past available_at) and, if $5, running runs whose lease has
-- expired by the database clock; or, when $6 names a run, that run alone if it is due or its
-- lease expired. Finding expired leases reads every running run of the agents (there is
-- deliberately no index on lease_until, which would make renewals non-HOT), so a busy claimer
-- passes $5 false most of the time. Each claim raises the fence by exactly one and counts an
-- attempt; an expired run that already used its last attempt is dead-lettered instead (a poison
-- run must not crash workers forever). SKIP LOCKED lets concurrent claimers pass each other;
-- after taking a row lock PostgreSQL re-checks the WHERE clause on the newest row version, so a
-- run another worker has just claimed is skipped, never claimed twice.
WITH expired AS (
    SELECT run_id, lease_owner AS previous_owner, lease_until AS previous_lease_until,
           attempt >= max_attempts AS exhausted
    FROM runs
    WHERE $6::text IS NULL AND $5::boolean AND state = 'running' AND agent = ANY($2::text[])
      AND lease_until < clock_timestamp()
    LIMIT $3
    FOR UPDATE SKIP LOCKED
), due AS (
    -- One index-ordered probe of runs_due per agent (a single `agent = ANY(...)` scan would
    -- read and sort every due run of those agents on every claim), then the oldest overall.
    SELECT d.run_id, NULL::text AS previous_owner, NULL::timestamptz AS previous_lease_until,
           false AS exhausted
    FROM unnest($2::text[]) AS a(agent)
    CROSS JOIN LATERAL (
        SELECT run_id, available_at
        FROM runs
        WHERE $6::text IS NULL AND state IN ('queued', 'waiting') AND agent = a.agent
          AND available_at <= clock_timestamp()
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
           state = 'running' AND attempt >= max_attempts AS exhausted
    FROM runs
    WHERE run_id = $6::text
      AND ((state IN ('queued', 'waiting') AND available_at <= clock_timestamp())
           OR (state = 'running' AND lease_until < clock_timestamp()))
    FOR UPDATE SKIP LOCKED
), picked AS (
    SELECT *
    FROM (SELECT * FROM expired UNION ALL SELECT * FROM due UNION ALL SELECT * FROM named)
        AS candidates
    LIMIT $3
), claimed AS (
    UPDATE runs AS r
    SET state = 'running', lease_owner = $1,
        lease_until = clock_timestamp() + make_interval(secs => $4),
        fence = r.fence + 1, attempt = r.attempt + 1, updated_at = clock_timestamp()
    FROM picked AS p
    WHERE r.run_id = p.run_id AND NOT p.exhausted
    RETURNING r.run_id, r.agent, r.input, r.fence, r.lease_until, r.attempt, r.max_attempts,
              r.step, r.checkpoint, r.checkpoint_version, p.previous_owner,
              p.previous_lease_until, clock_timestamp() AS claimed_at
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
    RETURNING r.run_id, r.fence, r.attempt, p.previous_owner, p.previous_lease_until
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
)
SELECT 'claimed' AS outcome, run_id, agent, input, fence, lease_until, attempt, max_attempts, step,
       checkpoint, checkpoint_version, previous_owner, previous_lease_until, claimed_at
FROM claimed
UNION ALL
SELECT 'dead_lettered', run_id, NULL, NULL, fence, NULL, attempt, NULL, NULL, NULL, NULL,
       previous_owner, previous_lease_until, NULL
FROM dead

-- renew_lease --
-- params: $1 run_id text, $2 worker_id text, $3 fence bigint, $4 lease_seconds float8
-- Extend one lease by $4 seconds, only for the same owner ($2) and fence ($3) of a running run
-- whose lease has not yet expired: a renewal must never revive an owner that was replaced.
UPDATE runs
SET lease_until = clock_timestamp() + make_interval(secs => $4), updated_at = clock_timestamp()
WHERE run_id = $1 AND lease_owner = $2 AND fence = $3 AND state = 'running'
  AND lease_until > clock_timestamp()
RETURNING run_id, lease_until

-- renew_leases --
-- params: $1 run_ids text[], $2 fences bigint[], $3 lease_seconds float8[], $4 worker_id text
-- Extend many leases of owner $4 in one statement: $1 run ids, $2 their fences, $3 their lease
-- seconds. Each run's own owner, fence, running state and expiry conditions are checked (see
-- BATCHED WRITES); the rows returned are the leases that held.
WITH batch AS MATERIALIZED (
    SELECT l.run_id, l.fence, l.lease_seconds, $4::text AS owner, clock_timestamp() AS now
    FROM unnest($1::text[], $2::bigint[], $3::float8[]) AS l(run_id, fence, lease_seconds)
)
UPDATE runs AS r
SET lease_until = clock_timestamp() + make_interval(secs => l.lease_seconds),
    updated_at = clock_timestamp()
FROM batch AS l
WHERE r.run_id = ANY($1::text[]) AND r.run_id = l.run_id AND r.lease_owner = l.owner
  AND r.fence = l.fence AND r.lease_until > l.now
RETURNING r.run_id, r.lease_until

-- commit_step --
-- params: $1 run_id text, $2 worker_id text, $3 fence bigint, $4 expected_version bigint,
--         $5 next_step text, $6 checkpoint jsonb, $7 events jsonb
-- Commit a step: next step $5, checkpoint $6, checkpoint version + 1, and the events $7 (a JSON
-- array of {kind, details}), only while worker $2 still owns run $1 with fence $3, the lease is
-- unexpired and the stored checkpoint version is still $4. No row returned: nothing committed.
-- The attempt counter restarts at 1: attempts count claims since the last committed progress.
WITH committed AS (
    UPDATE runs
    SET step = $5, checkpoint = $6, checkpoint_version = checkpoint_version + 1, attempt = 1,
        updated_at = clock_timestamp()
    WHERE run_id = $1 AND lease_owner = $2 AND fence = $3 AND state = 'running'
      AND lease_until > clock_timestamp() AND checkpoint_version = $4
    RETURNING run_id, fence, checkpoint_version, lease_until
), logged AS (
    INSERT INTO run_events (run_id, kind, fence, worker_id, details)
    SELECT c.run_id, e.kind, c.fence, $2, e.details
    FROM committed AS c, jsonb_to_recordset($7::jsonb) AS e(kind text, details jsonb)
)
SELECT checkpoint_version, lease_until FROM committed

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
    WHERE run_id = $1 AND lease_owner = $2 AND fence = $3 AND state = 'running'
      AND lease_until > clock_timestamp()
    RETURNING run_id, fence, state, attempt, max_attempts, available_at, agent
), logged AS (
    INSERT INTO run_events (run_id, kind, fence, worker_id, details)
    SELECT run_id, CASE WHEN state = 'dead' THEN 'dead_lettered' ELSE 'retry_scheduled' END,
           fence, $2,
           jsonb_build_object('error', $4::jsonb, 'attempt', attempt,
                              'max_attempts', max_attempts, 'retry_at',
                              CASE WHEN state = 'waiting' THEN available_at END)
    FROM failed
)
SELECT state, available_at, attempt FROM failed

-- release_lease --
-- params: $1 run_id text, $2 worker_id text, $3 fence bigint, $4 reason text
-- Give a run back on graceful shutdown: queued again at once, fence unchanged, and the attempt
-- not counted (the run did not fail; its worker is leaving). Only the current, unexpired owner.
WITH released AS (
    UPDATE runs
    SET state = 'queued', lease_owner = NULL, lease_until = NULL,
        attempt = greatest(attempt - 1, 0), available_at = clock_timestamp(),
        updated_at = clock_timestamp()
    WHERE run_id = $1 AND lease_owner = $2 AND fence = $3 AND state = 'running'
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
-- params: $1 run_id text, $2 reason text
-- Cancel a run that has not finished: state cancelled, fence + 1 (so the owner's renewals,
-- commits and effect requests with the old fence are all rejected, at the boundary too), lease
-- cleared, undispatched effects withdrawn, the owner told through NOTIFY. Returns no row when
-- the run is already finished or does not exist.
WITH target AS (
    SELECT run_id, state AS previous_state, lease_owner AS previous_owner
    FROM runs
    WHERE run_id = $1 AND state IN ('queued', 'running', 'waiting')
    FOR UPDATE
), cancelled AS (
    UPDATE runs AS r
    SET state = 'cancelled', fence = r.fence + 1, lease_owner = NULL, lease_until = NULL,
        updated_at = clock_timestamp(), finished_at = clock_timestamp()
    FROM target AS t
    WHERE r.run_id = t.run_id
    RETURNING r.run_id, r.fence, t.previous_state, t.previous_owner
), logged AS (
    INSERT INTO run_events (run_id, kind, fence, details)
    SELECT run_id, 'cancelled', fence,
           jsonb_build_object('previous_state', previous_state, 'previous_owner', previous_owner,
                              'reason', $2::text)
    FROM cancelled
), fenced AS (
    -- The effect boundary learns the new fence too: the old owner's requests are now stale.
    INSERT INTO effect_fences (run_id, fence)
    SELECT run_id, fence FROM cancelled
    ON CONFLICT (run_id) DO UPDATE
    SET fence = greatest(effect_fences.fence, EXCLUDED.fence), updated_at = clock_timestamp()
), withdrawn AS (
    -- Accepted effects not yet handed to a vendor are withdrawn: nobody will send them now.
    UPDATE effects AS e
    SET status = 'rejected', settled_at = clock_timestamp(), updated_at = clock_timestamp(),
        error = jsonb_build_object('type', 'RunCancelled',
                                   'message', 'the run was cancelled before this was sent')
    FROM cancelled AS c
    WHERE e.run_id = c.run_id AND e.status = 'accepted'
), told AS (
    SELECT pg_notify('orchestrator_cancel', run_id) FROM cancelled
)
SELECT run_id, fence, previous_state, previous_owner, (SELECT count(*) FROM told) AS notified
FROM cancelled

-- requeue_dead --
-- params: $1 run_id text
-- Put a dead-lettered run back in the queue with a fresh set of attempts.
WITH requeued AS (
    UPDATE runs
    SET state = 'queued', attempt = 0, available_at = clock_timestamp(), finished_at = NULL,
        updated_at = clock_timestamp()
    WHERE run_id = $1 AND state = 'dead'
    RETURNING run_id, fence, agent, error
), logged AS (
    INSERT INTO run_events (run_id, kind, fence, details)
    SELECT run_id, 'requeued', fence, jsonb_build_object('previous_error', error) FROM requeued
), woken AS (
    SELECT pg_notify('orchestrator_runs', agent) FROM requeued
)
SELECT run_id, (SELECT count(*) FROM woken) AS notified FROM requeued

-- record_event --
-- params: $1 run_id text, $2 kind text, $3 fence bigint, $4 worker_id text, $5 details jsonb
-- Append one event. Safe for any worker, even one that lost its lease: it changes no run state.
INSERT INTO run_events (run_id, kind, fence, worker_id, details)
VALUES ($1, $2, $3, $4, $5)
RETURNING event_id

-- list_runs --
-- params: $1 state text (NULL: any), $2 agent text (NULL: any), $3 limit int
-- Runs, newest first, optionally filtered by state and agent. "Newest" is submission order: each
-- run's "submitted" event, written with the run (see migration 0004: there is no index on
-- runs.created_at, which every claim and finish would have had to write).
SELECT r.* FROM run_events AS e JOIN runs AS r ON r.run_id = e.run_id
WHERE e.kind = 'submitted'
  AND ($1::text IS NULL OR r.state = $1) AND ($2::text IS NULL OR r.agent = $2)
ORDER BY e.event_id DESC
LIMIT $3

-- run_events --
-- params: $1 run_id text
-- The timeline of one run, oldest first.
SELECT event_id, run_id, at, kind, fence, worker_id, details
FROM run_events
WHERE run_id = $1
ORDER BY event_id

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
-- params: $1 worker_id text, $2 session_key int, $3 host text, $4 pid int, $5 agents text[]
-- Record a live worker: id $1, liveness key $2, host $3, pid $4, agents $5, under this server
-- instance (a worker registers again, with a new key, when its liveness session was lost).
INSERT INTO workers (worker_id, session_key, host, pid, agents, server_started_at)
VALUES ($1, $2, $3, $4, $5, pg_postmaster_start_time())
ON CONFLICT (worker_id) DO UPDATE
SET session_key = EXCLUDED.session_key, host = EXCLUDED.host, pid = EXCLUDED.pid,
    agents = EXCLUDED.agents, started_at = clock_timestamp(),
    server_started_at = EXCLUDED.server_started_at

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


-- commit_steps --
-- params: $1 worker_id text, $2 run_ids text[], $3 fences bigint[],
--         $4 expected_versions bigint[], $5 next_steps text[], $6 checkpoints text[] (JSON),
--         $7 events text[] (JSON arrays)
-- Group commit: commit_step for many runs of owner $1 in one statement. Arrays: $2 run ids,
-- $3 fences, $4 expected checkpoint versions, $5 next steps, $6 checkpoints, $7 events (each a
-- JSON array of {kind, details}). JSON arrays travel as text and are cast here: a JSON list
-- inside a jsonb[] parameter would be read as another array dimension. Each run's own owner,
-- fence, running state, expiry and version conditions are checked (see BATCHED WRITES); the
-- rows returned are the runs whose commit took effect.
WITH input AS MATERIALIZED (
    SELECT u.run_id, u.fence, u.expected_version, u.next_step, u.checkpoint::jsonb AS checkpoint,
           u.events::jsonb AS events, $1::text AS owner, clock_timestamp() AS now
    FROM unnest($2::text[], $3::bigint[], $4::bigint[], $5::text[], $6::text[], $7::text[])
        AS u(run_id, fence, expected_version, next_step, checkpoint, events)
), committed AS (
    UPDATE runs AS r
    SET step = u.next_step, checkpoint = u.checkpoint,
        checkpoint_version = r.checkpoint_version + 1, attempt = 1,
        updated_at = clock_timestamp()
    FROM input AS u
    WHERE r.run_id = ANY($2::text[]) AND r.run_id = u.run_id AND r.lease_owner = u.owner
      AND r.fence = u.fence AND r.lease_until > u.now
      AND r.checkpoint_version = u.expected_version
    RETURNING r.run_id, r.fence, r.checkpoint_version, r.lease_until, u.events
), logged AS (
    INSERT INTO run_events (run_id, kind, fence, worker_id, details)
    SELECT c.run_id, e.kind, c.fence, $1, e.details
    FROM committed AS c, jsonb_to_recordset(c.events) AS e(kind text, details jsonb)
)
SELECT run_id, checkpoint_version, lease_until FROM committed

-- finish_runs --
-- params: $1 worker_id text, $2 run_ids text[], $3 fences bigint[],
--         $4 expected_versions bigint[], $5 states text[], $6 results text[] (JSON),
--         $7 errors text[] (JSON), $8 checkpoints text[] (JSON)
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
           u.error::jsonb AS error, u.checkpoint::jsonb AS checkpoint, $1::text AS owner,
           clock_timestamp() AS now
    FROM unnest($2::text[], $3::bigint[], $4::bigint[], $5::text[], $6::text[], $7::text[],
                $8::text[])
        AS u(run_id, fence, expected_version, state, result, error, checkpoint)
), finished AS (
    UPDATE runs AS r
    SET state = CASE WHEN u.state IN ('succeeded', 'failed') THEN u.state END,
        result = u.result, error = u.error,
        checkpoint = coalesce(u.checkpoint, r.checkpoint),
        checkpoint_version = r.checkpoint_version + 1, lease_owner = NULL, lease_until = NULL,
        updated_at = clock_timestamp(), finished_at = clock_timestamp()
    FROM input AS u
    WHERE r.run_id = ANY($2::text[]) AND r.run_id = u.run_id AND r.lease_owner = u.owner
      AND r.fence = u.fence AND r.lease_until > u.now
      AND r.checkpoint_version = u.expected_version
    RETURNING r.run_id, r.fence, r.state, r.checkpoint_version, u.error
), logged AS (
    INSERT INTO run_events (run_id, kind, fence, worker_id, details)
    SELECT f.run_id, f.state, f.fence, $1,
           jsonb_build_object('version', f.checkpoint_version)
           || CASE WHEN f.error IS NULL THEN '{}'::jsonb
                   ELSE jsonb_build_object('error', f.error) END
    FROM finished AS f
)
SELECT run_id FROM finished

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
--         $6 payload jsonb, $7 idempotency_key text, $8 worker_id text
-- The boundary's rule for one effect request (see orchestrator_accept_effect in migration 0003).
SELECT outcome, accepted_fence, status, run_state, run_fence
FROM orchestrator_accept_effect($1, $2, $3, $4, $5, $6, $7, $8)

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
-- params: $1 dispatcher_id text, $2 kinds text[], $3 limit int, $4 lease_seconds float8
-- A dispatcher ($1) claims up to $3 effects of the kinds $2 it has vendors for, with its own
-- lease of $4 seconds: new or uncertain effects that are due, and dispatches whose dispatcher
-- lease expired (that dispatcher may have died after the vendor accepted). previous_status and
-- ever_dispatched tell the dispatcher whether it may send, or must reconcile first.
WITH picked AS (
    SELECT run_id, effect_key, status AS previous_status, ever_dispatched AS sent_before
    FROM effects
    WHERE kind = ANY($2::text[])
      AND ((status IN ('accepted', 'uncertain') AND available_at <= clock_timestamp())
           OR (status = 'dispatching' AND dispatcher_until < clock_timestamp()))
    ORDER BY available_at
    LIMIT $3
    FOR UPDATE SKIP LOCKED
)
UPDATE effects AS e
SET status = 'dispatching', dispatcher = $1,
    dispatcher_until = clock_timestamp() + make_interval(secs => $4),
    attempts = e.attempts + 1, ever_dispatched = true, updated_at = clock_timestamp()
FROM picked AS p
WHERE e.run_id = p.run_id AND e.effect_key = p.effect_key
RETURNING e.*, p.previous_status, p.sent_before

-- effect_may_dispatch --
-- params: $1 run_id text, $2 effect_key text, $3 dispatcher_id text, $4 fence bigint
-- The re-check right before a vendor call: the effect is still dispatching under this
-- dispatcher ($3) with the fence it claimed ($4) and an unexpired dispatcher lease, and its
-- run has not been cancelled.
SELECT e.status = 'dispatching' AND e.dispatcher = $3 AND e.fence = $4
       AND e.dispatcher_until > clock_timestamp() AS dispatcher_ok,
       coalesce(r.state, '') <> 'cancelled' AS run_ok
FROM effects AS e
LEFT JOIN runs AS r ON r.run_id = e.run_id
WHERE e.run_id = $1 AND e.effect_key = $2

-- settle_effect --
-- params: $1 run_id text, $2 effect_key text, $3 dispatcher_id text, $4 status text,
--         $5 external_id text, $6 result jsonb, $7 error jsonb, $8 retry_after_seconds float8
-- Record what happened at the vendor, only if dispatcher $3 still holds the effect: status $4
-- (confirmed, failed, uncertain, parked, rejected or accepted for a later retry), external id
-- $5, result $6, error $7, next attempt not before $8 seconds from now. Logs the event and
-- wakes the run's step that may be waiting for the outcome.
WITH settled AS (
    UPDATE effects
    SET status = $4, external_id = coalesce($5, external_id), result = $6, error = $7,
        dispatcher = NULL, dispatcher_until = NULL, updated_at = clock_timestamp(),
        available_at = clock_timestamp() + make_interval(secs => $8),
        settled_at = CASE WHEN $4 IN ('confirmed', 'failed', 'rejected')
                          THEN clock_timestamp() END
    WHERE run_id = $1 AND effect_key = $2 AND dispatcher = $3 AND status = 'dispatching'
    RETURNING run_id, effect_key, fence, status, external_id, attempts, kind
), logged AS (
    INSERT INTO run_events (run_id, kind, fence, worker_id, details)
    SELECT run_id, 'effect_' || status, fence, $3,
           jsonb_build_object('effect_key', effect_key, 'external_id', external_id,
                              'attempt', attempts, 'error', $7::jsonb)
    FROM settled
    WHERE EXISTS (SELECT 1 FROM runs WHERE runs.run_id = settled.run_id)
), told AS (
    SELECT pg_notify('orchestrator_effects', run_id) FROM settled
)
SELECT status, (SELECT count(*) FROM told) AS notified FROM settled

-- resolve_parked_effect --
-- params: $1 run_id text, $2 effect_key text, $3 decision text, $4 external_id text
-- A person decided a parked effect: $3 'confirmed' (it was sent; external id $4) or 'accepted'
-- (it was not sent: send it again with the same idempotency key).
WITH resolved AS (
    UPDATE effects
    SET status = $3, external_id = coalesce($4, external_id), updated_at = clock_timestamp(),
        available_at = clock_timestamp(),
        settled_at = CASE WHEN $3 = 'confirmed' THEN clock_timestamp() END,
        result = CASE WHEN $3 = 'confirmed' THEN jsonb_build_object('resolved_by', 'operator')
                      ELSE result END
    WHERE run_id = $1 AND effect_key = $2 AND status = 'parked'
    RETURNING run_id, effect_key, fence, status, kind
), logged AS (
    INSERT INTO run_events (run_id, kind, fence, details)
    SELECT run_id, 'effect_resolved', fence,
           jsonb_build_object('effect_key', effect_key, 'decision', status)
    FROM resolved
), told AS (
    SELECT pg_notify('orchestrator_effects', run_id) FROM resolved
    UNION ALL
    SELECT pg_notify('orchestrator_effects_due', kind) FROM resolved WHERE status = 'accepted'
)
SELECT status, (SELECT count(*) FROM told) AS notified FROM resolved

-- served_agents --
-- params: none
-- The agents that live workers serve right now.
SELECT DISTINCT unnest(agents) AS agent FROM workers ORDER BY 1
