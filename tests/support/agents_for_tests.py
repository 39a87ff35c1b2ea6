"""Agents used by the fault tests, importable by `serve` subprocesses (tests/ is on their path).

``marked``: like ``sleepy``, but each step execution first drops a marker file
``<run_id>.<count>.<pid>.<fence>`` in ``input["marker_dir"]``, so a test can see which worker
process ran which step, and how often, independently of the database.

``inbox``: waits for a ``reply`` signal (see ``AwaitSignal``).

``ticking``: one long step that acts in the world every few hundredths of a second (see
``Tick``), so a test can date the last thing a worker did.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta
from pathlib import Path

import anyio

from orchestrator import Effect, Wait
from orchestrator.agent.steps import Agent, Finish, Next, Outcome, Step, StepContext
from orchestrator.db.limits import RunningLimit


class MarkedNap(Step):
    async def run(self, ctx: StepContext) -> Outcome:
        count = (ctx.checkpoint or {}).get("count", 0)
        marker = Path(ctx.input["marker_dir"]) / f"{ctx.run_id}.{count}.{os.getpid()}.{ctx.fence}"
        marker.touch()
        await anyio.sleep(float(ctx.input.get("seconds", 1.0)))
        count += 1
        if count >= int(ctx.input.get("steps", 3)):
            return Finish(result={"count": count}, checkpoint={"count": count})
        return Next(MarkedNap, checkpoint={"count": count})


class Explode(Step):
    async def run(self, ctx: StepContext) -> Outcome:
        raise RuntimeError(f"boom on attempt {ctx.attempt}")


class Tick(Step):
    """Drops a file ``<run_id>.<fence>.<wall-clock ns>`` in ``input["tick_dir"]`` every tick
    for ``input["seconds"]`` (``input["again_seconds"]`` on a later attempt), then finishes."""

    async def run(self, ctx: StepContext) -> Outcome:
        key = "seconds" if ctx.attempt == 1 else "again_seconds"
        until = time.monotonic() + float(ctx.input.get(key, 1.0))
        ticks = 0
        while time.monotonic() < until:
            (Path(ctx.input["tick_dir"]) / f"{ctx.run_id}.{ctx.fence}.{time.time_ns()}").touch()
            ticks += 1
            await anyio.sleep(0.05)
        return Finish(result={"ticks": ticks, "fence": ctx.fence})


marked = Agent("marked", first=MarkedNap)
ticking = Agent("ticking", first=Tick)
exploding = Agent("exploding", first=Explode)


HOLD_SECONDS = 300
"""Longest a step holds on its hold file: a test that forgets to remove it fails, not hangs."""


class AwaitSignal(Step):
    """``inbox``: waits (without a lease) for a ``reply`` signal or ``input["seconds"]``; once
    it has one, drops a marker, holds while the file ``input["hold_file"]`` exists (so a test
    kills the worker in mid-step however slow the machine, then lets the replay through), then
    finishes and records a ``crm`` effect keyed by the signal's seq."""

    async def run(self, ctx: StepContext) -> Outcome:
        replies = [signal for signal in ctx.signals if signal.name == "reply"]
        if not replies:
            if ctx.wait is not None and ctx.wait.timed_out:
                return Finish({"timed_out": True})
            seconds = ctx.input.get("seconds")
            until = None if seconds is None else ctx.database_now() + timedelta(seconds=seconds)
            return Wait(then=AwaitSignal, signals=["reply"], until=until)
        marker_dir = ctx.input.get("marker_dir")
        if marker_dir:
            (Path(marker_dir) / f"{ctx.run_id}.{os.getpid()}.{ctx.fence}").touch()
        hold = ctx.input.get("hold_file")
        with anyio.move_on_after(HOLD_SECONDS):
            while hold and await anyio.Path(hold).exists():  # noqa: ASYNC110
                await anyio.sleep(0.05)
        first = replies[0]
        return Finish(
            {"replies": [s.data for s in replies], "fence": ctx.fence},
            effects=[Effect(f"answer-{first.seq}", "crm", {"reply": first.data})],
        )


inbox = Agent("inbox", first=AwaitSignal)


class AskOnce(Step):
    """One model call (``llm.chat``) with the run's input as the question, then finish: a
    model rate limit's test counts these calls at the model server."""

    async def run(self, ctx: StepContext) -> Outcome:
        from orchestrator.agent.llm import chat

        answer = await chat([{"role": "user", "content": str(ctx.input)}], max_tokens=16)
        return Finish(result={"text": answer.text})


asking = Agent("asking", first=AskOnce)


limited = Agent("limited", first=MarkedNap, limits=[RunningLimit(1, per="key")])
"""Declares a limit in its code: one running run per concurrency key."""
