"""Effects wait for a standby (invariants 5 and 11 through an asynchronous failover).

On a primary with an asynchronous streaming standby, the dispatcher sends an effect only once
the standby has flushed the claim that allows the send, and so the step that asked for it. A
failover then cannot take back a decision whose effect already reached a vendor: one email, one
CRM note, whatever the re-run step decides.

The standby is kept from the record by stopping the primary's walsender (SIGSTOP): whatever it
had not sent is never received, as when a machine dies with WAL in flight.
"""

from __future__ import annotations

import os
import signal

import anyio
import pytest

from orchestrator import Client, StandbyNotReached
from orchestrator.db.bootstrap import ensure_schema
from orchestrator.db.standby_wait import StandbyPositions
from orchestrator.effect_model import EffectStatus
from orchestrator.effects.adapters import Adapter
from orchestrator.effects.store import EffectStore
from orchestrator.effects.vendors import adapter_from_config
from orchestrator.errors import InvalidInput, RunNotFound
from orchestrator.models import RunState
from orchestrator.settings import (
    Settings,
    StandbyPolicy,
    StandbyPosition,
    StandbyWait,
    WithoutStandby,
)
from orchestrator.testing import LocalVendor, ReplicatedPostgres, SmtpSink, running_worker
from orchestrator.testing.loopback import ScriptedModelServer
from support import cli
from support.tool_agents_for_tests import ORDERS_TURNS, orders
from test_failover import (
    GRANTS,
    WORKER,
    finished,
    granted_twice,
    looked_up_crm,
    notice_worker,
    opened,
    replicated,
    submit_notices,
)

pytestmark = pytest.mark.slow


def hold_the_stream(pair: ReplicatedPostgres) -> int:
    """SIGSTOP the primary's walsender: the standby receives nothing more (the WAL already sent
    is everything committed so far, as ``wait_replayed`` made sure)."""
    pid = int(pair.primary.sql("SELECT pid FROM pg_stat_replication"))
    os.kill(pid, signal.SIGSTOP)
    return pid


def smtp(sink: SmtpSink) -> Adapter:
    return adapter_from_config(
        "email", {"adapter": "smtp", "host": "127.0.0.1", "port": sink.port, "sender": "a@b.c"}
    )


async def migrated(pair: ReplicatedPostgres, **options: object) -> Settings:
    settings = Settings(database_url=pair.dsn(), **options)  # type: ignore[arg-type]
    await ensure_schema(settings, pair.dsn(), auto_migrate=True)
    return settings


async def handed_back_on_the_primary(pair: ReplicatedPostgres, count: int) -> None:
    """Until the primary has ``count`` effects a dispatcher claimed twice or more: each was
    claimed, waited for the standby past the wait's bound, was handed back and claimed again,
    and could have been sent by now."""
    async with opened(Settings(database_url=pair.primary_dsn())) as (pool, _):
        with anyio.fail_after(90):
            while (  # noqa: ASYNC110
                await pool.fetchval("SELECT count(*) FROM orchestrator.effects WHERE attempts > 1")
                < count
            ):
                await anyio.sleep(0.05)


async def test_an_email_waits_for_the_standby_and_goes_out_once_through_a_failover() -> None:
    GRANTS.clear()
    async with replicated(synchronous=False) as pair:
        with SmtpSink() as sink:
            settings = await migrated(pair)
            async with opened(settings) as (_, store):
                run_ids = await submit_notices(store, 3, {"kind": "email"})
            await anyio.to_thread.run_sync(pair.wait_replayed)
            hold_the_stream(pair)
            async with notice_worker(settings, {"email": smtp(sink)}, dispatch_lease_seconds=5):
                await handed_back_on_the_primary(pair, 3)
                assert sink.message_ids() == []
                await anyio.to_thread.run_sync(pair.failover)
                async with opened(settings) as (pool, store):
                    states = await finished(store, run_ids, within=120)
                    effects = await EffectStore(pool).list_effects()
    assert set(states.values()) == {RunState.SUCCEEDED}, states
    assert [e.status for e in effects] == [EffectStatus.CONFIRMED] * 3
    message_ids = sink.message_ids()
    assert len(message_ids) == 3 and len(set(message_ids)) == 3, message_ids
    assert granted_twice() == []


async def test_a_tool_agent_that_decides_otherwise_on_the_replay_sends_one_note(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The model asks for another note when the lost turn is asked again (another key, which
    no lookup can match): only the note the promoted server asked for is sent."""
    async with (
        replicated(synchronous=False) as pair,
        LocalVendor() as vendor,
        ScriptedModelServer(ORDERS_TURNS) as model,
    ):
        monkeypatch.setenv("OPENAI_BASE_URL", model.base_url)
        monkeypatch.delenv("OPENAI_API_KEY", raising=False)
        settings = await migrated(pair)
        async with opened(settings) as (_, store):
            run_id = (await store.submit("orders", {"prompt": "Where is o-17?"})).run.run_id
        await anyio.to_thread.run_sync(pair.wait_replayed)
        hold_the_stream(pair)
        crm = looked_up_crm(vendor)
        async with running_worker(
            settings,
            [orders],
            effect_adapters={"crm": crm},
            start_retry_seconds=60,
            dispatch_lease_seconds=5,
            **WORKER,
        ):
            await handed_back_on_the_primary(pair, 1)
            assert vendor.requests_by_key == {}
            await anyio.to_thread.run_sync(pair.failover)
            async with opened(settings) as (pool, store):
                states = await finished(store, [run_id], within=120)
                records = await EffectStore(pool).list_effects(run_id=run_id)
    assert states == {run_id: RunState.SUCCEEDED}
    assert model.answered("Where is o-17?", 1) >= 2  # the lost turn was asked again
    assert [(r.status, r.payload["note"]) for r in records] == [
        (EffectStatus.CONFIRMED, "REPLAYED: different")
    ]
    assert list(vendor.requests_by_key.values()) == [1], vendor.requests_by_key
    assert len(vendor.deliveries) == 1


@pytest.mark.parametrize("without", [WithoutStandby.HOLD, WithoutStandby.SEND])
async def test_a_standby_away_holds_effects_or_sends_them_as_configured(
    without: WithoutStandby,
) -> None:
    async with replicated(synchronous=False) as pair:
        with SmtpSink() as sink:
            settings = await migrated(pair, standby=StandbyPolicy(without=without))
            await anyio.to_thread.run_sync(pair.stop_standby)  # its slot stays: it is expected
            async with (
                notice_worker(settings, {"email": smtp(sink)}, dispatch_lease_seconds=5) as worker,
                opened(settings) as (pool, store),
            ):
                [run_id] = await submit_notices(store, 1, {"kind": "email"})
                if without is WithoutStandby.HOLD:
                    with anyio.fail_after(60):
                        while not await EffectStore(pool).list_effects():  # noqa: ASYNC110
                            await anyio.sleep(0.05)
                    await anyio.sleep(1.5)
                    assert sink.message_ids() == []
                    probe = await worker.readiness()
                    assert not probe.ready and "no standby is connected" in probe.reason
                    await anyio.to_thread.run_sync(pair.start_standby)
                states = await finished(store, [run_id], within=60)
                ready = await worker.readiness()
    assert states == {run_id: RunState.SUCCEEDED}
    assert len(sink.message_ids()) == 1
    assert ready.ready, ready.reason


async def test_a_submission_acknowledged_after_the_standby_wait_survives_a_failover() -> None:
    """Without the wait, an acknowledged submission may be lost whole by a failover (the
    documented limit); with it, the caller is told only what the standby holds."""
    async with replicated(synchronous=False) as pair:
        settings = await migrated(pair)
        client = await Client.connect(settings)
        try:
            await anyio.to_thread.run_sync(pair.wait_replayed)
            hold_the_stream(pair)
            unwaited = await client.submit("failover_notice", {"kind": "email"})
            with pytest.raises(StandbyNotReached, match="no standby held it within 1s"):
                await client.submit("failover_notice", {"kind": "email"}, wait_for_standby=1)
            await anyio.to_thread.run_sync(pair.failover)
            with anyio.fail_after(60):
                while True:
                    try:
                        waited = await client.submit(
                            "failover_notice", {"kind": "email"}, wait_for_standby=True
                        )
                        break
                    except Exception:  # the pool reaching the promoted server
                        await anyio.sleep(0.2)
            with pytest.raises(RunNotFound):
                await client.get(unwaited.run_id)
            await anyio.to_thread.run_sync(pair.failover)
            with anyio.fail_after(60):
                while True:
                    try:
                        survived = await client.get(waited.run_id)
                        break
                    except RunNotFound:
                        raise
                    except Exception:
                        await anyio.sleep(0.2)
            # The command line waits the same way, for a submission and for a signal.
            submitted = await anyio.to_thread.run_sync(
                lambda: cli(pair.dsn(), "submit", "failover_notice", "--wait-for-standby")
            )
            assert submitted.returncode == 0, submitted.stderr
            signalled = await anyio.to_thread.run_sync(
                lambda: cli(
                    pair.dsn(),
                    "runs",
                    "signal",
                    submitted.stdout.strip(),
                    "go",
                    "--wait-for-standby",
                )
            )
            assert signalled.returncode == 0, signalled.stderr
        finally:
            await client.close()
    assert survived.run_id == waited.run_id


def positions(**changes: object) -> StandbyPositions:
    values: dict[str, object] = {
        "wal_end": 100,
        "wal_flushed": 100,
        "in_recovery": False,
        "physical_slots": 0,
        "idle_slots": 0,
        "standbys": 0,
        "hidden": 0,
        "least_flushed": None,
        "most_flushed": None,
        "least_replayed": None,
        "most_replayed": None,
    }
    return StandbyPositions(**{**values, **changes})  # type: ignore[arg-type]


def test_which_standbys_count() -> None:
    two = positions(
        standbys=2,
        physical_slots=2,
        least_flushed=90,
        most_flushed=120,
        least_replayed=80,
        most_replayed=110,
    )
    assert two.holds(StandbyPolicy(StandbyWait.ANY), 100)
    assert not two.holds(StandbyPolicy(StandbyWait.ALL), 100)
    assert two.holds(StandbyPolicy(StandbyWait.ALL), 90)
    replay = StandbyPolicy(StandbyWait.ANY, position="replay")  # type: ignore[arg-type]
    assert replay.position == "replay" and not two.holds(replay, 115)
    lone = positions()
    assert lone.problem(StandbyPolicy(), seen=False) is None
    assert "no standby is connected" in (lone.problem(StandbyPolicy(), seen=True) or "")
    away = positions(physical_slots=1, idle_slots=1)
    assert "no standby is connected" in (away.problem(StandbyPolicy(), seen=False) or "")
    one_of_two = positions(standbys=1, physical_slots=2, idle_slots=1, most_flushed=100)
    assert one_of_two.problem(StandbyPolicy(StandbyWait.ANY), seen=True) is None
    assert "1 physical replication slot(s)" in (
        one_of_two.problem(StandbyPolicy(StandbyWait.ALL), seen=True) or ""
    )
    hidden = positions(hidden=1, physical_slots=1)
    assert "pg_read_all_stats" in (hidden.problem(StandbyPolicy(), seen=False) or "")
    assert "standby" in (positions(in_recovery=True).problem(StandbyPolicy(), seen=False) or "")


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        (
            {"ORCHESTRATOR_STANDBY_WAIT": "sometimes"},
            "ORCHESTRATOR_STANDBY_WAIT must be one of any, all, off, not 'sometimes'",
        ),
        (
            {"ORCHESTRATOR_STANDBY_POSITION": "disk"},
            "ORCHESTRATOR_STANDBY_POSITION must be one of flush, replay",
        ),
        (
            {"ORCHESTRATOR_WITHOUT_STANDBY": "pray"},
            "ORCHESTRATOR_WITHOUT_STANDBY must be one of hold, send",
        ),
    ],
)
def test_a_bad_standby_setting_is_one_clear_line(environ: dict[str, str], message: str) -> None:
    with pytest.raises(InvalidInput, match=message):
        Settings.from_env(environ)


@pytest.mark.parametrize("bad", [0, -1, 3601, float("nan"), float("inf"), "yes", [1]])
async def test_a_bad_wait_for_standby_is_refused_before_anything_is_written(bad: object) -> None:
    from orchestrator.db.standby_wait import acknowledgement_seconds

    with pytest.raises(InvalidInput, match="wait_for_standby is True or a number"):
        acknowledgement_seconds(bad)  # type: ignore[arg-type]


def test_a_policy_takes_its_choices_as_text_and_refuses_others() -> None:
    policy = StandbyPolicy("all", "replay", "send")  # type: ignore[arg-type]
    assert (policy.wait, policy.position, policy.without) == (
        StandbyWait.ALL,
        StandbyPosition.REPLAY,
        WithoutStandby.SEND,
    )
    assert positions(standbys=1, least_replayed=5, least_flushed=50).holds(policy, 10) is False
    with pytest.raises(InvalidInput, match="--standby-wait must be one of any, all, off"):
        StandbyPolicy("most")  # type: ignore[arg-type]
    with pytest.raises(InvalidInput, match="standby must be a StandbyPolicy"):
        Settings(standby="any")  # type: ignore[arg-type]


async def test_no_wait_for_standby_given_as_none_is_no_wait() -> None:
    from orchestrator.db.standby_wait import acknowledgement_seconds

    assert acknowledgement_seconds(None) is None
    assert acknowledgement_seconds(False) is None
    assert acknowledgement_seconds(True) == 30.0
    assert acknowledgement_seconds(2.5) == 2.5
