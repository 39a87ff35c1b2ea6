"""The campaign's checker: after the cluster is stopped it reads the database and the vendor's own
records, and names every broken promise. It trusts neither the workers' logs nor the boundary's
bookkeeping: fences come from the timeline, deliveries from the vendor, and the fences a failover
may have erased from the timeline from the workers' own grant records (``grants.py``). The rules
for deploys are in ``deploy_checks.py``, those for trees of runs in ``tree_checks.py``, those for
schedules in ``schedule_checks.py``, those for live output in ``output_checks.py``."""

from __future__ import annotations

import collections
from collections.abc import Iterable, Mapping, Sequence

import asyncpg

from orchestrator.chaos.agents import TICK
from orchestrator.chaos.deploy_checks import check_deploys, read_cutovers
from orchestrator.chaos.findings import (
    CLOCK_TOLERANCE_SECONDS,
    COMMITTED,
    TERMINAL,
    Findings,
    Row,
    as_text,
    event_details,
    json_value,
    seconds_between,
)
from orchestrator.chaos.grants import Grant, duplicate_grants
from orchestrator.chaos.output_checks import check_output, read_outputs
from orchestrator.chaos.schedule_checks import check_schedules, read_schedule_records
from orchestrator.chaos.tree_checks import check_trees
from orchestrator.chaos.vendor import ChaosVendor

LIMIT_EXCEEDED = "limit exceeded"
SLOT_WITHOUT_LEASE = "slot without lease"
"""The flow-control rules: sampled while the campaign runs (``limits.py``), and the second also
checked here, on the runs left after quiescence."""
EMAILING = ("chaos_steps", "chaos_leaf", TICK)
"""The agents each of whose succeeded runs emailed its customer."""


async def check(
    pool: asyncpg.Pool,
    vendor: ChaosVendor,
    *,
    dispatch_lease_seconds: float,
    grants: Sequence[Grant] = (),
    submitted: Iterable[str] = (),
    served: Mapping[str, str] | None = None,
) -> Findings:
    """``grants``: the workers' own records of the (run, fence) they ran under; ``submitted``:
    the run ids the campaign was told it submitted; ``served``: the version of the agents' code
    each worker ran, by worker id."""
    found = Findings()
    runs = {row["run_id"]: row for row in await pool.fetch("SELECT * FROM orchestrator.runs")}
    for run_id in sorted(set(submitted) - runs.keys()):
        found.lost_runs += 1
        found.add("submitted run missing", run_id, "its submit succeeded; the run is gone")
    effects = await pool.fetch("SELECT * FROM orchestrator.effects")
    events: dict[str, list[asyncpg.Record]] = collections.defaultdict(list)
    for event in await pool.fetch("SELECT * FROM orchestrator.run_events ORDER BY event_id"):
        events[event["run_id"]].append(event)
    found.runs_by_state = dict(
        collections.Counter(row["state"] for row in runs.values() if row["schedule_id"] is None)
    )
    found.effects_by_status = dict(collections.Counter(row["status"] for row in effects))
    _check_runs(found, runs)
    check_leases_released(found, runs.values())
    check_timelines(found, events)
    claims = [
        (run_id, event["fence"], event["worker_id"])
        for run_id, timeline in events.items()
        for event in timeline
        if event["kind"] == "claimed"
    ]
    check_grants(found, claims, grants)
    _check_deliveries(found, runs, effects, events, vendor, dispatch_lease_seconds)
    await _check_budgets(found, pool)
    check_deploys(found, runs, events, await read_cutovers(pool), served or {})
    check_trees(found, runs, events, effects)
    check_schedules(found, runs, events, await read_schedule_records(pool))
    check_output(found, events, await read_outputs(pool))
    return found


def _check_runs(found: Findings, runs: dict[str, asyncpg.Record]) -> None:
    """After quiescence nothing may be left in flight: every run reached an end."""
    for run_id, run in runs.items():
        if run["state"] not in TERMINAL:
            found.lost_runs += 1
            found.add(
                "run not finished",
                run_id,
                f"{run['state']} (wait {as_text(run['wait'])}, available {run['available_at']}, "
                f"lease {run['lease_owner']} until {run['lease_until']})",
            )


def check_leases_released(found: Findings, runs: Iterable[asyncpg.Record]) -> None:
    """A run that is not running holds no lease column: the commit that parked or ended it
    ended its lease, so no counter (the per-key one reads the owner) can hold its slot."""
    for run in runs:
        if run["state"] != "running" and (
            run["lease_owner"] is not None or run["lease_until"] is not None
        ):
            found.add(
                SLOT_WITHOUT_LEASE,
                run["run_id"],
                f"{run['state']} with lease owner {run['lease_owner']} until {run['lease_until']}",
            )


def check_timelines(found: Findings, events: Mapping[str, Sequence[Row]]) -> None:
    """Claims raise the fence (as cancels and cutovers do); a checkpoint or final commit is
    committed only by the latest claim's fence, and versions go up by one."""
    for run_id, timeline in events.items():
        fence = 0
        version = 0
        for event in timeline:
            kind = event["kind"]
            details = event_details(event)
            if kind == "claimed":
                if event["fence"] <= fence:
                    found.add("fence not raised", run_id, f"claim with {event['fence']}≤{fence}")
                fence = max(fence, event["fence"])
                if details.get("previous_owner"):
                    found.takeovers += 1
            elif kind in ("cancelled", "cut_over"):
                fence = max(fence, event["fence"] or 0)
            elif kind in COMMITTED:
                if event["fence"] != fence:
                    found.add(
                        "checkpoint by a stale fence",
                        run_id,
                        f"{kind} version {details.get('version')} by fence {event['fence']}, "
                        f"current {fence}",
                    )
                if details.get("version") != version + 1:
                    found.add(
                        "checkpoint version skipped",
                        run_id,
                        f"version {details.get('version')} after {version}",
                    )
                version = int(details.get("version") or version)
            elif kind == "lease_lost":
                found.lost_leases += 1
            elif kind == "stale_fence_rejected":
                found.stale_fence_rejections += 1


def check_grants(
    found: Findings, claims: Iterable[tuple[str, int, str | None]], grants: Sequence[Grant]
) -> None:
    """No (run, fence) granted twice, by the workers' records and the claims the database kept
    as (run, fence, worker): a claim a failover took back is in the records only."""
    claims = list(claims)
    found.grants_recorded = len(grants)
    kept = {(run_id, fence) for run_id, fence, _ in claims}
    found.claims_lost_with_a_timeline = len(
        {(grant.run_id, grant.fence) for grant in grants} - kept
    )
    for duplicate in duplicate_grants(grants, claims):
        found.fences_granted_twice += 1
        found.add("fence granted twice", f"{duplicate.run_id}@{duplicate.fence}", duplicate.detail)


def _check_deliveries(
    found: Findings,
    runs: dict[str, asyncpg.Record],
    effects: list[asyncpg.Record],
    events: dict[str, list[asyncpg.Record]],
    vendor: ChaosVendor,
    dispatch_lease_seconds: float,
) -> None:
    by_key = {row["idempotency_key"]: row for row in effects}
    found.deliveries = len(vendor.deliveries)
    found.mcp_deliveries = sum(
        1
        for delivery in vendor.deliveries.values()
        if isinstance(delivery.payload, dict) and "tool" in delivery.payload
    )
    found.duplicate_posts = sum(vendor.resent.values())
    for key, resent in vendor.resent.items():
        effect = by_key.get(key)
        subject = f"{effect['run_id']}/{effect['effect_key']}" if effect else key
        found.add("sent twice", subject, f"{resent + 1} POSTs reached the vendor for one key")
    for key, delivery in vendor.deliveries.items():
        effect = by_key.get(key)
        if effect is None:
            found.add(
                "delivery without a record",
                key,
                f"the vendor got an effect nobody asked for: {as_text(delivery.payload)[:200]}",
            )
            continue
        subject = f"{effect['run_id']}/{effect['effect_key']}"
        if effect["status"] != "confirmed":
            found.add(
                "record disagrees", subject, f"delivered, but the record is {effect['status']}"
            )
        if delivery.payload != json_value(effect["payload"]):
            found.add("payload differs", subject, "the vendor got another payload than recorded")
        claims = [
            e for e in events[effect["run_id"]] if e["kind"] in ("claimed", "cancelled", "cut_over")
        ]
        newer = [
            e
            for e in claims
            if e["fence"] > effect["fence"]
            and seconds_between(effect["created_at"], e["at"]) > CLOCK_TOLERANCE_SECONDS
        ]
        if newer:
            found.add(
                "stale fence dispatched",
                subject,
                f"accepted with fence {effect['fence']} after fence {newer[0]['fence']} was "
                "granted",
            )
        cancel = next((e for e in claims if e["kind"] == "cancelled"), None)
        if cancel is not None and delivery.at > cancel["at"].timestamp() + dispatch_lease_seconds:
            found.add(
                "sent after cancel",
                subject,
                f"{delivery.at - cancel['at'].timestamp():.1f}s after the run was cancelled",
            )
        if effect["requires_approval"]:
            approved = effect["approved_sha256"]
            if approved is None or approved != effect["payload_sha256"]:
                found.add("sent without approval", subject, f"approved hash {approved}")
            elif effect["decided_at"] is None or effect["decided_at"].timestamp() > delivery.at:
                found.add("sent before approval", subject, f"decided at {effect['decided_at']}")
    for effect in effects:
        if effect["status"] == "confirmed" and effect["idempotency_key"] not in vendor.deliveries:
            found.add(
                "confirmed but never delivered",
                f"{effect['run_id']}/{effect['effect_key']}",
                "the record says confirmed; the vendor never got it",
            )
    irreversible = collections.defaultdict(list)
    for effect in effects:
        if effect["policy"] == "irreversible":
            irreversible[effect["run_id"]].append(effect)
    for run_id, run in runs.items():
        if run["state"] != "succeeded":
            continue
        if run["agent"] in EMAILING and not any(
            effect["effect_key"] == "email" for effect in irreversible[run_id]
        ):
            found.add("succeeded without its email", run_id, "no email effect was recorded")
        for effect in irreversible[run_id]:
            if effect["status"] == "confirmed" and vendor.posts[effect["idempotency_key"]] < 1:
                found.add("succeeded but not delivered", run_id, effect["effect_key"])


async def _check_budgets(found: Findings, pool: asyncpg.Pool) -> None:
    dimensions = ("turns", "input_tokens", "output_tokens", "cost")
    for row in await pool.fetch("SELECT * FROM orchestrator.run_budgets"):
        for dimension in dimensions:
            limit = row[f"{dimension}_limit"]
            used = row[f"{dimension}_spent"] + row[f"{dimension}_reserved"]
            if limit is not None and used > limit:
                found.add("over budget", row["run_id"], f"{dimension}: {used} of {limit}")
        limit = row["tool_calls_limit"]
        if limit is not None and row["tool_calls_spent"] > limit:
            found.add("over budget", row["run_id"], f"tool calls: {row['tool_calls_spent']}")
