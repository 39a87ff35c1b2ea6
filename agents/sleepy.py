"""``sleepy``: K steps of S seconds each, checkpointing a counter after every step.

Input ``{"steps": K, "seconds": S}`` (defaults 3 and 1.0). The result is the counter, which
equals K exactly when no step's commit was lost or repeated. Used by tests, benchmarks and
operators' smoke checks (``orchestrator submit sleepy --input '{"steps": 5, "seconds": 2}'``).
"""

from __future__ import annotations

import anyio

from orchestrator.agent.steps import Agent, Fail, Finish, Next, Outcome, Step, StepContext


class Nap(Step):
    async def run(self, ctx: StepContext) -> Outcome:
        steps = ctx.input.get("steps", 3)
        seconds = ctx.input.get("seconds", 1.0)
        if not isinstance(steps, int) or not isinstance(seconds, int | float):
            return Fail('input must be {"steps": int, "seconds": number}')
        if steps < 1 or seconds < 0:
            return Fail("steps must be at least 1 and seconds not negative")
        count = (ctx.checkpoint or {}).get("count", 0)
        await anyio.sleep(seconds)
        count += 1
        if count >= steps:
            return Finish(result={"count": count}, checkpoint={"count": count})
        return Next(Nap, checkpoint={"count": count})


sleepy = Agent("sleepy", first=Nap, description="K checkpointed steps of S seconds")
