"""Rate limits shared by every worker and dispatcher (docs/flow-control.md): a token bucket in
PostgreSQL that model calls and sends are charged against, a provider's 429 pausing everyone,
and a run waiting for capacity visible as such."""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path

import anyio
import asyncpg
import pytest

from orchestrator.access import Actor
from orchestrator.agent.llm import ModelCallFailed, complete
from orchestrator.agent.rates import RateLimitWait, RateScope, rate_scope, take_rate
from orchestrator.db.limits import LimitStore
from orchestrator.db.rates import RateLimitStore
from orchestrator.db.run_reads import RunReads
from orchestrator.db.store import RunStore
from orchestrator.effect_model import Effect
from orchestrator.effects.store import EffectStore
from orchestrator.errors import InvalidInput
from orchestrator.models import RunState
from orchestrator.settings import Settings
from orchestrator.testing import LocalVendor
from orchestrator.testing.loopback import LocalModelServer
from support import ServeProcess, crm_kind, serving, write_vendors_config
from test_flow_control import cli

ARRIVAL_JITTER = 2.0
"""How much closer together than their grants two requests may arrive: the time between a
grant in the database and the request reaching the server varies on a busy machine."""


def most_in_any_window(arrivals: Sequence[float], burst: int, per_second: float) -> list[str]:
    """The windows of arrivals that no bucket of ``burst`` refilled at ``per_second`` (with
    ``ARRIVAL_JITTER``) could have granted: empty when the limit held."""
    times = sorted(arrivals)
    over = []
    for first in range(len(times)):
        for last in range(first + burst, len(times)):
            span = times[last] - times[first]
            allowed = burst + per_second * (span + ARRIVAL_JITTER)
            if last - first + 1 > allowed:
                over.append(f"{last - first + 1} requests within {span:.2f}s")
    return over


def sent_during_pause(arrivals: Sequence[float], lasting: float) -> list[float]:
    """When requests came (seconds after the first, refused with 429) while the pause it set
    lasted, from 1.5 s on (the pause may be written that late on a busy machine)."""
    refused_at, *later = sorted(arrivals)
    return [t - refused_at for t in later if refused_at + 1.5 < t < refused_at + lasting]


@contextmanager
def asking_workers(
    settings: Settings, server: LocalModelServer, model: str, count: int
) -> Iterator[None]:
    """``count`` `serve` processes running the ``asking`` agent against ``server``'s ``model``."""
    env = {"OPENAI_BASE_URL": server.base_url, "ORCHESTRATOR_MODEL": model}
    options = serving("support.agents_for_tests")
    with ExitStack() as stack:
        for number in range(1, count + 1):
            stack.enter_context(
                ServeProcess(str(settings.database_url), *options, name=f"w{number}", env=env)
            )
        yield


async def until_all_answered(
    pool: asyncpg.Pool, while_waiting: Callable[[], Awaitable[None]] | None = None
) -> None:
    """Until every ``asking`` run has succeeded (bounded), calling ``while_waiting`` each poll."""
    with anyio.fail_after(120):
        while await pool.fetchval(
            "SELECT count(*) FROM runs WHERE agent = 'asking' AND state <> 'succeeded'"
        ):
            if while_waiting is not None:
                await while_waiting()
            await anyio.sleep(0.1)


async def test_a_bucket_grants_one_interval_then_says_how_long_to_wait(pool: asyncpg.Pool) -> None:
    rates = RateLimitStore(pool)
    await rates.set("api:crm", requests=3, per_seconds=3600)
    taken = await rates.take("api:crm", 5)
    assert taken.granted == 3
    assert 600 < taken.wait_seconds <= 1200  # a third of the interval, for one more
    again = await rates.take("api:crm", 1)
    assert again.granted == 0 and again.wait_seconds > 600
    assert (await rates.take("api:no-such-limit", 7)).granted == 7  # nothing limits it


async def test_tokens_are_taken_with_the_request_and_settled_by_what_it_cost(
    pool: asyncpg.Pool,
) -> None:
    rates = RateLimitStore(pool)
    await rates.set("model:m", tokens=1000, per_seconds=3600)
    assert (await rates.take("model:m", 1, 800)).granted == 1
    refused = await rates.take("model:m", 1, 800)
    assert refused.granted == 0 and refused.wait_seconds > 0
    await rates.settle("model:m", -700)  # the answer cost 100 tokens, not the 800 estimated
    assert (await rates.take("model:m", 1, 800)).granted == 1
    # A call estimated at more than the whole bucket waits for a full bucket, never forever.
    await rates.set("model:small", tokens=100, per_seconds=3600)
    assert (await rates.take("model:small", 1, 5000)).granted == 1
    [small] = await rates.list("model:small")
    assert small.tokens_left is not None and small.tokens_left < 0  # overdrawn: later calls wait


async def test_a_pause_holds_every_taker_and_a_shorter_one_never_shortens_it(
    pool: asyncpg.Pool,
) -> None:
    rates = RateLimitStore(pool)
    await rates.pause("model:p", 30, "w1")  # a 429 for a model nobody set a limit for
    taken = await rates.take("model:p", 1)
    assert taken.granted == 0 and 20 < taken.wait_seconds <= 30
    await rates.pause("model:p", 1, "w2")
    [paused] = await rates.list("model:p")
    assert paused.paused_by == "w1" and paused.requests is None and paused.tokens is None
    await rates.set("model:p", requests=10, per_seconds=1)  # a limit keeps the pause
    assert (await rates.take("model:p", 1)).granted == 0
    await rates.clear("model:p")
    assert (await rates.take("model:p", 1)).granted == 1


@pytest.mark.parametrize(
    ("options", "why"),
    [
        ({"requests": 0}, "requests must be"),
        ({"requests": -5}, "requests must be"),
        ({"requests": 2.5}, "requests must be"),
        ({"requests": True}, "requests must be"),
        ({"requests": 10**10}, "requests must be"),
        ({"tokens": 0}, "tokens must be"),
        ({"tokens": math.nan}, "tokens must be"),
        ({"tokens": 10**13}, "tokens must be"),
        ({}, "needs requests, tokens or both"),
        ({"requests": 5, "per_seconds": 0}, "interval"),
        ({"requests": 5, "per_seconds": -1}, "interval"),
        ({"requests": 5, "per_seconds": math.nan}, "interval"),
        ({"requests": 5, "per_seconds": math.inf}, "interval"),
        ({"requests": 5, "per_seconds": 10**9}, "interval"),
    ],
)
async def test_a_bad_rate_limit_is_one_line_and_changes_nothing(
    pool: asyncpg.Pool, options: dict[str, object], why: str
) -> None:
    rates = RateLimitStore(pool)
    with pytest.raises(InvalidInput, match=why) as raised:
        await rates.set("model:m", **options)  # type: ignore[arg-type]
    assert "\n" not in str(raised.value)
    assert await rates.list() == []
    assert await pool.fetchval("SELECT count(*) FROM audit_log") == 0


@pytest.mark.parametrize(
    "name", ["", " model:m", "model m", "x" * 201, "model:\x00", "-model", None, 7]
)
async def test_a_bad_rate_limit_name_is_refused_everywhere(
    pool: asyncpg.Pool, name: object
) -> None:
    rates = RateLimitStore(pool)
    with pytest.raises(InvalidInput, match="name"):
        await rates.set(name, requests=1)  # type: ignore[arg-type]
    with pytest.raises(InvalidInput, match="name"):
        await rates.clear(name)  # type: ignore[arg-type]
    with pytest.raises(InvalidInput, match="name"):
        await take_rate(name)  # type: ignore[arg-type]
    assert await rates.list() == []


async def test_clearing_an_unknown_rate_limit_says_so_and_decisions_are_audited(
    pool: asyncpg.Pool,
) -> None:
    rates = RateLimitStore(pool)
    with pytest.raises(InvalidInput, match="no rate limit named 'model:gone'"):
        await rates.clear("model:gone")
    await rates.set("model:m", requests=5, tokens=900, actor=Actor.acting(None, "vendor contract"))
    await rates.clear("model:m")
    rows = await pool.fetch("SELECT action FROM audit_log ORDER BY seq")
    assert [r["action"] for r in rows] == ["rate_limit_set", "rate_limit_cleared"]


@pytest.mark.parametrize(
    "call",
    [
        "SELECT * FROM orchestrator_rate_take('model:m', 0, 0, NULL, NULL)",
        "SELECT * FROM orchestrator_rate_take('model:m', -1, 0, NULL, NULL)",
        "SELECT * FROM orchestrator_rate_take('model:m', 1, -5, NULL, NULL)",
        "SELECT * FROM orchestrator_rate_take('model:m', NULL, 0, NULL, NULL)",
        "SELECT * FROM orchestrator_rate_pause('model:m', 'NaN', 'w')",
        "SELECT * FROM orchestrator_rate_pause('model:m', 1e9, 'w')",
        "SELECT * FROM orchestrator_rate_pause('bad name', 1, 'w')",
        "SELECT * FROM orchestrator_rate_pause('model:m', 1, NULL)",
        "SELECT * FROM orchestrator_set_rate_limit('model:m', 5, NULL, 'NaN', NULL, 'database',"
        " NULL)",
        "SELECT * FROM orchestrator_set_rate_limit('model:m', NULL, NULL, 60, NULL, 'database',"
        " NULL)",
        "SELECT * FROM orchestrator_declare_limits('a', '{\"not\": \"a list\"}', 'w')",
        'SELECT * FROM orchestrator_declare_limits(\'a\', \'[{"key_pattern": "*", "per": '
        '"all", "max_running": -1}]\', \'w\')',
    ],
)
async def test_the_database_refuses_hostile_arguments_and_changes_nothing(
    pool: asyncpg.Pool, call: str
) -> None:
    await RateLimitStore(pool).set("model:m", requests=5)
    before = await pool.fetch("SELECT * FROM rate_limits")
    with pytest.raises(asyncpg.PostgresError):
        await pool.fetch(call)
    assert await pool.fetch("SELECT * FROM rate_limits") == before
    assert await pool.fetchval("SELECT count(*) FROM flow_limits") == 0


async def test_a_run_waiting_for_capacity_is_listed_as_such_and_its_timeline_says_why(
    store: RunStore, pool: asyncpg.Pool
) -> None:
    rates = RateLimitStore(pool)
    await rates.set("api:crm", requests=1, per_seconds=60)
    await store.submit("a", {})
    run = (await store.claim("w1", ["a"], limit=1, lease_seconds=60)).claimed[0]
    scope = RateScope(rates, run.run_id, run.fence, "w1")
    assert await scope.take("api:crm") == 0.0  # the bucket's one request
    waited: list[float] = []

    async def wait_in_a_step() -> None:
        with rate_scope(scope):
            waited.append(await take_rate("api:crm"))

    async with anyio.create_task_group() as group:
        group.start_soon(wait_in_a_step)
        with anyio.fail_after(30):
            while True:
                [listed] = await RunReads(pool).list_runs()
                if listed.held_back is not None:
                    break
                await anyio.sleep(0.05)
        assert listed.held_back == "rate limit api:crm" and listed.state is RunState.RUNNING
        await rates.set("api:crm", requests=1000, per_seconds=1)  # raised: the wait ends
    assert waited and waited[0] > 0
    await rates.set("api:crm", requests=1, per_seconds=60)
    assert await scope.take("api:crm") == 0.0
    with pytest.raises(RateLimitWait, match="api:crm") as raised:
        await scope.take("api:crm", within=5)  # the next is a minute away: no use waiting
    assert "\n" not in str(raised.value)
    events = await pool.fetch(
        "SELECT details FROM run_events WHERE run_id = $1 AND kind = 'held_back'", run.run_id
    )
    assert len(events) == 1, events  # one event per claim, however often it asked again


async def test_four_workers_never_exceed_a_shared_model_rate_limit(
    settings: Settings, store: RunStore, pool: asyncpg.Pool
) -> None:
    # Four `serve` processes run 24 one-call runs against a model limited to 4 requests per 2
    # seconds. Every window of requests at the model fits one burst plus the rate; runs waiting
    # for capacity are listed as such.
    await RateLimitStore(pool).set("model:shared-model", requests=4, per_seconds=2)
    for i in range(24):
        await store.submit("asking", {"question": i})
    seen: set[str | None] = set()

    async def look() -> None:
        seen.update(run.held_back for run in await RunReads(pool).list_runs(agent="asking"))

    async with LocalModelServer() as server:
        with asking_workers(settings, server, "shared-model", 4):
            await until_all_answered(pool, look)
        arrivals = list(server.arrivals)
    assert len(arrivals) == 24
    assert most_in_any_window(arrivals, burst=4, per_second=2.0) == []
    assert "rate limit model:shared-model" in seen
    waits = await pool.fetchval(
        "SELECT count(*) FROM run_events WHERE kind = 'held_back' AND details->>'by' = 'rate'"
    )
    assert waits > 0


async def test_a_model_s_429_with_retry_after_pauses_every_worker(
    settings: Settings, store: RunStore, pool: asyncpg.Pool
) -> None:
    # One request a second between two workers; the model answers the first with 429 and
    # Retry-After: 6. Nobody calls it again until the pause is over, not only the worker that
    # was told.
    await RateLimitStore(pool).set("model:paused-model", requests=1, per_seconds=1)
    for i in range(8):
        await store.submit("asking", {"question": i})
    async with LocalModelServer() as server:
        server.busy_for, server.retry_after = 1, 6.0
        with asking_workers(settings, server, "paused-model", 2):
            await until_all_answered(pool)
        arrivals = sorted(server.arrivals)
    during_pause = sent_during_pause(arrivals, lasting=5)
    assert during_pause == [], during_pause
    assert len(arrivals) == 9  # eight answers and the one 429


async def accepted_crm_effects(store: RunStore, pool: asyncpg.Pool, count: int) -> None:
    for i in range(count):
        await store.submit("agent", {"i": i})
        run = (await store.claim("W", ["agent"], limit=1, lease_seconds=600)).claimed[0]
        async with pool.acquire() as db, db.transaction():
            effect = Effect("crm-note", "crm", {"note": i})
            await EffectStore(pool).accept(db, run.run_id, run.fence, effect, worker_id="W")


async def dispatched(
    database_url: str, vendor: LocalVendor, tmp_path: Path, *, expected: int
) -> None:
    """Two `effects dispatch` processes until the vendor has ``expected`` deliveries."""
    config = write_vendors_config(tmp_path, {"crm": crm_kind(vendor, timeout_seconds=10)})
    options = ["--effects-config", config, "--lease-seconds", "10", "--poll-seconds", "0.1"]
    dispatch = ("effects", "dispatch")
    with (
        ServeProcess(database_url, *options, "--dispatcher-id", "D1", name="D1", command=dispatch),
        ServeProcess(database_url, *options, "--dispatcher-id", "D2", name="D2", command=dispatch),
    ):
        with anyio.fail_after(120):
            while len(vendor.deliveries) < expected:  # noqa: ASYNC110 - vendor state, polled
                await anyio.sleep(0.05)


async def test_dispatchers_share_an_effect_kind_s_rate_limit_and_send_each_effect_once(
    database_url: str, store: RunStore, pool: asyncpg.Pool, tmp_path: Path
) -> None:
    await RateLimitStore(pool).set("effect:crm", requests=3, per_seconds=2)
    await accepted_crm_effects(store, pool, 12)
    async with LocalVendor() as vendor:
        await dispatched(database_url, vendor, tmp_path, expected=12)
    assert set(vendor.requests_by_key.values()) == {1}
    assert most_in_any_window(vendor.arrivals, burst=3, per_second=1.5) == []


async def test_a_vendor_s_429_with_retry_after_pauses_the_kind_for_every_dispatcher(
    database_url: str, store: RunStore, pool: asyncpg.Pool, tmp_path: Path
) -> None:
    await RateLimitStore(pool).set("effect:crm", requests=1, per_seconds=1)
    await accepted_crm_effects(store, pool, 6)
    async with LocalVendor() as vendor:
        vendor.busy_for, vendor.retry_after = 1, 6.0
        await dispatched(database_url, vendor, tmp_path, expected=6)
    arrivals = sorted(vendor.arrivals)
    during_pause = sent_during_pause(arrivals, lasting=5)
    assert during_pause == [], during_pause
    assert len(vendor.deliveries) == 6 and vendor.requests == 7


async def test_a_tool_agent_s_model_turn_waits_for_the_limit_and_gives_up_past_its_time(
    pool: asyncpg.Pool,
) -> None:
    # ``complete`` (ToolAgent's model turn) takes the model's limit before every attempt; one
    # that cannot have capacity within the turn's time fails without calling the model.
    rates = RateLimitStore(pool)
    await rates.set("model:tool-model", requests=2, tokens=100_000, per_seconds=3600)
    async with LocalModelServer() as server:
        env = {"OPENAI_BASE_URL": server.base_url}
        with rate_scope(RateScope(rates, who="test")):
            for _ in range(2):
                await complete([{"role": "user", "content": "hi"}], model="tool-model", environ=env)
            with pytest.raises(ModelCallFailed, match="model:tool-model"):
                await complete(
                    [{"role": "user", "content": "hi"}],
                    model="tool-model",
                    environ=env,
                    budget_seconds=5,
                )
    assert len(server.requests) == 2
    [limit] = await rates.list("model:tool-model")
    # Each call was charged its estimate, then settled to what the server said it cost.
    assert limit.tokens_left is not None and 100_000 - limit.tokens_left < 2 * 1024


async def test_the_cli_sets_lists_and_clears_rate_limits_and_shows_held_back_runs(
    settings: Settings, store: RunStore, pool: asyncpg.Pool
) -> None:
    done = await asyncio.to_thread(
        cli, settings, "rates", "set", "model:gpt-4o", "--requests", "500", "--tokens",
        "400000", "--per", "60", "--json",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    shown = json.loads(done.stdout)
    assert (shown["requests"], shown["tokens"], shown["per_seconds"]) == (500, 400000, 60.0)
    done = await asyncio.to_thread(cli, settings, "rates", "list", "--json")
    (listed,) = json.loads(done.stdout)
    assert listed["name"] == "model:gpt-4o" and listed["paused_until"] is None
    done = await asyncio.to_thread(cli, settings, "rates", "list")
    assert "model:gpt-4o" in done.stdout and "500 of 500" in done.stdout
    for bad, why in (
        (["--requests", "-1"], "requests must be"),
        (["--requests", "5", "--per", "nan"], "interval"),
        (["--requests", "5", "--per", "0"], "interval"),
        ([], "needs requests, tokens or both"),
    ):
        done = await asyncio.to_thread(cli, settings, "rates", "set", "model:x", *bad)
        assert done.returncode == 1, (bad, done.stderr)
        assert why in done.stderr and done.stderr.strip().count("\n") == 0, done.stderr
    done = await asyncio.to_thread(cli, settings, "rates", "clear", "model:nope")
    assert done.returncode == 1 and "no rate limit named 'model:nope'" in done.stderr
    done = await asyncio.to_thread(cli, settings, "rates", "clear", "model:gpt-4o")
    assert done.returncode == 0, done.stderr
    assert await RateLimitStore(pool).list() == []
    # A run held back by a full limit: `runs list` names the limit.
    await LimitStore(pool).set("a", 0, per="key")
    await store.submit("a", {}, concurrency_key="acme")
    done = await asyncio.to_thread(cli, settings, "runs", "list", "--json")
    (run,) = json.loads(done.stdout)
    assert run["held_back"] == "a per key, keys *: at most 0 running"
    done = await asyncio.to_thread(cli, settings, "runs", "list")
    assert "held back by" in done.stdout and "acme" in done.stdout


async def test_a_429_pauses_every_worker_even_where_no_operator_set_a_limit(
    settings: Settings, store: RunStore, pool: asyncpg.Pool
) -> None:
    # Runs keep arriving, one every 0.3 s, for two workers; the model's first answer is a 429
    # with Retry-After: 5. No model call reaches it while the pause lasts, from either worker.
    async with LocalModelServer() as server:
        server.busy_for, server.retry_after = 1, 5.0
        with asking_workers(settings, server, "unlimited-model", 2):
            for i in range(20):
                await store.submit("asking", {"question": i})
                await anyio.sleep(0.3)
            await until_all_answered(pool)
        arrivals = sorted(server.arrivals)
    during_pause = sent_during_pause(arrivals, lasting=4)
    assert during_pause == [], during_pause
    [pause] = await RateLimitStore(pool).list("model:unlimited-model")
    assert pause.requests is None and pause.tokens is None  # the pause alone, no limit
