"""Where sagas live in a store: their streams, a small index and their timers.

- **The stream** ``saga-<name>-<key>`` holds one event per transition (type
  ``eventflow.saga.transition``); the last event of each batch also carries the saga's
  fields and control state, so loading a saga reads one event. Appends check the stream's
  version (optimistic concurrency), and a transition's envelope id comes from the message
  that caused it, so a re-run after a crash stores nothing twice.
- **The tables** (:mod:`eventflow.sagas.tables`): the index and the timers (on the store's
  clock), behind one port with a SQL and a memory implementation. A timer row is written
  in the transaction of the transition that set it; the index row only when the saga's
  status changes (``updated``: when it last did). Inputs that reach a saga before its start
  are kept in its stream (a ``kept`` transition), not in a table.
- **Recent sagas**: the last committed state of the sagas this process saved last
  (:data:`RECENT` of them), so the next input of a saga usually needs no read. It is only a
  guess: the append checks the stream's version, and a saga another process changed
  meanwhile makes it conflict, then it is read from the store. An entry is written once its
  transaction committed, never before, and taken out by the input that uses it.
"""

from __future__ import annotations

import builtins
import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import orjson

from ..envelope import Envelope, hashed_id
from ..errors import StoreError
from ..ports import Store, Transaction
from .control import Control, Status
from .definition import SagaDefinition
from .outcome import Outcome
from .tables import IndexRow, NewTimer, SagaTables, TimerRow, Writes, tables_for

__all__ = [
    "RECENT",
    "TRANSITION_TYPE",
    "IndexRow",
    "Loaded",
    "SagaStore",
    "TimerRow",
    "saga_store",
]

TRANSITION_TYPE = "eventflow.saga.transition"
RECENT = 1024
"""Sagas whose last committed state a process keeps (about 1 KB each), most recent first."""


@dataclass
class Loaded:
    """A saga as read from its stream: the version, its fields and its control state."""

    version: int
    state: dict[str, Any]
    control: Control


class SagaStore:
    """The saga persistence of one store (see the module docstring)."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.tables: SagaTables = tables_for(store)
        """The index and the timers."""
        self._copy_state = not store.supports_sql
        self._recent: dict[str, tuple[int, bytes, Control]] = {}  # id: (version, state, control)

    async def setup(self) -> None:
        """Create the saga tables if needed. Idempotent."""
        await self.tables.setup()

    # -- streams -----------------------------------------------------------------------------

    async def load(self, definition: SagaDefinition, key: str) -> Loaded | None:
        """The saga of ``key``, or None when it never started."""
        stream = definition.stream_prefix + key
        async for rec in self.store.read_stream(stream, backwards=True, limit=1):
            saga = rec.envelope.data.get("saga")
            if saga is None:
                raise StoreError(
                    f"the last event of {stream!r} carries no saga state: the stream was "
                    "written by something other than eventflow's sagas"
                )
            # A copy: the memory store hands out its stored envelope's data, which a handling
            # that changes the saga and then rolls back must leave as it was.
            state = copy.deepcopy(saga["state"]) if self._copy_state else saga["state"]
            return Loaded(rec.stream_version, state, Control.from_dict(saga["control"]))
        return None

    def recent(self, definition: SagaDefinition, key: str) -> Loaded | None:
        """The saga of ``key`` as this process last committed it, or None (not among the
        recent ones): a guess that the save's version check confirms. The entry is taken
        out (the machine changes its control in place): the handling puts back what it
        commits, and one that rolls back leaves the next input to read the store."""
        entry = self._recent.pop(definition.stream_prefix + key, None)
        if entry is None:
            return None
        version, state, control = entry
        return Loaded(version, orjson.loads(state), control)

    def _remember(self, saga_id: str, version: int, state: bytes, control: Control) -> None:
        """After the commit of ``version`` of ``saga_id``: keep it (an older one never
        replaces a newer), forgetting the least recent past :data:`RECENT`."""
        recent = self._recent
        old = recent.pop(saga_id, None)
        if old is not None and old[0] > version:
            recent[saga_id] = old
            return
        recent[saga_id] = (version, state, control)
        if len(recent) > RECENT:
            del recent[next(iter(recent))]

    async def history(self, saga_id: str) -> builtins.list[dict[str, Any]]:
        """Every transition of a saga (the JSON form), oldest first."""
        return [rec.envelope.data async for rec in self.store.read_stream(saga_id)]

    async def save(
        self,
        tx: Transaction,
        definition: SagaDefinition,
        loaded_version: int,
        state: dict[str, Any],
        control: Control,
        outcome: Outcome,
        *,
        source: str,
        cause: Envelope | None,
        now: float,
        was: Status | None = None,
        sends: Sequence[tuple[str, Envelope]] = (),
        handled: tuple[str, str] | None = None,
        last: bool = False,
        checked_at_commit: bool = False,
    ) -> Callable[[], None]:
        """Append the outcome's transitions (checking the stream is still at
        ``loaded_version``: ``ConcurrencyError`` otherwise, with nothing written), then
        update the timers, the index when the status is not ``was`` (the status loaded;
        None: a saga not stored yet) and queue ``sends`` in the outbox, all in ``tx``: the
        tables ride on the append (:meth:`~eventflow.sagas.tables.SagaTables.append`), and
        so may the dedup entry ``handled`` (``Writes.handled``); ``last``,
        ``checked_at_commit``: see ``Writes``.
        Returns what to call once ``tx`` committed (the saga joins the recent ones)."""
        key = control.key
        saga_id = definition.stream_prefix + key
        saved = {"state": state, "control": control.as_dict()}
        envelopes = self._transition_envelopes(
            definition, saga_id, saved, control, outcome, source=source, cause=cause
        )
        started = control.origin_ms / 1000
        status = control.status
        row = IndexRow(saga_id, definition.name, key, status.value, _at(started), _at(now))
        timers = [
            NewTimer(name, due - now, token) for name, (due, token) in outcome.timers_set.items()
        ]
        cancelled = tuple(outcome.timers_cancelled)
        writes = Writes(row, timers, cancelled, status != was, handled, last, checked_at_commit)
        version = await self.tables.append(tx, saga_id, envelopes, loaded_version, writes, sends)
        kept, copied = orjson.dumps(state), control.copy()
        return lambda: self._remember(saga_id, version, kept, copied)

    def _transition_envelopes(
        self,
        definition: SagaDefinition,
        saga_id: str,
        saved: dict[str, Any],
        control: Control,
        outcome: Outcome,
        *,
        source: str,
        cause: Envelope | None,
    ) -> list[Envelope]:
        """One envelope per transition; the last carries the saga's state and control
        (``saved``). Ids come from the cause (or the input's number) so a re-run appends
        nothing new."""
        causation: str | None
        correlation: str | None
        if cause is not None:
            origin, causation, correlation = cause.id, cause.id, cause.correlation_id
        else:
            origin, causation = f"input-{control.seq}", None
            correlation = control.correlation_id
        key, origin_ms, last = control.key, control.origin_ms, len(outcome.transitions) - 1
        out = []
        for i, t in enumerate(outcome.transitions):
            data: dict[str, Any] = t.as_dict()
            if i == last:
                data["saga"] = {"name": definition.name, "key": key, **saved}
            out.append(
                Envelope.create(
                    TRANSITION_TYPE,
                    data,
                    source=source,
                    id=hashed_id(origin_ms, saga_id, origin, str(i)),
                    key=key,
                    correlation_id=correlation,
                    causation_id=causation,
                    time=t.at,
                )
            )
        return out

    # -- index, timers -------------------------------------------------------

    async def list(
        self, *, name: str | None = None, status: str | None = None, limit: int = 1000
    ) -> builtins.list[IndexRow]:
        """Sagas in the index, most recently updated first."""
        return await self.tables.list(name=name, status=status, limit=limit)

    async def find(self, saga_id: str) -> IndexRow | None:
        """The index row of ``saga_id``, if it exists."""
        return await self.tables.find(saga_id)

    async def counts(self) -> dict[tuple[str, str], int]:
        """How many sagas there are per (saga class name, status)."""
        return await self.tables.counts()

    async def earliest(self, name: str, limit: int = 100) -> tuple[builtins.list[TimerRow], float]:
        """The earliest timers of the saga class ``name`` and the store clock's reading."""
        return await self.tables.earliest(name, limit)

    async def drop_timer(self, tx: Transaction, row: TimerRow) -> None:
        """Delete a timer row that fired for nothing (its saga or setting is gone)."""
        await self.tables.drop_timer(tx, row)


def _at(seconds: float) -> datetime:
    return datetime.fromtimestamp(seconds, UTC)


def saga_store(store: Store) -> SagaStore:
    """The saga persistence of ``store``."""
    return SagaStore(store)
