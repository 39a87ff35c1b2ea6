"""What a claimed run was woken with: its pending signals and, after a ``Wait``, what it waited
for (read back from ``runs.wait``) and whether it must wait on, parked again as it was."""

from __future__ import annotations

from collections.abc import Sequence

from orchestrator.agent.children import ChildOutcome, ChildrenWait
from orchestrator.agent.steps import AgentRegistry, EffectView, WaitState
from orchestrator.db.deadlines import pooled
from orchestrator.db.run_reads import RunReads
from orchestrator.db.signals import Signal, SignalStore
from orchestrator.db.store import Park, RunStore, StepCommit
from orchestrator.effects.store import EffectNotFound
from orchestrator.models import JSON, ClaimedRun, RunState, StoredWait


def claimed_signals(claimed: ClaimedRun) -> tuple[Signal, ...]:
    """The signals the claim gave; any it did not give (over 100) go to the steps after this."""
    if claimed.signals is None:
        return ()
    return tuple(Signal.from_json(value) for value in claimed.signals)


async def pending_signals(
    store: RunStore, run_id: str, awaited: Sequence[str], *, within: float
) -> tuple[Signal, ...]:
    """The run's unconsumed signals, those it was woken for first."""
    async with pooled(store.pool, within=within) as db:
        return await SignalStore(db).pending(run_id, awaited)


async def read_wait(
    claimed: ClaimedRun,
    wait: JSON,
    signals: tuple[Signal, ...],
    effects: EffectView,
    store: RunReads | None = None,
) -> tuple[WaitState, bool]:
    """What the run waited for; and whether it must wait on (nothing it waits for has
    happened yet, and its time has not come). ``store`` reads the children it waited for."""
    stored = StoredWait.from_json(wait)
    names, keys, until, reason = stored.signals, stored.effects, stored.until, stored.reason
    signalled = any(signal.name in names for signal in signals)
    settled = bool(keys) and all([await _settled(effects, key) for key in keys])
    children: dict[str, ChildOutcome] | None = None
    enough = False
    if stored.children and store is not None:
        children = await _children(store, claimed.run_id, stored.children)
        waited = ChildrenWait(stored.children, stored.need, children)
        enough = waited.satisfied
    happened = signalled or settled or enough or reason == "budget"
    due = until is not None and claimed.claimed_at >= until  # the database's clock
    state = WaitState(names, keys, until, reason, timed_out=due and not happened, children=children)
    return state, not happened and not due and bool(names or keys or stored.children)


async def _children(store: RunReads, run_id: str, keys: Sequence[str]) -> dict[str, ChildOutcome]:
    rows = await store.children_of(run_id, keys)
    return {
        row["child_key"]: ChildOutcome(
            row["child_key"], row["run_id"], RunState(row["state"]), row["result"], row["error"]
        )
        for row in rows
    }


async def _settled(effects: EffectView, effect_key: str) -> bool:
    try:
        record = await effects.get(effect_key)
    except EffectNotFound:  # never recorded: nothing to wait for
        return True
    return record.status.settled


def park_again(
    claimed: ClaimedRun, wait: JSON, state: WaitState, registry: AgentRegistry
) -> StepCommit:
    """The commit that parks a run woken too early as it was, without running its step."""
    return StepCommit(
        claimed.lease,
        claimed.checkpoint_version,
        claimed.step or registry.get(claimed.agent).first.step_name(),
        claimed.checkpoint,
        park=Park(wait, state.until),
    )
