"""The processes of ``effects.py`` that send: a dispatcher, its set-up, and the raw client loops.

Not a benchmark itself. Run by the current interpreter or by a baseline one (an older release
installed in another virtualenv, started with ``-P`` so that this tree is not on its path), so
it imports the standard library and only the API that every release shares:
``Dispatcher(pool, adapters, dispatcher_id=, lease_seconds=, batch=, concurrency=,
poll_seconds=)``, ``adapter_from_config``, ``RunStore.claim``, ``EffectStore.accept``,
``migrate``, ``connect`` and ``create_pool``. Each command prints its answers on stdout as
``@@ {json}`` lines (anything else there is ignored) and reads its cues on stdin:

* ``installed``: which orchestrator this interpreter imports (checked before anything runs);
* ``setup DSN PREFIX AGENT COUNT``: migrate the database with this release's migrations, then
  create COUNT accepted effect records the way a step commit does (runs inserted, claimed, and
  each run's effect accepted in a transaction); answers which orchestrator it imported;
* ``dispatch DSN URL CONCURRENCY BATCH POLL NAME``: open a pool (concurrency + 2 connections,
  with the release's ``effects dispatch`` pool options) and build a ``Dispatcher`` for kind
  ``crm`` (``http`` adapter, reconcile ``lookup``), say ``ready``, start at ``go``, and at
  ``stop`` answer the CPU time this process spent between the two (``resource.getrusage``:
  user + system) and the dispatcher's outcome counts; with ``EFFECTS_DISPATCH_PROFILE=PATH``
  in the environment it runs under ``cProfile`` and writes its stats to ``PATH.NAME`` (read
  them with ``pstats``);
* ``raw URL COUNT CONCURRENCY CLIENT PREFIX MAX_SECONDS``: the physical limit of the same
  requests, with ``httpx`` or ``aiohttp`` (one client, CONCURRENCY tasks, keep-alive):
  ``ready``, then at ``go`` COUNT POSTs of the dispatcher's payloads, each with its own
  ``Idempotency-Key``; answers the seconds from go to the last answer and the CPU time over
  the same span (after MAX_SECONDS no new request is started: it answers how many it sent).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import platform
import resource
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

MARK = "@@ "
KIND = "crm"
EFFECT_KEY = "crm-update"
ACCEPT_BATCH = 500
SETUP_LEASE_SECONDS = 3_600.0
TIMEOUT_SECONDS = 10.0

INSERT_RUNS_SQL = """
INSERT INTO runs (run_id, agent, input)
SELECT $1 || lpad(g::text, 6, '0'), $2, jsonb_build_object('n', g)
FROM generate_series(1, $3) AS g
"""


def say(**answer: Any) -> None:
    print(MARK + json.dumps(answer, default=str), flush=True)


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def payload(n: int) -> dict[str, Any]:
    """The body of every effect and raw request: the same shape and size for both."""
    return {"customer": "bench", "n": n}


async def cue(expected: str) -> None:
    """Wait for the line ``expected`` on stdin (off the event loop)."""
    line = await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    if line.strip() != expected:
        raise SystemExit(f"expected {expected!r} on stdin, got {line.strip()!r}")


def installed() -> dict[str, Any]:
    """Which orchestrator this interpreter imports, and its version."""
    from importlib.metadata import packages_distributions, version

    import orchestrator

    distribution = (packages_distributions().get("orchestrator") or ["orchestrator"])[0]
    return {
        "distribution": distribution,
        "orchestrator_version": version(distribution),
        "package": orchestrator.__file__,
        "python": platform.python_version(),
    }


def quiet_logs() -> None:
    try:
        from orchestrator.telemetry import configure_logging
    except ImportError:  # an old release: its default logging
        return
    configure_logging(json_logs=True, level="warning")


async def open_connection(dsn: str) -> Any:
    from orchestrator.settings import Settings

    try:
        from orchestrator.db.connections import connect
    except ModuleNotFoundError:  # older releases
        from orchestrator.database import connect  # type: ignore[import-not-found,no-redef,unused-ignore]
    return await connect(Settings(database_url=dsn), application_name="bench-effects-setup")


async def open_pool(dsn: str, name: str, size: int, *, dispatcher: bool = False) -> Any:
    """A pool of ``size`` connections; a ``dispatcher``'s is opened with the options the
    installed release's ``effects dispatch`` uses (``DISPATCH_POOL``, where it has one)."""
    from orchestrator.settings import Settings

    try:
        from orchestrator.db.connections import create_pool
    except ModuleNotFoundError:  # older releases
        from orchestrator.database import create_pool  # type: ignore[import-not-found,no-redef,unused-ignore]
    options: dict[str, Any] = {}
    if dispatcher:
        from orchestrator.effects import dispatcher as module

        options = dict(getattr(module, "DISPATCH_POOL", {}))
    return await create_pool(
        Settings(database_url=dsn), application_name=name, min_size=size, max_size=size, **options
    )


async def setup(dsn: str, prefix: str, agent: str, count: int) -> None:
    from orchestrator.db.store import RunStore
    from orchestrator.effects.store import EffectStore

    try:
        from orchestrator.effect_model import Effect
    except ModuleNotFoundError:  # releases before the effect values moved to the ground floor
        from orchestrator.effects.model import Effect  # type: ignore[import-not-found,no-redef,unused-ignore]

    try:
        from orchestrator.db.migrations import migrate
    except ModuleNotFoundError:  # older releases
        from orchestrator.migrations import migrate  # type: ignore[import-not-found,no-redef,unused-ignore]

    started = time.perf_counter()
    connection = await open_connection(dsn)
    try:
        await migrate(connection)
        await connection.execute(INSERT_RUNS_SQL, prefix, agent, count)
    finally:
        await connection.close()
    pool = await open_pool(dsn, "bench-effects-setup", 4)
    try:
        store, effects = RunStore(pool), EffectStore(pool)
        accepted = 0
        while accepted < count:
            batch = await store.claim(
                "bench-requester",
                [agent],
                limit=min(ACCEPT_BATCH, count - accepted),
                lease_seconds=SETUP_LEASE_SECONDS,
            )
            if not batch.claimed:
                raise SystemExit(f"set-up claimed {accepted} of {count} runs, then none")
            async with pool.acquire() as db, db.transaction():
                for run in batch.claimed:
                    effect = Effect(EFFECT_KEY, KIND, payload(int(run.input["n"])))
                    answer = await effects.accept(
                        db, run.run_id, run.fence, effect, worker_id="bench-requester"
                    )
                    if answer.outcome != "accepted":
                        raise SystemExit(f"set-up effect of {run.run_id}: {answer.outcome}")
            accepted += len(batch.claimed)
        async with pool.acquire() as db:
            await db.execute("ANALYZE runs, effects, run_events")
    finally:
        await pool.close()
    say(accepted=accepted, seconds=time.perf_counter() - started, installed=installed())


async def dispatch(
    dsn: str, url: str, concurrency: int, batch: int, poll: float, name: str
) -> None:
    from orchestrator.effects.dispatcher import Dispatcher

    try:
        from orchestrator.effects.vendors import adapter_from_config
    except ModuleNotFoundError:  # releases before effects/vendors.py
        from orchestrator.effects.adapters import adapter_from_config  # type: ignore[attr-defined,no-redef,unused-ignore]

    quiet_logs()
    adapter = adapter_from_config(
        KIND,
        {
            "adapter": "http",
            "url": f"{url}/send",
            "reconcile": "lookup",
            "lookup_url": f"{url}/requests/{{idempotency_key}}",
            "timeout_seconds": TIMEOUT_SECONDS,
        },
    )
    pool = await open_pool(dsn, name, concurrency + 2, dispatcher=True)
    try:
        dispatcher = Dispatcher(
            pool,
            {KIND: adapter},
            dispatcher_id=name,
            batch=batch,
            concurrency=concurrency,
            poll_seconds=poll,
        )
        say(ready=True, installed=installed())
        await cue("go")
        cpu_start = cpu_seconds()
        task = asyncio.create_task(dispatcher.run())
        await cue("stop")
        cpu = cpu_seconds() - cpu_start
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        outcomes = getattr(dispatcher, "outcomes", None)
        say(cpu_seconds=cpu, outcomes=dict(outcomes) if isinstance(outcomes, dict) else None)
    finally:
        await pool.close()


async def raw(
    url: str, count: int, concurrency: int, client: str, prefix: str, max_seconds: float
) -> None:
    numbers = iter(range(1, count + 1))
    sent = 0
    deadline = float("inf")
    errors: list[str] = []
    post: Callable[[int], Awaitable[None]]
    close: Callable[[], Awaitable[None]]
    if client == "httpx":
        import httpx

        session = httpx.AsyncClient(
            timeout=httpx.Timeout(TIMEOUT_SECONDS),
            limits=httpx.Limits(max_connections=concurrency),
        )

        async def post_httpx(n: int) -> None:
            headers = {"Idempotency-Key": f"{prefix}{n:06d}"}
            response = await session.post(f"{url}/send", json=payload(n), headers=headers)
            response.json()
            if response.status_code != 200:
                errors.append(f"HTTP {response.status_code}")

        post, close = post_httpx, session.aclose
    elif client == "aiohttp":
        import aiohttp

        connector = aiohttp.TCPConnector(limit=concurrency)
        aiohttp_session = aiohttp.ClientSession(
            connector=connector, timeout=aiohttp.ClientTimeout(total=TIMEOUT_SECONDS)
        )

        async def post_aiohttp(n: int) -> None:
            headers = {"Idempotency-Key": f"{prefix}{n:06d}"}
            async with aiohttp_session.post(
                f"{url}/send", json=payload(n), headers=headers
            ) as response:
                await response.json()
                if response.status != 200:
                    errors.append(f"HTTP {response.status}")

        post, close = post_aiohttp, aiohttp_session.close
    else:
        raise SystemExit(f"unknown client {client!r}")

    async def sender() -> None:
        nonlocal sent
        for n in numbers:
            await post(n)
            sent += 1
            if time.perf_counter() > deadline:
                return

    try:
        await post(0)  # connect once outside the timing
        say(ready=True)
        await cue("go")
        cpu_start, started = cpu_seconds(), time.perf_counter()
        deadline = started + max_seconds
        await asyncio.gather(*(sender() for _ in range(concurrency)))
        seconds, cpu = time.perf_counter() - started, cpu_seconds() - cpu_start
    finally:
        await close()
    say(
        seconds=seconds,
        cpu_seconds=cpu,
        sent=sent,
        timed_out=sent < count,
        errors=len(errors),
        first_error=errors[:1],
    )


def main(argv: list[str]) -> None:
    command, *args = argv
    if command == "installed":
        say(installed=installed())
    elif command == "setup":
        asyncio.run(setup(args[0], args[1], args[2], int(args[3])))
    elif command == "dispatch":
        dsn, url, concurrency, batch, poll, name = args
        run = dispatch(dsn, url, int(concurrency), int(batch), float(poll), name)
        profile_to = os.environ.get("EFFECTS_DISPATCH_PROFILE")
        if profile_to:  # where a dispatcher's CPU goes: cProfile stats, one file per process
            import cProfile

            with cProfile.Profile() as profile:
                asyncio.run(run)
            profile.dump_stats(f"{profile_to}.{name}")
        else:
            asyncio.run(run)
    elif command == "raw":
        url, count, concurrency, client, prefix, max_seconds = args
        asyncio.run(raw(url, int(count), int(concurrency), client, prefix, float(max_seconds)))
    else:
        raise SystemExit(f"unknown command {command!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
