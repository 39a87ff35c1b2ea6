"""libpq's multi-host URLs (``host1:port1,host2:port2`` with ``target_session_attrs=primary``):
the form an HA PostgreSQL is reached by. The Client, a worker and the command line all connect
through one whose first host is down (the lost primary); tests/test_failover.py does the same
through a real promotion."""

from __future__ import annotations

import json
import socket
from urllib.parse import urlsplit, urlunsplit

import pytest

from orchestrator.agents.noop import noop
from orchestrator.client import Client
from orchestrator.db.connections import redact_dsn
from orchestrator.models import RunState
from orchestrator.settings import Settings
from orchestrator.testing import running_worker
from support import cli


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def multi_host(database_url: str) -> str:
    """``database_url`` behind a dead first host, asking for the primary."""
    parts = urlsplit(database_url)
    userinfo, _, hostport = parts.netloc.rpartition("@")
    prefix = f"{userinfo}@" if userinfo else ""
    netloc = f"{prefix}127.0.0.1:{_closed_port()},{hostport}"
    query = "&".join(filter(None, [parts.query, "target_session_attrs=primary"]))
    return urlunsplit(parts._replace(netloc=netloc, query=query))


async def test_client_and_worker_reach_the_primary_through_a_multi_host_url(
    database_url: str,
) -> None:
    settings = Settings(database_url=multi_host(database_url))
    async with (
        await Client.connect(settings) as client,
        running_worker(settings, [noop], poll_seconds=0.1),
    ):
        run = await client.submit("noop", {"n": 1})
        finished = await client.wait(run.run_id, within=30)
    assert finished.state is RunState.SUCCEEDED


def test_the_command_line_takes_a_multi_host_url(database_url: str) -> None:
    url = multi_host(database_url)
    submitted = cli(url, "submit", "noop", "--input", "{}")
    assert submitted.returncode == 0, submitted.stderr
    run_id = submitted.stdout.strip()
    listed = cli(url, "runs", "list", "--json")
    assert listed.returncode == 0, listed.stderr
    assert run_id in {run["run_id"] for run in json.loads(listed.stdout)}


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        (
            "postgresql://app:s3cret@db1:5432,db2:5433/orch?target_session_attrs=primary",
            "postgresql://app:***@db1:5432,db2:5433/orch?target_session_attrs=primary",
        ),
        ("postgresql://app@db1,db2/orch", "postgresql://app@db1,db2/orch"),
    ],
)
def test_a_multi_host_url_is_redacted_in_errors_and_logs(url: str, shown: str) -> None:
    assert redact_dsn(url) == shown
    Settings(database_url=url)  # accepted as it is
