"""Signals: messages from the world to a run, stored durably and consumed exactly once.

A signal (``orchestrator runs signal RUN NAME --data JSON``, or ``Client.signal``) is stored in
order with the run. The run's next step reads every unconsumed signal in ``ctx.signals``, and its
fenced commit consumes them: a step that dies before committing leaves them for the step that
replays it, so each signal enters the run's committed history exactly once. A run waiting for a
signal of that name (``Wait(signals=[...])``) is woken. The same idempotency key twice is one
signal.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING

from orchestrator.access import Actor
from orchestrator.db.audit import decided
from orchestrator.db.notifications import SIGNALS_CHANNEL
from orchestrator.db.queries import query
from orchestrator.errors import IdempotencyConflict, InvalidInput, InvalidTransition, RunNotFound
from orchestrator.ids import validate_run_id
from orchestrator.jsontext import compact, utf8_size
from orchestrator.models import JSON, Lease, Row
from orchestrator.storable import check_json, check_text

if TYPE_CHECKING:
    from orchestrator.db.executor import Executor

MAX_SIGNAL_BYTES = 256 * 1024
_SIGNAL_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_.:-]{0,99}$")


def validate_signal_name(name: str) -> str:
    if not isinstance(name, str) or not _SIGNAL_NAME.fullmatch(name):
        raise InvalidInput(
            f"malformed signal name {name!r}: 1-100 characters, starting with a letter, holding "
            "only letters, digits and _ . : - (for example customer_reply)"
        )
    return name


@dataclass(frozen=True, slots=True)
class Signal:
    """One signal as stored: its place in the run's order, name, data and when it came."""

    seq: int
    name: str
    data: JSON
    sent_at: datetime
    idempotency_key: str | None = None

    @classmethod
    def from_json(cls, value: dict[str, JSON]) -> Signal:
        """From the JSON a claim returns a run's signals as."""
        return cls(
            value["seq"], value["name"], value["data"], datetime.fromisoformat(value["sent_at"]),
            value["idempotency_key"],
        )  # fmt: skip

    @classmethod
    def from_record(cls, record: Row) -> Signal:
        return cls(
            record["seq"], record["name"], record["data"], record["sent_at"],
            record["idempotency_key"],
        )  # fmt: skip


@dataclass(frozen=True, slots=True)
class SentSignal:
    signal: Signal
    created: bool
    """False when the idempotency key was already used: the stored signal is returned."""


class SignalStore:
    def __init__(self, db: Executor) -> None:
        self.db = db

    async def send(
        self,
        run_id: str,
        name: str,
        data: JSON = None,
        *,
        idempotency_key: str | None = None,
        actor: Actor | None = None,
    ) -> SentSignal:
        """Store a signal for ``run_id`` (and wake it if it waits for ``name``), sent by
        ``actor`` (None: the database role that connected) as the audit trail records."""
        validate_run_id(run_id)
        validate_signal_name(name)
        check_json(data, "signal data")
        size = utf8_size(compact(data))
        if size > MAX_SIGNAL_BYTES:
            raise InvalidInput(
                f"signal data is {size:,} bytes, over the {MAX_SIGNAL_BYTES:,}-byte limit; store "
                "large documents elsewhere and send a reference"
            )
        if idempotency_key is not None:
            check_text(idempotency_key, "the idempotency key")
            if not 1 <= len(idempotency_key) <= 200:
                raise InvalidInput("an idempotency key must be 1-200 characters")
        record = await decided(
            self.db,
            "signal",
            actor,
            "send_signal",
            run_id,
            name,
            data,
            idempotency_key,
            run_id=run_id,
        )
        assert record is not None
        seq = record["seq"]
        state = record["state"]
        if state is None:
            raise RunNotFound(run_id)
        if seq is not None:
            return SentSignal(Signal(seq, name, data, record["sent_at"], idempotency_key), True)
        # A retried send whose first attempt landed gets that signal back, even if the run has
        # finished since.
        existing = (
            await self.db.fetchrow(query("get_signal_by_key"), run_id, idempotency_key)
            if idempotency_key is not None
            else None
        )
        if existing is None:
            if state not in ("queued", "running", "waiting"):
                raise InvalidTransition(
                    f"run {run_id} is {state}: signals are taken only by queued, running or "
                    "waiting runs"
                )
            raise AssertionError("a live run stored no signal and had none under its key")
        signal = Signal.from_record(existing)
        if signal.name != name or signal.data != data:
            raise IdempotencyConflict(
                f"idempotency key {idempotency_key!r} was already used for signal "
                f"{signal.name!r} #{signal.seq} of run {run_id} with other data; use a new key "
                "for a new signal"
            )
        return SentSignal(signal, created=False)

    async def consume(self, consumed: Sequence[tuple[Lease, Sequence[int]]]) -> None:
        """In a commit's transaction (``db`` is its connection): the signals each step was
        given are consumed, by the fence that committed it."""
        rows = [(lease, seq) for lease, seqs in consumed for seq in seqs]
        await self.db.execute(
            query("consume_signals"),
            [lease.run_id for lease, _ in rows],
            [seq for _, seq in rows],
            [lease.fence for lease, _ in rows],
        )

    async def pending(self, run_id: str, awaited: Sequence[str] = ()) -> tuple[Signal, ...]:
        """The run's unconsumed signals (at most 100), in the order they came; those named in
        ``awaited`` chosen first."""
        records = await self.db.fetch(query("pending_signals"), run_id, list(awaited))
        return tuple(Signal.from_record(record) for record in records)

    async def history(
        self, run_id: str, *, newest: int | None = None
    ) -> list[tuple[Signal, datetime | None, int | None]]:
        """Every signal of the run (or the ``newest`` ones), oldest first, with when, and by
        which fence, it was consumed."""
        validate_run_id(run_id)
        if newest is not None and newest < 0:
            raise InvalidInput(f"the newest signals shown must be 0 or more, not {newest!r}")
        records = await self.db.fetch(query("run_signals"), run_id, newest)
        return [(Signal.from_record(r), r["consumed_at"], r["consumed_fence"]) for r in records]


__all__ = ["SIGNALS_CHANNEL", "SentSignal", "Signal", "SignalStore", "validate_signal_name"]
