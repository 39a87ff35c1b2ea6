-- Versioned agents (docs/upgrades.md): which version of an agent's code started a run and wrote
-- its latest checkpoint, and the versions each worker serves. A claim hands a run only to a
-- worker that serves the version its checkpoint was written under, or declares an upgrade from
-- it; the upgraded checkpoint is committed, fenced, by the claim's first commit.
--
-- Expand only: a previous release's workers neither read nor write these columns, and claim as
-- they did.

ALTER TABLE runs
    ADD COLUMN started_version text,
    ADD COLUMN agent_version text,
    ADD CONSTRAINT runs_started_version_check
        CHECK (started_version IS NULL OR length(started_version) BETWEEN 1 AND 64),
    ADD CONSTRAINT runs_agent_version_check
        CHECK (agent_version IS NULL OR length(agent_version) BETWEEN 1 AND 64);

-- Per agent served: [its version, then the versions it upgrades from].
ALTER TABLE workers ADD COLUMN agent_versions jsonb;
