-- A worker's last renewal, kept on its own row.
--
-- `workers list` read it from the runs the worker held at that moment, so a worker between runs,
-- or whose runs had all finished or gone to wait, showed none although it had renewed a second
-- before. The renewal statements now stamp it, once per statement (not per lease).

ALTER TABLE workers ADD COLUMN last_renewal_at timestamptz;
