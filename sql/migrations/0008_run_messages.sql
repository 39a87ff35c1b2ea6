-- The transcript of a tool agent's conversation: one row per message, appended in the same
-- fenced transaction as the turn that produced it (or nothing at all), never updated. A turn's
-- commit writes only its own few rows, so its cost does not grow with the length of the
-- conversation, as it would if the transcript lived in the checkpoint.
--
-- body is the chat message as the model API takes it (role, content, tool_calls, tool_call_id);
-- usage, on assistant messages, is what the turn's model call cost, every attempt of it
-- included (each attempt is billed).

CREATE TABLE run_messages (
    run_id  text        NOT NULL,
    seq     integer     NOT NULL CHECK (seq >= 0),
    turn    integer     NOT NULL CHECK (turn >= 0),
    role    text        NOT NULL CHECK (role IN ('system', 'user', 'assistant', 'tool')),
    body    jsonb       NOT NULL,
    usage   jsonb,
    fence   bigint      NOT NULL,
    at      timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (run_id, seq)
);
