"""The checker's rule "fence granted twice", on fabricated evidence: a failover campaign can only
be trusted if this rule fails when a (run, fence) was handed out twice, and stays quiet for one
claim running several steps. Also the campaign's pieces a failover needs: the client gate and
the workload's agents."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest

from orchestrator.chaos.campaign import plans
from orchestrator.chaos.checker import check_grants
from orchestrator.chaos.context import ClientGate
from orchestrator.chaos.findings import Findings
from orchestrator.chaos.grants import (
    GRANTS_DIR_ENV,
    MEMBER_ENV,
    Grant,
    duplicate_grants,
    read_grants,
    record_grant,
)
from orchestrator.errors import InvalidInput


def grant(holder: str, fence: int, seq: int, run_id: str = "r_1") -> Grant:
    return Grant(run_id, fence, holder, seq, "announce")


def test_one_claim_running_several_steps_is_one_grant() -> None:
    grants = [grant("chaos-w1.g1", 3, 0), grant("chaos-w1.g1", 3, 1), grant("chaos-w1.g1", 3, 2)]
    assert duplicate_grants(grants, [("r_1", 3, "chaos-w1.g1")]) == []


def test_successive_fences_and_other_runs_are_not_duplicates() -> None:
    grants = [
        grant("chaos-w1.g1", 1, 0),
        grant("chaos-w2.g1", 2, 0),
        grant("chaos-w2.g1", 1, 0, run_id="r_2"),
    ]
    claims = [("r_1", 1, "chaos-w1.g1"), ("r_1", 2, "chaos-w2.g1"), ("r_2", 1, "chaos-w2.g1")]
    assert duplicate_grants(grants, claims) == []


def test_one_fence_run_under_by_two_processes_is_granted_twice() -> None:
    [found] = duplicate_grants([grant("chaos-w1.g1", 4, 1), grant("chaos-w2.g1", 4, 1)], [])
    assert (found.run_id, found.fence) == ("r_1", 4)
    assert found.detail == "granted to chaos-w1.g1 and chaos-w2.g1"


def test_a_claim_the_failover_took_back_and_the_database_kept_claim_of_another_worker() -> None:
    """The lost primary granted fence 4 to w1 (only w1's record shows it); the promoted server
    granted fence 4 again, to w2, and kept that claim."""
    [found] = duplicate_grants([grant("chaos-w1.g1", 4, 1)], [("r_1", 4, "chaos-w2.g1")])
    assert found.detail == "granted to chaos-w1.g1 and chaos-w2.g1"


def test_one_process_granted_the_same_fence_twice_starts_its_steps_over() -> None:
    grants = [grant("chaos-w1.g1", 5, 1), grant("chaos-w1.g1", 5, 2), grant("chaos-w1.g1", 5, 1)]
    [found] = duplicate_grants(grants, [("r_1", 5, "chaos-w1.g1")])
    assert "granted to it twice" in found.detail and "version 1 after announce at version 2" in (
        found.detail
    )


def test_the_checker_names_each_duplicate_as_a_violation() -> None:
    found = Findings()
    check_grants(
        found,
        [("r_1", 4, "chaos-w2.g1"), ("r_2", 1, "chaos-w1.g1")],
        [grant("chaos-w1.g1", 4, 1), grant("chaos-w1.g1", 1, 0, run_id="r_2")],
    )
    assert found.grants_recorded == 2 and found.fences_granted_twice == 1
    [violation] = found.violations
    assert violation.rule == "fence granted twice" and violation.subject == "r_1@4"
    assert found.as_json()["fences_granted_twice"] == 1


def test_workers_record_grants_to_a_file_of_their_own_that_the_checker_reads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    record_grant("r_1", 1, 0, "announce")  # outside a campaign: nothing, nowhere
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setenv(GRANTS_DIR_ENV, str(tmp_path))
    monkeypatch.setenv(MEMBER_ENV, "chaos-w1.g1")
    record_grant("r_1", 1, 0, "announce")
    record_grant("r_1", 1, 1, "await_go")
    monkeypatch.setenv(MEMBER_ENV, "chaos-w2.g1")
    record_grant("r_1", 1, 1, "await_go")
    with open(tmp_path / "chaos-w2.g1.jsonl", "a") as torn:  # a process killed mid-line
        torn.write('{"run":"r_1","fen')
    grants = read_grants(tmp_path)
    assert [(g.holder, g.seq, g.what) for g in grants] == [
        ("chaos-w1.g1", 0, "announce"),
        ("chaos-w1.g1", 1, "await_go"),
        ("chaos-w2.g1", 1, "await_go"),
    ]
    [found] = duplicate_grants(grants, [])
    assert found.detail == "granted to chaos-w1.g1 and chaos-w2.g1"


async def test_a_failover_closes_the_client_gate_after_the_clients_inside_leave() -> None:
    """The campaign's submitter and person pass the gate; a failover waits for those inside
    (bounded) and keeps new ones out until the primary is replaced."""
    gate = ClientGate()
    order: list[str] = []
    inside = anyio.Event()

    async def client(name: str, seconds: float) -> None:
        async with gate.open():
            order.append(f"{name} in")
            inside.set()
            await anyio.sleep(seconds)
            order.append(f"{name} out")

    async def failover() -> None:
        async with gate.closed(within=5):
            order.append("failover")
            await anyio.sleep(0.2)
            order.append("promoted")

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(client, "submit", 0.3)
            await inside.wait()
            tasks.start_soon(failover)
            await anyio.sleep(0.05)
            tasks.start_soon(client, "person", 0)
    assert order == ["submit in", "submit out", "failover", "promoted", "person in", "person out"]


def test_the_workload_is_of_the_agents_asked_for() -> None:
    assert {plan.agent for plan in plans(1, 6)} == {"chaos_steps", "chaos_tools", "chaos_tree"}
    assert {plan.agent for plan in plans(1, 6, ("chaos_steps",))} == {"chaos_steps"}
    with pytest.raises(InvalidInput, match=r"unknown agents \['nope'\]"):
        plans(1, 6, ("chaos_steps", "nope"))
