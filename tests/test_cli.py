"""The command line as a user runs it: real processes, real database, exit codes and output."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import asyncpg
import pytest

from orchestrator.db.store import RunStore
from support import cli

pytestmark = pytest.mark.slow


async def table_counts(pool: asyncpg.Pool) -> tuple[int, int]:
    runs = await pool.fetchval("SELECT count(*) FROM runs")
    events = await pool.fetchval("SELECT count(*) FROM run_events")
    return int(runs), int(events)


async def test_submit_show_list_cancel(database_url: str, store: RunStore) -> None:
    submitted = cli(database_url, "submit", "summarise", "--input", '{"doc": "a"}')
    assert submitted.returncode == 0, submitted.stderr
    run_id = submitted.stdout.strip()
    assert run_id.startswith("r_")
    assert "no live worker serves agent 'summarise'" in submitted.stderr

    shown = cli(database_url, "runs", "show", run_id, "--json")
    assert shown.returncode == 0, shown.stderr
    detail = json.loads(shown.stdout)
    assert detail["run"]["state"] == "queued"
    assert [e["kind"] for e in detail["events"]] == ["submitted"]

    listed = cli(database_url, "runs", "list", "--json", "--agent", "summarise")
    assert [r["run_id"] for r in json.loads(listed.stdout)] == [run_id]
    table = cli(database_url, "runs", "list")
    assert run_id in table.stdout and "queued" in table.stdout

    human = cli(database_url, "runs", "show", run_id)
    assert "fence" in human.stdout and "submitted" in human.stdout

    cancelled = cli(database_url, "runs", "cancel", run_id, "--reason", "test")
    assert cancelled.returncode == 0, cancelled.stderr
    assert (await store.get(run_id)).state.value == "cancelled"


async def test_submit_from_file_and_stdin_with_idempotency(
    database_url: str, tmp_path: Path, store: RunStore
) -> None:
    payload = tmp_path / "input.json"
    payload.write_text('{"doc": "from file"}')
    first = cli(
        database_url,
        "submit",
        "summarise",
        "--input",
        f"@{payload}",
        "--idempotency-key",
        "k-1",
        "--json",
    )
    second = cli(
        database_url,
        "submit",
        "summarise",
        "--input",
        "@-",
        "--idempotency-key",
        "k-1",
        "--json",
        stdin='{"doc": "from file"}',
    )
    assert first.returncode == 0 and second.returncode == 0, (first.stderr, second.stderr)
    a, b = json.loads(first.stdout), json.loads(second.stdout)
    assert a["created"] is True and b["created"] is False
    assert a["run"]["run_id"] == b["run"]["run_id"]
    assert "matched run" in second.stderr
    assert len(await store.list_runs()) == 1


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["submit", "summarise", "--input", "{not json"], "not valid JSON"),
        (["submit", "summarise", "--input", "[1, 2]"], "must be a JSON object"),
        (["submit", "summarise", "--input", "@/nonexistent/input.json"], "cannot read input file"),
        (["submit", "bad agent", "--input", "{}"], "malformed agent name"),
        (["submit", "summarise", "--run-id", "no spaces allowed"], "malformed run id"),
        (["runs", "show", "r_unknown"], "no run with id"),
        (["runs", "show", "bad id!"], "malformed run id"),
        (["runs", "cancel", "r_unknown"], "no run with id"),
        (["runs", "retry", "r_unknown"], "no run with id"),
    ],
)
async def test_bad_input_exits_1_with_a_reason_and_changes_nothing(
    database_url: str, pool: asyncpg.Pool, args: list[str], message: str
) -> None:
    before = await table_counts(pool)
    result = cli(database_url, *args)
    assert result.returncode == 1, (result.stdout, result.stderr)
    assert message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert result.stdout == ""
    assert await table_counts(pool) == before


async def test_oversized_input_is_refused(database_url: str, pool: asyncpg.Pool) -> None:
    big = json.dumps({"blob": "x" * (1024 * 1024)})
    result = cli(database_url, "submit", "summarise", "--input", "@-", stdin=big)
    assert result.returncode == 1
    assert "over the 1,048,576-byte limit" in result.stderr
    assert await table_counts(pool) == (0, 0)


async def test_invalid_transitions_exit_1(database_url: str, store: RunStore) -> None:
    run = (await store.submit("summarise", {})).run
    retry = cli(database_url, "runs", "retry", run.run_id)
    assert retry.returncode == 1 and "not dead" in retry.stderr
    await store.cancel(run.run_id)
    again = cli(database_url, "runs", "cancel", run.run_id)
    assert again.returncode == 1 and "already cancelled" in again.stderr


def test_usage_errors_exit_2() -> None:
    for args in (["submit"], ["runs", "list", "--state", "bogus"], ["nonsense"]):
        result = cli("postgresql://unused@127.0.0.1:1/x", *args)
        assert result.returncode == 2, (args, result.stderr)


def test_database_unreachable_names_the_dsn_without_password() -> None:
    result = cli("postgresql://app:hunter2@127.0.0.1:1/orchestrator", "runs", "list")
    assert result.returncode == 1
    assert "hunter2" not in result.stderr
    assert (
        "cannot reach PostgreSQL at postgresql://app:***@127.0.0.1:1/orchestrator" in result.stderr
    )


async def test_db_url_and_migrate(database_url: str) -> None:
    url = cli(database_url, "db", "url")
    assert url.stdout.strip() == database_url
    migrated = cli(database_url, "db", "migrate")
    assert migrated.returncode == 0 and "no change" in migrated.stdout


def test_every_list_command_has_json() -> None:
    result: Any = cli("postgresql://unused@127.0.0.1:1/x", "runs", "list", "--help")
    assert "--json" in result.stdout


async def test_effects_list_show_and_resolve(
    database_url: str, store: RunStore, pool: asyncpg.Pool
) -> None:
    from orchestrator.effect_model import Effect
    from orchestrator.effects.store import EffectStore

    await store.submit("agent", {})
    run = (await store.claim("W", ["agent"])).claimed[0]
    async with pool.acquire() as db, db.transaction():
        await EffectStore(pool).accept(
            db, run.run_id, run.fence, Effect("k1", "crm", {}), worker_id="W"
        )
    await pool.execute("UPDATE effects SET status = 'parked'")

    listed = cli(database_url, "effects", "list", "--run", run.run_id, "--json")
    assert [e["effect_key"] for e in json.loads(listed.stdout)] == ["k1"]
    assert "parked" in cli(database_url, "effects", "list").stdout
    shown = cli(database_url, "effects", "show", run.run_id, "k1", "--json")
    assert json.loads(shown.stdout)["status"] == "parked"

    no_decision = cli(database_url, "effects", "resolve", run.run_id, "k1")
    assert no_decision.returncode == 2 and "--sent or --not-sent" in no_decision.stderr
    resolved = cli(database_url, "effects", "resolve", run.run_id, "k1", "--sent", "--by", "ana")
    assert resolved.returncode == 0 and "(note: ana)" in resolved.stdout
    again = cli(database_url, "effects", "resolve", run.run_id, "k1", "--not-sent")
    assert again.returncode == 1 and "not parked" in again.stderr
    unknown = cli(database_url, "effects", "show", run.run_id, "nope")
    assert unknown.returncode == 1 and "no effect 'nope'" in unknown.stderr


def test_dispatch_refuses_a_bad_vendor_config(database_url: str, tmp_path: Path) -> None:
    bad_json = tmp_path / "bad.json"
    bad_json.write_text("{nope")
    wrong_adapter = tmp_path / "wrong.json"
    wrong_adapter.write_text('{"kinds": {"crm": {"adapter": "carrier-pigeon"}}}')
    for path, message in ((bad_json, "not valid JSON"), (wrong_adapter, "adapter must be")):
        result = cli(database_url, "effects", "dispatch", "--effects-config", str(path))
        assert result.returncode == 1 and message in result.stderr, result.stderr


async def test_runs_show_keeps_a_takeovers_previous_owner_and_says_what_attempt_means(
    database_url: str, store: RunStore
) -> None:
    run_id = (await store.submit("summarise", {"doc": "a" * 300})).run.run_id
    first = (
        await store.claim("worker-a-with-a-long-name:1234:abcdef", ["summarise"], lease_seconds=0.2)
    ).claimed[0]
    await anyio.sleep(0.3)
    second = (await store.claim("worker-b", ["summarise"], lease_seconds=30)).claimed[0]
    assert second.previous_owner == first.lease.worker_id
    assert await store.commit_step(second.lease, expected_version=0, next_step="Two", checkpoint={})
    shown = cli(database_url, "runs", "show", run_id)
    assert shown.returncode == 0, shown.stderr
    assert 'previous_owner="worker-a-with-a-long-name:1234:abcdef"' in shown.stdout
    assert "1 of 5 since the last checkpoint (2 claims in all)" in shown.stdout
    assert "Two" in shown.stdout
    assert await store.finish(second.lease, expected_version=1, result={"done": True})
    finished = cli(database_url, "runs", "show", run_id)
    assert "next step" not in finished.stdout and "since the last checkpoint" not in finished.stdout


def test_help_shows_no_doubled_percent_signs() -> None:
    """click prints help as written: a ``%%`` escape meant for argparse shows literally."""
    for args in (
        ["serve", "--help"],
        ["effects", "serve", "--help"],
        ["effects", "dispatch", "--help"],
    ):
        shown = cli("postgresql://unused@127.0.0.1:1/x", *args)
        assert shown.returncode == 0 and "%%" not in shown.stdout, (args, shown.stdout)


MY_AGENT = """
from orchestrator import Agent, Finish, Outcome, Step, StepContext


class Hello(Step):
    async def run(self, ctx: StepContext) -> Outcome:
        return Finish(result={"hello": ctx.input["name"]})


myagent = Agent("myagent", first=Hello)
"""


def serve_in(folder: Path, script: Path, env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [str(script), "serve", "--agents", "myagent", "--poll-seconds", "0.2", "--log-json"],
        cwd=folder,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


async def test_serve_finds_an_agent_module_in_the_working_directory(
    database_url: str, store: RunStore, tmp_path: Path
) -> None:
    """The installed ``orchestrator`` script, run in the folder holding ``myagent.py``, imports it
    as ``python -m`` would: the working directory is on the import path."""
    (tmp_path / "myagent.py").write_text(MY_AGENT)
    script = Path(sys.executable).parent / "orchestrator"
    assert script.exists(), script
    env = {**os.environ, "ORCHESTRATOR_DATABASE_URL": database_url}
    env.pop("PYTHONPATH", None)
    run_id = (await store.submit("myagent", {"name": "ana"})).run.run_id
    with serve_in(tmp_path, script, env) as serve:
        try:
            with anyio.fail_after(30):
                while not (run := await store.get(run_id)).state.terminal:
                    assert serve.poll() is None, serve.communicate()[1]
                    await anyio.sleep(0.1)
        finally:
            serve.terminate()
            serve.wait(20)
    assert run.result == {"hello": "ana"}
