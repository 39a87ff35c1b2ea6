"""``contract_notice``: one irreversible email and one replaceable CRM update, fenced.

Input: ``{"customer": "ACME", "to": "legal@acme.test", "think_seconds": 0}``.

1. ``Prepare`` drafts the notice (``think_seconds`` stands in for a model call) and asks for
   two effects in the same commit as its checkpoint: the email (irreversible: sent at most
   once, whoever asks again gets the first outcome) and the CRM status (replaceable: a newer
   owner may replace it until it is sent).
2. ``Confirm`` waits for both outcomes and finishes with the vendors' ids.

The effects are sent by the dispatcher, configured with vendors for the kinds ``email`` and
``crm``; the agent never sees a credential.
"""

from __future__ import annotations

import anyio

from orchestrator.agent.steps import Agent, Fail, Finish, Next, Outcome, Step, StepContext
from orchestrator.effect_model import Effect, EffectPolicy, EffectStatus


class Prepare(Step):
    async def run(self, ctx: StepContext) -> Outcome:
        customer = str(ctx.input.get("customer", "customer"))
        await anyio.sleep(float(ctx.input.get("think_seconds", 0)))
        body = f"Dear {customer}, your contract renewal has been reviewed."
        return Next(
            Confirm,
            checkpoint={"drafted_by_fence": ctx.fence},
            effects=[
                Effect(
                    "notice-email",
                    "email",
                    {
                        "to": ctx.input.get("to", "legal@example.com"),
                        "subject": "Renewal",
                        "body": body,
                    },
                ),
                Effect(
                    "crm-status",
                    "crm",
                    {"customer": customer, "status": "notice-sent", "fence": ctx.fence},
                    EffectPolicy.REPLACEABLE,
                ),
            ],
        )


class Confirm(Step):
    async def run(self, ctx: StepContext) -> Outcome:
        assert ctx.effects is not None
        email = await ctx.effects.wait("notice-email", within=60)
        crm = await ctx.effects.wait("crm-status", within=60)
        outcomes = {"email": email.status.value, "crm": crm.status.value}
        if email.status is not EffectStatus.CONFIRMED or crm.status is not EffectStatus.CONFIRMED:
            return Fail("an effect did not go through", details=outcomes)
        return Finish(
            result={"email": email.external_id, "crm": crm.external_id, **ctx.checkpoint},
        )


contract_notice = Agent(
    "contract_notice",
    first=Prepare,
    steps=[Confirm],
    description="send one irreversible email and one replaceable CRM update",
)
