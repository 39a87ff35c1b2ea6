-- A wait sees the signals it names whatever else is pending, and a run cannot re-claim itself in
-- a loop. run_signals_unconsumed finds a run's unconsumed signals of given names in order (the
-- claim hands a woken run the signals it waits for first; parking asks whether one is there)
-- without reading the other signals ahead of them. runs.wake_streak counts the run's consecutive
-- parks that were due at once although its step was given no signal: past a few, park_runs backs
-- the run off instead of making it due again now.
CREATE INDEX run_signals_unconsumed ON run_signals (run_id, name, seq) WHERE consumed_at IS NULL;

ALTER TABLE runs ADD COLUMN wake_streak integer NOT NULL DEFAULT 0
    CONSTRAINT runs_wake_streak_check CHECK (wake_streak >= 0);
