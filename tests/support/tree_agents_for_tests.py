"""Agents that start runs, for the child-run process tests, importable by `serve` subprocesses
(tests/ is on their path).

``tree_root``: ``Plan`` thinks ``input["think"]`` seconds, then starts ``input["children"]``
children (of ``input["child_agent"]``, ``tree_leaf`` by default: see ``children_of``) with its
commit; ``Gather`` lingers ``input["linger"]`` seconds and waits for all of them;
``Merge`` finishes with how many succeeded and the parent fence each was spawned under.

``tree_middle``: starts ``input["children"]`` leaves at once and waits for them.

``tree_leaf``: thinks ``input["think"]`` seconds, then asks the CRM vendor for one note with its
commit and finishes.
"""

from __future__ import annotations

import anyio

from orchestrator import Agent, Child, Effect, Finish, Next, Outcome, Step, StepContext, Wait


def children_of(ctx: StepContext) -> list[Child]:
    """``input["children"]`` children, each given ``input["child"]`` or its own entry of
    ``input["child_inputs"]``."""
    agent = str(ctx.input.get("child_agent", "tree_leaf"))
    count = int(ctx.input.get("children", 3))
    inputs = ctx.input.get("child_inputs") or [ctx.input.get("child", {})] * count
    return [Child(agent, dict(inputs[n]), key=f"c{n}") for n in range(count)]


class Plan(Step):
    async def run(self, ctx: StepContext) -> Outcome:
        await anyio.sleep(float(ctx.input.get("think", 0)))
        return Next(Gather, checkpoint={"planned_by": ctx.fence}, children=children_of(ctx))


class Gather(Step):
    async def run(self, ctx: StepContext) -> Outcome:
        await anyio.sleep(float(ctx.input.get("linger", 0)))
        keys = [child.key for child in children_of(ctx)]
        return Wait(then=Merge, children=keys)


class Merge(Step):
    async def run(self, ctx: StepContext) -> Outcome:
        assert ctx.wait is not None and ctx.wait.children is not None
        done = [o for o in ctx.wait.children.values() if o.succeeded]
        return Finish(result={"succeeded": len(done), "planned_by": ctx.checkpoint["planned_by"]})


class Delegate(Step):
    async def run(self, ctx: StepContext) -> Outcome:
        return Wait(then=Merge, children=children_of(ctx), checkpoint={"planned_by": ctx.fence})


class Note(Step):
    async def run(self, ctx: StepContext) -> Outcome:
        await anyio.sleep(float(ctx.input.get("think", 0)))
        note = Effect("note", "crm", {"run": ctx.run_id})
        return Finish(result={"noted": True}, effects=[note])


tree_root = Agent("tree_root", first=Plan, steps=[Gather, Merge])
tree_middle = Agent("tree_middle", first=Delegate, steps=[Merge])
tree_leaf = Agent("tree_leaf", first=Note)
