-- Worker liveness for dead-session takeover.
--
-- Each `serve` process registers here and holds a session-level advisory lock keyed by its
-- session_key on a dedicated connection for as long as it lives. PostgreSQL frees that lock the
-- moment the process's socket closes (a killed process), so "the owner's lock is gone" proves the
-- owner is dead, and its runs may be taken over before lease_until. A paused or partitioned owner
-- keeps its session and lock: its lease is honoured until it expires.

CREATE SEQUENCE worker_session_keys AS integer CYCLE;

CREATE TABLE workers (
    worker_id     text        PRIMARY KEY,
    session_key   integer     NOT NULL UNIQUE,
    host          text        NOT NULL,
    pid           integer     NOT NULL,
    agents        text[]      NOT NULL,
    started_at    timestamptz NOT NULL DEFAULT clock_timestamp()
);

-- The reaper looks up running runs by owner. lease_owner changes only on claim, cancel, finish
-- and release, never on renewal, so this index keeps renewals HOT.
CREATE INDEX runs_owner ON runs (lease_owner) WHERE state = 'running';
