-- A lost attempt's unfinished output is what its own fence did not commit (docs/streaming.md).
-- Migration 0031 took the run's checkpoint version for the open fence's last: true when the run
-- ended under that fence, false when a newer fence had already committed past the lost attempt's
-- step before anything retracted it (the new owner published nothing first): that step's output
-- was then kept and shown, though only the new owner committed the step. The open fence's last
-- committed version is read from its own commits in the run's timeline (each step commit writes
-- a 'checkpoint' event with the version it made, a final commit 'succeeded' or 'failed'); a fence
-- that committed nothing leaves all its output unfinished.

CREATE OR REPLACE FUNCTION orchestrator_stream_retract(p_stream run_streams, p_run runs)
RETURNS run_streams LANGUAGE plpgsql SET search_path FROM CURRENT AS $$
DECLARE
    first_seq bigint;
    last_seq bigint;
    retracted bigint;
    stream run_streams := p_stream;
    committed bigint;
BEGIN
    SELECT coalesce(max((e.details ->> 'version')::bigint), 0) INTO committed
    FROM run_events AS e
    WHERE e.run_id = stream.run_id AND e.fence = stream.open_fence
      AND e.kind IN ('checkpoint', 'succeeded', 'failed')
      -- A commit's events are the worker's words: one that is not a version is not a commit.
      AND e.details ->> 'version' ~ '^[0-9]{1,18}$';
    SELECT min(o.seq), max(o.seq), count(*) INTO first_seq, last_seq, retracted
    FROM run_output AS o
    WHERE o.run_id = stream.run_id AND o.seq >= stream.open_from
      AND o.fence = stream.open_fence AND o.kind IN ('text', 'progress')
      AND o.base_version >= committed;
    IF retracted > 0 THEN
        stream.last_seq := stream.last_seq + 1;
        INSERT INTO run_output (run_id, seq, fence, base_version, kind, data)
        VALUES (stream.run_id, stream.last_seq, stream.open_fence, p_run.checkpoint_version,
                'retracted',
                jsonb_build_object(
                    'fence', stream.open_fence, 'from_seq', first_seq, 'to_seq', last_seq,
                    'events', retracted,
                    'reason', CASE WHEN p_run.fence > stream.open_fence
                                   THEN 'the attempt lost the run to fence ' || p_run.fence
                                   ELSE 'the attempt ended without committing its step' END));
        PERFORM pg_notify('orchestrator_output', stream.run_id);
    END IF;
    stream.open_fence := NULL;
    stream.open_from := NULL;
    RETURN stream;
END
$$;
