"""Fences as the database issues them: one bigint, the server's epoch in its high bits.

A claim grants ``greatest(fence + 1, epoch << EPOCH_BITS)`` where the epoch is the WAL timeline
of the primary minus one (migration 0015), so a promoted standby grants fences above any the
lost primary could have granted. Comparing fences stays comparing integers; these helpers only
explain a fence to a person.
"""

from __future__ import annotations

EPOCH_BITS = 40
"""Claims per run within one epoch: up to 2**40 (a trillion)."""


def epoch_of(fence: int) -> int:
    """The epoch (promotions of the database so far) a fence was granted in."""
    return fence >> EPOCH_BITS


def describe_fence(fence: int) -> str:
    """``fence`` as it reads best: the bare number before any failover, else with its epoch
    and its count within that epoch."""
    epoch = epoch_of(fence)
    if epoch <= 0:
        return str(fence)
    return f"{fence} (epoch {epoch}, #{fence - (epoch << EPOCH_BITS)})"
