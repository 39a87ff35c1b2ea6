"""The traces of a claimed batch: a claim span, each attempt's root span, and its links to the
run's submitter and earlier attempts, kept in the database before any of the steps start."""

from __future__ import annotations

from structlog.typing import FilteringBoundLogger

from orchestrator.db.deadlines import pooled
from orchestrator.telemetry import (
    LINK_KIND,
    RUN_FENCE,
    WORKER_ID,
    open_span,
    span_context_from,
    traceparent_of,
)
from orchestrator.worker.execution import RunExecution
from orchestrator.worker.running import Running


async def trace_attempts(
    running: Running,
    worker_id: str,
    executions: list[RunExecution],
    claim_sent_at_ns: int,
    log: FilteringBoundLogger,
) -> None:
    """A claim span for a batch that claimed runs (an idle poll leaves no span), each
    attempt's root span, and its links to the run's submitter and earlier attempts.

    The attempts' trace contexts are kept in the database before any of their steps start
    (a worker that freezes in its first step is still linked from the attempt that takes
    over): one statement per claimed batch, only while tracing. Its failure costs only the
    links, never the runs.
    """
    claim = open_span(
        "claim",
        attributes=lambda: {WORKER_ID: worker_id, "orchestrator.claimed": len(executions)},
        root=True,
        start_time=claim_sent_at_ns,
    )
    claim.end()
    by_run: dict[str, RunExecution] = {}
    attempts: list[tuple[str, int, str]] = []
    for execution in executions:
        traceparent = traceparent_of(execution.open_span(claim_sent_at_ns))
        if traceparent is not None:
            by_run[execution.claimed.run_id] = execution
            attempts.append((execution.claimed.run_id, execution.claimed.fence, traceparent))
    if not attempts:
        return
    try:
        async with pooled(running.claim_pool, within=running.statement_seconds) as db:
            earlier = await running.store.record_attempt_traces(worker_id, attempts, db=db)
    except Exception as error:  # a database error or a bug: the runs go on, unlinked
        log.warning("could not keep the attempts' trace contexts", error=repr(error))
        return
    for row in earlier:
        execution = by_run[row.run_id]
        linked = span_context_from(row.traceparent)
        if linked is not None and row.fence < execution.claimed.fence:
            execution.span.add_link(
                linked,
                {
                    LINK_KIND: "submitted" if row.fence == 0 else "earlier_attempt",
                    RUN_FENCE: row.fence,
                    WORKER_ID: row.worker_id or "",
                },
            )
