-- Runs, their append-only timeline, and the schema version table.
--
-- Renewals are the hottest write: they touch only lease_until and updated_at, neither of which is
-- in any index (or index predicate), and the table keeps 30% free space per page, so a renewal is
-- a HOT update that writes no index entries. Expired leases are found through runs_running, a
-- small partial index over the running set, never through an index on lease_until.

CREATE TABLE runs (
    run_id             text        PRIMARY KEY,
    agent              text        NOT NULL,
    state              text        NOT NULL DEFAULT 'queued'
        CHECK (state IN ('queued', 'running', 'waiting', 'succeeded', 'failed', 'cancelled', 'dead')),
    input              jsonb       NOT NULL,
    fence              bigint      NOT NULL DEFAULT 0 CHECK (fence >= 0),
    lease_owner        text,
    lease_until        timestamptz,
    attempt            integer     NOT NULL DEFAULT 0 CHECK (attempt >= 0),
    max_attempts       integer     NOT NULL DEFAULT 5 CHECK (max_attempts >= 1),
    available_at       timestamptz NOT NULL DEFAULT clock_timestamp(),
    step               text,
    checkpoint         jsonb,
    checkpoint_version bigint      NOT NULL DEFAULT 0,
    result             jsonb,
    error              jsonb,
    idempotency_key    text        UNIQUE,
    created_at         timestamptz NOT NULL DEFAULT clock_timestamp(),
    updated_at         timestamptz NOT NULL DEFAULT clock_timestamp(),
    finished_at        timestamptz,
    CONSTRAINT runs_lease_matches_state CHECK (
        (state = 'running') = (lease_owner IS NOT NULL AND lease_until IS NOT NULL)
    )
) WITH (fillfactor = 70);

-- Claim path 1: runs that are due (queued, or waiting for a retry/backoff).
CREATE INDEX runs_due ON runs (agent, available_at) WHERE state IN ('queued', 'waiting');
-- Claim path 2: running runs whose lease may have expired. Small: only the running set.
CREATE INDEX runs_running ON runs (agent) WHERE state = 'running';
-- Listing newest first.
CREATE INDEX runs_created ON runs (created_at);

CREATE TABLE run_events (
    event_id   bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    run_id     text        NOT NULL REFERENCES runs (run_id) ON DELETE CASCADE,
    at         timestamptz NOT NULL DEFAULT clock_timestamp(),
    kind       text        NOT NULL,
    fence      bigint,
    worker_id  text,
    details    jsonb       NOT NULL DEFAULT '{}'::jsonb
);

CREATE INDEX run_events_run ON run_events (run_id, event_id);
