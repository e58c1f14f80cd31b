"""The saga tables of a store: the index and the timers.

One port, :class:`SagaTables`, with two implementations chosen once per store by what the
store declares (``supports_sql``): :class:`SqlSagaTables` (PostgreSQL and SQLite: tables
written through the store's own transactions, in the ``$1`` style both run) and
:class:`MemorySagaTables` (dicts, changed when the memory store's transaction commits).

- **The index** ``ef_sagas`` (id, name, key, status, started, updated) serves ``list``
  and ``find`` without reading streams; it is written when a saga's status changes.
- **Riding on the append**: :meth:`SagaTables.append` appends a transition's events and
  writes its rows (and queues its commands in the outbox) in one go; a conflicting append
  writes none of them. The default appends, then saves; a store adapter may send it all
  in one round trip (PostgreSQL: one statement).
- **The timers** ``ef_saga_timers`` (saga id, timer name, saga name, key, due, token).
  ``due`` is on the store's clock (:class:`~eventflow.ports.StoreClock`): a timer is set
  with a delay, and SQL adds it to the clock inside the statement that writes the row, so
  the instances whose clocks disagree agree on what is due (PostgreSQL: the server's
  clock). ``earliest`` reads the earliest timers of a saga class with the clock's reading.
"""

from __future__ import annotations

import builtins
import functools
import weakref
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any, Protocol

from ..envelope import Envelope
from ..ports import Store, Transaction

__all__ = [
    "DROP_TIMER",
    "IndexRow",
    "MemorySagaTables",
    "NewTimer",
    "SagaTables",
    "SqlSagaTables",
    "TimerRow",
    "Writes",
    "tables_for",
]


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
    """One timer waiting in the store (``due``: on the store's clock)."""

    saga_id: str
    timer: str
    name: str
    key: str
    due: float
    token: str


@dataclass(frozen=True)
class NewTimer:
    """A timer to set: due ``delay`` seconds after the store's clock at the write."""

    timer: str
    delay: float
    token: str


@dataclass(frozen=True)
class Writes:
    """What one saga transition writes to the tables (the arguments of
    :meth:`SagaTables.save`)."""

    row: IndexRow
    timers: Sequence[NewTimer]
    cancelled: Sequence[str]
    index: bool = True
    handled: tuple[str, str] | None = None
    """The dedup entry (group, message id) of the message the transition handles: a store
    adapter may write it with the append (PostgreSQL: in its statement; a copy's entry
    committed first then raises ``AlreadyHandled``, nothing written), and the store's
    ``mark_handled`` of it in ``tx`` then writes nothing more. The default leaves it to
    the consumer, which marks it before the commit."""
    last: bool = False
    """Nothing else is written in ``tx`` after this append (the consumer's mark of
    ``handled`` aside): an adapter may then send it as a transaction of its own when
    nothing ran in ``tx`` before (PostgreSQL: no BEGIN, no COMMIT)."""
    checked_at_commit: bool = False
    """The caller applies its input again, in a fresh transaction, when the commit of
    ``tx`` raises ``ConcurrencyError`` (the consumer's pipeline does): an adapter may then
    check the version with the commit instead of at the append (SQLite: the append
    travels with the ``COMMIT``, one trip to the database thread less). Only with
    ``handled``: the commit raises ``AlreadyHandled`` when the events are stored already
    (a copy of a message handled before)."""


class SagaTables(Protocol):
    """The saga index and timers of one store. Writes take the transaction of
    the saga transition they belong to and commit with it; reads see what committed."""

    store: Store

    async def setup(self) -> None:
        """Create the tables if needed. Idempotent, safe from several processes at once."""

    async def save(
        self,
        tx: Transaction,
        row: IndexRow,
        timers: Sequence[NewTimer],
        cancelled: Iterable[str],
        *,
        index: bool = True,
    ) -> None:
        """Write the saga's index row when ``index`` (insert, or update status and
        updated), delete its ``cancelled`` timers and set ``timers`` (replacing a timer of
        the same name); the timer rows take the saga's name and key from ``row``."""

    async def append(
        self,
        tx: Transaction,
        stream_id: str,
        envelopes: Sequence[Envelope],
        expected_version: int,
        writes: Writes,
        sends: Sequence[tuple[str, Envelope]] = (),
    ) -> int:
        """Append ``envelopes`` to ``stream_id`` at ``expected_version``, then make the
        ``writes`` (as :meth:`save`) and queue ``sends`` in the store's outbox, all in
        ``tx`` (the context's open transaction); returns the stream's new version. A
        conflict raises ``ConcurrencyError`` with none of them written."""

    async def list(
        self, *, name: str | None = None, status: str | None = None, limit: int = 1000
    ) -> builtins.list[IndexRow]:
        """Sagas in the index, most recently updated first."""

    async def find(self, saga_id: str) -> IndexRow | None:
        """The index row of ``saga_id``, if it exists."""

    async def counts(self) -> dict[tuple[str, str], int]:
        """How many sagas there are per (saga class name, status): one grouped read."""

    async def earliest(self, name: str, limit: int) -> tuple[builtins.list[TimerRow], float]:
        """The ``limit`` earliest timers of the saga class ``name`` (due or not), earliest
        first, and the store clock's reading when they were read."""

    async def drop_timer(self, tx: Transaction, row: TimerRow) -> None:
        """Delete the timer ``row`` if it is still set with its token."""


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
_COLUMNS = "id, name, key, status, started, updated"
_TIMER_COLUMNS = "saga_id, timer, name, key, due, token"
_INDEX = (
    f"INSERT INTO ef_sagas ({_COLUMNS}) VALUES ($1, $2, $3, $4, $5, $6) "
    "ON CONFLICT (id) DO UPDATE SET status = excluded.status, updated = excluded.updated"
)
_CANCEL = "DELETE FROM ef_saga_timers WHERE saga_id = $1 AND timer = $2"
DROP_TIMER = "DELETE FROM ef_saga_timers WHERE saga_id = $1 AND timer = $2 AND token = $3"
"""Deletes the timer row that fired, only if it is still that setting (its token)."""


class _AppendThenSave:
    """:meth:`SagaTables.append` as the store's append (``_append_events``), then ``save``
    and the outbox."""

    store: Store
    save: Callable[..., Awaitable[None]]  # each subclass's (SagaTables.save)

    async def append(
        self,
        tx: Transaction,
        stream_id: str,
        envelopes: Sequence[Envelope],
        expected_version: int,
        writes: Writes,
        sends: Sequence[tuple[str, Envelope]] = (),
    ) -> int:
        """The events (a conflict raises before anything else is written), then ``save``
        and the outbox's ``add``."""
        version = await self._append_events(tx, stream_id, envelopes, expected_version, writes)
        w = writes
        await self.save(tx, w.row, w.timers, w.cancelled, index=w.index)
        if sends:
            await self.store.outbox.add(sends, tx=tx)
        return version

    async def _append_events(
        self,
        tx: Transaction,
        stream_id: str,
        envelopes: Sequence[Envelope],
        expected_version: int,
        writes: Writes,
    ) -> int:
        """The store's append in ``tx`` (the context's open transaction); the new version."""
        return await self.store.append(stream_id, envelopes, expected_version=expected_version)


class SqlSagaTables(_AppendThenSave):
    """The saga tables of a SQL store (PostgreSQL, SQLite): see the module docstring."""

    def __init__(self, store: Store) -> None:
        self.store = store
        clock = store.clock.sql
        assert clock is not None, "a SQL store's clock has an SQL expression"
        self._clock = clock
        self._set_sql = (
            f"INSERT INTO ef_saga_timers ({_TIMER_COLUMNS}) "
            f"VALUES ($1, $2, $3, $4, {clock} + $5, $6) ON CONFLICT (saga_id, timer) "
            "DO UPDATE SET due = excluded.due, token = excluded.token"
        )
        self._ready = False

    async def setup(self) -> None:
        """Create the tables if needed (two processes creating them at once: try again)."""
        if self._ready:
            return
        for attempt in range(3):
            try:
                async with self.store.transaction() as tx:
                    for sql in _SCHEMA:
                        await tx.execute(sql)
                break
            except Exception:
                if attempt == 2:
                    raise
        self._ready = True

    async def save(
        self,
        tx: Transaction,
        row: IndexRow,
        timers: Sequence[NewTimer],
        cancelled: Iterable[str],
        *,
        index: bool = True,
    ) -> None:
        """One statement for the index row (when ``index``), one per timer changed (a store
        adapter may send them in fewer round trips: :func:`tables_for`)."""
        for sql, args in self.writes(row, timers, cancelled, index=index):
            await tx.execute(sql, *args)

    def writes(
        self,
        row: IndexRow,
        timers: Sequence[NewTimer],
        cancelled: Iterable[str],
        *,
        index: bool = True,
    ) -> list[tuple[str, tuple[Any, ...]]]:
        """The statements of :meth:`save`, in order, with their arguments (``$1``
        style): the index row, the deletes, then the upserts."""
        out: list[tuple[str, tuple[Any, ...]]] = []
        if index:
            started, updated = row.started.timestamp(), row.updated.timestamp()
            out.append((_INDEX, (row.id, row.name, row.key, row.status, started, updated)))
        out.extend((_CANCEL, (row.id, timer)) for timer in cancelled)
        set_sql = self._set_sql
        out.extend(
            (set_sql, (row.id, t.timer, row.name, row.key, t.delay, t.token)) for t in timers
        )
        return out

    async def list(
        self, *, name: str | None = None, status: str | None = None, limit: int = 1000
    ) -> builtins.list[IndexRow]:
        """Most recently updated first."""
        async with self.store.transaction() as tx:
            found = await tx.fetch(
                f"SELECT {_COLUMNS} FROM ef_sagas WHERE ($1 = '' OR name = $1) "
                "AND ($2 = '' OR status = $2) ORDER BY updated DESC LIMIT $3",
                name or "",
                status or "",
                limit,
            )
        return [_index_row(r) for r in found]

    async def find(self, saga_id: str) -> IndexRow | None:
        """The row, or None."""
        async with self.store.transaction() as tx:
            found = await tx.fetch(f"SELECT {_COLUMNS} FROM ef_sagas WHERE id = $1", saga_id)
        return _index_row(found[0]) if found else None

    async def counts(self) -> dict[tuple[str, str], int]:
        """One ``GROUP BY`` over the index."""
        async with self.store.transaction() as tx:
            found = await tx.fetch(
                "SELECT name, status, COUNT(*) FROM ef_sagas GROUP BY name, status"
            )
        return {(str(r[0]), str(r[1])): int(r[2]) for r in found}

    async def earliest(self, name: str, limit: int) -> tuple[builtins.list[TimerRow], float]:
        """One query: the rows and the clock (read again when there is no row)."""
        async with self.store.transaction() as tx:
            found = await tx.fetch(
                f"SELECT {_TIMER_COLUMNS}, {self._clock} FROM ef_saga_timers "
                "WHERE name = $1 ORDER BY due LIMIT $2",
                name,
                limit,
            )
            now = float(found[0][6]) if found else await self.store.clock.now(tx)
        return [TimerRow(r[0], r[1], r[2], r[3], float(r[4]), r[5]) for r in found], now

    async def drop_timer(self, tx: Transaction, row: TimerRow) -> None:
        """Only the setting that fired (its token)."""
        await tx.execute(DROP_TIMER, row.saga_id, row.timer, row.token)


class MemorySagaTables(_AppendThenSave):
    """The saga tables of a memory store: dicts shared by every user of that store object,
    changed when the transaction that wrote them commits."""

    def __init__(self, store: Store) -> None:
        self.store = store
        shared = _memory_shared.get(store)
        if shared is None:
            shared = _memory_shared[store] = _Shared()
        self._shared = shared

    async def setup(self) -> None:
        """Nothing to create."""

    async def save(
        self,
        tx: Transaction,
        row: IndexRow,
        timers: Sequence[NewTimer],
        cancelled: Iterable[str],
        *,
        index: bool = True,
    ) -> None:
        """Applied at the commit; dues from the clock's reading now."""
        now = await self.store.clock.now(tx)
        rows = [
            TimerRow(row.id, t.timer, row.name, row.key, now + t.delay, t.token) for t in timers
        ]
        gone = tuple(cancelled)
        shared = self._shared

        def apply() -> None:
            if index:
                old = shared.index.get(row.id)
                shared.index[row.id] = row if old is None else replace(row, started=old.started)
            for timer in gone:
                shared.timers.pop((row.id, timer), None)
            for t in rows:
                shared.timers[(row.id, t.timer)] = t

        _on_commit(tx, apply)

    async def list(
        self, *, name: str | None = None, status: str | None = None, limit: int = 1000
    ) -> builtins.list[IndexRow]:
        """Most recently updated first."""
        rows = [
            r
            for r in self._shared.index.values()
            if (name is None or r.name == name) and (status is None or r.status == status)
        ]
        return sorted(rows, key=lambda r: r.updated, reverse=True)[:limit]

    async def find(self, saga_id: str) -> IndexRow | None:
        """The row, or None."""
        return self._shared.index.get(saga_id)

    async def counts(self) -> dict[tuple[str, str], int]:
        """Counted on each call."""
        found: dict[tuple[str, str], int] = {}
        for r in self._shared.index.values():
            found[(r.name, r.status)] = found.get((r.name, r.status), 0) + 1
        return found

    async def earliest(self, name: str, limit: int) -> tuple[builtins.list[TimerRow], float]:
        """Sorted on each call (a memory store holds few timers)."""
        rows = [t for t in self._shared.timers.values() if t.name == name]
        return sorted(rows, key=lambda t: t.due)[:limit], await self.store.clock.now()

    async def drop_timer(self, tx: Transaction, row: TimerRow) -> None:
        """At the commit, if the row is still that setting."""
        timers, key = self._shared.timers, (row.saga_id, row.timer)

        def apply() -> None:
            if timers.get(key) == row:
                del timers[key]

        _on_commit(tx, apply)


class _Shared:
    def __init__(self) -> None:
        self.index: dict[str, IndexRow] = {}
        self.timers: dict[tuple[str, str], TimerRow] = {}


_memory_shared: weakref.WeakKeyDictionary[Any, _Shared] = weakref.WeakKeyDictionary()


@functools.singledispatch
def tables_for(store: Store) -> SagaTables:
    """The saga tables of ``store``: SQL where its transactions run SQL, else in memory.

    A store adapter that can write them in fewer round trips registers its own for its
    store class (``tables_for.register(PostgresStore, PostgresSagaTables)``, in the
    adapter's package): the same tables, the same rows, the one contract
    (``tests/sagas/test_saga_tables.py`` runs on every store)."""
    if store.supports_sql:
        return SqlSagaTables(store)
    return MemorySagaTables(store)


def _on_commit(tx: Transaction, apply: Callable[[], object]) -> None:
    """Run ``apply`` when the memory store's transaction ``tx`` commits (now, for a
    transaction that cannot defer)."""
    defer = getattr(tx, "defer", None)
    if defer is None:
        apply()
    else:
        defer(apply)


def _at(seconds: float) -> datetime:
    return datetime.fromtimestamp(seconds, UTC)


def _index_row(r: tuple[Any, ...]) -> IndexRow:
    """An index row from SQL (times are stored as Unix seconds)."""
    return IndexRow(r[0], r[1], r[2], r[3], _at(float(r[4])), _at(float(r[5])))
