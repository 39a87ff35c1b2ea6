"""A run's transcript: the messages of its conversation with a model, append-only, fenced.

A step appends messages by returning them with its outcome (``Next(..., messages=[...])``); they
are written in the step's own fenced commit, numbered after the last committed one, or not at all.
``ctx.transcript.messages()`` reads the committed transcript; ``messages(start)`` only the
messages from position ``start`` on (those committed since a step last read it). One execution
keeps what it has read and committed, so a long conversation is read from the database once per
claim, not once per turn.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Protocol

from orchestrator.models import Message

if TYPE_CHECKING:
    from orchestrator.db.store import RunStore


class TranscriptView(Protocol):
    async def messages(self, start: int = 0) -> list[Message]:
        """The committed transcript, oldest first, from position ``start`` on (``seq`` is the
        position: the first message is 0)."""
        ...


class Transcript:
    """``ctx.transcript`` for one execution: the committed messages, read once, then kept."""

    # Weak references: what a step derives from the transcript may be kept for as long as this
    # execution (this object) lives, and no longer (ToolAgent keeps its encoded messages so).
    __slots__ = ("__weakref__", "_loaded", "_messages", "run_id", "store")

    def __init__(self, store: RunStore, run_id: str, *, empty: bool = False) -> None:
        """``empty``: the run has committed nothing yet (messages are only written with a step's
        commit), so there is nothing to read."""
        self.store = store
        self.run_id = run_id
        self._messages: list[Message] = []
        self._loaded = empty

    async def messages(self, start: int = 0) -> list[Message]:
        """A copy of the committed messages from position ``start`` on: a step that keeps what
        it read asks only for what was committed since, and the copy does not grow with the
        conversation."""
        if start < 0:
            raise ValueError(f"start must be 0 or more, not {start}")
        committed = await self._committed()
        return committed[start:] if start else list(committed)

    async def _committed(self) -> list[Message]:
        """The kept list itself, not a copy: counting it must not cost more as it grows."""
        if not self._loaded:
            self._messages = await self.store.messages(self.run_id)
            self._loaded = True
        return self._messages

    async def numbered(self, new: Sequence[Message], fence: int) -> list[Message]:
        """``new`` as they will be committed: numbered after the committed ones, under ``fence``."""
        if not new:
            return []
        start = len(await self._committed())
        return [replace(message, seq=start + i, fence=fence) for i, message in enumerate(new)]

    def committed(self, messages: Sequence[Message]) -> None:
        """The step's commit took effect: its messages are part of the transcript now."""
        if self._loaded:
            self._messages.extend(messages)
