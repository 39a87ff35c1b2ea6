-- What `orchestrator db grant` grants (docs/database-roles.md has the matrix and the reasons).
-- A template: {schema}, {worker}, {dispatcher}, {proxy} and {console} are replaced by quoted
-- identifiers (orchestrator.db.grants); the migrator role owns the schema and needs no grant.
-- Run in one transaction after every `orchestrator db migrate`: each run first revokes
-- everything the four roles hold in the schema, so a rerun converges on exactly this.

-- Start from nothing.
REVOKE ALL ON ALL TABLES IN SCHEMA {schema} FROM {worker}, {dispatcher}, {proxy}, {console};
REVOKE ALL ON ALL SEQUENCES IN SCHEMA {schema} FROM {worker}, {dispatcher}, {proxy}, {console};
REVOKE ALL ON ALL FUNCTIONS IN SCHEMA {schema} FROM {worker}, {dispatcher}, {proxy}, {console};
REVOKE ALL ON SCHEMA {schema} FROM {worker}, {dispatcher}, {proxy}, {console};

-- Every role finds the schema and checks its version before it starts.
GRANT USAGE ON SCHEMA {schema} TO {worker}, {dispatcher}, {proxy}, {console};
GRANT SELECT ON {schema}.orchestrator_schema_migrations
    TO {worker}, {dispatcher}, {proxy}, {console};

-- WORKER (`orchestrator serve`): claims, renews, commits and finishes runs (the fence only as a
-- claim moves it: trigger runs_fence_guard), records its steps' events, transcript and trace
-- contexts, consumes signals, reserves and settles budgets, registers itself. Effects only
-- through the boundary's rule (orchestrator_accept_effect); no write on effects at all, so it
-- can neither approve one nor rewrite a payload. Its chores (approval expiry, retention) are
-- definer functions too.
GRANT SELECT ON {schema}.runs, {schema}.run_events, {schema}.run_messages, {schema}.run_traces,
    {schema}.run_signals, {schema}.effects, {schema}.run_budgets, {schema}.budget_ledger,
    {schema}.workers
    TO {worker};
GRANT UPDATE (state, lease_owner, lease_until, fence, attempt, available_at, step, checkpoint,
              checkpoint_version, result, error, wait, wake_streak, signals_pending, updated_at,
              finished_at)
    ON {schema}.runs TO {worker};
GRANT INSERT ON {schema}.run_events, {schema}.run_messages, {schema}.run_traces,
    {schema}.budget_ledger
    TO {worker};
GRANT UPDATE (consumed_at, consumed_fence) ON {schema}.run_signals TO {worker};
GRANT INSERT (run_id, turns_limit, tool_calls_limit, input_tokens_limit, output_tokens_limit,
              cost_limit),
      UPDATE (turns_spent, tool_calls_spent, input_tokens_spent, output_tokens_spent, cost_spent,
              turns_reserved, input_tokens_reserved, output_tokens_reserved, cost_reserved,
              reserved_fence, updated_at)
    ON {schema}.run_budgets TO {worker};
GRANT INSERT, UPDATE, DELETE ON {schema}.workers TO {worker};
GRANT USAGE ON SEQUENCE {schema}.worker_session_keys TO {worker};
GRANT EXECUTE ON FUNCTION
    {schema}.orchestrator_accept_effect(text, text, bigint, text, text, jsonb, text, text,
                                        boolean, double precision),
    {schema}.orchestrator_expire_approvals(integer),
    {schema}.orchestrator_purge_finished(timestamptz, integer),
    {schema}.audit_append(text, text, text, text, text, jsonb)
    TO {worker};

-- DISPATCHER (`orchestrator effects dispatch`): claims due effects under its own lease,
-- re-checks them, settles them and wakes their runs. Of a run it sees only what waking needs
-- (never the input, checkpoint or result); of an effect it may not change the payload, fence or
-- approval.
GRANT SELECT ON {schema}.effects TO {dispatcher};
GRANT UPDATE (status, dispatcher, dispatcher_until, attempts, ever_dispatched, lookup_first,
              known_epoch, external_id, result, error, available_at, settled_at, updated_at)
    ON {schema}.effects TO {dispatcher};
GRANT SELECT (run_id, agent, state, wait, available_at) ON {schema}.runs TO {dispatcher};
GRANT UPDATE (available_at) ON {schema}.runs TO {dispatcher};
GRANT INSERT ON {schema}.run_events TO {dispatcher};
GRANT SELECT (run_id, fence, traceparent) ON {schema}.run_traces TO {dispatcher};

-- PROXY (`orchestrator effects serve`): the boundary's rule and the effect records it answers
-- with; services' tokens (by hash: who, their scope, whether they still work) and a run's agent,
-- which a scoped token is held to. Nothing else of runs (input, checkpoint, result), no
-- transcripts, signals, budgets or audit rows.
GRANT SELECT ON {schema}.effects TO {proxy};
GRANT SELECT (run_id, agent) ON {schema}.runs TO {proxy};
GRANT SELECT (token_id, principal, sha256, scope, expires_at, revoked_at, last_used_at),
      UPDATE (last_used_at)
    ON {schema}.access_tokens TO {proxy};
GRANT SELECT (name, kind, role, disabled_at) ON {schema}.principals TO {proxy};
GRANT EXECUTE ON FUNCTION
    {schema}.orchestrator_accept_effect(text, text, bigint, text, text, jsonb, text, text,
                                        boolean, double precision)
    TO {proxy};

-- CONSOLE (`orchestrator console`, and applications' clients): reads everything (token hashes
-- too: it authenticates tokens by them); submits and watches runs, sends signals, decides
-- approvals and parked effects, tops up budgets, cancels (orchestrator_cancel_run) and audits.
-- It holds no lease column, so it cannot claim, renew or commit a run.
GRANT SELECT ON {schema}.runs, {schema}.run_events, {schema}.run_messages, {schema}.run_traces,
    {schema}.run_signals, {schema}.effects, {schema}.run_budgets, {schema}.budget_ledger,
    {schema}.workers, {schema}.principals, {schema}.access_tokens, {schema}.audit_log
    TO {console};
GRANT INSERT (run_id, agent, input, max_attempts, idempotency_key, available_at),
      UPDATE (available_at, signals_pending, watched, updated_at)
    ON {schema}.runs TO {console};
GRANT INSERT ON {schema}.run_events, {schema}.run_traces, {schema}.budget_ledger TO {console};
GRANT INSERT (run_id, name, data, idempotency_key) ON {schema}.run_signals TO {console};
GRANT UPDATE (status, approved_sha256, decided_by, decided_at, decision_note, external_id,
              result, error, available_at, settled_at, updated_at)
    ON {schema}.effects TO {console};
GRANT UPDATE (turns_limit, tool_calls_limit, input_tokens_limit, output_tokens_limit, cost_limit,
              updated_at)
    ON {schema}.run_budgets TO {console};
GRANT UPDATE (last_used_at) ON {schema}.access_tokens TO {console};
-- Accounts mode with --oidc-group: a sign-in adds the person, or changes their role, from the
-- provider's groups (audited). Tokens stay the admin's: the console cannot create or revoke one.
GRANT INSERT (name, kind, role, created_by), UPDATE (kind, role, updated_at, disabled_at)
    ON {schema}.principals TO {console};
GRANT EXECUTE ON FUNCTION
    {schema}.orchestrator_cancel_run(text, text, text),
    {schema}.audit_append(text, text, text, text, text, jsonb)
    TO {console};
