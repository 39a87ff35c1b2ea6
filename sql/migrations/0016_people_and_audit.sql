-- People and services, their tokens, and a tamper-evident audit trail (docs/people.md).
--
-- A decision used to carry a typed name; now it carries the principal the server established
-- (a token's owner, a signed-in person, or the database role a command connected as), and every
-- decision appends a row to audit_log in the decision's own transaction. The log is append-only
-- (a trigger refuses UPDATE, DELETE and TRUNCATE) and each row's sha256 covers the previous
-- row's, so an edit or a deletion a superuser forces past the trigger breaks the chain where
-- `orchestrator audit verify` looks.

CREATE TABLE principals (
    name        text PRIMARY KEY CHECK (name ~ '^[A-Za-z0-9][A-Za-z0-9._@+-]{0,199}$'),
    kind        text NOT NULL CHECK (kind IN ('person', 'service')),
    role        text NOT NULL CHECK (role IN ('viewer', 'approver', 'operator', 'admin')),
    created_at  timestamptz NOT NULL DEFAULT clock_timestamp(),
    created_by  text NOT NULL,
    updated_at  timestamptz NOT NULL DEFAULT clock_timestamp(),
    disabled_at timestamptz
);

-- A token is shown once, as orc_<token_id>_<secret>; only the SHA-256 of the whole token is
-- kept. The secret has 256 bits, so a fast hash is enough (no password stretching needed).
CREATE TABLE access_tokens (
    token_id     text PRIMARY KEY CHECK (token_id ~ '^[a-z0-9]{12}$'),
    principal    text NOT NULL REFERENCES principals (name) ON DELETE CASCADE,
    sha256       text NOT NULL UNIQUE CHECK (sha256 ~ '^[0-9a-f]{64}$'),
    description  text,
    scope        jsonb,
    created_at   timestamptz NOT NULL DEFAULT clock_timestamp(),
    created_by   text NOT NULL,
    expires_at   timestamptz,
    revoked_at   timestamptz,
    revoked_by   text,
    last_used_at timestamptz
);
CREATE INDEX access_tokens_of_principal ON access_tokens (principal);

CREATE TABLE audit_log (
    seq         bigint PRIMARY KEY CHECK (seq > 0),
    at          timestamptz NOT NULL,
    db_user     text NOT NULL,
    principal   text NOT NULL,
    via         text NOT NULL,
    action      text NOT NULL,
    run_id      text,
    effect_key  text,
    detail      jsonb NOT NULL,
    prev_sha256 text NOT NULL,
    sha256      text NOT NULL
);
CREATE INDEX audit_log_of_run ON audit_log (run_id, seq) WHERE run_id IS NOT NULL;

CREATE FUNCTION audit_log_is_append_only() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'the audit log is append-only: % refused', TG_OP
        USING HINT = 'decisions are appended by audit_append(); nothing may change or remove one';
END
$$;
CREATE TRIGGER audit_log_append_only BEFORE UPDATE OR DELETE ON audit_log
    FOR EACH ROW EXECUTE FUNCTION audit_log_is_append_only();
CREATE TRIGGER audit_log_no_truncate BEFORE TRUNCATE ON audit_log
    FOR EACH STATEMENT EXECUTE FUNCTION audit_log_is_append_only();

-- The text a row's sha256 covers: every column but the hash itself, with the time as epoch
-- microseconds and the detail as jsonb's own (canonical) text, so a verifier can rebuild it.
CREATE FUNCTION audit_row_text(
    p_prev text, p_seq bigint, p_at timestamptz, p_db_user text, p_principal text, p_via text,
    p_action text, p_run_id text, p_effect_key text, p_detail jsonb
) RETURNS text LANGUAGE sql IMMUTABLE AS $$
    SELECT concat_ws(E'\n', p_prev, p_seq::text,
                     ((extract(epoch FROM p_at) * 1000000)::bigint)::text, p_db_user,
                     p_principal, p_via, p_action, coalesce(p_run_id, ''),
                     coalesce(p_effect_key, ''), p_detail::text)
$$;

-- Append one decision. The chain is one line: an advisory lock (held to the end of the
-- caller's transaction) makes appends take turns, so seq has no gaps and each row names the
-- row before it. SECURITY DEFINER so that a role allowed only to call this can append (and
-- cannot write the table otherwise); the principal defaults to the role that connected.
CREATE FUNCTION audit_append(
    p_principal text, p_via text, p_action text, p_run_id text, p_effect_key text, p_detail jsonb
) RETURNS bigint LANGUAGE plpgsql SECURITY DEFINER SET search_path FROM CURRENT AS $$
DECLARE
    last_seq bigint;
    last_sha text;
    new_seq bigint;
    new_at timestamptz := clock_timestamp();
    principal_name text := coalesce(p_principal, session_user);
    via_name text := coalesce(p_via, 'database-role');
    detail_doc jsonb := coalesce(p_detail, '{}'::jsonb);
BEGIN
    PERFORM pg_advisory_xact_lock(hashtext('orchestrator.audit_log'),
                                  hashtext(current_schema()));
    SELECT seq, sha256 INTO last_seq, last_sha FROM audit_log ORDER BY seq DESC LIMIT 1;
    new_seq := coalesce(last_seq, 0) + 1;
    last_sha := coalesce(last_sha, repeat('0', 64));
    INSERT INTO audit_log (seq, at, db_user, principal, via, action, run_id, effect_key, detail,
                           prev_sha256, sha256)
    VALUES (new_seq, new_at, session_user, principal_name, via_name, p_action, p_run_id,
            p_effect_key, detail_doc, last_sha,
            encode(sha256(convert_to(audit_row_text(
                last_sha, new_seq, new_at, session_user, principal_name, via_name, p_action,
                p_run_id, p_effect_key, detail_doc), 'UTF8')), 'hex'));
    RETURN new_seq;
END
$$;
