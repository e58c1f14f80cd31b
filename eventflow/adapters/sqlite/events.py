"""The SQLite event log: streams, the global order, snapshots, checkpoints, outbox, leases.

SQLite has one writer at a time, and an append assigns positions inside its write
transaction, so positions are committed in order: a reader never sees position N+1 before
N, and a rolled-back append leaves no gap (``INTEGER PRIMARY KEY`` takes max + 1).
"""

from __future__ import annotations

import asyncio
import os
import sqlite3
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from datetime import datetime
from typing import Any

import orjson

from ...envelope import Envelope
from ...errors import ConcurrencyError
from ...events import Event
from ...ports import OutboxMessage, RecordedEvent, Snapshot, Transaction
from ...sourcing.append import prepare_append
from ...sourcing.paging import paged, stream_range
from .db import SqliteDatabase

__all__ = ["EVENTS_SCHEMA", "SqliteCheckpoints", "SqliteEventLog", "SqliteLeases", "SqliteOutbox"]

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
    expires_at REAL NOT NULL
);
"""

_POLL_INTERVAL = 0.05
DEFAULT_LEASE_TTL = 10.0


def _record(row: tuple[object, ...]) -> RecordedEvent:
    position, stream_id, version, blob = row
    return RecordedEvent(
        str(stream_id),
        int(version),  # type: ignore[call-overload]
        int(position),  # type: ignore[call-overload]
        Envelope.from_bytes(blob),  # type: ignore[arg-type]
    )


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

        return paged(fetch, cursor, limit, _record, lambda row: int(row[2]))

    def read_all(self, *, after: int = 0, limit: int | None = None) -> AsyncIterator[RecordedEvent]:
        """Events after ``after`` in global order, read in pages."""
        sql = (
            "SELECT position, stream_id, stream_version, envelope FROM ef_events "
            "WHERE position > ? ORDER BY position LIMIT ?"
        )

        async def fetch(cursor: int, size: int) -> list[tuple[Any, ...]]:
            return await self.db.query(sql, (cursor, size))

        return paged(fetch, after, limit, _record, lambda row: int(row[0]))

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


class SqliteCheckpoints:
    """Checkpoints in ``ef_checkpoints``."""

    def __init__(self, db: SqliteDatabase) -> None:
        self._db = db

    async def get(self, name: str) -> int:
        """0 if never set."""
        rows = await self._db.query("SELECT position FROM ef_checkpoints WHERE name = ?", (name,))
        return int(rows[0][0]) if rows else 0

    async def set(self, name: str, position: int, *, tx: Transaction | None = None) -> None:
        """Upsert; inside ``tx`` (the caller's open transaction) it commits with it."""
        await self._db.run(
            lambda conn: conn.execute(
                "INSERT OR REPLACE INTO ef_checkpoints (name, position) VALUES (?, ?)",
                (name, position),
            )
        )

    async def list(self) -> dict[str, int]:
        """Every checkpoint."""
        rows = await self._db.query("SELECT name, position FROM ef_checkpoints ORDER BY name")
        return {str(n): int(p) for n, p in rows}

    async def delete(self, name: str, *, tx: Transaction | None = None) -> None:
        """Forget ``name``."""
        await self._db.run(
            lambda conn: conn.execute("DELETE FROM ef_checkpoints WHERE name = ?", (name,))
        )


class SqliteOutbox:
    """Outgoing messages in ``ef_outbox``."""

    def __init__(self, db: SqliteDatabase) -> None:
        self._db = db
        self.added = asyncio.Event()

    async def add(
        self, messages: Sequence[tuple[str, Envelope]], *, tx: Transaction | None = None
    ) -> None:
        """Queue messages; inside ``tx`` they commit with it."""
        rows = [(topic, env.key, env.to_bytes(), env.id) for topic, env in messages]
        await self._db.run(
            lambda conn: conn.executemany(
                "INSERT INTO ef_outbox (topic, msg_key, payload, message_id) VALUES (?, ?, ?, ?)",
                rows,
            )
        )
        self.added.set()

    async def pending(self, limit: int = 100) -> list[OutboxMessage]:
        """Oldest first."""
        rows = await self._db.query(
            "SELECT seq, topic, msg_key, payload, message_id FROM ef_outbox ORDER BY seq LIMIT ?",
            (limit,),
        )
        return [
            OutboxMessage(int(s), str(t), None if k is None else str(k), bytes(p), str(m))
            for s, t, k, p, m in rows
        ]

    async def remove(self, seqs: Sequence[int]) -> None:
        """Delete sent messages."""
        await self._db.run(
            lambda conn: conn.executemany(
                "DELETE FROM ef_outbox WHERE seq = ?", [(s,) for s in seqs]
            )
        )


class SqliteLeases:
    """Named leases in ``ef_leases``: the cross-process lock of the SQLite store.

    The holder renews its lease every ``ttl / 3`` seconds; a holder that dies loses it after
    ``ttl`` seconds and a waiting process takes over.
    """

    def __init__(self, db: SqliteDatabase, ttl: float = DEFAULT_LEASE_TTL) -> None:
        self._db = db
        self.ttl = ttl
        self._owner = f"{os.getpid()}:{uuid.uuid4().hex[:12]}"
        self._local: dict[str, asyncio.Lock] = {}

    def _try(self, conn: sqlite3.Connection, name: str, now: float) -> bool:
        conn.execute(
            "INSERT INTO ef_leases (name, owner, expires_at) VALUES (?, ?, ?) "
            "ON CONFLICT (name) DO UPDATE SET owner = excluded.owner, "
            "expires_at = excluded.expires_at "
            "WHERE ef_leases.expires_at < ? OR ef_leases.owner = excluded.owner",
            (name, self._owner, now + self.ttl, now),
        )
        row = conn.execute("SELECT owner FROM ef_leases WHERE name = ?", (name,)).fetchone()
        return row is not None and row[0] == self._owner

    @asynccontextmanager
    async def hold(self, name: str) -> AsyncIterator[None]:
        """Wait for the lease on ``name`` and keep it renewed until the block exits."""
        local = self._local.setdefault(name, asyncio.Lock())
        async with local:  # contenders in this process queue here instead of polling
            while not await self._acquire(name):  # noqa: ASYNC110 - other processes hold it
                await asyncio.sleep(self.ttl / 4)
            renewer = asyncio.create_task(self._renew(name))
            try:
                yield
            finally:
                renewer.cancel()
                await asyncio.gather(renewer, return_exceptions=True)
                await asyncio.shield(self._release(name))

    async def _acquire(self, name: str) -> bool:
        # Shielded: if the caller is cancelled (a lock timeout) while the INSERT runs on the
        # database thread and it succeeds, the lease is given back rather than left held.
        attempt = asyncio.ensure_future(self._db.run(self._try, name, time.time()))
        try:
            return await asyncio.shield(attempt)
        except asyncio.CancelledError:
            if await attempt:
                await self._release(name)
            raise

    async def _release(self, name: str) -> None:
        await self._db.run(
            lambda conn: conn.execute(
                "DELETE FROM ef_leases WHERE name = ? AND owner = ?", (name, self._owner)
            )
        )

    async def _renew(self, name: str) -> None:
        while True:
            await asyncio.sleep(self.ttl / 3)
            await self._db.run(self._try, name, time.time())
