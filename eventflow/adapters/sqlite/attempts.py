"""Attempt records of the SQLite store, in ``ef_attempts``."""

from __future__ import annotations

import sqlite3
import time

from ...ports import AttemptRecord
from .db import SqliteDatabase

__all__ = ["ATTEMPTS_SCHEMA", "DEFAULT_ATTEMPTS_RETENTION", "SqliteAttempts"]

DEFAULT_ATTEMPTS_RETENTION = 7 * 24 * 3600.0
_PRUNE_EVERY = 1_000

ATTEMPTS_SCHEMA = """
CREATE TABLE IF NOT EXISTS ef_attempts (
    grp TEXT NOT NULL,
    message_id TEXT NOT NULL,
    failures INTEGER NOT NULL DEFAULT 0,
    starts INTEGER NOT NULL DEFAULT 0,
    last_error TEXT,
    updated_at REAL NOT NULL,
    PRIMARY KEY (grp, message_id)
) WITHOUT ROWID;
"""


class SqliteAttempts:
    """Durable records of messages not handled at their first delivery. A record is deleted
    once its message is handled or dead-lettered; one left behind (its message never came
    back) is pruned after ``retention`` seconds."""

    durable = True

    def __init__(self, db: SqliteDatabase, retention: float = DEFAULT_ATTEMPTS_RETENTION) -> None:
        self._db = db
        self.retention = retention
        self._writes = 0

    async def get(self, group: str, message_id: str) -> AttemptRecord:
        """The message's record (an empty one when there is none)."""
        rows = await self._db.query(
            "SELECT failures, starts FROM ef_attempts WHERE grp = ? AND message_id = ?",
            (group, message_id),
        )
        return AttemptRecord(int(rows[0][0]), int(rows[0][1])) if rows else AttemptRecord()

    async def started(self, group: str, message_id: str) -> AttemptRecord:
        """Count a redelivery whose handler starts now; return the record as it was."""
        return await self._db.run(self._started, group, message_id, time.time())

    @staticmethod
    def _started(
        conn: sqlite3.Connection, group: str, message_id: str, now: float
    ) -> AttemptRecord:
        row = conn.execute(
            "SELECT failures, starts FROM ef_attempts WHERE grp = ? AND message_id = ?",
            (group, message_id),
        ).fetchone()
        conn.execute(
            "INSERT INTO ef_attempts (grp, message_id, starts, updated_at) VALUES (?, ?, 1, ?) "
            "ON CONFLICT (grp, message_id) DO UPDATE SET starts = starts + 1, "
            "updated_at = excluded.updated_at",
            (group, message_id, now),
        )
        return AttemptRecord() if row is None else AttemptRecord(int(row[0]), int(row[1]))

    async def failed(self, group: str, message_id: str, error: str) -> None:
        """Count a failed handler attempt (and now and then prune old records)."""
        self._writes += 1
        prune = self._writes % _PRUNE_EVERY == 0
        await self._db.run(self._failed, group, message_id, error, time.time(), prune)

    def _failed(
        self,
        conn: sqlite3.Connection,
        group: str,
        message_id: str,
        error: str,
        now: float,
        prune: bool,
    ) -> None:
        conn.execute(
            "INSERT INTO ef_attempts (grp, message_id, failures, last_error, updated_at) "
            "VALUES (?, ?, 1, ?, ?) ON CONFLICT (grp, message_id) DO UPDATE SET "
            "failures = failures + 1, last_error = excluded.last_error, "
            "updated_at = excluded.updated_at",
            (group, message_id, error, now),
        )
        if prune:
            conn.execute("DELETE FROM ef_attempts WHERE updated_at < ?", (now - self.retention,))

    async def clear(self, group: str, message_id: str) -> None:
        """Forget the message."""
        await self._db.run(
            lambda conn: conn.execute(
                "DELETE FROM ef_attempts WHERE grp = ? AND message_id = ?", (group, message_id)
            )
        )
