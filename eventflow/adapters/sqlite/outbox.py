"""The SQLite store's outbox, and how its relay hears adds made by other processes.

SQLite cannot notify another process, but it can say cheaply whether anyone else wrote:
``PRAGMA data_version`` on a connection changes whenever another connection (another
process, or another store object on the same file) commits. The outbox keeps a second
connection to the file for that one question, asked in the event loop's thread: it takes
microseconds, holds no lock another connection waits for, and with a busy timeout of 0 it
never waits either (a check that cannot read the version wakes nobody; the next one, or the
relay's own look every second, will). Asked on the store's thread instead, each check cost
about twice the CPU (a thread wake-up each way).

``pending`` reads the version just before it reads the rows; ``added.wait`` (the relay's
wait when idle) reads it again at short intervals, and a change sets ``added``, so the relay
looks. Adds made through this store set ``added`` at once. The relay checks every
``CHECK_FIRST`` for ``CHECK_HOT`` seconds after it last had something to do, then the
interval doubles with every check that finds nothing, up to ``CHECK_MAX``: a relay that is
busy, or was a moment ago (hops of one message at a time), finds a new row within about a
millisecond, and an idle one checks ``1 / CHECK_MAX`` times a second.

Every commit of another connection counts, not only outbox adds (heartbeats, lease
renewals, other instances' dedup entries, this store's own writes): each costs the relay
one look at an empty outbox. A database in memory has no other connection: nothing is
checked.
"""

from __future__ import annotations

import asyncio
import sqlite3
import time
from collections.abc import Sequence
from contextlib import AbstractAsyncContextManager, nullcontext
from typing import Literal

from ...envelope import Envelope
from ...leases import Lease
from ...ports import OutboxMessage, Transaction
from .db import SqliteDatabase
from .events import SqliteLeases

__all__ = ["CHECK_FIRST", "CHECK_HOT", "CHECK_MAX", "SqliteOutbox"]

CHECK_FIRST = 0.001
"""Seconds between checks for other processes' adds while the relay is busy."""
CHECK_HOT = 0.02
"""Seconds after the relay last had something to do during which it checks every
``CHECK_FIRST``."""
CHECK_MAX = 0.025
"""The longest interval between two checks while the relay stays idle."""


class _Probe:
    """The connection that reads ``PRAGMA data_version`` (see the module docstring): opened
    when first needed while the store is open, closed with it."""

    def __init__(self, db: SqliteDatabase) -> None:
        self._db = db
        self._conn: sqlite3.Connection | None = None

    def version(self) -> int | None:
        """The file's data version, or None when it cannot be compared with the last one
        (the store is closed, the file busy or gone, the connection new: versions of two
        connections are unrelated)."""
        if not self._db.is_open or self._db.path == ":memory:":
            return None
        try:
            if self._conn is None:
                self._conn = sqlite3.connect(
                    self._db.path, timeout=0, isolation_level=None, check_same_thread=False
                )
                self._conn.execute("PRAGMA data_version").fetchone()
                return None
            return int(self._conn.execute("PRAGMA data_version").fetchone()[0])
        except sqlite3.Error:
            self.close()
            return None

    def close(self) -> None:
        """Close the connection (opened again when next needed). Idempotent."""
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()


class _Added(asyncio.Event):
    """``outbox.added``: set by this store's adds, and, while a task waits on it, by
    commits of other connections to the file (see the module docstring)."""

    def __init__(self, db: SqliteDatabase) -> None:
        super().__init__()
        self._watched = db.path != ":memory:"
        self.probe = _Probe(db)
        self.seen: int | None = None
        """The data version read just before ``pending`` last read the rows."""
        self.pause = CHECK_FIRST
        self._busy_at = 0.0

    def looking(self) -> None:
        """``pending`` is about to read the rows: what is committed after this is a change."""
        self.seen = self.probe.version()

    def busy(self) -> None:
        """The relay found work: check often again."""
        self.pause = CHECK_FIRST
        self._busy_at = time.monotonic()

    async def wait(self) -> Literal[True]:
        """Return once set: by an add of this store, or by a commit of another connection
        found by a check."""
        if not self._watched:
            return await super().wait()
        while not self.is_set():
            try:
                async with asyncio.timeout(self.pause):
                    return await super().wait()
            except TimeoutError:
                pass
            if time.monotonic() - self._busy_at > CHECK_HOT:
                self.pause = min(self.pause * 2, CHECK_MAX)
            version = self.probe.version()
            # None: it cannot tell now (the file busy, the check's connection new); the next
            # check, or the relay's own look every second, will.
            if version is not None and version != self.seen:
                self.busy()
                self.set()
        return True


def _insert(conn: sqlite3.Connection, rows: list[tuple[str, str | None, bytes, str]]) -> None:
    conn.executemany(
        "INSERT INTO ef_outbox (topic, msg_key, payload, message_id) VALUES (?, ?, ?, ?)", rows
    )


class SqliteOutbox:
    """Outgoing messages in ``ef_outbox``."""

    def __init__(self, db: SqliteDatabase) -> None:
        self._db = db
        self.added = _Added(db)

    def relaying(self) -> AbstractAsyncContextManager[None]:
        """Nothing to do: adds tell no one, the waiting relay checks (see
        ``Outbox.relaying``)."""
        return nullcontext()

    async def add(
        self, messages: Sequence[tuple[str, Envelope]], *, tx: Transaction | None = None
    ) -> None:
        """Queue messages; inside ``tx`` (or the context's open transaction) they are written
        with its next statement or its commit, and commit with it."""
        rows = [(topic, env.key, env.to_bytes(), env.id) for topic, env in messages]
        await self._db.queue(tx, _insert, rows)
        self.added.set()

    async def pending(self, limit: int = 100) -> list[OutboxMessage]:
        """Oldest first."""
        self.added.looking()
        rows = await self._db.query(
            "SELECT seq, topic, msg_key, payload, message_id FROM ef_outbox ORDER BY seq LIMIT ?",
            (limit,),
        )
        if rows:
            self.added.busy()
        return [
            OutboxMessage(int(s), str(t), None if k is None else str(k), bytes(p), str(m))
            for s, t, k, p, m in rows
        ]

    async def remove(self, seqs: Sequence[int], *, lease: Lease | None = None) -> None:
        """Delete sent messages; with ``lease``, fenced like ``checkpoints.set``."""
        rows = [(s,) for s in seqs]

        def write(conn: sqlite3.Connection) -> None:
            if lease is not None:
                SqliteLeases.check_epoch(conn, lease)
            conn.executemany("DELETE FROM ef_outbox WHERE seq = ?", rows)

        await self._db.run(write)

    def close(self) -> None:
        """Close the connection the checks use (the store closes). Idempotent."""
        self.added.probe.close()
