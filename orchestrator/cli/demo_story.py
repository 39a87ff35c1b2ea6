"""``orchestrator demo``: the seed's failure played out with real processes, real vendors and
a model that chooses the side effects.

On the configured database (the embedded PostgreSQL by default) it starts a local HTTP vendor, a
local SMTP server, two `serve` worker processes (each also dispatching effects), and submits a batch
of ``contract_summary`` runs: a tool agent whose model reads a contract, then emails a summary (an
irreversible effect) and updates the CRM (a replaceable one), as tool calls it chose. With no
``OPENAI_API_KEY`` and no ``OPENAI_BASE_URL`` the model is the local scripted one
(``orchestrator.testing.loopback.ScriptedModelServer``), which the demo says; with either set, the
workers use that model. Mid-run it SIGSTOPs worker A until its leases expire, so worker B claims A's
runs with a higher fence and replays their turns; then it resumes A, which wakes up believing it
still owns them. At the end it checks, and prints, that every run succeeded, each effect reached its
vendor exactly once, A committed nothing after losing its leases, and nothing is left running.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import anyio
from rich.console import Console
from rich.table import Table

from orchestrator.db.bootstrap import open_store
from orchestrator.db.connections import resolve_dsn
from orchestrator.db.store import RunStore
from orchestrator.effect_model import EffectRecord
from orchestrator.effects.store import EffectStore
from orchestrator.models import Run, RunEvent
from orchestrator.settings import Settings
from orchestrator.testing.local_scripts import contract_summary_script
from orchestrator.testing.loopback import LocalVendor, ScriptedModelServer, SmtpSink
from orchestrator.worker.execution import NOT_THE_OWNER

WORKER_A = "demo-worker-a"
WORKER_B = "demo-worker-b"


LOCAL_MODEL_LATENCY_SECONDS = 0.8
"""How long the scripted model takes per answer: long enough that the paused worker is caught
between a turn's model call and its commit."""


def _start_worker(
    name: str,
    dsn: str,
    config: Path,
    lease: float,
    log_dir: Path,
    concurrency: int,
    model_env: dict[str, str],
) -> subprocess.Popen[bytes]:
    log = open(log_dir / f"{name}.log", "wb")  # noqa: SIM115 - handed to the child process
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "orchestrator.cli",
            "serve",
            "--agents",
            "orchestrator.agents.contract_summary",
            "--worker-id",
            name,
            "--effects-config",
            str(config),
            "--lease-seconds",
            str(lease),
            "--heartbeat-seconds",
            str(lease / 4),
            "--poll-seconds",
            "0.2",
            "--grace-seconds",
            "2",
            "--log-json",
            # Each worker takes half the batch, one claim at a time, so the paused one holds runs.
            "--concurrency",
            str(concurrency),
            "--claim-batch",
            "1",
        ],
        env={**os.environ, **model_env, "ORCHESTRATOR_DATABASE_URL": dsn},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=log,
    )


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGCONT)
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(5)


async def _timelines(store: RunStore, run_ids: list[str]) -> dict[str, list[RunEvent]]:
    return {run_id: await store.events(run_id) for run_id in run_ids}


async def run_demo(
    settings: Settings, *, lease_seconds: float, runs: int, console: Console, out: Console
) -> bool:
    try:
        return await _demo(
            settings, lease_seconds=lease_seconds, runs=runs, console=console, out=out
        )
    except TimeoutError:
        console.print("[red]the demo timed out waiting for the workers[/red] (see the logs above)")
        return False


async def _demo(
    settings: Settings, *, lease_seconds: float, runs: int, console: Console, out: Console
) -> bool:
    started = time.monotonic()
    console.print(
        "[bold]orchestrator demo[/bold]: stale workers meet leases and the fenced boundary"
    )
    work = Path(tempfile.mkdtemp(prefix="orchestrator-demo-"))
    async with (
        LocalVendor() as vendor,
        ScriptedModelServer(
            contract_summary_script, latency=LOCAL_MODEL_LATENCY_SECONDS
        ) as local_model,
        open_store(settings, application_name="demo") as store,
    ):
        model_env = _choose_model(console, local_model)
        with SmtpSink() as sink:
            config = _write_vendors(work, vendor, sink)
            console.print(f"vendors: HTTP CRM at {vendor.url}, SMTP at 127.0.0.1:{sink.port}")
            console.print(f"worker logs: {work}")
            dsn = resolve_dsn(settings)
            workers = {
                name: _start_worker(
                    name, dsn, config, lease_seconds, work, max(1, runs // 2), model_env
                )
                for name in (WORKER_A, WORKER_B)
            }
            try:
                run_ids = await _submit(store, runs, console)
                await _pause_a_past_its_leases(
                    store, workers[WORKER_A], run_ids, lease_seconds, console
                )
                await _until_finished(store, run_ids, console)
                await _until_a_noticed(store, run_ids)
            finally:
                for process in workers.values():
                    _stop(process)
            seen = await _observe(store, run_ids, sink, vendor)
    seen.leftover = [p.args for p in workers.values() if p.poll() is None]
    checks = _report(seen, out, started=started)
    broken = [label for label, ok in checks if not ok]
    if broken:
        console.print(f"[red]{len(broken)} invariant(s) broken[/red]; worker logs in {work}")
    return not broken


# -- the phases -----------------------------------------------------------------------------
def _choose_model(console: Console, local_model: ScriptedModelServer) -> dict[str, str]:
    """The workers' model: the configured one, else the local scripted model (said either way)."""
    if os.environ.get("OPENAI_API_KEY") or os.environ.get("OPENAI_BASE_URL"):
        where = os.environ.get("OPENAI_BASE_URL") or "OpenAI"
        console.print(f"model: {os.environ.get('ORCHESTRATOR_MODEL', 'gpt-4o-mini')} at {where}")
        return {}
    console.print(
        "model: the local scripted model (no OPENAI_API_KEY or OPENAI_BASE_URL set), "
        f"at {local_model.base_url}"
    )
    return {"OPENAI_BASE_URL": local_model.base_url, "OPENAI_API_KEY": ""}


def _write_vendors(work: Path, vendor: LocalVendor, sink: SmtpSink) -> Path:
    config = work / "vendors.json"
    crm = {
        "adapter": "http",
        "url": vendor.send_url,
        "reconcile": "lookup",
        "lookup_url": vendor.lookup_url,
    }
    email = {
        "adapter": "smtp",
        "host": "127.0.0.1",
        "port": sink.port,
        "sender": "agents@orchestrator.demo",
    }
    config.write_text(json.dumps({"kinds": {"crm": crm, "email": email}}))
    return config


async def _submit(store: RunStore, runs: int, console: Console) -> list[str]:
    run_ids = []
    for n in range(runs):
        document = {
            "contract_id": "c-1001",
            "to": f"legal{n}@customer.test",
            "account": f"customer-{n}",
        }
        run_ids.append((await store.submit("contract_summary", document)).run.run_id)
    console.print(
        f"submitted {runs} contract_summary runs; two workers are claiming, and the "
        "model chooses the email and the CRM update as tool calls"
    )
    return run_ids


async def _pause_a_past_its_leases(
    store: RunStore,
    worker_a: subprocess.Popen[bytes],
    run_ids: list[str],
    lease_seconds: float,
    console: Console,
) -> None:
    """Once A holds runs, SIGSTOP it past its leases' end (B claims them), then resume it."""
    with anyio.fail_after(30):
        while True:
            listed = await store.list_runs(limit=len(run_ids))
            if WORKER_A in {run.lease_owner for run in listed if run.run_id in run_ids}:
                break
            await anyio.sleep(0.05)
    worker_a.send_signal(signal.SIGSTOP)
    console.print(
        f"worker A paused (SIGSTOP) holding runs; its {lease_seconds:.1f}s leases "
        "will expire and worker B will claim them with a higher fence …"
    )
    await anyio.sleep(lease_seconds * 2 + 1.5)
    worker_a.send_signal(signal.SIGCONT)
    console.print("worker A resumed: it wakes up believing it still owns its runs")


async def _until_finished(store: RunStore, run_ids: list[str], console: Console) -> None:
    with anyio.fail_after(60):
        while True:
            done = sum([(await store.get(run_id)).state.terminal for run_id in run_ids])
            console.print(f"  {done}/{len(run_ids)} runs finished", end="\r")
            if done == len(run_ids):
                break
            await anyio.sleep(0.25)
    console.print()


async def _until_a_noticed(store: RunStore, run_ids: list[str]) -> None:
    """Let A notice (and record) every lost lease before judging; bounded."""
    with anyio.move_on_after(10):
        while True:
            held_by_a = lost_by_a = 0
            for run_id in run_ids:
                timeline = await store.events(run_id)
                held_by_a += _takeover_from_a(timeline) is not None
                lost_by_a += any(
                    e.kind == "lease_lost" and e.worker_id == WORKER_A for e in timeline
                )
            if lost_by_a >= held_by_a:
                return
            await anyio.sleep(0.2)


@dataclass
class Observed:
    """What the demo saw at the end: the runs, their timelines, the effect records, and what
    each vendor received."""

    run_ids: list[str]
    timelines: dict[str, list[RunEvent]]
    final: list[Run]
    effects: list[EffectRecord]
    email_ids: Counter[str]
    crm_requests: dict[str, int]
    crm_total: int
    leftover: list[object] = field(default_factory=list)


async def _observe(
    store: RunStore, run_ids: list[str], sink: SmtpSink, vendor: LocalVendor
) -> Observed:
    effects = await EffectStore(store.pool).list_effects(limit=10_000)
    return Observed(
        run_ids=run_ids,
        timelines=await _timelines(store, run_ids),
        final=[await store.get(run_id) for run_id in run_ids],
        effects=[e for e in effects if e.run_id in run_ids],
        email_ids=Counter(sink.message_ids()),
        crm_requests=dict(vendor.requests_by_key),
        crm_total=vendor.requests,
    )


# -- the verdict ----------------------------------------------------------------------------
def _checks(seen: Observed, taken_from_a: dict[str, RunEvent]) -> list[tuple[str, bool]]:
    runs, effects, run_ids = len(seen.run_ids), seen.effects, seen.run_ids
    emails = _emails_per_run(seen)
    crm = [seen.crm_requests.get(e.idempotency_key, 0) for e in effects if e.kind == "crm"]
    return [
        ("every run succeeded", Counter(r.state.value for r in seen.final) == {"succeeded": runs}),
        (
            "each run's model chose one email and one CRM update",
            Counter(e.run_id for e in effects if e.kind == "email") == Counter(run_ids)
            and Counter(e.run_id for e in effects if e.kind == "crm") == Counter(run_ids),
        ),
        ("worker A's runs were taken over with a higher fence", bool(taken_from_a)),
        (
            "each email reached the SMTP server exactly once",
            len(emails) == runs and set(emails) == {1} and sum(seen.email_ids.values()) == runs,
        ),
        (
            "each CRM update reached the vendor exactly once",
            len(crm) == runs and set(crm) == {1} and seen.crm_total == runs,
        ),
        ("worker A committed nothing after losing its leases", not _late_commits_of_a(seen)),
        ("nothing left running", not seen.leftover),
    ]


def _emails_per_run(seen: Observed) -> list[int]:
    return [
        seen.email_ids.get(f"<{e.idempotency_key}@orchestrator>", 0)
        for e in seen.effects
        if e.kind == "email"
    ]


def _late_commits_of_a(seen: Observed) -> list[RunEvent]:
    return [
        e
        for timeline in seen.timelines.values()
        for e in timeline
        if e.kind in ("checkpoint", "succeeded", "effect_accepted")
        and e.worker_id == WORKER_A
        and any(
            x.kind == "lease_lost"
            and x.worker_id == WORKER_A
            and x.at < e.at
            and x.run_id == e.run_id
            for x in timeline
        )
    ]


def _report(seen: Observed, out: Console, *, started: float) -> list[tuple[str, bool]]:
    """Print the measures and the invariants; return the invariants as (label, held)."""
    events = [event for timeline in seen.timelines.values() for event in timeline]
    own_check, fenced = _ways_stopped(events)
    taken_from_a = {
        run_id: takeover
        for run_id, timeline in seen.timelines.items()
        if (takeover := _takeover_from_a(timeline)) is not None
    }
    recoveries = [
        (claim.at - _parse(claim.details["previous_lease_until"])).total_seconds()
        for claim in taken_from_a.values()
        if claim.details.get("previous_lease_until")
    ]
    states = Counter(run.state.value for run in seen.final)
    crm = [seen.crm_requests.get(e.idempotency_key, 0) for e in seen.effects if e.kind == "crm"]
    summary = Table(title="summary", show_edge=False, title_justify="left", header_style="bold")
    summary.add_column("measure")
    summary.add_column("value")
    summary.add_row("runs by state", ", ".join(f"{k}: {v}" for k, v in sorted(states.items())))
    summary.add_row("runs taken over from worker A", str(len(taken_from_a)))
    summary.add_row("emails delivered per run", _spread(_emails_per_run(seen)))
    summary.add_row("CRM updates delivered per run", _spread(crm))
    summary.add_row("lost leases", str(sum(e.kind == "lease_lost" for e in events)))
    summary.add_row(f"stale worker stopped by {OWN_LEASE_CHECK}", str(len(own_check)))
    summary.add_row(f"stale worker stopped by {REFUSED_BY_FENCE}", str(len(fenced)))
    if recoveries:
        summary.add_row(
            "recovery (lease expiry → new claim)",
            f"max {max(recoveries):.2f}s, mean {sum(recoveries) / len(recoveries):.2f}s",
        )
    summary.add_row("elapsed", f"{time.monotonic() - started:.1f}s")
    out.print(summary)
    checks = _checks(seen, taken_from_a)
    result = Table(show_edge=False, header_style="bold")
    result.add_column("invariant")
    result.add_column("result")
    for label, ok in checks:
        result.add_row(label, "ok" if ok else "BROKEN")
    out.print()
    out.print(result)
    out.print()
    out.print(
        f"A stale worker is stopped two ways: by {OWN_LEASE_CHECK} (it finds its lease gone "
        f"and commits nothing), or by {REFUSED_BY_FENCE} (a commit or effect it sent under an "
        "old fence is refused in the database)"
    )
    example = next(iter(taken_from_a), None)
    if example is not None:
        out.print(
            f"inspect a run worker A held and worker B took over: orchestrator runs show {example}",
            markup=False,
        )
        out.print(f"and its effects: orchestrator effects list --run {example}", markup=False)
    return checks


OWN_LEASE_CHECK = "its own lease check"
REFUSED_BY_FENCE = "the fence"


def _takeover_from_a(timeline: list[RunEvent]) -> RunEvent | None:
    """The claim by another worker that took this run over from worker A, if one did."""
    held_by_a = False
    for event in timeline:
        if event.kind != "claimed":
            continue
        if event.worker_id == WORKER_A:
            held_by_a = True
        elif held_by_a:
            return event
    return None


Attempt = tuple[str, int | None]
"""A run id and the fence of one of its attempts."""


def _ways_stopped(events: list[RunEvent]) -> tuple[set[Attempt], set[Attempt]]:
    """The (run, fence) attempts a stale worker was stopped in, split by how: its own lease check
    (a refused renewal, the local deadline: it commits nothing), or the fence (the database
    refused its commit, or the boundary its effects, as stale)."""
    fenced = {
        (e.run_id, e.fence)
        for e in events
        if e.kind == "stale_fence_rejected"
        or (e.kind == "lease_lost" and str(e.details.get("reason", "")).endswith(NOT_THE_OWNER))
    }
    own_check = {(e.run_id, e.fence) for e in events if e.kind == "lease_lost"} - fenced
    return own_check, fenced


def _spread(values: list[int]) -> str:
    if not values:
        return "none"
    return f"min {min(values)}, max {max(values)} over {len(values)} runs"


def _parse(value: str) -> datetime:
    return datetime.fromisoformat(value)
