"""``contract_review``: a small, realistic agent that shows the step API to a newcomer.

Input: ``{"contract": "<text>", "recipient": "legal@example.com"}``.

1. ``Summarise`` asks a model for a summary (one bounded model call) and checkpoints it. If the
   worker dies after the call but before the commit, the next worker calls the model again:
   replaying a model call is acceptable, so it is not an effect.
2. ``Review`` checks the summary without calling anything; an unusable summary fails the run for
   good (``Fail``: a retry would not help), an empty one is retried (``raise``).
3. ``Deliver`` finishes with what should be sent. (Sending it as an irreversible, fenced effect
   is the effect boundary's job.)

Run it: ``OPENAI_API_KEY=... orchestrator serve --agents orchestrator.agents.contract_review``,
or point ``ORCHESTRATOR_MODEL_BASE_URL`` at any OpenAI-compatible server.
"""

from __future__ import annotations

from orchestrator.agent.llm import chat
from orchestrator.agent.steps import Agent, Fail, Finish, Next, Outcome, Step, StepContext

MAX_CONTRACT_CHARS = 50_000
MAX_SUMMARY_CHARS = 2_000


class Summarise(Step):
    lease_seconds = 120.0  # a model call can be slow; the lease covers it with room to renew

    async def run(self, ctx: StepContext) -> Outcome:
        contract = ctx.input.get("contract")
        if not isinstance(contract, str) or not contract.strip():
            return Fail("input.contract must be the contract's text")
        if len(contract) > MAX_CONTRACT_CHARS:
            return Fail(f"input.contract is over {MAX_CONTRACT_CHARS:,} characters")
        completion = await chat(
            [
                {"role": "system", "content": "Summarise contracts for a legal team in 5 bullets."},
                {"role": "user", "content": contract},
            ]
        )
        ctx.log.info("summarised", output_tokens=completion.output_tokens)
        return Next(Review, checkpoint={"summary": completion.text, "model": completion.model})


class Review(Step):
    async def run(self, ctx: StepContext) -> Outcome:
        summary = ctx.checkpoint["summary"].strip()
        if not summary:
            raise ValueError("the model returned an empty summary")
        if len(summary) > MAX_SUMMARY_CHARS:
            return Fail("the summary is too long to send", details={"chars": len(summary)})
        return Next(Deliver, checkpoint={**ctx.checkpoint, "summary": summary, "reviewed": True})


class Deliver(Step):
    async def run(self, ctx: StepContext) -> Outcome:
        recipient = ctx.input.get("recipient", "legal@example.com")
        return Finish(result={"to": recipient, "summary": ctx.checkpoint["summary"]})


contract_review = Agent(
    "contract_review",
    first=Summarise,
    steps=[Review, Deliver],
    description="summarise a contract with a model, review it, deliver it",
)
