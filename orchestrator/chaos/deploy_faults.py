"""The ``deploy`` fault: new code for the chaos agents under runs in flight (docs/upgrades.md).
Every worker slot gets a process running the next version, which upgrades every older version's
checkpoints; once one of them serves, the agents are cut over to it; the old processes run on for
a while (whatever they still try must be refused), then are stopped as a deploy stops them."""

from __future__ import annotations

import anyio

from orchestrator.chaos.agents import chaos_leaf, chaos_steps, chaos_tick, chaos_tools, chaos_tree
from orchestrator.chaos.context import FaultContext, FaultGroup, FaultRecord, ScheduledFault
from orchestrator.chaos.statements import CAMPAIGN_ERRORS, STATEMENT_SECONDS
from orchestrator.db.agents import AgentStore

CUT_OVER = (chaos_steps.name, chaos_tools.name, chaos_tree.name, chaos_leaf.name, chaos_tick.name)
WITHIN_SECONDS = 60.0
"""How long the new processes may take to register, and the cutover to be taken (a busy machine,
a database restarting)."""
LINGER_LEASES = 2.0
"""How many leases the old processes run on after the cutover before they are stopped."""


class DeployFaults(FaultGroup):
    def __init__(self, context: FaultContext) -> None:
        super().__init__(context)
        self._one_at_a_time = anyio.Lock()

    async def deploy(self, fault: ScheduledFault, record: FaultRecord) -> None:
        cluster = self.context.cluster
        async with self._one_at_a_time:  # each deploy moves every worker on by one version
            cluster.version += 1
            version = cluster.version
            record.target = f"version {version}"
            old = []
            for member in cluster.of("worker"):
                async with member.lock:
                    replaced = cluster.replace(member)
                if replaced is not None:
                    old.append(replaced)
            try:
                runs_cut = await self._cut_over(version) if await self._serving(version) else None
                if runs_cut is None:
                    record.detail = f"version {version} was not serving and cut over in time"
                    return
                await anyio.sleep(cluster.timing.lease_seconds * LINGER_LEASES)
            finally:
                with anyio.CancelScope(shield=True):
                    await anyio.to_thread.run_sync(cluster.retire, old)
            record.fired = True
            record.detail = (
                f"cut over to version {version}: {runs_cut} runs taken from older workers; "
                f"{len(old)} old workers stopped"
            )

    async def _serving(self, version: int) -> bool:
        """Whether a worker running ``version`` registered within the bound."""
        with anyio.move_on_after(WITHIN_SECONDS):
            while True:
                try:
                    if await self.context.pool.fetchval(
                        "SELECT count(*) FROM orchestrator.workers "
                        "WHERE agent_versions -> $1 ->> 0 = $2",
                        chaos_steps.name,
                        str(version),
                        timeout=STATEMENT_SECONDS,
                    ):
                        return True
                except CAMPAIGN_ERRORS:
                    pass
                await anyio.sleep(0.2)
        return False

    async def _cut_over(self, version: int) -> int | None:
        """Cut every chaos agent over to ``version`` (again after a database fault: a cutover
        to the version in force changes nothing): how many runs it took from older workers,
        ``None`` when the database did not take it within the bound."""
        agents = AgentStore(self.context.pool)
        runs_cut = 0
        with anyio.move_on_after(WITHIN_SECONDS):
            for agent in CUT_OVER:
                while True:
                    try:
                        async with self.context.clients.open():  # an operator's decision
                            runs_cut += (await agents.cutover(agent, version)).runs_cut
                        break
                    except CAMPAIGN_ERRORS:
                        await anyio.sleep(0.2)
            return runs_cut
        return None
