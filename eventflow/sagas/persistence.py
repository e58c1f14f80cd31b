"""Where sagas live in a store: their streams, a small index and their timers.

- **The stream** ``saga-<name>-<key>`` holds one event per transition (type
  ``eventflow.saga.transition``); the last event of each batch also carries the saga's
  fields and control state, so loading a saga reads one event. Appends check the stream's
  version (optimistic concurrency), and a transition's envelope id comes from the message
  that caused it, so a re-run after a crash stores nothing twice.
- **The index** ``ef_sagas`` (id, name, key, status, started, updated) serves ``list``
  without reading streams.
- **The timers** ``ef_saga_timers`` (saga id, timer name, due, token): the timer loop reads
  the due ones. A timer row is written in the transaction of the transition that set it.

SQL stores (SQLite, PostgreSQL) keep the index and timers in tables written through the
store's own :class:`~eventflow.ports.Transaction` (the ``$1`` style runs on both); the
memory store keeps them in dicts, applied when its transaction commits.
"""

from __future__ import annotations

import builtins
import copy
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, TypeVar

from ..envelope import Envelope, hashed_id
from ..errors import StoreError
from ..ports import Store, Transaction
from .definition import Saga, SagaDefinition
from .machine import Control, Outcome

__all__ = [
    "TRANSITION_TYPE",
    "IndexRow",
    "Loaded",
    "SagaStore",
    "TimerRow",
    "build_saga",
    "saga_store",
]

TRANSITION_TYPE = "eventflow.saga.transition"

_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS ef_sagas (id TEXT PRIMARY KEY, name TEXT NOT NULL, "
    "key TEXT NOT NULL, status TEXT NOT NULL, started DOUBLE PRECISION NOT NULL, "
    "updated DOUBLE PRECISION NOT NULL)",
    "CREATE INDEX IF NOT EXISTS ef_sagas_by_status ON ef_sagas (status, name, updated)",
    "CREATE TABLE IF NOT EXISTS ef_saga_timers (saga_id TEXT NOT NULL, timer TEXT NOT NULL, "
    "name TEXT NOT NULL, key TEXT NOT NULL, due DOUBLE PRECISION NOT NULL, "
    "token TEXT NOT NULL, PRIMARY KEY (saga_id, timer))",
    "CREATE INDEX IF NOT EXISTS ef_saga_timers_by_due ON ef_saga_timers (name, due)",
)


@dataclass(frozen=True)
class IndexRow:
    """One saga in the index."""

    id: str
    name: str
    key: str
    status: str
    started: datetime
    updated: datetime


@dataclass(frozen=True)
class TimerRow:
    """One timer waiting in the store."""

    saga_id: str
    timer: str
    name: str
    key: str
    due: float
    token: str


@dataclass
class Loaded:
    """A saga as read from its stream: the version, its fields and its control state."""

    version: int
    state: dict[str, Any]
    control: Control


_S = TypeVar("_S", bound=Saga)


def build_saga(cls: type[_S], loaded: Loaded) -> _S:
    """The saga object of ``loaded`` (its fields, and its key, status and reason)."""
    saga = cls.model_validate(loaded.state)
    control = loaded.control
    saga._meta.update(key=control.key, status=control.status, reason=control.reason)
    return saga


class _MemoryTables:
    def __init__(self) -> None:
        self.index: dict[str, IndexRow] = {}
        self.timers: dict[tuple[str, str], TimerRow] = {}


_memory_tables: weakref.WeakKeyDictionary[Any, _MemoryTables] = weakref.WeakKeyDictionary()


class SagaStore:
    """The saga persistence of one store (see the module docstring)."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self._sql = store.supports_sql
        self._ready = False

    async def setup(self) -> None:
        """Create the index and timer tables if needed (SQL stores). Idempotent."""
        if self._ready or not self._sql:
            self._ready = True
            return
        for attempt in range(3):
            try:
                async with self.store.transaction() as tx:
                    for sql in _SCHEMA:
                        await tx.execute(sql)
                break
            except Exception:  # two processes creating the tables at once: look again
                if attempt == 2:
                    raise
        self._ready = True

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
            state = copy.deepcopy(saga["state"]) if not self._sql else saga["state"]
            return Loaded(rec.stream_version, state, Control.from_dict(saga["control"]))
        return None

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
    ) -> None:
        """Append the outcome's transitions (checking the stream is still at
        ``loaded_version``: ``ConcurrencyError`` otherwise, before anything else is written),
        then update the index and the timers, all in ``tx``."""
        key = control.key
        saga_id = definition.stream_prefix + key
        envelopes = self._transition_envelopes(
            definition, saga_id, state, control, outcome, source=source, cause=cause
        )
        await self.store.append(saga_id, envelopes, expected_version=loaded_version)
        started = control.origin_ms / 1000
        row = IndexRow(saga_id, definition.name, key, control.status, _at(started), _at(now))
        timers = [
            TimerRow(saga_id, name, definition.name, key, due, token)
            for name, (due, token) in outcome.timers_set.items()
        ]
        if self._sql:
            await tx.execute(
                "INSERT INTO ef_sagas (id, name, key, status, started, updated) "
                "VALUES ($1, $2, $3, $4, $5, $6) ON CONFLICT (id) DO UPDATE SET "
                "status = excluded.status, updated = excluded.updated",
                row.id,
                row.name,
                row.key,
                row.status,
                started,
                now,
            )
            for name in outcome.timers_cancelled:
                await tx.execute(
                    "DELETE FROM ef_saga_timers WHERE saga_id = $1 AND timer = $2", saga_id, name
                )
            for t in timers:
                await tx.execute(
                    "INSERT INTO ef_saga_timers (saga_id, timer, name, key, due, token) "
                    "VALUES ($1, $2, $3, $4, $5, $6) ON CONFLICT (saga_id, timer) DO UPDATE "
                    "SET due = excluded.due, token = excluded.token",
                    t.saga_id,
                    t.timer,
                    t.name,
                    t.key,
                    t.due,
                    t.token,
                )
            return
        tables = self._memory()
        cancelled = set(outcome.timers_cancelled)

        def apply() -> None:
            tables.index[saga_id] = row
            for name in cancelled:
                tables.timers.pop((saga_id, name), None)
            for t in timers:
                tables.timers[(saga_id, t.timer)] = t

        _on_commit(tx, apply)

    def _transition_envelopes(
        self,
        definition: SagaDefinition,
        saga_id: str,
        state: dict[str, Any],
        control: Control,
        outcome: Outcome,
        *,
        source: str,
        cause: Envelope | None,
    ) -> list[Envelope]:
        """One envelope per transition; the last carries the saga's state. Ids come from
        the cause (or the input's number) so a re-run appends nothing new."""
        origin = cause.id if cause is not None else f"input-{control.seq}"
        last = len(outcome.transitions) - 1
        out = []
        for i, t in enumerate(outcome.transitions):
            data: dict[str, Any] = t.as_dict()
            if i == last:
                data["saga"] = {
                    "name": definition.name,
                    "key": control.key,
                    "state": state,
                    "control": control.as_dict(),
                }
            out.append(
                Envelope.create(
                    TRANSITION_TYPE,
                    data,
                    source=source,
                    id=hashed_id(control.origin_ms, saga_id, origin, str(i)),
                    key=control.key,
                    correlation_id=(
                        cause.correlation_id if cause is not None else control.correlation_id
                    ),
                    causation_id=cause.id if cause is not None else None,
                    time=t.at,
                )
            )
        return out

    # -- index and timers ------------------------------------------------------------------

    async def list(
        self, *, name: str | None = None, status: str | None = None, limit: int = 1000
    ) -> builtins.list[IndexRow]:
        """Sagas in the index, most recently updated first."""
        if not self._sql:
            rows = [
                r
                for r in self._memory().index.values()
                if (name is None or r.name == name) and (status is None or r.status == status)
            ]
            return sorted(rows, key=lambda r: r.updated, reverse=True)[:limit]
        async with self.store.transaction() as tx:
            found = await tx.fetch(
                "SELECT id, name, key, status, started, updated FROM ef_sagas "
                "WHERE ($1 = '' OR name = $1) AND ($2 = '' OR status = $2) "
                "ORDER BY updated DESC LIMIT $3",
                name or "",
                status or "",
                limit,
            )
        return [_row(r) for r in found]

    async def find(self, saga_id: str) -> IndexRow | None:
        """The index row of ``saga_id``, if it exists."""
        if not self._sql:
            return self._memory().index.get(saga_id)
        async with self.store.transaction() as tx:
            found = await tx.fetch(
                "SELECT id, name, key, status, started, updated FROM ef_sagas WHERE id = $1",
                saga_id,
            )
        if not found:
            return None
        return _row(found[0])

    async def due(
        self, names: Sequence[str], now: float, limit: int = 100
    ) -> builtins.list[TimerRow]:
        """Timers of the sagas ``names`` due at ``now``, earliest first."""
        if not self._sql:
            rows = [t for t in self._memory().timers.values() if t.name in names and t.due <= now]
            return sorted(rows, key=lambda t: t.due)[:limit]
        out: builtins.list[TimerRow] = []
        async with self.store.transaction() as tx:
            for name in names:
                found = await tx.fetch(
                    "SELECT saga_id, timer, name, key, due, token FROM ef_saga_timers "
                    "WHERE name = $1 AND due <= $2 ORDER BY due LIMIT $3",
                    name,
                    now,
                    limit,
                )
                out.extend(TimerRow(r[0], r[1], r[2], r[3], float(r[4]), r[5]) for r in found)
        return sorted(out, key=lambda t: t.due)[:limit]

    async def next_due(self, names: Sequence[str]) -> float | None:
        """When the earliest timer of ``names`` is due (None: no timer)."""
        if not self._sql:
            dues = [t.due for t in self._memory().timers.values() if t.name in names]
            return min(dues) if dues else None
        best: float | None = None
        async with self.store.transaction() as tx:
            for name in names:
                found = await tx.fetch("SELECT MIN(due) FROM ef_saga_timers WHERE name = $1", name)
                if found and found[0][0] is not None:
                    due = float(found[0][0])
                    best = due if best is None else min(best, due)
        return best

    async def drop_timer(self, tx: Transaction, row: TimerRow) -> None:
        """Delete a timer row that fired for nothing (its saga or setting is gone)."""
        if not self._sql:
            tables = self._memory()
            key = (row.saga_id, row.timer)

            def apply() -> None:
                if tables.timers.get(key) == row:
                    del tables.timers[key]

            _on_commit(tx, apply)
            return
        await tx.execute(
            "DELETE FROM ef_saga_timers WHERE saga_id = $1 AND timer = $2 AND token = $3",
            row.saga_id,
            row.timer,
            row.token,
        )

    def _memory(self) -> _MemoryTables:
        tables = _memory_tables.get(self.store)
        if tables is None:
            tables = _memory_tables[self.store] = _MemoryTables()
        return tables


def _on_commit(tx: Transaction, apply: Callable[[], None]) -> None:
    """Run ``apply`` when the memory store's transaction ``tx`` commits (now, for a
    transaction that cannot defer)."""
    defer = getattr(tx, "defer", None)
    if defer is None:
        apply()
    else:
        defer(apply)


def _at(seconds: float) -> datetime:
    return datetime.fromtimestamp(seconds, UTC)


def _row(r: tuple[Any, ...]) -> IndexRow:
    """An index row from SQL (times are stored as Unix seconds)."""
    return IndexRow(r[0], r[1], r[2], r[3], _at(float(r[4])), _at(float(r[5])))


def saga_store(store: Store) -> SagaStore:
    """The saga persistence of ``store``."""
    return SagaStore(store)
