"""Garbage-collector settings for the long-running ``serve`` process.

At saturation CPython's cyclic collector took a large share of a worker's CPU while finding
almost nothing to collect (docs/performance.md). Two standard remedies, applied only by the
``serve`` entry point (a process-wide decision, like installing telemetry providers; a host
application embedding ``Worker`` keeps its own):

- ``gc.freeze()`` once start-up is done: modules, classes and configuration live for the whole
  process, and without it every full collection walked all of them again.
- A first-generation threshold above the number of objects a worker's in-flight runs hold at
  once. The collector counts allocations minus deallocations, so hundreds of runs in flight,
  whose objects are freed by reference counting moments later, set it off every few runs
  although it found almost nothing to collect. Real cyclic garbage still triggers a collection,
  only after more of it has accumulated.
"""

from __future__ import annotations

import gc

WORKER_THRESHOLDS = (20_000, 20, 10)
"""Generation 0, 1 and 2 thresholds (CPython's defaults are 700, 10, 10)."""


def tune_for_worker() -> None:
    """Collect once, freeze what start-up allocated, and raise the collection thresholds."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*WORKER_THRESHOLDS)
