-- Retention and operations.
--
-- Finished runs older than a cutoff are deleted in small batches (by workers, and by
-- `orchestrator runs purge`). runs_finished finds them oldest first without reading live runs;
-- it holds only finished runs, so claims and step commits never touch it (a run enters it once,
-- in its final commit).
CREATE INDEX runs_finished ON runs (finished_at)
    WHERE state IN ('succeeded', 'failed', 'cancelled', 'dead');

-- Effects parked for a person, counted by the metrics' gauges without reading every effect.
CREATE INDEX effects_parked ON effects (run_id) WHERE status = 'parked';
