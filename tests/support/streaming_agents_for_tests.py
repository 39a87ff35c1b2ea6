"""Agents that publish live output (tests/test_streaming_processes.py): a step that commits its
progress, then one whose answer the model streams."""

from __future__ import annotations

from orchestrator import Agent, Finish, Next, Step, StepContext
from orchestrator.agent import llm
from orchestrator.agent.steps import Outcome


class Prepare(Step):
    async def run(self, ctx: StepContext) -> Outcome:
        ctx.output.progress("prepared", step=1)
        return Next(Answer, checkpoint={"prepared": True})


class Answer(Step):
    async def run(self, ctx: StepContext) -> Outcome:
        ctx.output.progress("asking the model")
        question = str(ctx.input["question"])
        completion = await llm.chat([{"role": "user", "content": question}], stream=True)
        return Finish({"answer": completion.text})


streamer = Agent("streamer", first=Prepare, steps=[Answer])
