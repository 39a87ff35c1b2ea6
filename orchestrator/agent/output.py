"""A step's live output (docs/streaming.md): ``ctx.output.text(...)`` and ``.progress(...)``.

What a step publishes is buffered and written in batches, never one commit per token: a batch
goes out ``FLUSH_SECONDS`` after its first event (or at once when it reaches ``BATCH_EVENTS``
events or ``BATCH_BYTES`` bytes), one batch in flight at a time, and what is left is written
before the step's commit, so a committed step's output is complete. A crash loses at most the
unwritten tail (the last few milliseconds), and that tail belongs to an attempt that never
commits its step, whose output every reader sees retracted anyway.

Each append is fenced in the database: once the worker no longer holds the run under its fence
nothing more is written, and the publisher stops (``stopped``) without failing the step. Past
the run's bound one ``truncated`` event is written and the rest is dropped, again without
failing the step. One event's data is at most ``MAX_EVENT_BYTES``: more is refused with
``InvalidInput`` at the call, before anything is buffered.

What a model call publishes goes through its own ``OutputPart``: when the call fails midway and
is tried again within the same attempt, the part is withdrawn. Its unwritten text is dropped and
what was written is retracted by the publisher itself, under the same fence: a ``retracted``
event, which the database accepts only for positions its fence wrote in this step.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import anyio

from orchestrator.db.deadlines import DATABASE_ERRORS
from orchestrator.errors import InvalidInput
from orchestrator.jsontext import compact, utf8_size
from orchestrator.storable import check_json, check_text

if TYPE_CHECKING:
    from orchestrator.db.output import OutputStore
    from orchestrator.models import JSON
    from orchestrator.telemetry import RunLogger

MAX_EVENT_BYTES = 65536
"""One event's data, as JSON (the database refuses more: orchestrator_output_limits)."""
FLUSH_SECONDS = 0.005
"""How long the first unwritten event waits for others to share its batch."""
BATCH_EVENTS = 200
BATCH_BYTES = 32768
DEFAULT_MAX_EVENTS = 10_000
DEFAULT_MAX_BYTES = 8 * 1024 * 1024
MAX_EVENTS_VARIABLE = "ORCHESTRATOR_OUTPUT_MAX_EVENTS"
MAX_BYTES_VARIABLE = "ORCHESTRATOR_OUTPUT_MAX_BYTES"


@dataclass(frozen=True, slots=True)
class OutputLimits:
    """A run's output bound: events and bytes of data over all its attempts (the database caps
    them at 100,000 events and 64 MiB)."""

    max_events: int = DEFAULT_MAX_EVENTS
    max_bytes: int = DEFAULT_MAX_BYTES

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> OutputLimits:
        env = os.environ if environ is None else environ
        return cls(
            _count(env, MAX_EVENTS_VARIABLE, DEFAULT_MAX_EVENTS),
            _count(env, MAX_BYTES_VARIABLE, DEFAULT_MAX_BYTES),
        )


def _count(env: Mapping[str, str], name: str, default: int) -> int:
    raw = env.get(name, "").strip()
    if not raw:
        return default
    if not raw.isdigit() or int(raw) < 1:
        raise InvalidInput(
            f"{name}={raw!r} is not a whole number of 1 or more; unset it for "
            f"the default ({default:,})"
        )
    return int(raw)


class OutputTarget(NamedTuple):
    """Where a step's output goes: its run, under its worker's lease, from its checkpoint.

    A NamedTuple: every step of every run builds one, and it is the cheapest immutable record.
    """

    store: OutputStore
    run_id: str
    worker_id: str
    fence: int
    base_version: int
    limits: OutputLimits
    log: RunLogger | None = None


class OutputPart:
    """What one model call publishes (``StepOutput.part()``): if the call fails midway and is
    tried again, ``withdraw`` takes its text back, so that no reader shows it twice."""

    __slots__ = ("_output", "done", "recording", "seqs")

    def __init__(self, output: StepOutput) -> None:
        self._output = output
        self.seqs: list[int] = []
        """The positions its events were written at (while it may still be withdrawn)."""
        self.done = False
        """Closed or withdrawn: nothing more goes through it."""
        self.recording = True
        """Its positions are kept: until it is closed, or its retraction is made."""

    def text(self, chunk: str) -> None:
        """``StepOutput.text_storable``, as this call's text."""
        if not self.done:
            self._output._text(chunk, self)

    def withdraw(self, reason: str) -> None:
        """The call failed: drop what it published that is not written yet and retract what
        is (one ``retracted`` event per unbroken run of its positions, from the same fence)."""
        if not self.done:
            self.done = True
            self._output._withdraw(self, reason)

    def close(self) -> None:
        """The call answered: what it published stays."""
        self.done = True
        self.recording = False
        self.seqs = []

    def retractions(self, reason: str) -> list[dict[str, JSON]]:
        """The events that take back what of this part was written (none if nothing was)."""
        runs: list[list[int]] = []
        for seq in self.seqs:
            if runs and seq == runs[-1][1] + 1:
                runs[-1][1] = seq
            else:
                runs.append([seq, seq])
        self.seqs, self.recording = [], False
        return [
            {"kind": "retracted", "data": {"from_seq": first, "to_seq": last, "reason": reason}}
            for first, last in runs
        ]


class StepOutput:
    """``ctx.output``: publish text and progress while the step runs (see the module doc).

    Outside a worker (a step called by hand) nothing is published and nothing fails.
    """

    __slots__ = (
        "_buffer",
        "_bytes",
        "_bytes_of_last",
        "_first_at",
        "_last_part",
        "_last_text",
        "_target",
        "_task",
        "_timer",
        "_token",
        "_urgent",
        "stopped",
    )

    def __init__(self, target: OutputTarget | None = None) -> None:
        self._target = target
        self._buffer: list[tuple[str, list[str] | dict[str, JSON], OutputPart | None]] = []
        """Events not yet written, each with the part it belongs to: a text event's pieces are
        joined when it is written; a ``retract`` entry becomes its part's retractions."""
        self._bytes = 0
        self._bytes_of_last = 0
        self._first_at = 0.0
        """When the oldest unwritten event was published (the event loop's clock)."""
        self._urgent = False
        """Write without waiting for the window: the step is about to commit."""
        self._last_text: list[str] | None = None
        self._last_part: OutputPart | None = None
        """The part of ``_last_text``: a part's text never shares an event with other text."""
        self._timer: asyncio.TimerHandle | None = None
        self._task: asyncio.Task[None] | None = None
        self.stopped: str | None = None if target is not None else "not in a worker"
        """Why nothing more is published: ``stale`` (the run is no longer this attempt's),
        ``truncated`` (its bound is reached), ``unavailable`` (the database failed an append)."""

    def text(self, chunk: str) -> None:
        """Append ``chunk`` to the step's text (a model's answer as it streams)."""
        if not isinstance(chunk, str):
            raise InvalidInput(f"output text is a string, not {type(chunk).__name__}")
        check_text(chunk, "output text")
        self.text_storable(chunk)

    def text_storable(self, chunk: str) -> None:
        """``text`` for a chunk known to be storable (``storable_text``: a model's tokens)."""
        self._text(chunk, None)

    def part(self) -> OutputPart:
        """A part for one model call's text, which can be withdrawn (``OutputPart``)."""
        return OutputPart(self)

    def _text(self, chunk: str, part: OutputPart | None) -> None:
        size = utf8_size(compact(chunk)) + 10
        if size > MAX_EVENT_BYTES:
            raise InvalidInput(
                f"an output event is at most {MAX_EVENT_BYTES:,} bytes; this text is {size:,} "
                "(publish it in smaller pieces)"
            )
        if not chunk or self.stopped:
            return
        if (
            self._last_text is not None
            and self._last_part is part
            and self._bytes_of_last + size <= MAX_EVENT_BYTES
        ):
            self._last_text.append(chunk)  # one event per batch of tokens, not one per token
            self._bytes_of_last += size
            self._added(size)
            return
        pieces = [chunk]
        self._buffer.append(("text", pieces, part))
        self._last_text, self._last_part = pieces, part
        self._bytes_of_last = size
        self._added(size)

    def _withdraw(self, part: OutputPart, reason: str) -> None:
        if self.stopped:
            return
        self._buffer = [entry for entry in self._buffer if entry[2] is not part]
        if self._last_part is part:
            self._last_text = self._last_part = None
        # What of it is written, or in the write in flight, is retracted by the next write.
        self._buffer.append(("retract", {"reason": check_text(reason, "a reason")}, part))
        self._added(utf8_size(reason) + 100)

    def progress(self, message: str, **details: JSON) -> None:
        """Say how the step is getting on: ``message``, and ``details`` (JSON values)."""
        if not isinstance(message, str):
            raise InvalidInput(f"a progress message is a string, not {type(message).__name__}")
        data: dict[str, JSON] = {**details, "message": check_text(message, "a progress message")}
        check_json(data, "progress details")
        size = utf8_size(compact(data))
        if size > MAX_EVENT_BYTES:
            raise InvalidInput(
                f"an output event is at most {MAX_EVENT_BYTES:,} bytes; this progress is {size:,}"
            )
        if self.stopped:
            return
        self._buffer.append(("progress", data, None))
        self._last_text = self._last_part = None
        self._added(size)

    # -- batching ---------------------------------------------------------------------------
    def _added(self, size: int) -> None:
        if not self._bytes:
            self._first_at = asyncio.get_running_loop().time()
        self._bytes += size
        if self._full():
            self._start()
        elif self._timer is None and (self._task is None or self._task.done()):
            self._timer = asyncio.get_running_loop().call_later(FLUSH_SECONDS, self._start)

    def _full(self) -> bool:
        return len(self._buffer) >= BATCH_EVENTS or self._bytes >= BATCH_BYTES

    def _start(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._write())

    async def _write(self) -> None:
        """Write batches until the buffer is empty: events added while one is written go in the
        next, which waits for the window of its oldest event, so that a run makes at most one
        append per ``FLUSH_SECONDS`` however fast its tokens come."""
        target = self._target
        assert target is not None
        loop = asyncio.get_running_loop()
        for _ in range(1_000_000):  # bounded: each round takes what was buffered
            if not self._buffer or self.stopped:
                return
            wait = self._first_at + FLUSH_SECONDS - loop.time()
            if wait > 0 and not self._urgent and not self._full():
                await asyncio.sleep(wait)
                continue
            # At most a batch's worth: what piled up behind a slow write goes in the next rounds
            # (the database takes at most 1,000 events an append).
            buffered, self._buffer = self._buffer[:BATCH_EVENTS], self._buffer[BATCH_EVENTS:]
            if not self._buffer:
                self._bytes = 0
            self._last_text = self._last_part = None
            batch: list[dict[str, JSON]] = []
            parts: list[OutputPart | None] = []
            for kind, data, part in buffered:
                if kind == "retract":
                    assert part is not None and isinstance(data, dict)
                    taken = part.retractions(str(data["reason"]))
                    batch += taken
                    parts += [None] * len(taken)
                    continue
                text = {"text": "".join(data)} if isinstance(data, list) else data
                batch.append({"kind": kind, "data": text})
                parts.append(part)
            if not batch:  # a withdrawn part of which nothing was written
                continue
            try:
                answer = await target.store.append(
                    target.run_id,
                    target.worker_id,
                    target.fence,
                    target.base_version,
                    batch,
                    max_events=target.limits.max_events,
                    max_bytes=target.limits.max_bytes,
                )
            except DATABASE_ERRORS as error:
                # Live output is not a commit: a failed write loses its batch, not the step.
                self.stopped = "unavailable"
                if target.log is not None:
                    target.log.warning("live output not written", error=str(error))
                return
            if answer.status != "ok":
                self.stopped = answer.status
                continue
            assert answer.last_seq is not None
            # The batch's events are the last positions: the append locks the run's head row.
            first = answer.last_seq - len(batch) + 1
            for offset, part in enumerate(parts):
                if part is not None and part.recording:
                    part.seqs.append(first + offset)

    def __enter__(self) -> None:
        """While the step runs: model calls that stream publish their tokens here
        (``current_output``)."""
        self._token = _CURRENT.set(self)

    def __exit__(self, *exc_info: object) -> None:
        _CURRENT.reset(self._token)

    async def flush(self, within: float) -> None:
        """Write what is buffered and wait for it (at most ``within`` seconds: the step's commit
        does not wait longer for its output)."""
        if self._target is None or (not self._buffer and self._task is None):
            return
        self._urgent = True
        with anyio.move_on_after(within):
            for _ in range(3):  # a write in flight, then what it left (bounded)
                if self._buffer and not self.stopped:
                    self._start()
                task = self._task
                if task is None or task.done():
                    if not self._buffer or self.stopped:
                        return
                    continue
                await asyncio.shield(task)

    def close(self) -> None:
        """The step is over: nothing more is written (a write in flight is cancelled)."""
        self.stopped = self.stopped or "closed"
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._task is not None and not self._task.done():
            self._task.cancel()
        self._buffer = []


_CURRENT: ContextVar[StepOutput | None] = ContextVar("orchestrator_step_output", default=None)


def current_output() -> StepOutput | None:
    """The running step's output (``None`` outside a worker's step): model calls that stream
    publish their tokens there."""
    return _CURRENT.get()
