"""The SQLite event log: streams, the global order, snapshots, checkpoints, leases.

SQLite has one writer at a time, and an append assigns positions inside its write
transaction, so positions are committed in order: a reader never sees position N+1 before
N, and a rolled-back append leaves no gap (``INTEGER PRIMARY KEY`` takes max + 1).
"""

from __future__ import annotations

import asyncio
import sqlite3
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import AbstractAsyncContextManager
from datetime import datetime
from typing import Any

import orjson

from ...envelope import Envelope, stored_envelopes
from ...errors import AlreadyHandled, ConcurrencyError, ConfigurationError, LeaseLostError
from ...events import Event
from ...leases import DEFAULT_LEASE_TTL, FENCE_NEEDS_TX, Lease, Wakeups, hold_lease, new_owner
from ...ports import RecordedEvent, Snapshot, Transaction
from ...sourcing.append import prepare_append
from ...sourcing.paging import paged, stream_range
from .db import SqliteDatabase

__all__ = [
    "EVENTS_SCHEMA",
    "SqliteCheckpoints",
    "SqliteEventLog",
    "SqliteLeases",
    "upgrade_events_schema",
]

EVENTS_SCHEMA = """
CREATE TABLE IF NOT EXISTS ef_events (
    position INTEGER PRIMARY KEY,
    event_id TEXT NOT NULL UNIQUE,
    stream_id TEXT NOT NULL,
    stream_version INTEGER NOT NULL,
    type TEXT NOT NULL,
    envelope BLOB NOT NULL,
    UNIQUE (stream_id, stream_version)
);
-- for `eventflow trace`: the envelope is JSON text in a BLOB (read as text: SQLite takes a
-- BLOB given to json_extract for its binary JSONB); stores of earlier versions get it when
-- next opened
CREATE INDEX IF NOT EXISTS ef_events_correlation
    ON ef_events (json_extract(CAST(envelope AS TEXT), '$.correlation_id'));
CREATE TABLE IF NOT EXISTS ef_snapshots (
    stream_id TEXT PRIMARY KEY,
    version INTEGER NOT NULL,
    state TEXT NOT NULL,
    taken_at TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS ef_checkpoints (
    name TEXT PRIMARY KEY,
    position INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS ef_outbox (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    topic TEXT NOT NULL,
    msg_key TEXT,
    payload BLOB NOT NULL,
    message_id TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS ef_leases (
    name TEXT PRIMARY KEY,
    owner TEXT NOT NULL,
    expires_at REAL NOT NULL,
    epoch INTEGER NOT NULL DEFAULT 0
);
"""

_POLL_INTERVAL = 0.05
_LEASE_POLL = 0.25  # seconds between a contender's tries (the file is local: cheap)


async def upgrade_events_schema(db: SqliteDatabase) -> None:
    """Bring a file made by an earlier version up to date: ``ef_leases`` gets its ``epoch``
    column (0 for the rows it holds, so the next holder of each name takes epoch 1). Looked
    up first without the write lock: an up-to-date file (the usual case) costs no write."""
    [(missing,)] = await db.query(_LEASES_WITHOUT_EPOCH)
    if missing:
        await db.run(_add_lease_epoch)


_LEASES_WITHOUT_EPOCH = (
    "SELECT COUNT(*) > 0 AND SUM(name = 'epoch') = 0 FROM pragma_table_info('ef_leases')"
)


def _add_lease_epoch(conn: sqlite3.Connection) -> None:
    # Checked again under the write lock: another process may have upgraded it meanwhile.
    if conn.execute(_LEASES_WITHOUT_EPOCH).fetchone()[0]:
        conn.execute("ALTER TABLE ef_leases ADD COLUMN epoch INTEGER NOT NULL DEFAULT 0")


def _records(rows: Sequence[Any]) -> Iterator[RecordedEvent]:
    """A page of rows (position, stream_id, stream_version, envelope) as records, made as
    they are read."""
    envelopes = stored_envelopes(r[3] for r in rows)
    for r, env in zip(rows, envelopes, strict=True):
        yield RecordedEvent(str(r[1]), int(r[2]), int(r[0]), env)


class SqliteEventLog:
    """Event-store methods over a :class:`SqliteDatabase` (mixed into the SQLite store)."""

    db: SqliteDatabase

    def _init_events(self) -> None:
        self._appended = asyncio.Event()

    async def append(
        self,
        stream_id: str,
        events: Sequence[Event | Envelope],
        *,
        expected_version: int | None = None,
    ) -> int:
        """Append atomically; see ``EventStore.append``."""
        envelopes = prepare_append(stream_id, events)
        version = await self.db.run(self._append, stream_id, envelopes, expected_version)
        self._appended.set()
        return version

    async def append_at_commit(
        self,
        tx: Transaction,
        stream_id: str,
        events: Sequence[Event | Envelope],
        expected_version: int,
        handled: tuple[str, str],
    ) -> int:
        """Queue an append at ``expected_version`` in ``tx``: it runs with the ``COMMIT``
        (``SqliteDatabase.queue``), one trip to the thread less. Returns the version the
        commit gives the stream. The commit raises ``ConcurrencyError`` if the stream moved
        meanwhile, and ``AlreadyHandled(*handled)`` (the dedup entry of the message that
        caused the events) if some of them are stored already; nothing is kept either way."""
        envelopes = prepare_append(stream_id, events)
        await self.db.queue(tx, _append_checked, stream_id, envelopes, expected_version, handled)
        self._appended.set()  # as an append inside a transaction does
        return expected_version + len(envelopes)

    @staticmethod
    def _append(
        conn: sqlite3.Connection,
        stream_id: str,
        envelopes: list[Envelope],
        expected: int | None,
    ) -> int:
        row = conn.execute(
            "SELECT COALESCE(MAX(stream_version), 0) FROM ef_events WHERE stream_id = ?",
            (stream_id,),
        ).fetchone()
        current = int(row[0])
        if not envelopes:
            if expected is not None and expected != current:
                raise ConcurrencyError(stream_id, expected, current)
            return current
        marks = ",".join("?" * len(envelopes))
        stored = {
            r[0]
            for r in conn.execute(
                f"SELECT event_id FROM ef_events WHERE event_id IN ({marks})",
                [e.id for e in envelopes],
            )
        }
        fresh = [e for e in envelopes if e.id not in stored]
        if not fresh:
            return current  # a retried append: every event is stored already
        if expected is not None and expected != current:
            raise ConcurrencyError(stream_id, expected, current)
        conn.executemany(
            "INSERT INTO ef_events (event_id, stream_id, stream_version, type, envelope) "
            "VALUES (?, ?, ?, ?, ?)",
            [
                (e.id, stream_id, current + i, e.type, e.to_bytes())
                for i, e in enumerate(fresh, start=1)
            ],
        )
        return current + len(fresh)

    def read_stream(
        self,
        stream_id: str,
        *,
        from_version: int | None = None,
        backwards: bool = False,
        limit: int | None = None,
    ) -> AsyncIterator[RecordedEvent]:
        """One stream's events in version order (or reversed), read in pages."""
        cursor, cmp, order = stream_range(from_version, backwards)
        sql = (
            "SELECT position, stream_id, stream_version, envelope FROM ef_events "
            f"WHERE stream_id = ? AND stream_version {cmp} ? "
            f"ORDER BY stream_version {order} LIMIT ?"
        )

        async def fetch(after: int, size: int) -> list[tuple[Any, ...]]:
            return await self.db.query(sql, (stream_id, after, size))

        return paged(fetch, cursor, limit, _records, lambda row: int(row[2]))

    def read_all(self, *, after: int = 0, limit: int | None = None) -> AsyncIterator[RecordedEvent]:
        """Events after ``after`` in global order, read in pages."""
        sql = (
            "SELECT position, stream_id, stream_version, envelope FROM ef_events "
            "WHERE position > ? ORDER BY position LIMIT ?"
        )

        async def fetch(cursor: int, size: int) -> list[tuple[Any, ...]]:
            return await self.db.query(sql, (cursor, size))

        return paged(fetch, after, limit, _records, lambda row: int(row[0]))

    async def correlated(self, correlation_id: str, *, limit: int = 100_000) -> list[RecordedEvent]:
        """The events of one correlation in global order, through ``ef_events_correlation``."""
        rows = await self.db.query(
            "SELECT position, stream_id, stream_version, envelope FROM ef_events "
            "WHERE json_extract(CAST(envelope AS TEXT), '$.correlation_id') = ? "
            "ORDER BY position LIMIT ?",
            (correlation_id, limit),
        )
        return list(_records(rows))

    async def subscribe(self, *, after: int = 0) -> AsyncIterator[RecordedEvent]:
        """Catch up, then follow appends: woken at once by this store's appends, and by a
        cheap poll for other processes' appends."""
        position = after
        while True:
            self._appended.clear()
            async for rec in self.read_all(after=position):
                position = rec.position
                yield rec
            try:
                async with asyncio.timeout(_POLL_INTERVAL):
                    await self._appended.wait()
            except TimeoutError:
                pass

    async def stream_version(self, stream_id: str) -> int:
        """0 when the stream does not exist."""
        rows = await self.db.query(
            "SELECT COALESCE(MAX(stream_version), 0) FROM ef_events WHERE stream_id = ?",
            (stream_id,),
        )
        return int(rows[0][0])

    async def last_position(self) -> int:
        """0 when empty."""
        rows = await self.db.query("SELECT COALESCE(MAX(position), 0) FROM ef_events")
        return int(rows[0][0])

    async def save_snapshot(self, snapshot: Snapshot) -> None:
        """Replace the stream's snapshot."""
        await self.db.run(
            lambda conn: conn.execute(
                "INSERT OR REPLACE INTO ef_snapshots (stream_id, version, state, taken_at) "
                "VALUES (?, ?, ?, ?)",
                (
                    snapshot.stream_id,
                    snapshot.version,
                    orjson.dumps(dict(snapshot.state)).decode(),
                    snapshot.taken_at.isoformat(),
                ),
            )
        )

    async def load_snapshot(self, stream_id: str) -> Snapshot | None:
        """The stream's snapshot, if any."""
        rows = await self.db.query(
            "SELECT version, state, taken_at FROM ef_snapshots WHERE stream_id = ?", (stream_id,)
        )
        if not rows:
            return None
        version, state, taken_at = rows[0]
        return Snapshot(
            stream_id, int(version), orjson.loads(state), datetime.fromisoformat(str(taken_at))
        )


def _append_checked(
    conn: sqlite3.Connection,
    stream_id: str,
    envelopes: list[Envelope],
    expected: int,
    handled: tuple[str, str],
) -> None:
    """On the thread, with the ``COMMIT``: see ``SqliteEventLog.append_at_commit``."""
    if SqliteEventLog._append(conn, stream_id, envelopes, expected) != expected + len(envelopes):
        raise AlreadyHandled(*handled)  # events of that message's handling are stored


class SqliteCheckpoints:
    """Checkpoints in ``ef_checkpoints``; writes made with a lease are fenced."""

    def __init__(self, db: SqliteDatabase) -> None:
        self._db = db

    async def get(self, name: str) -> int:
        """0 if never set."""
        rows = await self._db.query("SELECT position FROM ef_checkpoints WHERE name = ?", (name,))
        return int(rows[0][0]) if rows else 0

    async def set(
        self,
        name: str,
        position: int,
        *,
        tx: Transaction | None = None,
        lease: Lease | None = None,
    ) -> None:
        """Upsert; inside ``tx`` (the caller's open transaction) it commits with it. With
        ``lease``, the epoch is checked in the same write transaction (SQLite has one writer
        at a time, so no takeover can commit in between)."""

        def write(conn: sqlite3.Connection) -> None:
            if lease is not None:
                SqliteLeases.check_epoch(conn, lease)
            conn.execute(
                "INSERT OR REPLACE INTO ef_checkpoints (name, position) VALUES (?, ?)",
                (name, position),
            )

        await self._db.run_in(tx, write)

    async def list(self) -> dict[str, int]:
        """Every checkpoint."""
        rows = await self._db.query("SELECT name, position FROM ef_checkpoints ORDER BY name")
        return {str(n): int(p) for n, p in rows}

    async def delete(
        self, name: str, *, tx: Transaction | None = None, lease: Lease | None = None
    ) -> None:
        """Forget ``name``; fenced like ``set``."""

        def write(conn: sqlite3.Connection) -> None:
            if lease is not None:
                SqliteLeases.check_epoch(conn, lease)
            conn.execute("DELETE FROM ef_checkpoints WHERE name = ?", (name,))

        await self._db.run_in(tx, write)


class SqliteLeases:
    """Named leases in ``ef_leases``, shared by every process using the file.

    A row per name: its owner, its epoch and when it expires (wall-clock seconds: every
    process on the file shares the host's clock). Taking a free or expired lease bumps the
    epoch; releasing expires the row and keeps the epoch, so it never goes back and a stale
    holder's epoch never matches again. Contenders in this process are woken at release;
    others find it free at their next try (every 0.25 s at most). ``owner`` is unique per
    store instance.
    """

    def __init__(self, db: SqliteDatabase, ttl: float = DEFAULT_LEASE_TTL) -> None:
        self._db = db
        self.ttl = ttl
        self.owner = new_owner()
        self.poll = min(_LEASE_POLL, ttl / 4)
        self._released = Wakeups()

    def hold(self, name: str) -> AbstractAsyncContextManager[Lease]:
        """Wait for the lease on ``name`` and keep it renewed for the block (see ``Leases``)."""
        return hold_lease(self, name, owner=self.owner, ttl=self.ttl, poll=self.poll)

    async def holder(self, name: str) -> str | None:
        """The owner holding ``name`` now, or None when it is free or expired."""
        rows = await self._db.query(
            "SELECT owner FROM ef_leases WHERE name = ? AND expires_at > ?", (name, time.time())
        )
        return str(rows[0][0]) if rows else None

    async def acquire(self, name: str, owner: str, ttl: float) -> int | None:
        """Take ``name`` if it is free or expired (one statement); return the new epoch."""

        def take(conn: sqlite3.Connection) -> int | None:
            now = time.time()
            row = conn.execute(
                "INSERT INTO ef_leases (name, owner, epoch, expires_at) VALUES (?, ?, 1, ?) "
                "ON CONFLICT (name) DO UPDATE SET owner = excluded.owner, "
                "epoch = ef_leases.epoch + 1, expires_at = excluded.expires_at "
                "WHERE ef_leases.expires_at <= ? RETURNING epoch",
                (name, owner, now + ttl, now),
            ).fetchone()
            return None if row is None else int(row[0])

        return await self._db.run(take)

    async def renew(self, name: str, owner: str, epoch: int, ttl: float) -> bool:
        """Extend the lease if ``(owner, epoch)`` still holds it and it has not expired."""

        def extend(conn: sqlite3.Connection) -> bool:
            now = time.time()
            return (
                conn.execute(
                    "UPDATE ef_leases SET expires_at = ? "
                    "WHERE name = ? AND owner = ? AND epoch = ? AND expires_at > ?",
                    (now + ttl, name, owner, epoch, now),
                ).rowcount
                == 1
            )

        return await self._db.run(extend)

    async def release(self, name: str, owner: str, epoch: int) -> None:
        """Expire the row (keeping its epoch) if ``(owner, epoch)`` holds it; wake this
        process's contenders."""
        await self._db.run(
            lambda conn: conn.execute(
                "UPDATE ef_leases SET expires_at = 0 WHERE name = ? AND owner = ? AND epoch = ?",
                (name, owner, epoch),
            )
        )
        self._released.wake(name)

    async def wait(self, name: str, timeout: float) -> None:
        """Return when this process releases ``name``, or after ``timeout``."""
        await self._released.wait(name, timeout)

    async def fence(self, lease: Lease, tx: Transaction) -> None:
        """Refuse ``tx`` unless ``lease`` is the latest holding of its name: one read of its
        row inside ``tx``, which holds the file's write lock, so no takeover commits before
        ``tx`` ends (see ``Leases.fence``)."""
        if tx is None:
            raise ConfigurationError(FENCE_NEEDS_TX)
        try:
            await self._db.run_in(tx, SqliteLeases.check_epoch, lease)
        except LeaseLostError as exc:
            self._db.doom(tx, exc)
            raise

    @staticmethod
    def check_epoch(conn: sqlite3.Connection, lease: Lease) -> None:
        """Raise ``lease.error()`` unless ``lease`` is the latest holding of its name; call
        it inside the write transaction whose writes it guards."""
        row = conn.execute(
            "SELECT owner, epoch FROM ef_leases WHERE name = ?", (lease.name,)
        ).fetchone()
        if row is None or (row[0], row[1]) != (lease.owner, lease.epoch):
            raise lease.error()
