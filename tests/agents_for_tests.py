"""Agents used by the fault tests, importable by `serve` subprocesses (tests/ is on their path).

``marked``: like ``sleepy``, but each step execution first drops a marker file
``<run_id>.<count>.<pid>.<fence>`` in ``input["marker_dir"]``, so a test can see which worker
process ran which step, and how often, independently of the database.
"""

from __future__ import annotations

import os
from pathlib import Path

import anyio

from orchestrator.steps import Agent, Finish, Next, Outcome, Step, StepContext


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


marked = Agent("marked", first=MarkedNap)
exploding = Agent("exploding", first=Explode)
