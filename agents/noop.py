"""``noop``: one step that finishes at once. For smoke checks and throughput benchmarks."""

from __future__ import annotations

from orchestrator.agent.steps import Agent, Finish, Outcome, Step, StepContext


class Done(Step):
    async def run(self, ctx: StepContext) -> Outcome:
        return Finish(result={"ok": True})


noop = Agent("noop", first=Done, description="finishes at once")
