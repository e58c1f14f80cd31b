"""Handled (group, message id) pairs of a SQLite store in ``ef_dedup``: the dedup store of
``SqliteStore`` (``store.dedup``), and the one insert it and the transactional inbox
(``SqliteStore.mark_handled``) share."""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Sequence

from .db import SqliteDatabase

__all__ = ["DEDUP_SCHEMA", "DEFAULT_DEDUP_RETENTION", "SqliteDedupStore", "record"]

DEFAULT_DEDUP_RETENTION = 7 * 24 * 3600.0
_CACHE_SIZE = 100_000
_PRUNE_EVERY = 10_000
_LOOKUP_CHUNK = 500  # ids per statement, well below SQLite's limit on parameters

# cancelled_by: the compensation that cancelled the message before the group handled it
# (files made by earlier versions get the column from the store's _ADDED_COLUMNS).
DEDUP_SCHEMA = """
CREATE TABLE IF NOT EXISTS ef_dedup (
    grp TEXT NOT NULL,
    message_id TEXT NOT NULL,
    handled_at REAL NOT NULL,
    cancelled_by TEXT,
    PRIMARY KEY (grp, message_id)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS ef_dedup_age ON ef_dedup (handled_at);
"""


def record(
    conn: sqlite3.Connection, group: str, message_id: str, cancelled_by: str | None, now: float
) -> bool:
    """Insert the pair unless it is there; True if this inserted it."""
    return bool(
        conn.execute(
            "INSERT OR IGNORE INTO ef_dedup (grp, message_id, handled_at, cancelled_by) "
            "VALUES (?, ?, ?, ?)",
            (group, message_id, now, cancelled_by),
        ).rowcount
    )


class SqliteDedupStore:
    """Handled (group, id) pairs in ``ef_dedup``, kept ``retention`` seconds.

    A bounded in-process cache answers repeated ``seen`` for ids this process marked.
    """

    def __init__(self, db: SqliteDatabase, retention: float = DEFAULT_DEDUP_RETENTION) -> None:
        self._db = db
        self.retention = retention
        self._cache: dict[tuple[str, str], None] = {}
        self._marks = 0

    async def seen(self, group: str, message_id: str) -> bool:
        """True if the pair was marked (by any process using this file)."""
        if (group, message_id) in self._cache:
            return True
        # A lookup in the event loop (no trip to the thread), of what is committed: it does
        # not wait for this connection's transaction under way. One that records this pair
        # can only be a handling of the same message still in flight, which the consumer
        # holds a copy back from (or which rolls the copy back at its commit).
        rows = await self._db.lookup(
            "SELECT 1 FROM ef_dedup WHERE grp = ? AND message_id = ?", (group, message_id)
        )
        return bool(rows)

    async def seen_many(self, group: str, message_ids: Sequence[str]) -> set[str]:
        """The ids of ``message_ids`` marked (by any process using this file): those this
        process marked from its cache, the others in one statement (per 500 ids)."""
        cache = self._cache
        found = {m for m in message_ids if (group, m) in cache}
        rest = [m for m in dict.fromkeys(message_ids) if m not in found]
        for start in range(0, len(rest), _LOOKUP_CHUNK):
            chunk = rest[start : start + _LOOKUP_CHUNK]
            marks = ", ".join("?" * len(chunk))
            rows = await self._db.lookup(
                f"SELECT message_id FROM ef_dedup WHERE grp = ? AND message_id IN ({marks})",
                (group, *chunk),
            )
            found.update(row[0] for row in rows)
        return found

    async def mark(self, group: str, message_id: str) -> None:
        """Record the pair (idempotent); prunes expired pairs now and then."""
        await self.mark_new(group, message_id)

    async def mark_new(
        self, group: str, message_id: str, *, cancelled_by: str | None = None
    ) -> bool:
        """Record the pair unless it is there (``INSERT OR IGNORE``); True if this call
        recorded it. Prunes expired pairs now and then."""
        self._marks += 1
        prune = self._marks % _PRUNE_EVERY == 0
        added = await self._db.run(self._mark, group, message_id, cancelled_by, time.time(), prune)
        cache = self._cache
        cache[(group, message_id)] = None
        if len(cache) > _CACHE_SIZE:
            del cache[next(iter(cache))]
        return added

    async def cancelled_by(self, group: str, message_id: str) -> str | None:
        """The compensation that cancelled the pair, if one did."""
        rows = await self._db.query(
            "SELECT cancelled_by FROM ef_dedup WHERE grp = ? AND message_id = ?",
            (group, message_id),
        )
        return str(rows[0][0]) if rows and rows[0][0] is not None else None

    def _mark(
        self,
        conn: sqlite3.Connection,
        group: str,
        message_id: str,
        cancelled_by: str | None,
        now: float,
        prune: bool,
    ) -> bool:
        added = record(conn, group, message_id, cancelled_by, now)
        if prune:
            conn.execute("DELETE FROM ef_dedup WHERE handled_at < ?", (now - self.retention,))
        return added

    async def open(self) -> None:
        """The database is opened by its store."""

    async def close(self) -> None:
        """The database is closed by its store."""
