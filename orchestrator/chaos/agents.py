"""The agents a chaos campaign's workers serve (``serve --agents orchestrator.chaos.agents``).

``chaos_steps`` is a step agent: it emails the customer (irreversible) and notes the CRM
(replaceable) in one commit, then optionally waits for a ``go`` signal, then works a while
(``work_seconds``, a window for faults to land in) and optionally asks for a refund a person
must approve, waiting for it to settle, then finishes. ``chaos_tools`` is a tool agent under a
budget: the model looks the customer up, emails them and notes the CRM, asks for a refund (above
100 needs approval), then answers; with the ``mcp`` extra it also opens a case through an MCP
server's effectful tool (``open_case``, sent once by the dispatcher's ``mcp`` adapter).
``CHAOS_SCRIPT`` is what the campaign's scripted model
answers; a replayed turn proposes other arguments, as a real model may.

``chaos_tree`` starts a tree (docs/child-runs.md): its first step spawns two or three
``chaos_leaf`` children with its commit and either waits for them in the same commit or goes on
to a step that names the same children again (a key spawned before names the child it has) and
waits there, for all of them, any one or two; it finishes with the outcome it read of each. A
leaf works a while (a window for a cascading cancel to land in), then emails its customer and
notes the CRM with its commit, and finishes.

``chaos_tick`` is the agent of the campaign's schedules (``orchestrator.chaos.schedules``): a
leaf's two steps under a name of its own.

Every step, and the read-only lookup, first records the (run, fence) it runs under outside the
database (``orchestrator.chaos.grants``): the checker's evidence that survives a failover.

Every step of the step agents publishes live output (docs/streaming.md) before its effects: a
progress naming its fence, checkpoint version and step, and a line of text beginning
``[fence F vV step]`` (``published_by`` reads them back); a working step publishes a draft line
it withdraws after the first piece of its work (the publisher's own retraction) and a line after
each later piece. ``chaos_tools`` streams the model's answers (``ToolAgent(stream=True)``).

Every agent is versioned (docs/upgrades.md): a ``serve`` process runs the version
``ORCHESTRATOR_CHAOS_AGENT_VERSION`` names (1 when unset), and the ``deploy`` fault starts newer
ones. Each version of the step agents (``chaos_steps``, ``chaos_tree``, ``chaos_leaf``) names
its checkpoint's keys its own way (``announced_v2``) and upgrades every older version's
checkpoint by renaming them; a step that meets a checkpoint it cannot read raises
``CheckpointMisread``, which the checker reports.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import ClassVar, cast

import anyio

from orchestrator.agent.budgets import Budget
from orchestrator.agent.children import Child
from orchestrator.agent.steps import Agent, Finish, Next, Outcome, Step, StepContext, Wait
from orchestrator.agent.tool_loop import ToolAgent
from orchestrator.agent.tools import ToolContext, ToolSource, tool
from orchestrator.chaos.grants import record_grant
from orchestrator.effect_model import Effect, EffectPolicy
from orchestrator.errors import InvalidInput
from orchestrator.models import JSON
from orchestrator.testing.loopback import ScriptedCall, ScriptedTurn, ScriptRequest

SIGNAL_WAIT_SECONDS = 120.0
"""How long a step run waits for ``go`` before going on without it."""
VERSION_ENV = "ORCHESTRATOR_CHAOS_AGENT_VERSION"
"""Which version of the chaos agents' code a process runs: a whole number from 1."""
MISREAD = "checkpoint misread"
"""How a ``CheckpointMisread`` begins, in the failed attempt the run's timeline keeps."""


class CheckpointMisread(LookupError):
    """A step met a checkpoint not in its own version's shape: an upgrade is missing or wrong."""


def served_version() -> int:
    """The version ``VERSION_ENV`` names, 1 when unset; anything else is one line."""
    text = os.environ.get(VERSION_ENV, "1")
    if not re.fullmatch(r"[1-9][0-9]{0,8}", text):
        raise InvalidInput(f"{VERSION_ENV} is a whole number from 1, not {text!r}")
    return int(text)


def shaped(version: int, facts: dict[str, JSON]) -> dict[str, JSON]:
    """``facts`` as ``version`` writes a checkpoint: each key renamed for it, as a release that
    renames a field does, so that no version can take another's checkpoint for its own."""
    return {f"{fact}_v{version}": value for fact, value in facts.items()}


def read_facts(version: int, checkpoint: JSON, *needed: str) -> dict[str, JSON]:
    """The facts of a checkpoint in ``version``'s shape; ``CheckpointMisread`` when it is in
    another's, or lacks one of ``needed``."""
    suffix = f"_v{version}"
    if not isinstance(checkpoint, dict) or not all(key.endswith(suffix) for key in checkpoint):
        raise CheckpointMisread(f"{MISREAD}: version {version} cannot read {checkpoint!r}")
    facts = {key.removesuffix(suffix): value for key, value in checkpoint.items()}
    missing = [fact for fact in needed if fact not in facts]
    if missing:
        raise CheckpointMisread(f"{MISREAD}: version {version} finds no {missing} in {facts!r}")
    return facts


def upgrade(older: int, version: int) -> Callable[[JSON], JSON]:
    """The upgrade of a checkpoint ``older`` wrote to ``version``'s shape."""

    def renamed(checkpoint: JSON) -> JSON:
        return shaped(version, read_facts(older, checkpoint))

    return renamed


def _field(ctx: StepContext, name: str) -> object:
    return ctx.input.get(name) if isinstance(ctx.input, dict) else None


def _granted(ctx: StepContext) -> None:
    """The step's first act: its grant recorded, and its live output begun (its progress, and a
    line of text) under the attempt it runs as."""
    record_grant(ctx.run_id, ctx.fence, ctx.checkpoint_version, ctx.step)
    ctx.output.progress(
        f"{ctx.step} under fence {ctx.fence}",
        fence=ctx.fence,
        version=ctx.checkpoint_version,
        step=ctx.step,
    )
    ctx.output.text(f"{_mark(ctx)} started\n")


def _mark(ctx: StepContext) -> str:
    """What begins each line of text a step publishes: the attempt (fence) and the step (the
    checkpoint version it started from, and its name) that wrote it (``published_by``)."""
    return f"[fence {ctx.fence} v{ctx.checkpoint_version} {ctx.step}]"


DRAFT = "draft"
"""The line a working step publishes first and withdraws: the publisher's own retraction."""
_MARK = re.compile(r"\[fence ([0-9]{1,18}) v([0-9]{1,18}) ([a-z_]{1,40})\] ([a-z0-9 ]{1,40})")
WORK_PIECES = 3
"""A working step's work, in pieces, with a line of text after each."""


def published_by(data: object) -> tuple[int, int, str, str] | None:
    """The (fence, checkpoint version, step, what) a chaos step's text or progress names, or
    ``None`` (a tool agent's streamed answer names none)."""
    if not isinstance(data, dict):
        return None
    text = data.get("text")
    if isinstance(text, str):
        marked = _MARK.match(text)
        if marked is None:
            return None
        fence, version, step, what = marked.groups()
        return int(fence), int(version), step, what
    fence, version, step = data.get("fence"), data.get("version"), data.get("step")
    if isinstance(fence, int) and isinstance(version, int) and isinstance(step, str):
        return fence, version, step, "progress"
    return None


async def _work(ctx: StepContext) -> None:
    """Mid-step for ``input["work_seconds"]``: a window for faults (and cancels) to land in,
    publishing as it goes. The first piece's line is a draft the step withdraws once it is
    written (the publisher's own retraction); each later piece ends with a line that stays."""
    work = _field(ctx, "work_seconds")
    if not isinstance(work, int | float):
        return
    draft = ctx.output.part()
    draft.text(f"{_mark(ctx)} {DRAFT}\n")
    for piece in range(1, WORK_PIECES + 1):
        await anyio.sleep(work / WORK_PIECES)
        if piece == 1:
            draft.withdraw("chaos: the draft is withdrawn")
        else:
            ctx.output.text(f"{_mark(ctx)} worked {piece} of {WORK_PIECES}\n")


def _contact(ctx: StepContext, stage: str) -> list[Effect]:
    """An irreversible email to the run's customer and a replaceable CRM note."""
    customer = _field(ctx, "customer")
    return [
        Effect("email", "email", {"run": ctx.run_id, "to": f"{customer}@customer.test"}),
        Effect(
            "crm",
            "crm",
            {"run": ctx.run_id, "account": customer, "stage": stage},
            EffectPolicy.REPLACEABLE,
        ),
    ]


class ChaosStep(Step):
    """A step of a chaos step agent: it reads and writes checkpoints in its version's shape."""

    version: ClassVar[int] = 1
    """The version of the agent's code the step belongs to (``versioned`` sets it)."""

    def facts(self, ctx: StepContext, *needed: str) -> dict[str, JSON]:
        return read_facts(self.version, ctx.checkpoint, *needed)


class Announce(ChaosStep):
    name = "announce"

    async def run(self, ctx: StepContext) -> Outcome:
        _granted(ctx)
        return Next(
            AwaitGo,
            checkpoint=shaped(self.version, {"announced": True}),
            effects=_contact(ctx, "announced"),
        )


class AwaitGo(ChaosStep):
    name = "await_go"

    async def run(self, ctx: StepContext) -> Outcome:
        _granted(ctx)
        facts = self.facts(ctx, "announced")
        woken = ctx.wait is not None
        if _field(ctx, "signal") and not woken and not any(s.name == "go" for s in ctx.signals):
            until = ctx.database_now() + timedelta(seconds=SIGNAL_WAIT_SECONDS)
            return Wait(AwaitGo, signals=["go"], until=until, reason="waiting for go")
        return Next(AskRefund, checkpoint=shaped(self.version, {**facts, "went": True}))


class AskRefund(ChaosStep):
    name = "ask_refund"

    async def run(self, ctx: StepContext) -> Outcome:
        _granted(ctx)
        self.facts(ctx, "announced", "went")
        await _work(ctx)
        amount = _field(ctx, "refund")
        if not isinstance(amount, int | float):
            return Finish(result={"refund": None})
        approval = _field(ctx, "approval_seconds")
        refund = Effect(
            "refund",
            "payments",
            {"run": ctx.run_id, "amount": amount},
            requires_approval=True,
            approval_seconds=float(approval) if isinstance(approval, int | float) else 60.0,
        )
        return Wait(Close, effects=[refund], reason="refund awaits approval")


class Close(ChaosStep):
    name = "close"

    async def run(self, ctx: StepContext) -> Outcome:
        _granted(ctx)
        self.facts(ctx, "announced", "went")
        refund = await ctx.effects.get("refund")
        return Finish(result={"refund": refund.status.value})


LEAF = "chaos_leaf"
"""The agent of ``chaos_tree``'s children."""


def _leaves(ctx: StepContext) -> list[Child]:
    """The children ``input["leaves"]`` plans, keyed by their place, under the tree's tenant."""
    planned = _field(ctx, "leaves")
    tenant = _field(ctx, "tenant")
    return [
        Child(
            LEAF,
            leaf,
            key=f"leaf-{n}",
            max_attempts=100,
            concurrency_key=tenant if isinstance(tenant, str) else None,
        )
        for n, leaf in enumerate(planned if isinstance(planned, list) else [])
    ]


def _need(ctx: StepContext) -> int | None:
    need = _field(ctx, "need")
    return need if isinstance(need, int) else None


class FanOut(ChaosStep):
    name = "fan_out"

    async def run(self, ctx: StepContext) -> Outcome:
        _granted(ctx)
        leaves = _leaves(ctx)
        checkpoint = shaped(self.version, {"spawned": [leaf.key for leaf in leaves]})
        if _field(ctx, "fan") == "wait":
            return Wait(
                Merge,
                children=leaves,
                need=_need(ctx),
                checkpoint=checkpoint,
                reason="waiting for the leaves it started",
            )
        return Next(Gather, checkpoint=checkpoint, children=leaves)


class Gather(ChaosStep):
    name = "gather"

    async def run(self, ctx: StepContext) -> Outcome:
        _granted(ctx)
        facts = self.facts(ctx, "spawned")
        # The same children again: each key names the child the first step spawned.
        return Wait(
            Merge,
            children=_leaves(ctx),
            need=_need(ctx),
            checkpoint=shaped(self.version, facts),
            reason="waiting for the leaves it started before",
        )


class Merge(ChaosStep):
    name = "merge"

    async def run(self, ctx: StepContext) -> Outcome:
        _granted(ctx)
        self.facts(ctx, "spawned")
        outcomes = ctx.wait.children if ctx.wait is not None and ctx.wait.children else {}
        read: dict[str, JSON] = {
            key: {"state": outcome.state.value, "result": outcome.result}
            for key, outcome in sorted(outcomes.items())
        }
        return Finish(result={"read": read})


class Reach(ChaosStep):
    name = "reach"

    async def run(self, ctx: StepContext) -> Outcome:
        _granted(ctx)
        await _work(ctx)
        return Next(
            Reply, checkpoint=shaped(self.version, {"reached": True}), effects=_contact(ctx, "leaf")
        )


class Reply(ChaosStep):
    name = "reply"

    async def run(self, ctx: StepContext) -> Outcome:
        _granted(ctx)
        self.facts(ctx, "reached")
        return Finish(result={"customer": _field(ctx, "customer")})


def versioned(name: str, steps: Sequence[type[ChaosStep]], version: int, description: str) -> Agent:
    """Agent ``name`` at ``version``: its steps read and write that version's checkpoints, and
    it upgrades those of every older version."""
    classes = [
        cast("type[ChaosStep]", type(step.__name__, (step,), {"version": version}))
        for step in steps
    ]
    return Agent(
        name,
        first=classes[0],
        steps=classes[1:],
        description=description,
        version=version,
        upgrades={older: upgrade(older, version) for older in range(1, version)},
    )


def steps_agent(version: int) -> Agent:
    """``chaos_steps`` at ``version``."""
    return versioned(
        "chaos_steps",
        (Announce, AwaitGo, AskRefund, Close),
        version,
        "Chaos campaign: email, CRM note, optional signal wait and gated refund.",
    )


def tree_agent(version: int) -> Agent:
    """``chaos_tree`` at ``version``."""
    return versioned(
        "chaos_tree",
        (FanOut, Gather, Merge),
        version,
        "Chaos campaign: fans out to leaves, waits for all, any or some, reads how they ended.",
    )


def leaf_agent(version: int) -> Agent:
    """``chaos_leaf`` at ``version``."""
    return versioned(
        LEAF, (Reach, Reply), version, "Chaos campaign: a tree's leaf, working, then emailing."
    )


TICK = "chaos_tick"
"""The agent of the campaign's schedules (``orchestrator.chaos.schedules``)."""


def tick_agent(version: int) -> Agent:
    """``chaos_tick`` at ``version``: a leaf's steps under a name of their own, so that the runs
    the campaign's schedules start meet neither the workload's limits nor its trees."""
    return versioned(
        TICK, (Reach, Reply), version, "Chaos campaign: a scheduled run, working, then emailing."
    )


@tool.read_only(timeout=10)
def lookup_customer(ctx: ToolContext, customer: str) -> dict[str, str]:
    """Look a customer up.

    Args:
        customer: The customer's id.
    """
    record_grant(ctx.run_id, ctx.fence, ctx.turn, "lookup_customer")
    return {"customer": customer, "email": f"{customer}@customer.test", "tier": "gold"}


@tool.effect("email", policy=EffectPolicy.IRREVERSIBLE)
def send_email(to: str, body: str) -> dict[str, str]:
    """Email the customer: the dispatcher sends it once and never again, looking a send of
    unknown fate up at the vendor instead.

    Args:
        to: The recipient's address.
        body: The message.
    """
    return {"to": to, "body": body}


@tool.effect("crm", policy=EffectPolicy.REPLACEABLE)
def note_crm(customer: str, note: str) -> dict[str, str]:
    """Note the CRM (a newer note may replace an unsent one).

    Args:
        customer: The customer's id.
        note: The note.
    """
    return {"customer": customer, "note": note}


@tool.effect("payments", approve=lambda amount, **_: amount > 100, approval_seconds=60)
def refund(customer: str, amount: float) -> dict[str, object]:
    """Refund the customer (above 100, a person approves first).

    Args:
        customer: The customer's id.
        amount: The amount, in euros.
    """
    return {"customer": customer, "amount": amount}


MCP_URL_ENV = "ORCHESTRATOR_CHAOS_MCP_URL"
"""The campaign's MCP server (``orchestrator.chaos.mcp_vendor``), set in the cluster's
processes when the ``mcp`` extra is installed."""
MCP_SERVER = "cases"


def mcp_classification(url: str) -> dict[str, object]:
    """The operator's classification of the campaign's MCP server: one effectful tool."""
    return {
        "servers": {
            MCP_SERVER: {
                "url": url,
                "effect_kind": MCP_SERVER,
                "tools": {"open_case": {"class": "effect", "policy": "irreversible"}},
            }
        }
    }


def _mcp_tools() -> list[ToolSource]:
    url = os.environ.get(MCP_URL_ENV)
    if not url:
        return []
    from orchestrator.agent.mcp.tools import load_classification

    return list(load_classification(mcp_classification(url)))


def tools_agent(version: int) -> ToolAgent:
    """``chaos_tools`` at ``version``. The tool loop's checkpoint is the library's shape, which
    no version of this code changes, so an older version's is read as it is."""
    agent = ToolAgent(
        "chaos_tools",
        instructions="Look the customer up, email them, note the CRM, refund what they ask.",
        tools=[lookup_customer, send_email, note_crm, refund, *_mcp_tools()],
        max_turns=8,
        max_output_tokens=300,
        budget=Budget(turns=12, tool_calls=16),
        stream=True,
    )
    # ToolAgent takes no version of its own: the attributes Agent's version and upgrades set.
    agent.version = str(version)
    agent.upgrades = {str(older): _as_it_is for older in range(1, version)}
    return agent


def _as_it_is(checkpoint: JSON) -> JSON:
    return checkpoint


VERSION = served_version()
chaos_steps = steps_agent(VERSION)
chaos_tools = tools_agent(VERSION)
chaos_tree = tree_agent(VERSION)
chaos_leaf = leaf_agent(VERSION)
chaos_tick = tick_agent(VERSION)

_ASK = re.compile(r"customer (\S+) asks for a refund of (\d+)")


def CHAOS_SCRIPT(request: ScriptRequest) -> ScriptedTurn:
    """``chaos_tools``' model: lookup; email and CRM note; refund; a final answer."""
    asked = _ASK.search(request.conversation)
    customer, amount = (asked.group(1), int(asked.group(2))) if asked else ("unknown", 0)
    note = f"replayed {request.replay}" if request.replay else "first answer"
    plan = [
        ScriptedTurn(calls=(ScriptedCall("lookup_customer", {"customer": customer}),)),
        ScriptedTurn(
            calls=(
                ScriptedCall("send_email", {"to": f"{customer}@customer.test", "body": note}),
                ScriptedCall("note_crm", {"customer": customer, "note": note}),
                *(
                    (ScriptedCall("open_case", {"customer": customer, "summary": note}),)
                    if "open_case" in request.tools
                    else ()
                ),
            )
        ),
        ScriptedTurn(calls=(ScriptedCall("refund", {"customer": customer, "amount": amount}),)),
        ScriptedTurn(content=f"Done for {customer}."),
    ]
    return plan[min(request.turn, len(plan) - 1)]


def tools_prompt(customer: str, amount: int) -> str:
    """The request ``CHAOS_SCRIPT`` understands."""
    return f"customer {customer} asks for a refund of {amount}"
