-- Worker liveness across a PostgreSQL restart.
--
-- A restart ends every session, so every worker's liveness lock is gone at once, yet the workers
-- are alive and about to reconnect. Judged by the lock alone, the first reaper back ended the
-- leases of every other live worker. Each registration now records the server instance it was
-- made under (pg_postmaster_start_time()): a worker whose lock is gone is dead at once only if it
-- registered with this server instance; one registered under an earlier instance is given a
-- grace period after the server started, to reconnect and register again, before it is judged.

ALTER TABLE workers ADD COLUMN server_started_at timestamptz;
