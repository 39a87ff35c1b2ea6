"""Values JSON cannot represent, refused where they enter with a message naming where they are:
a step's result, checkpoint and effect payloads (the step's attempt fails), signal data and a
run's input. A real worker on a real database."""

from __future__ import annotations

from collections.abc import Coroutine
from datetime import UTC, datetime
from typing import Any

import asyncpg
import pytest

from orchestrator import (
    Agent,
    Client,
    Effect,
    Finish,
    InvalidInput,
    Next,
    Outcome,
    Step,
    StepContext,
)
from orchestrator.db.signals import SignalStore
from orchestrator.db.store import RunStore
from orchestrator.models import RunState
from orchestrator.settings import Settings
from orchestrator.storable import check_json
from orchestrator.testing import running_worker, wait_for_run
from test_waits import FAST

# The steps below return an un-awaited coroutine, as the README's example once led an author
# to; Python warns when it is collected, which is the point.
pytestmark = [
    pytest.mark.filterwarnings("ignore:coroutine .* was never awaited:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning"),
]


async def _forgotten() -> int:
    return 1


def test_the_refusal_names_where_the_value_is_and_what_it_is() -> None:
    coroutine = _forgotten()
    cases: list[tuple[Any, str]] = [
        (
            {"refund": coroutine},
            'result["refund"] is a coroutine, which JSON cannot represent; '
            "did you forget an await?",
        ),
        ([1, {"ids": {1, 2}}], 'result[1]["ids"] is a set, which JSON cannot represent'),
        (
            {"a": {"b": [0.5, float("nan")]}},
            'result["a"]["b"][1] is nan, which is not a JSON number',
        ),
        ({"x": object()}, 'result["x"] is an object, which JSON cannot represent'),
        ({"k": {("a", 1): 1}}, 'result["k"] has an object key of type tuple'),
        ({"note": ["a\x00b"]}, 'result["note"][0] holds a string with a NUL character'),
        (coroutine, "result is a coroutine, which JSON cannot represent; did you forget an await?"),
    ]
    try:
        for value, says in cases:
            with pytest.raises(InvalidInput) as refused:
                check_json(value, "result")
            assert str(refused.value).startswith(says), str(refused.value)
    finally:
        coroutine.close()


class Forgets(Step):
    """Returns, in the place the input names, an effect read without its await."""

    async def run(self, ctx: StepContext) -> Outcome:
        value = ctx.effects.get("refund")  # the missing await
        where = ctx.input["where"]
        if where == "result":
            return Finish({"refund": value})
        if where == "checkpoint":
            return Next(Forgets, checkpoint={"refund": [value]})
        return Finish({"ok": True}, effects=[Effect("refund", "crm", {"order": {"ref": value}})])


forgetful = Agent("forgetful", first=Forgets)

SAYS = {
    "result": 'result["refund"] is a coroutine',
    "checkpoint": 'checkpoint["refund"][0] is a coroutine',
    "payload": 'effect refund payload["order"]["ref"] is a coroutine',
}


async def test_a_step_returning_a_value_json_cannot_represent_fails_its_attempt(
    settings: Settings, store: RunStore, pool: asyncpg.Pool
) -> None:
    async with running_worker(settings, [forgetful], **FAST):
        run_ids = {
            where: (await store.submit("forgetful", {"where": where}, max_attempts=1)).run.run_id
            for where in SAYS
        }
        ended = {where: await wait_for_run(store, run_id) for where, run_id in run_ids.items()}
    for where, run in ended.items():
        assert run.state is RunState.DEAD, (where, run.result)  # never succeeded with a repr
        assert run.result is None
        message = run.error["message"]
        assert message.startswith(SAYS[where]) and "did you forget an await?" in message, message
        assert "\n" not in message
    assert await pool.fetchval("SELECT count(*) FROM effects") == 0
    assert await pool.fetchval("SELECT count(*) FROM runs WHERE checkpoint_version > 0") == 0


async def test_signal_data_and_run_input_name_the_bad_value(
    settings: Settings, store: RunStore, pool: asyncpg.Pool
) -> None:
    run_id = (await store.submit("nobody_serves_this", {})).run.run_id
    coroutine: Coroutine[Any, Any, int] = _forgotten()
    try:
        with pytest.raises(InvalidInput, match=r'^signal data\["refund"\] is a coroutine'):
            await SignalStore(pool).send(run_id, "reply", {"refund": coroutine})
        async with await Client.connect(settings) as client:
            with pytest.raises(InvalidInput, match=r'^signal data\["at"\] is a datetime'):
                await client.signal(run_id, "reply", {"at": datetime.now(UTC)})
            with pytest.raises(InvalidInput, match=r'^input\["tags"\] is a set'):
                await client.submit("nobody_serves_this", {"tags": {"a"}})
    finally:
        coroutine.close()
    assert await pool.fetchval("SELECT count(*) FROM run_signals") == 0
    assert await pool.fetchval("SELECT count(*) FROM runs") == 1
