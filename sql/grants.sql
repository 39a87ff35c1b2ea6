-- What `orchestrator db grant` grants (docs/database-roles.md has the matrix and the reasons).
-- A template: {schema}, {worker}, {dispatcher}, {proxy}, {console} and {client} are replaced by
-- quoted identifiers (orchestrator.db.grants); the migrator role owns the schema and needs no
-- grant. Run in one transaction after every `orchestrator db migrate`: each run first revokes
-- everything the five roles hold in the schema, so a rerun converges on exactly this.
--
-- Decisions (approve, deny, resolve, signal, top-up, cancel, retry), submissions, sign-ins,
-- budget reservations and settlements, and purges are SECURITY DEFINER functions that check who
-- decides and append their own audit row (migration 0019): no role but the owner writes the
-- tables they change directly, and none but the owner may call audit_append.

-- Start from nothing.
REVOKE ALL ON ALL TABLES IN SCHEMA {schema}
    FROM {worker}, {dispatcher}, {proxy}, {console}, {client};
REVOKE ALL ON ALL SEQUENCES IN SCHEMA {schema}
    FROM {worker}, {dispatcher}, {proxy}, {console}, {client};
REVOKE ALL ON ALL FUNCTIONS IN SCHEMA {schema}
    FROM {worker}, {dispatcher}, {proxy}, {console}, {client};
REVOKE ALL ON SCHEMA {schema} FROM {worker}, {dispatcher}, {proxy}, {console}, {client};

-- Every role finds the schema and checks its version before it starts.
GRANT USAGE ON SCHEMA {schema} TO {worker}, {dispatcher}, {proxy}, {console}, {client};
GRANT SELECT ON {schema}.orchestrator_schema_migrations
    TO {worker}, {dispatcher}, {proxy}, {console}, {client};

-- WORKER (`orchestrator serve`): claims, renews, commits and finishes runs (the fence only as a
-- claim moves it: trigger runs_fence_guard), records its steps' events, transcript and trace
-- contexts, consumes signals, registers itself. Effects only through the boundary's rule
-- (orchestrator_accept_effect); no write on effects at all, so it can neither approve one nor
-- rewrite a payload. Budgets only through their reservation and settlement (spent only grows);
-- its chores (approval expiry, a purge of runs finished an hour ago or more, which audits
-- itself) are definer functions too. It appends nothing to the audit trail itself.
GRANT SELECT ON {schema}.runs, {schema}.run_events, {schema}.run_messages, {schema}.run_traces,
    {schema}.run_signals, {schema}.effects, {schema}.run_budgets, {schema}.budget_ledger,
    {schema}.workers, {schema}.flow_limits, {schema}.run_holds, {schema}.rate_limits,
    {schema}.agent_cutovers, {schema}.cutover_drains, {schema}.budget_carves,
    {schema}.run_checkpoints, {schema}.schedules, {schema}.schedule_slots
    TO {worker};
-- A drained run's last commit gives the run back and drops its drain (release_drained).
GRANT DELETE ON {schema}.cutover_drains TO {worker};
GRANT UPDATE (state, lease_owner, lease_until, fence, attempt, available_at, step, checkpoint,
              checkpoint_version, result, error, wait, wake_streak, signals_pending, updated_at,
              finished_at, started_version, agent_version, children_awaited)
    ON {schema}.runs TO {worker};
GRANT INSERT ON {schema}.run_events, {schema}.run_messages, {schema}.run_traces,
    {schema}.run_checkpoints TO {worker};
GRANT UPDATE (consumed_at, consumed_fence) ON {schema}.run_signals TO {worker};
GRANT INSERT, UPDATE, DELETE ON {schema}.workers TO {worker};
GRANT USAGE ON SEQUENCE {schema}.worker_session_keys TO {worker};
GRANT EXECUTE ON FUNCTION
    {schema}.orchestrator_accept_effect(text, text, bigint, text, text, jsonb, text, text,
                                        boolean, double precision),
    {schema}.orchestrator_reserve_budget(text, text, bigint, jsonb, bigint, bigint, bigint,
                                         numeric),
    {schema}.orchestrator_settle_budgets(text[], bigint[], bigint[], bigint[], bigint[],
                                         bigint[], numeric[]),
    {schema}.orchestrator_expire_approvals(integer),
    {schema}.orchestrator_purge_finished(timestamptz, integer),
    {schema}.orchestrator_hold_run(text, text, text, timestamptz),
    {schema}.orchestrator_declare_limits(text, jsonb, text),
    {schema}.orchestrator_spawn_children(text, bigint, text, jsonb),
    {schema}.orchestrator_carve_budgets(text, bigint, text, jsonb, jsonb),
    {schema}.orchestrator_stream_append(text, text, bigint, bigint, jsonb, bigint, bigint)
    TO {worker};
-- Schedules (migration 0030) are claimed and fired by any `serve` process, only through these.
GRANT EXECUTE ON FUNCTION
    {schema}.orchestrator_claim_schedules(text, double precision, integer),
    {schema}.orchestrator_fire_schedule(text, text, bigint, timestamptz[], timestamptz[], text[],
                                        timestamptz, jsonb)
    TO {worker};
-- Rate limits (migration 0022) are taken, settled and paused only through their definer
-- functions, by the workers' model calls and the dispatchers' sends.
GRANT EXECUTE ON FUNCTION
    {schema}.orchestrator_rate_take(text, integer, bigint, text, bigint),
    {schema}.orchestrator_rate_settle(text, bigint),
    {schema}.orchestrator_rate_pause(text, double precision, text)
    TO {worker}, {dispatcher};

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
GRANT SELECT (name) ON {schema}.rate_limits TO {dispatcher};

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

-- CLIENT (applications' `Client`, and the CLI of operators who are not admins): reads runs and
-- what they carry; submits and watches runs; signals, decides approvals and parked effects, tops
-- up budgets, cancels and retries, each through its definer function, recorded as the login
-- that connected (it may not name anyone else). No lease column, no direct write but a run's
-- `watched` flag; nothing of people, tokens or the audit trail.
GRANT SELECT ON {schema}.runs, {schema}.run_events, {schema}.run_messages, {schema}.run_traces,
    {schema}.run_signals, {schema}.effects, {schema}.run_budgets, {schema}.budget_ledger,
    {schema}.workers, {schema}.flow_limits, {schema}.run_holds, {schema}.rate_limits,
    {schema}.agent_cutovers, {schema}.cutover_drains, {schema}.budget_carves,
    {schema}.run_checkpoints, {schema}.schedules, {schema}.schedule_slots
    TO {client}, {console};
GRANT UPDATE (watched) ON {schema}.runs TO {client}, {console};
GRANT EXECUTE ON FUNCTION
    {schema}.orchestrator_submit_run(text, text, jsonb, integer, text, timestamptz, text),
    {schema}.orchestrator_submit_run(text, text, jsonb, integer, text, timestamptz, text, text,
                                     integer),
    {schema}.orchestrator_set_limit(text, text, text, integer, text, text, text),
    {schema}.orchestrator_clear_limit(text, text, text, text, text, text),
    {schema}.orchestrator_set_rate_limit(text, integer, bigint, double precision, text, text,
                                         text),
    {schema}.orchestrator_clear_rate_limit(text, text, text, text),
    {schema}.orchestrator_cutover(text, text, text, text, text),
    {schema}.orchestrator_cutover(text, text, boolean, text, text, text),
    {schema}.orchestrator_fork_run(text, bigint, text, text, text, text),
    {schema}.orchestrator_decide_approval(text, text, text, text, text, bigint, text, text,
                                          text),
    {schema}.orchestrator_resolve_effect(text, text, boolean, text, text, text, text),
    {schema}.orchestrator_send_signal(text, text, jsonb, text, text, text, text),
    {schema}.orchestrator_top_up_budget(text, jsonb, text, text, text),
    {schema}.orchestrator_cancel_run(text, text, text, text, text),
    {schema}.orchestrator_retry_run(text, text, text, text),
    {schema}.orchestrator_create_schedule(text, text, text, text, bigint, text, text, text,
                                          integer, integer, integer, timestamptz, timestamptz,
                                          jsonb, text, integer, integer, timestamptz, text, text,
                                          text),
    {schema}.orchestrator_change_schedule(text, text, timestamptz, text, text, text),
    {schema}.orchestrator_backfill_schedule(text, timestamptz[], text[], text, text, text)
    TO {client}, {console};

-- Live output (migration 0031) is read through its function alone, which retracts what a
-- lost attempt left unfinished before it answers; only a worker appends, under its lease.
GRANT EXECUTE ON FUNCTION {schema}.orchestrator_stream_read(text, bigint, integer)
    TO {client}, {console};

-- CONSOLE (`orchestrator console`): everything the client may, and it vouches for the people it
-- signs in (orchestrator_may_vouch: its decisions name the person, who must be enabled and hold
-- a role that allows the decision). It reads people, token hashes (it authenticates tokens by
-- them) and the audit trail, stamps a token's last use, and records sign-ins through
-- orchestrator_sign_in, which may add a person or change their role from the OpenID provider's
-- groups but never makes an admin, re-enables anyone or touches a service. It cannot add,
-- disable or change people otherwise, nor create or revoke tokens (the admin's, as the owner).
GRANT SELECT ON {schema}.principals, {schema}.access_tokens, {schema}.audit_log TO {console};
GRANT UPDATE (last_used_at) ON {schema}.access_tokens TO {console};
GRANT EXECUTE ON FUNCTION
    {schema}.orchestrator_may_vouch(),
    {schema}.orchestrator_sign_in(text, text, text, text)
    TO {console};

-- Every role that waits for a standby before it acts (a dispatcher before a send, a worker's
-- dispatcher in `serve`, a client or the console before it says a submission or a decision
-- is done) reads the standbys' positions through this function alone (migration 0020).
GRANT EXECUTE ON FUNCTION {schema}.orchestrator_standby_positions()
    TO {worker}, {dispatcher}, {console}, {client};
