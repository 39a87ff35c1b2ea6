"""The action proxy's fence store with real proxy processes: a regression after lost
transactions is refused, logged and counted after a restart; two processes share one file;
bad paths stop the command at once; old entries are pruned while it serves."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import anyio
import asyncpg
import httpx
import pytest

from orchestrator.db.store import RunStore
from orchestrator.effects.fence_store import FenceStore, Remembered
from test_effects_proxy import auth, free_port, request, running_proxy, start_proxy
from test_proxy_fences import (
    check_race,
    lose_transactions,
    race_on_a_forgetful_database,
    two_claims,
)

pytestmark = pytest.mark.slow


async def scrape(metrics_port: int) -> dict[str, float]:
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{metrics_port}") as client:
        with anyio.fail_after(60):
            while True:
                try:
                    text = (await client.get("/metrics")).text
                    break
                except httpx.TransportError:
                    await anyio.sleep(0.1)
    return {
        line.split('outcome="', 1)[1].split('"', 1)[0]: float(line.rpartition(" ")[2])
        for line in text.splitlines()
        if line.startswith("orchestrator_proxy_requests_total{")
    }


def log_lines(path: Path) -> list[dict[str, object]]:
    lines = []
    for line in path.read_text().splitlines():
        try:
            lines.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return lines


async def test_a_restarted_proxy_still_refuses_a_fence_the_database_forgot(
    database_url: str, store: RunStore, pool: asyncpg.Pool, tmp_path: Path
) -> None:
    fences = tmp_path / "fences.sqlite3"
    run_id, old, new = await two_claims(store)
    async with running_proxy(database_url, fence_store=fences) as first:
        accepted = await first.post("/v1/effects", json=request(run_id, new), headers=auth())
        assert accepted.status_code == 201, accepted.text

    # The failover: the promoted database lost B's claim and B's effect; A owns the run again.
    await lose_transactions(pool, run_id, fence=old, owner="A", effect_fences="deleted")
    metrics_port = free_port()
    with (tmp_path / "stderr").open("wb") as stderr:
        async with running_proxy(
            database_url,
            "--metrics-listen",
            f"127.0.0.1:{metrics_port}",
            fence_store=fences,
            stderr=stderr,
        ) as second:
            refused = await second.post("/v1/effects", json=request(run_id, old), headers=auth())
            counted = await scrape(metrics_port)
    assert refused.status_code == 409, refused.text
    answer = refused.json()
    assert (answer["error"], answer["remembered_fence"], answer["presented_fence"]) == (
        "fence_regression",
        new,
        old,
    )
    assert counted["fence_regression"] == 1.0
    assert counted["accepted"] == 0.0  # nothing reached the database's boundary
    assert await pool.fetchval("SELECT count(*) FROM effects") == 0
    assert await pool.fetchval("SELECT count(*) FROM effect_fences") == 0
    [logged] = [
        line
        for line in log_lines(tmp_path / "stderr")
        if line["event"] == "fence regression refused"
    ]
    assert logged["level"] == "error"
    assert (logged["orchestrator.run.id"], logged["remembered_fence"]) == (run_id, new)


async def test_two_proxies_on_one_file_share_what_they_remember(
    database_url: str, store: RunStore, pool: asyncpg.Pool, tmp_path: Path
) -> None:
    fences = tmp_path / "fences.sqlite3"
    run_id, old, new = await two_claims(store)
    async with (
        running_proxy(database_url, fence_store=fences) as one,
        running_proxy(database_url, fence_store=fences) as two,
    ):
        first = await one.post("/v1/effects", json=request(run_id, new), headers=auth())
        assert first.status_code == 201, first.text
        answers: list[httpx.Response] = []

        async def send(client: httpx.AsyncClient, key: str) -> None:
            body = request(run_id, new, effect_key=key)
            answers.append(await client.post("/v1/effects", json=body, headers=auth()))

        async with anyio.create_task_group() as group:
            for i in range(30):
                group.start_soon(send, one if i % 2 else two, f"k{i}")
        assert [a.status_code for a in answers] == [201] * 30, [a.text for a in answers]

        await lose_transactions(pool, run_id, fence=old, owner="A", effect_fences="lowered")
        for client in (one, two):
            refused = await client.post("/v1/effects", json=request(run_id, old), headers=auth())
            assert refused.json()["error"] == "fence_regression", refused.text


async def test_two_proxy_processes_sharing_a_store_never_go_backwards_in_a_race(
    database_url: str, store: RunStore, pool: asyncpg.Pool, tmp_path: Path
) -> None:
    """Workers A and B race through two proxy processes in turn while the database keeps
    forgetting B's claim: once B was accepted through either proxy, A is accepted by none."""
    fences = tmp_path / "fences.sqlite3"
    run_id, old, new = await two_claims(store)
    async with (
        running_proxy(database_url, fence_store=fences) as one,
        running_proxy(database_url, fence_store=fences) as two,
    ):
        sent = await race_on_a_forgetful_database(
            [one, two], pool, run_id, old, new, headers=auth()
        )
        check_race(sent, old, new)
        await lose_transactions(pool, run_id, fence=old, owner="A", effect_fences="lowered")
        for client in (one, two):
            refused = await client.post("/v1/effects", json=request(run_id, old), headers=auth())
            assert refused.json()["error"] == "fence_regression", refused.text
    reader = FenceStore.open(fences)
    try:
        assert (await reader.remembered(run_id) or Remembered(0, 0)).fence == new
    finally:
        reader.close()


def test_require_sync_standby_refuses_to_start_the_proxy_without_one(database_url: str) -> None:
    """The plain embedded server has no synchronous standby: the proxy exits with one error line
    naming the setting (after the requirement's own structured log record)."""
    process = start_proxy(
        database_url, free_port(), "--require-sync-standby", stderr=subprocess.PIPE
    )
    _, said = process.communicate(timeout=60)
    assert process.returncode == 1
    lines = said.decode().strip().splitlines()
    [line] = [line for line in lines if not line.startswith("{")]  # the rest: JSON log records
    assert line.startswith("error: --require-sync-standby:"), lines
    assert "synchronous_standby_names" in line
    assert "listening" not in said.decode()


WRITER = textwrap.dedent(
    """
    import random, sys
    import anyio
    from pathlib import Path
    from orchestrator.effects.fence_store import FenceStore

    async def main() -> None:
        store = FenceStore.open(Path(sys.argv[1]))
        fences = [(f"r_{run}", fence) for run in range(10) for fence in range(1, 101)]
        random.Random(int(sys.argv[2])).shuffle(fences)
        async with anyio.create_task_group() as group:
            for run_id, fence in fences:
                group.start_soon(store.remember, run_id, fence)
        store.close()

    anyio.run(main)
    """
)


def start_writer(path: Path, seed: int) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", WRITER, str(path), str(seed)], env=os.environ)


async def test_two_processes_writing_one_file_only_raise_fences(tmp_path: Path) -> None:
    path = tmp_path / "fences.sqlite3"
    reader = FenceStore.open(path)
    writers = [start_writer(path, seed) for seed in (1, 2)]
    seen: dict[str, list[int]] = {f"r_{run}": [] for run in range(10)}
    try:
        with anyio.fail_after(120):
            while any(writer.poll() is None for writer in writers):
                for run_id, values in seen.items():
                    found = await reader.remembered(run_id)
                    values.append(0 if found is None else found.fence)
                await anyio.sleep(0.01)
        assert [writer.returncode for writer in writers] == [0, 0]
        for run_id, values in seen.items():
            assert values == sorted(values), run_id  # never lowered between two reads
            assert (await reader.remembered(run_id) or Remembered(0, 0)).fence == 100
    finally:
        for writer in writers:
            if writer.poll() is None:
                writer.kill()
                writer.wait()
        reader.close()


@pytest.mark.parametrize(
    ("option", "says"),
    [
        ("{tmp}/missing/f.sqlite3", "does not exist"),
        ("{tmp}", "is a directory"),
        ("{tmp}/not-sqlite", "file is not a database"),
        ("/proc/orchestrator-fences.sqlite3", "unable to open"),
    ],
)
def test_an_unusable_fence_store_stops_the_proxy_in_one_line(
    tmp_path: Path, option: str, says: str
) -> None:
    (tmp_path / "not-sqlite").write_text("plain text\n" * 100)
    path = option.format(tmp=tmp_path)
    # An unreachable database: the store is checked first, so the answer comes at once.
    process = start_proxy(
        "postgresql://nobody@127.0.0.1:9/none",
        free_port(),
        stderr=subprocess.PIPE,
        fence_store=Path(path),
    )
    _, said = process.communicate(timeout=60)
    assert process.returncode == 1
    [line] = said.decode().strip().splitlines()
    assert line.startswith("error: cannot use --fence-store") and path in line and says in line


async def test_the_proxy_prunes_entries_past_the_retention_while_it_serves(
    database_url: str, tmp_path: Path
) -> None:
    path = tmp_path / "fences.sqlite3"
    seeded = FenceStore.open(path, clock=lambda: time.time() - 3 * 3600)
    for i in range(1_234):
        await seeded.remember(f"r_old{i}", 5)
    await seeded.remember("r_recent", 5)
    seeded.close()
    recent = FenceStore.open(path)
    await recent.remember("r_recent", 6)  # touched now
    async with running_proxy(database_url, "--fence-store-retention", "1h", fence_store=path):
        with anyio.fail_after(60):
            while True:
                if await recent.count() == 1:
                    break
                await anyio.sleep(0.1)
    assert (await recent.remembered("r_recent") or Remembered(0, 0)).fence == 6
    recent.close()
