"""``orchestrator demo``: the seed's failure, played out against the real database.

Worker A claims a run and checkpoints, then "pauses" (a GC pause, a partition, a long model
call) past its lease. Worker B claims the run with a higher fence and resumes from A's last
checkpoint. A wakes up and tries to renew and to commit: both are rejected, nothing of A's is
committed, and B finishes. The demo checks each of these facts and fails (exit 1) if any
invariant does not hold.
"""

from __future__ import annotations

import os
import socket

import anyio
from rich.console import Console
from rich.table import Table

from orchestrator.bootstrap import open_store
from orchestrator.presentation import print_run
from orchestrator.settings import Settings


def _worker_id(name: str) -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{name}"


async def run_demo(
    settings: Settings, *, lease_seconds: float, console: Console, out: Console
) -> bool:
    checks: list[tuple[str, bool]] = []

    def check(label: str, ok: bool) -> None:
        checks.append((label, ok))
        console.print(f"  {'[green]ok[/green]' if ok else '[red]BROKEN[/red]'}  {label}")

    console.print("[bold]orchestrator demo[/bold]: a stale worker meets the lease protocol")
    async with open_store(settings, application_name="orchestrator-demo") as store:
        worker_a, worker_b = _worker_id("worker-a"), _worker_id("worker-b")
        submitted = await store.submit("contract-summary", {"contract": "ACME-2026-114"})
        run_id = submitted.run.run_id
        console.print(f"submitted {run_id}")

        a = await store.claim_run(worker_a, run_id, lease_seconds=lease_seconds)
        assert a is not None, "a freshly submitted run must be claimable"
        console.print(f"worker A claimed it: fence {a.fence}, lease {lease_seconds:.1f}s")
        a_commit = await store.commit_step(
            a.lease,
            expected_version=0,
            next_step="send_summary",
            checkpoint={"summary": "draft v1"},
        )
        check("A commits its first checkpoint while it owns the run", a_commit is not None)

        console.print(
            f"worker A pauses (GC, partition, slow model call) for >{lease_seconds:.1f}s …"
        )
        early = await store.claim_run(worker_b, run_id, lease_seconds=lease_seconds)
        check("B cannot claim while A's lease is valid", early is None)
        with anyio.fail_after(lease_seconds + 30):
            b = None
            while b is None:
                await anyio.sleep(min(0.25, lease_seconds / 4))
                b = await store.claim_run(worker_b, run_id, lease_seconds=30)
        console.print(f"lease expired by the database clock; worker B claimed: fence {b.fence}")
        check("B's fence is exactly one above A's", b.fence == a.fence + 1)
        check("B resumes from A's last checkpoint", b.checkpoint == {"summary": "draft v1"})

        console.print("worker A wakes up and carries on from its in-memory state …")
        a_renew = await store.renew(a.lease, lease_seconds=lease_seconds)
        check("A's renewal with the old fence is rejected", a_renew is None)
        a_late = await store.commit_step(
            a.lease, expected_version=1, next_step="done", checkpoint={"sent": "by A"}
        )
        check("A's late commit is rejected (nothing committed)", a_late is None)
        a_finish = await store.finish(a.lease, expected_version=1, result={"sent_by": "A"})
        check("A cannot finish the run either", a_finish is False)
        await store.record_event(
            run_id,
            "lease_lost",
            fence=a.fence,
            worker_id=worker_a,
            details={"reason": "renewal rejected after pause"},
        )

        b_commit = await store.commit_step(
            b.lease,
            expected_version=b.checkpoint_version,
            next_step="finish",
            checkpoint={"summary": "draft v1", "sent": True},
        )
        check("B commits on top of A's checkpoint", b_commit is not None)
        finished = await store.finish(
            b.lease, expected_version=b.checkpoint_version + 1, result={"sent_by": "B"}
        )
        check("B finishes the run", finished)

        run = await store.get(run_id)
        events = await store.events(run_id)
        now = await store.database_now()
        commits = [(e.fence, e.worker_id) for e in events if e.kind == "checkpoint"]
        check(
            "the timeline holds only the owners' commits",
            commits == [(a.fence, worker_a), (b.fence, worker_b)],
        )
        check(
            "the run succeeded with B's result",
            run.state.value == "succeeded" and run.result == {"sent_by": "B"},
        )

    out.print()
    print_run(out, run, events, now)
    summary = Table(title="summary", show_edge=False, title_justify="left", header_style="bold")
    summary.add_column("check")
    summary.add_column("result")
    for label, ok in checks:
        summary.add_row(label, "ok" if ok else "BROKEN")
    out.print()
    out.print(summary)
    broken = [label for label, ok in checks if not ok]
    out.print()
    out.print(f"inspect it yourself: orchestrator runs show {run_id}", markup=False)
    if broken:
        console.print(f"[red]{len(broken)} invariant(s) broken[/red]")
    return not broken
