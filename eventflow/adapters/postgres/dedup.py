"""Handled (group, message id) pairs of a PostgreSQL store in ``ef_dedup``: its table (and
the upgrade of tables made by earlier versions), the dedup store of ``PostgresStore``
(``store.dedup``), and the one insert it and the transactional inbox
(``PostgresStore.mark_handled``) share."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime, timedelta

from .db import PostgresDatabase

__all__ = [
    "DEDUP_KEY",
    "DEDUP_SQL",
    "DEFAULT_DEDUP_RETENTION",
    "INSERT_DEDUP",
    "RIDE_DEDUP",
    "PostgresDedupStore",
]

DEFAULT_DEDUP_RETENTION = 7 * 24 * 3600.0

DEDUP_SQL = """
-- cancelled_by: the compensation that cancelled the message before the group handled it
CREATE TABLE IF NOT EXISTS ef_dedup (
    grp text COLLATE "C" NOT NULL,
    message_id text COLLATE "C" NOT NULL,
    handled_at timestamptz NOT NULL DEFAULT now(),
    cancelled_by text,
    PRIMARY KEY (grp, message_id)
);
CREATE INDEX IF NOT EXISTS ef_dedup_age ON ef_dedup (handled_at);
-- Schemas of earlier versions lack cancelled_by. Adding a nullable column is instant but
-- locks the table for a moment, and every handling writes to it: only when it is missing,
-- waiting at most 2 s.
DO $$
DECLARE
    prev text := current_setting('lock_timeout');
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_attribute
                    WHERE attrelid = 'ef_dedup'::regclass AND attname = 'cancelled_by'
                      AND NOT attisdropped) THEN
        PERFORM set_config('lock_timeout', '2s', true);
        ALTER TABLE ef_dedup ADD COLUMN IF NOT EXISTS cancelled_by text;
        PERFORM set_config('lock_timeout', prev, true);
    END IF;
EXCEPTION WHEN lock_not_available THEN
    RAISE EXCEPTION 'eventflow could not upgrade ef_dedup (add its cancelled_by column) '
        'within 2 s: another transaction holds the table'
        USING HINT = 'open the store again once long transactions on ef_dedup have ended '
                     '(see pg_stat_activity)';
END
$$;
"""

# Returns a row only if it inserted one: a concurrent insert of the pair (another
# transaction's, not committed yet) is waited for, then conflicts if it committed.
INSERT_DEDUP = (
    "INSERT INTO ef_dedup (grp, message_id, cancelled_by) VALUES ($1, $2, $3) "
    "ON CONFLICT DO NOTHING RETURNING 1"
)

# The same entry as a rider of an append (.rider): no ON CONFLICT, so a copy's entry
# committed first (or committing: the insert waits for it) fails the append's whole
# statement on DEDUP_KEY, nothing of it written.
RIDE_DEDUP = "INSERT INTO ef_dedup (grp, message_id) SELECT $1::text, $2::text WHERE {appended}"
DEDUP_KEY = "ef_dedup_pkey"
"""The unique constraint of ``ef_dedup`` (the primary key's default name)."""


class PostgresDedupStore:
    """Handled (group, id) pairs in ``ef_dedup``."""

    def __init__(self, db: PostgresDatabase, retention: float = DEFAULT_DEDUP_RETENTION) -> None:
        self._db = db
        self.retention = retention

    async def seen(self, group: str, message_id: str) -> bool:
        """True if the pair was marked by any process."""
        async with self._db.connection() as conn:
            return bool(
                await conn.fetchval(
                    "SELECT EXISTS (SELECT 1 FROM ef_dedup WHERE grp = $1 AND message_id = $2)",
                    group,
                    message_id,
                )
            )

    async def seen_many(self, group: str, message_ids: Sequence[str]) -> set[str]:
        """The ids of ``message_ids`` marked by any process, in one statement."""
        async with self._db.connection() as conn:
            rows = await conn.fetch(
                "SELECT message_id FROM ef_dedup WHERE grp = $1 AND message_id = ANY($2::text[])",
                group,
                list(message_ids),
            )
        return {row[0] for row in rows}

    async def mark(self, group: str, message_id: str) -> None:
        """Record the pair (inside the context's transaction, if one is open)."""
        await self.mark_new(group, message_id)

    async def mark_new(
        self, group: str, message_id: str, *, cancelled_by: str | None = None
    ) -> bool:
        """Record the pair unless it is there; True if this call recorded it (a concurrent
        insert of the pair is waited for; inside the context's transaction, if one is open)."""
        async with self._db.connection() as conn:
            inserted = await conn.fetchval(INSERT_DEDUP, group, message_id, cancelled_by)
        return inserted is not None

    async def cancelled_by(self, group: str, message_id: str) -> str | None:
        """The compensation that cancelled the pair, if one did."""
        async with self._db.connection() as conn:
            value = await conn.fetchval(
                "SELECT cancelled_by FROM ef_dedup WHERE grp = $1 AND message_id = $2",
                group,
                message_id,
            )
        return None if value is None else str(value)

    async def prune(self) -> int:
        """Delete entries older than the retention; return how many."""
        async with self._db.connection() as conn:
            status = await conn.execute(
                "DELETE FROM ef_dedup WHERE handled_at < $1",
                datetime.now(UTC) - timedelta(seconds=self.retention),
            )
        return int(status.split()[-1])

    async def open(self) -> None:
        """The pool is opened by the store."""

    async def close(self) -> None:
        """The pool is closed by the store."""
