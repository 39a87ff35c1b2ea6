-- Everything lives in a schema of its own (ORCHESTRATOR_SCHEMA, default orchestrator), so that
-- orchestrator can share an application's database without its runs, workers and effects
-- tables colliding with the application's. A database of an earlier release kept its objects in
-- public: orchestrator.db.migrations moved them here, with the version table and its history,
-- in the transaction just before this migration. Every connection sets search_path to the
-- schema; the boundary's function now resolves its tables there whatever its caller's is.

ALTER FUNCTION orchestrator_accept_effect(text, text, bigint, text, text, jsonb, text, text)
    SET search_path FROM CURRENT;
