"""Versioned agents for the cutover process tests, importable by `serve` subprocesses (tests/ is
on their path): ``serve --agents support.versioned_agents_for_tests`` serves the version named
by ``ORCHESTRATOR_TEST_AGENT_VERSION`` (1 or 2; 1 when unset).

``versioned``: ``input["steps"]`` steps; each naps ``input["seconds"]`` and asks the CRM vendor
for one note (key ``note-<step>``) with its commit. Version 1 counts in ``{"n": ...}``, version 2
in ``{"count": ...}`` and upgrades version 1's checkpoint.

``legacy``: commits one step and waits for ``go``; version 2 reads no version 1 checkpoint (no
upgrade path), so a run started under version 1 waits for a version 1 worker.
"""

from __future__ import annotations

import os

import anyio

from orchestrator.agent.steps import Agent, Finish, Next, Outcome, Step, StepContext, Wait
from orchestrator.effect_model import Effect
from orchestrator.models import JSON

VERSION = int(os.environ.get("ORCHESTRATOR_TEST_AGENT_VERSION", "1"))
COUNTER = "n" if VERSION == 1 else "count"


class Note(Step):
    async def run(self, ctx: StepContext) -> Outcome:
        done = int((ctx.checkpoint or {}).get(COUNTER, 0))
        await anyio.sleep(float(ctx.input.get("seconds", 0)))
        note = Effect(f"note-{done}", "crm", {"run": ctx.run_id, "step": done})
        done += 1
        if done >= int(ctx.input.get("steps", 2)):
            return Finish(
                result={"steps": done, "version": VERSION},
                checkpoint={COUNTER: done},
                effects=[note],
            )
        return Next(Note, checkpoint={COUNTER: done}, effects=[note])


def from_v1(checkpoint: JSON) -> JSON:
    assert isinstance(checkpoint, dict)
    return {"count": checkpoint["n"]}


class Hold(Step):
    async def run(self, ctx: StepContext) -> Outcome:
        return Wait(then=Done, signals=["go"], checkpoint={"held_by": VERSION})


class Done(Step):
    async def run(self, ctx: StepContext) -> Outcome:
        return Finish(result={"version": VERSION})


versioned = Agent(
    "versioned", first=Note, version=VERSION, upgrades={1: from_v1} if VERSION == 2 else {}
)
legacy = Agent("legacy", first=Hold, steps=[Done], version=VERSION)
