-- What a dispatcher (and a client that waits for a standby) needs to know of the primary's
-- streaming standbys: where the WAL ends now, and how far the physical standbys have flushed and
-- replayed it (docs/high-availability.md).
--
-- pg_stat_replication shows those positions only to superusers and members of
-- pg_read_all_stats; this function shows the positions alone, as the schema owner, so that no
-- orchestrator role needs pg_read_all_stats (which would also show every session's query).
-- Logical walsenders (a CDC consumer cannot be promoted) are left out; a physical slot nobody
-- streams from is a standby that is away. During recovery there is no WAL end to wait for.
--
-- wal_end is what a caller waits for after its own commits: the end of the WAL flushed so far,
-- which holds every commit flushed before the call; in a session with synchronous_commit off a
-- commit may not be flushed yet, so there it is the end of the WAL inserted so far, which the WAL
-- writer flushes within wal_writer_delay. wal_flushed is the former alone, for a caller whose
-- commit was flushed (the dispatcher flushes its claim): WAL that nobody flushes at once (a
-- page pruned by a read) would otherwise keep it waiting for the WAL writer.
CREATE FUNCTION orchestrator_standby_positions(
    OUT wal_end pg_lsn,
    OUT wal_flushed pg_lsn,
    OUT in_recovery boolean,
    OUT physical_slots integer,
    OUT idle_slots integer,
    OUT standbys integer,
    OUT hidden integer,
    OUT least_flushed pg_lsn,
    OUT most_flushed pg_lsn,
    OUT least_replayed pg_lsn,
    OUT most_replayed pg_lsn
) LANGUAGE sql VOLATILE SECURITY DEFINER SET search_path FROM CURRENT AS $$
WITH physical AS (
    SELECT r.flush_lsn, r.replay_lsn
    FROM pg_catalog.pg_stat_replication AS r
    WHERE r.state IN ('streaming', 'catchup')
      AND NOT EXISTS (
          SELECT FROM pg_catalog.pg_replication_slots AS s
          WHERE s.active_pid = r.pid AND s.slot_type = 'logical'
      )
), slots AS (
    SELECT count(*)::integer AS physical_slots,
           count(*) FILTER (WHERE NOT active)::integer AS idle_slots
    FROM pg_catalog.pg_replication_slots
    WHERE slot_type = 'physical'
)
SELECT CASE WHEN pg_catalog.pg_is_in_recovery() THEN NULL
            WHEN pg_catalog.current_setting('synchronous_commit') = 'off'
                THEN pg_catalog.pg_current_wal_insert_lsn()
            ELSE pg_catalog.pg_current_wal_flush_lsn() END,
       CASE WHEN NOT pg_catalog.pg_is_in_recovery()
            THEN pg_catalog.pg_current_wal_flush_lsn() END,
       pg_catalog.pg_is_in_recovery(),
       (SELECT physical_slots FROM slots),
       (SELECT idle_slots FROM slots),
       count(*) FILTER (WHERE flush_lsn IS NOT NULL)::integer,
       count(*) FILTER (WHERE flush_lsn IS NULL)::integer,
       min(flush_lsn), max(flush_lsn), min(replay_lsn), max(replay_lsn)
FROM physical
$$;
REVOKE ALL ON FUNCTION orchestrator_standby_positions() FROM PUBLIC;
