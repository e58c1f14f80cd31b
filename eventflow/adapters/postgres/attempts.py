"""Attempt records of the PostgreSQL store, in ``ef_attempts``."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from ...ports import AttemptRecord
from .db import PostgresDatabase

__all__ = ["ATTEMPTS_SQL", "DEFAULT_ATTEMPTS_RETENTION", "PostgresAttempts"]

DEFAULT_ATTEMPTS_RETENTION = 7 * 24 * 3600.0
_PRUNE_EVERY = 1_000

ATTEMPTS_SQL = """
CREATE TABLE IF NOT EXISTS ef_attempts (
    grp text COLLATE "C" NOT NULL,
    message_id text COLLATE "C" NOT NULL,
    failures integer NOT NULL DEFAULT 0,
    starts integer NOT NULL DEFAULT 0,
    last_error text,
    updated_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (grp, message_id)
);
"""

# One round trip: the row as it was (NULLs when there was none), counting this start (a
# data-modifying WITH runs whether or not the query reads it; both see the same snapshot).
_STARTED = (
    "WITH old AS (SELECT failures, starts FROM ef_attempts WHERE grp = $1 AND message_id = $2), "
    "up AS (INSERT INTO ef_attempts (grp, message_id, starts) VALUES ($1, $2, 1) "
    "ON CONFLICT (grp, message_id) DO UPDATE SET starts = ef_attempts.starts + 1, "
    "updated_at = now()) "
    "SELECT (SELECT failures FROM old), (SELECT starts FROM old)"
)


class PostgresAttempts:
    """Durable records of messages not handled at their first delivery. A record is deleted
    once its message is handled or dead-lettered; one left behind (its message never came
    back) is pruned after ``retention`` seconds."""

    durable = True

    def __init__(self, db: PostgresDatabase, retention: float = DEFAULT_ATTEMPTS_RETENTION) -> None:
        self._db = db
        self.retention = retention
        self._writes = 0

    async def get(self, group: str, message_id: str) -> AttemptRecord:
        """The message's record (an empty one when there is none)."""
        async with self._db.connection() as conn:
            row = await conn.fetchrow(
                "SELECT failures, starts FROM ef_attempts WHERE grp = $1 AND message_id = $2",
                group,
                message_id,
            )
        return AttemptRecord() if row is None else AttemptRecord(int(row[0]), int(row[1]))

    async def started(self, group: str, message_id: str) -> AttemptRecord:
        """Count a redelivery whose handler starts now; return the record as it was."""
        async with self._db.connection() as conn:
            row = await conn.fetchrow(_STARTED, group, message_id)
        return AttemptRecord(int(row[0] or 0), int(row[1] or 0))

    async def failed(self, group: str, message_id: str, error: str) -> None:
        """Count a failed handler attempt (and now and then prune old records)."""
        self._writes += 1
        async with self._db.connection() as conn:
            await conn.execute(
                "INSERT INTO ef_attempts (grp, message_id, failures, last_error) "
                "VALUES ($1, $2, 1, $3) ON CONFLICT (grp, message_id) DO UPDATE SET "
                "failures = ef_attempts.failures + 1, last_error = excluded.last_error, "
                "updated_at = now()",
                group,
                message_id,
                error,
            )
            if self._writes % _PRUNE_EVERY == 0:
                await conn.execute(
                    "DELETE FROM ef_attempts WHERE updated_at < $1",
                    datetime.now(UTC) - timedelta(seconds=self.retention),
                )

    async def clear(self, group: str, message_id: str) -> None:
        """Forget the message."""
        async with self._db.connection() as conn:
            await conn.execute(
                "DELETE FROM ef_attempts WHERE grp = $1 AND message_id = $2", group, message_id
            )
