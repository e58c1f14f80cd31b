"""The ``sqlite:///path.db`` store: the event log, dedup (``dedup.py``), dead letters,
heartbeats, checkpoints, outbox and leases in one SQLite file."""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Sequence
from contextlib import AbstractAsyncContextManager
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING
from urllib.parse import unquote

import orjson

from ...errors import AlreadyHandled, ConfigurationError
from ...leases import DEFAULT_LEASE_TTL
from ...ports import DeadLetter, Heartbeat, Transaction
from ...urls import seconds_option, split_url, url_options
from .attempts import ATTEMPTS_SCHEMA, SqliteAttempts
from .clock import SqliteClock
from .db import DEFAULT_BUSY_TIMEOUT, SqliteDatabase, SqliteTransaction
from .dedup import DEDUP_SCHEMA, SqliteDedupStore, record
from .events import (
    EVENTS_SCHEMA,
    SqliteCheckpoints,
    SqliteEventLog,
    SqliteLeases,
    upgrade_events_schema,
)
from .outbox import SqliteOutbox

if TYPE_CHECKING:
    from ...supervision import Supervisor

__all__ = ["SqliteDeadLetterStore", "SqliteHeartbeats", "SqliteStore"]

URL_OPTIONS = ("busy_timeout", "lease_ttl")

SCHEMA = """
CREATE TABLE IF NOT EXISTS ef_dead_letters (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT NOT NULL UNIQUE,
    topic TEXT NOT NULL,
    grp TEXT NOT NULL,
    payload BLOB NOT NULL,
    error TEXT NOT NULL,
    reason TEXT NOT NULL,
    attempts INTEGER NOT NULL,
    failed_at TEXT NOT NULL,
    msg_key TEXT,
    headers TEXT NOT NULL,
    envelope_id TEXT,
    source TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS ef_heartbeats (
    instance TEXT PRIMARY KEY,
    app TEXT NOT NULL,
    host TEXT NOT NULL,
    pid INTEGER NOT NULL,
    started_at TEXT NOT NULL,
    last_seen TEXT NOT NULL,
    subscriptions TEXT NOT NULL,
    stats TEXT NOT NULL,
    health TEXT NOT NULL DEFAULT 'ok',
    problems TEXT NOT NULL DEFAULT '[]'
);
"""
# Columns added since the first release, for files made by earlier versions.
_ADDED_COLUMNS = (
    ("ef_heartbeats", "health", "TEXT NOT NULL DEFAULT 'ok'"),
    ("ef_heartbeats", "problems", "TEXT NOT NULL DEFAULT '[]'"),
    ("ef_dedup", "cancelled_by", "TEXT"),
)


def _add_columns(conn: sqlite3.Connection) -> None:
    """Add the columns of ``_ADDED_COLUMNS`` that a file made by an earlier version lacks."""
    for table, column, decl in _ADDED_COLUMNS:
        have = {row[1] for row in conn.execute(f"PRAGMA table_info({table})")}
        if column not in have:
            conn.execute(f"ALTER TABLE {table} ADD COLUMN {column} {decl}")


def _letter(row: tuple[object, ...]) -> DeadLetter:
    (lid, topic, grp, payload, error, reason, attempts, failed_at, key, headers, eid, source) = row
    return DeadLetter(
        id=str(lid),
        topic=str(topic),
        group=str(grp),
        payload=bytes(payload),  # type: ignore[call-overload]
        error=str(error),
        attempts=int(attempts),  # type: ignore[call-overload]
        failed_at=datetime.fromisoformat(str(failed_at)),
        reason=str(reason),
        key=None if key is None else str(key),
        headers=orjson.loads(headers),  # type: ignore[arg-type]
        envelope_id=None if eid is None else str(eid),
        source=orjson.loads(source),  # type: ignore[arg-type]
    )


_LETTER_COLS = (
    "id, topic, grp, payload, error, reason, attempts, failed_at, msg_key, headers, "
    "envelope_id, source"
)


class SqliteDeadLetterStore:
    """Dead letters in ``ef_dead_letters``, oldest first."""

    def __init__(self, db: SqliteDatabase) -> None:
        self._db = db

    async def add(self, letter: DeadLetter) -> None:
        """Insert ``letter``: committed when this returns, or with the transaction this
        context has open."""
        await self._db.run(self._add, letter)

    @staticmethod
    def _add(conn: sqlite3.Connection, d: DeadLetter) -> None:
        conn.execute(
            f"INSERT OR IGNORE INTO ef_dead_letters ({_LETTER_COLS}) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (
                d.id,
                d.topic,
                d.group,
                d.payload,
                d.error,
                d.reason,
                d.attempts,
                d.failed_at.isoformat(),
                d.key,
                orjson.dumps(dict(d.headers)).decode(),
                d.envelope_id,
                orjson.dumps(dict(d.source)).decode(),
            ),
        )

    async def list(self, *, group: str | None = None, limit: int = 100) -> list[DeadLetter]:
        """Oldest first, optionally one group's."""
        if group is None:
            rows = await self._db.query(
                f"SELECT {_LETTER_COLS} FROM ef_dead_letters ORDER BY seq LIMIT ?", (limit,)
            )
        else:
            rows = await self._db.query(
                f"SELECT {_LETTER_COLS} FROM ef_dead_letters WHERE grp = ? ORDER BY seq LIMIT ?",
                (group, limit),
            )
        return [_letter(r) for r in rows]

    async def get(self, letter_id: str) -> DeadLetter | None:
        """One letter or None."""
        rows = await self._db.query(
            f"SELECT {_LETTER_COLS} FROM ef_dead_letters WHERE id = ?", (letter_id,)
        )
        return _letter(rows[0]) if rows else None

    async def remove(self, letter_ids: Sequence[str]) -> int:
        """Delete; return how many existed."""
        return await self._db.run(self._remove, tuple(letter_ids))

    @staticmethod
    def _remove(conn: sqlite3.Connection, ids: Sequence[str]) -> int:
        removed = 0
        for lid in ids:
            removed += conn.execute("DELETE FROM ef_dead_letters WHERE id = ?", (lid,)).rowcount
        return removed

    async def count(self) -> dict[str, int]:
        """Letters per group."""
        rows = await self._db.query("SELECT grp, COUNT(*) FROM ef_dead_letters GROUP BY grp")
        return {str(g): int(n) for g, n in rows}


class SqliteHeartbeats:
    """Heartbeats in ``ef_heartbeats``."""

    def __init__(self, db: SqliteDatabase) -> None:
        self._db = db

    async def beat(self, hb: Heartbeat) -> None:
        """Insert or replace the instance's row."""
        await self._db.run(self._beat, hb)

    @staticmethod
    def _beat(conn: sqlite3.Connection, hb: Heartbeat) -> None:
        conn.execute(
            "INSERT OR REPLACE INTO ef_heartbeats (instance, app, host, pid, started_at, "
            "last_seen, subscriptions, stats, health, problems) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (
                hb.instance,
                hb.app,
                hb.host,
                hb.pid,
                hb.started_at.isoformat(),
                hb.last_seen.isoformat(),
                orjson.dumps(list(hb.subscriptions)).decode(),
                orjson.dumps(dict(hb.stats)).decode(),
                hb.health,
                orjson.dumps(list(hb.problems)).decode(),
            ),
        )

    async def list(self) -> list[Heartbeat]:
        """Newest first."""
        rows = await self._db.query(
            "SELECT instance, app, host, pid, started_at, last_seen, subscriptions, stats, "
            "health, problems FROM ef_heartbeats ORDER BY last_seen DESC"
        )
        return [
            Heartbeat(
                instance=str(r[0]),
                app=str(r[1]),
                host=str(r[2]),
                pid=int(r[3]),
                started_at=datetime.fromisoformat(str(r[4])),
                last_seen=datetime.fromisoformat(str(r[5])),
                subscriptions=tuple(orjson.loads(r[6])),
                stats=orjson.loads(r[7]),
                health=str(r[8]),
                problems=tuple(orjson.loads(r[9])),
            )
            for r in rows
        ]

    async def remove(self, instance: str) -> None:
        """Delete the instance's row."""
        await self._db.run(
            lambda conn: conn.execute("DELETE FROM ef_heartbeats WHERE instance = ?", (instance,))
        )

    async def prune(self, older_than: float) -> int:
        """Delete rows not refreshed for ``older_than`` seconds; return how many."""
        cutoff = (datetime.now(UTC) - timedelta(seconds=older_than)).isoformat()
        return await self._db.run(
            lambda conn: (
                conn.execute("DELETE FROM ef_heartbeats WHERE last_seen < ?", (cutoff,)).rowcount
            )
        )


class SqliteStore(SqliteEventLog):
    """The SQLite store: one file, one connection shared by all its parts.

    ``busy_timeout``: seconds a write waits for another process's write transaction before
    failing; ``lease_ttl``: seconds a lease outlives its holder's last renewal.
    """

    def __init__(
        self,
        path: str,
        *,
        url: str | None = None,
        busy_timeout: float = DEFAULT_BUSY_TIMEOUT,
        lease_ttl: float = DEFAULT_LEASE_TTL,
    ) -> None:
        self.path = path
        self.url = url or f"sqlite:///{path}"
        self.busy_timeout = busy_timeout
        self.lease_ttl = lease_ttl
        self.db = SqliteDatabase(path, busy_timeout=busy_timeout)
        self.dedup = SqliteDedupStore(self.db)
        self.dead_letters = SqliteDeadLetterStore(self.db)
        self.heartbeats = SqliteHeartbeats(self.db)
        self.checkpoints = SqliteCheckpoints(self.db)
        self.outbox = SqliteOutbox(self.db)
        self.leases = SqliteLeases(self.db, lease_ttl)
        self.attempts = SqliteAttempts(self.db)
        self.clock = SqliteClock()
        self._init_events()

    @property
    def durable(self) -> bool:
        """True for a file; False for ``:memory:`` (a database of this connection only)."""
        return self.path != ":memory:"

    supports_sql = True
    """Its transactions run SQL."""

    def transaction(self) -> AbstractAsyncContextManager[SqliteTransaction]:
        """One transaction on the store's connection; the task's store calls join it."""
        return self.db.transaction()

    async def mark_handled(
        self, group: str, message_id: str, tx: Transaction, *, cancelled_by: str | None = None
    ) -> None:
        """Record a dedup entry inside ``tx`` (visible on commit). The insert is queued: it
        travels to the database thread with the transaction's next statement or its commit
        (``db.queue``), so ``AlreadyHandled``, if a copy committed one first, is raised
        there and ``tx`` rolls back. Transactions on one file are serialized: whichever of
        two recording one pair commits first records it, and the other raises."""
        await self.db.queue(tx, _record_new, group, message_id, cancelled_by, time.time())

    @classmethod
    def from_url(cls, url: str) -> SqliteStore:
        """``sqlite:///relative.db``, ``sqlite:////absolute.db`` or ``sqlite:///:memory:``,
        with the options ``?busy_timeout=SECONDS&lease_ttl=SECONDS``; anything else is
        refused (``sqlite:/x.db`` would otherwise quietly open ``./x.db``)."""
        return cls(_url_path(url), url=url, **_url_settings(url))

    async def open(self, supervisor: Supervisor | None = None) -> None:
        """Open the file and create (or upgrade) the tables if needed. Idempotent."""
        await self.db.open(SCHEMA + DEDUP_SCHEMA + EVENTS_SCHEMA + ATTEMPTS_SCHEMA)
        await upgrade_events_schema(self.db)
        await self.db.run(_add_columns)

    async def close(self) -> None:
        """Close the connections. Idempotent."""
        self.outbox.close()
        await self.db.close()

    async def __aenter__(self) -> SqliteStore:
        await self.open()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


def _record_new(
    conn: sqlite3.Connection, group: str, message_id: str, cancelled_by: str | None, now: float
) -> None:
    """``record`` the pair, raising ``AlreadyHandled`` if it was there."""
    if not record(conn, group, message_id, cancelled_by, now):
        raise AlreadyHandled(group, message_id)


def _url_path(url: str) -> str:
    # urlsplit reads sqlite:/x.db and sqlite:///x.db alike, so look at the text itself: the
    # path starts after exactly "sqlite:///" (a fourth slash makes it absolute).
    rest = url.partition(":")[2]
    parts = split_url(url, kind="SQLite store", form="sqlite:///path/app.db")
    if not rest.split("?")[0].strip("/"):
        raise ConfigurationError(
            f"SQLite URL {url!r} names no file: use sqlite:///app.db (relative to the working "
            "directory) or sqlite:////absolute/path/app.db"
        )
    if not rest.startswith("//"):
        given = parts.path
        if given == ":memory:":
            where = f"for a database in memory write sqlite:///{rest}"
        elif given.startswith("/"):
            where = f"for the absolute path {given} write sqlite:///{rest}"
        else:
            where = f"for {given} relative to the working directory write sqlite:///{rest}"
        raise ConfigurationError(
            f"SQLite URL {url!r} lacks slashes: the path follows sqlite:/// (three slashes, a "
            f"fourth for an absolute path); {where}"
        )
    if parts.netloc:
        raise ConfigurationError(
            f"SQLite URL {url!r} has a host part ({parts.netloc!r}), which SQLite does not "
            f"take: the path follows sqlite:/// (sqlite:///relative/path.db or "
            f"sqlite:////absolute/path.db); did you mean sqlite:///{rest[2:]}?"
        )
    if parts.fragment:
        raise ConfigurationError(
            f"SQLite URL {url!r} has a #fragment; write a '#' in a file name as %23"
        )
    path = unquote(parts.path[1:])
    if not path:
        raise ConfigurationError(f"SQLite URL {url!r} names no file: use sqlite:///app.db")
    return path


def _url_settings(url: str) -> dict[str, float]:
    options = url_options(url, URL_OPTIONS, kind="SQLite store")
    return {
        "busy_timeout": seconds_option(url, options, "busy_timeout", DEFAULT_BUSY_TIMEOUT),
        "lease_ttl": seconds_option(url, options, "lease_ttl", DEFAULT_LEASE_TTL),
    }
