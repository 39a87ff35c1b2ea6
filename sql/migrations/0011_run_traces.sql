-- Trace contexts for incident review: one row per run attempt (fence >= 1) holding the W3C
-- traceparent of that attempt's root span, and one with fence 0 for whoever submitted the run,
-- when it was submitted inside a trace. A new attempt's span links to every earlier row, and the
-- dispatcher parents its spans to the row of the fence that requested the effect (an effect
-- record names the run and fence that requested it), so a takeover is one click away in a
-- tracing UI. Written only while tracing is on; never read by claims or commits.
CREATE TABLE run_traces (
    run_id      text        NOT NULL,
    fence       bigint      NOT NULL CHECK (fence >= 0),
    traceparent text        NOT NULL CHECK (length(traceparent) <= 128),
    worker_id   text,
    at          timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (run_id, fence)
);
