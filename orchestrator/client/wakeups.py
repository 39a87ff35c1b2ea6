"""The waits of one client on each run, woken by notifications on one listening connection."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager


class RunWakeups:
    """An event per wait, by run: a notification about a run wakes its waits, and listening
    anew wakes them all (whatever was notified meanwhile was missed)."""

    def __init__(self) -> None:
        self._events: dict[str, set[asyncio.Event]] = {}

    @contextmanager
    def waiting(self, run_id: str) -> Iterator[asyncio.Event]:
        """An event set whenever ``run_id`` is notified, while the block runs."""
        event = asyncio.Event()
        self._events.setdefault(run_id, set()).add(event)
        try:
            yield event
        finally:
            waits = self._events.get(run_id)
            if waits is not None:
                waits.discard(event)
                if not waits:
                    del self._events[run_id]

    def wake(self, channel: str, run_id: str) -> None:
        """A notification's handler: wake the waits on ``run_id``."""
        for event in self._events.get(run_id, ()):
            event.set()

    def wake_all(self) -> None:
        for waits in self._events.values():
            for event in waits:
                event.set()
