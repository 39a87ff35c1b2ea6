"""`serve --metrics-listen`: Prometheus text scraped over real HTTP on loopback, and a readiness
endpoint that fails while PostgreSQL is down and recovers after."""

from __future__ import annotations

import json
import signal
import urllib.error
import urllib.request
from pathlib import Path

import anyio
import asyncpg
import pytest

from orchestrator.db.embedded import EmbeddedPostgres
from orchestrator.db.limits import LimitStore
from orchestrator.db.rates import RateLimitStore
from orchestrator.db.store import RunStore
from orchestrator.effect_model import Effect
from orchestrator.effects.store import EffectStore
from orchestrator.errors import InvalidInput
from orchestrator.worker.metrics_endpoint import parse_listen
from support import ServeProcess, started_and_migrated, submit_all
from test_effects_processes import start_dispatcher, vendors_on_loopback
from test_effects_proxy import free_port
from test_serve_faults import wait_all_terminal

pytestmark = pytest.mark.slow


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()
    except urllib.error.URLError as error:  # not listening yet
        return 0, str(error.reason)


async def until_status(url: str, status: int, within: float) -> str:
    """Poll ``url`` (bounded) until it answers ``status``; its body."""
    for _ in range(int(within / 0.25)):
        code, body = await anyio.to_thread.run_sync(get, url)
        if code == status:
            return body
        await anyio.sleep(0.25)
    raise AssertionError(f"{url} never answered {status}; last {code}: {body}")


def samples(text: str, name: str) -> dict[str, float]:
    """``{labels: value}`` of one metric in Prometheus text."""
    found: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            labels, _, value = line.rpartition(" ")
            found[labels[len(name) :]] = float(value)
    return found


def by_agent(found: dict[str, float]) -> dict[str, float]:
    return {
        labels.split('agent="', 1)[1].split('"', 1)[0]: value for labels, value in found.items()
    }


async def test_metrics_are_scraped_and_readiness_follows_the_database(
    own_server: EmbeddedPostgres,
) -> None:
    settings = await started_and_migrated(own_server)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    done = await submit_all(settings, "noop", [{}] * 5)
    await submit_all(settings, "backlog", [{}] * 3)  # nobody serves it: the queue gauges show it
    with ServeProcess(
        settings.database_url,
        "--agents",
        "orchestrator.agents.noop",
        "--metrics-listen",
        f"127.0.0.1:{port}",
        "--poll-seconds",
        "0.2",
        name="metrics-worker",
    ) as worker:
        await wait_all_terminal(settings, done, within=60)
        await until_status(f"{base}/ready", 200, within=60)
        text = await until_status(f"{base}/metrics", 200, within=60)
        claims = samples(text, "orchestrator_claims_total")
        assert sum(claims.values()) == 5 and all('agent="noop"' in k for k in claims)
        finished = samples(text, "orchestrator_runs_finished_total")
        assert sum(finished.values()) == 5, text
        assert samples(text, "orchestrator_step_duration_seconds_count")
        # The gauges are sampled every 10 s: the first sample may predate the claims.
        for _ in range(100):
            queued = by_agent(samples(text, "orchestrator_runs_queued"))
            if queued == {"backlog": 3.0}:
                break
            await anyio.sleep(0.25)
            text = (await anyio.to_thread.run_sync(get, f"{base}/metrics"))[1]
        assert queued == {"backlog": 3.0}, text
        oldest = by_agent(samples(text, "orchestrator_runs_oldest_due_age_seconds"))
        assert oldest["backlog"] > 0
        assert samples(text, "orchestrator_effects_awaiting_approval") == {
            '{otel_scope_name="orchestrator",otel_scope_schema_url="",otel_scope_version=""}': 0
        }
        assert "metrics-worker" not in text  # no series per worker id (a new one per restart)
        assert (await anyio.to_thread.run_sync(get, f"{base}/nothing"))[0] == 404

        await anyio.to_thread.run_sync(lambda: own_server.stop(mode="fast"))
        down = json.loads(await until_status(f"{base}/ready", 503, within=60))
        assert down["ready"] is False and "database" in down["reason"]
        assert (await anyio.to_thread.run_sync(get, f"{base}/metrics"))[0] == 200
        await anyio.to_thread.run_sync(own_server.ensure_running)
        up = json.loads(await until_status(f"{base}/ready", 200, within=60))
        assert up == {"ready": True, "reason": "ready"}
        assert worker.process.poll() is None


async def test_every_counter_is_exposed_at_zero_before_its_first_event(database_url: str) -> None:
    """``increase()`` alerts need a series to exist before the first lost lease or refusal."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    with ServeProcess(
        database_url,
        "--agents",
        "orchestrator.agents.noop",
        "--metrics-listen",
        f"127.0.0.1:{port}",
        name="zero-worker",
    ):
        await until_status(f"{base}/ready", 200, within=30)
        text = (await anyio.to_thread.run_sync(get, f"{base}/metrics"))[1]
    for name in (
        "orchestrator_lease_lost_total",
        "orchestrator_lease_renewal_failures_total",
        "orchestrator_effects_stale_rejections_total",
    ):
        assert list(samples(text, name).values()) == [0.0], (name, text)
    assert by_agent(samples(text, "orchestrator_claims_total")) == {"noop": 0.0}, text
    finished = samples(text, "orchestrator_runs_finished_total")
    for disposition in ("succeeded", "failed", "dead", "waiting"):
        assert [v for k, v in finished.items() if f'"{disposition}"' in k] == [0.0], text
    steps = samples(text, "orchestrator_steps_total")
    for outcome in ("next", "finish", "fail", "wait", "error"):
        assert [v for k, v in steps.items() if f'outcome="{outcome}"' in k] == [0.0], text


def test_a_bad_listen_address_is_one_line() -> None:
    for bad in ("9464", "localhost:", "host:99999", ":80x"):
        with pytest.raises(InvalidInput, match="--metrics-listen takes HOST:PORT"):
            parse_listen(bad)
    assert parse_listen("[::1]:9464") == ("::1", 9464)


async def test_the_dispatcher_counts_outcomes_and_people_waiting(
    database_url: str, store: RunStore, pool: asyncpg.Pool, tmp_path: Path
) -> None:
    await store.submit("agent", {})
    await store.submit("agent", {})
    first, second = (await store.claim("W", ["agent"], limit=2, lease_seconds=60)).claimed
    async with pool.acquire() as db, db.transaction():
        effects = EffectStore(pool)
        await effects.accept(
            db, first.run_id, first.fence, Effect("note", "crm", {"n": 1}), worker_id="W"
        )
        gated = Effect("refund", "crm", {"amount": 500}, requires_approval=True)
        await effects.accept(db, second.run_id, second.fence, gated, worker_id="W")
    port = free_port()
    async with vendors_on_loopback(tmp_path) as (vendor, _, config):
        dispatcher = start_dispatcher(
            database_url,
            config,
            "--poll-seconds",
            "0.1",
            "--metrics-listen",
            f"127.0.0.1:{port}",
            "--log-json",
        )
        try:
            base = f"http://127.0.0.1:{port}"
            await until_status(f"{base}/ready", 200, within=60)
            for _ in range(80):
                text = (await anyio.to_thread.run_sync(get, f"{base}/metrics"))[1]
                outcomes = samples(text, "orchestrator_effects_outcomes_total")
                if any(value for value in outcomes.values()):
                    break
                await anyio.sleep(0.25)
            counted = {k: v for k, v in outcomes.items() if v}
            assert list(counted.values()) == [1.0], outcomes
            assert 'kind="crm"' in next(iter(counted)) and 'outcome="confirmed"' in next(
                iter(counted)
            )
            # Every configured kind's other outcomes are there at 0, ready for increase().
            for kind in ("crm", "email"):
                assert sum(f'kind="{kind}"' in k for k in outcomes) == 8
            waiting = samples(text, "orchestrator_effects_awaiting_approval")
            assert list(waiting.values()) == [1.0], text
            assert samples(text, "orchestrator_effects_send_duration_seconds_count")
        finally:
            dispatcher.send_signal(signal.SIGTERM)
            assert dispatcher.wait(60) == 0
    assert len(vendor.deliveries) == 1


async def test_limit_gauges_and_held_back_claims_are_scraped_per_agent_and_limit(
    database_url: str, pool: asyncpg.Pool, store: RunStore
) -> None:
    """Flow control's series: per agent and limit name, never per key (unbounded)."""
    await LimitStore(pool).set("sleepy", 1, per="key")
    await RateLimitStore(pool).set("model:gpt-4o-mini", requests=100)
    for key in ("acme", "acme", "globex-1"):
        await store.submit("sleepy", {"steps": 1, "seconds": 30}, concurrency_key=key)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    with ServeProcess(
        database_url,
        "--agents",
        "orchestrator.agents.sleepy",
        "--metrics-listen",
        f"127.0.0.1:{port}",
        "--poll-seconds",
        "0.2",
        name="limits-worker",
    ):
        await until_status(f"{base}/ready", 200, within=60)
        for _ in range(200):  # the gauges are sampled every 10 s
            text = (await anyio.to_thread.run_sync(get, f"{base}/metrics"))[1]
            running = samples(text, "orchestrator_limit_running")
            held = sum(samples(text, "orchestrator_claims_held_back_total").values())
            if list(running.values()) == [1.0] and held >= 1:
                break
            await anyio.sleep(0.25)
    [labels] = running
    assert 'agent="sleepy"' in labels and 'limit="sleepy per key, keys *"' in labels, text
    assert list(samples(text, "orchestrator_limit_backlog").values()) == [1.0], text  # acme's 2nd
    assert list(samples(text, "orchestrator_limit_max_running").values()) == [1.0], text
    assert held >= 1, text
    paused = samples(text, "orchestrator_rate_limit_paused")
    assert list(paused.values()) == [0.0] and 'limit="model:gpt-4o-mini"' in next(iter(paused))
    assert "acme" not in text and "globex-1" not in text  # no series per key
