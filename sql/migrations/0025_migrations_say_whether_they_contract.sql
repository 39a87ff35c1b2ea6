-- Each applied migration says whether it contracts the schema (CONTRIBUTING.md: expand, then
-- contract). A release that finds the schema migrated past what it knows keeps working when
-- none of the newer migrations contracts, so that a rolling upgrade can run it beside the
-- newer release; it refuses the schema when one does.
ALTER TABLE orchestrator_schema_migrations ADD COLUMN contracts boolean NOT NULL DEFAULT false;
