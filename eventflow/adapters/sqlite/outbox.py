"""The SQLite store's outbox, and how its relay hears adds made by other processes.

A store that commits outbox rows while the relay is elsewhere announces them on a socket
the relay listens on (``notify.py``), right after the commit: the relay hears it within
microseconds. What follows is the safety net, for where no announcement arrives (another
network namespace, no such sockets, a datagram lost); while announcements are heard, a row
it finds unseen wakes the relay only if it is still unseen at the next check.

SQLite cannot notify another process by itself, but another connection can read cheaply
whether the outbox grew: its high-water mark, ``max(seq)``, a look at the end of its
primary key (microseconds; it holds no lock a writer waits for, and with a busy timeout of
0 it never waits either: a check that cannot read wakes nobody, the next one will).
Sequence numbers only grow (``AUTOINCREMENT``) and writes to one file commit one after the
other, so a row
committed after the relay's last look has a ``seq`` above every row that look saw: the
mark rises past ``known``, the highest ``seq`` the relay has seen, exactly when the outbox
holds something the relay has not seen. Deletes (the relay's own), heartbeats, dedup
entries and lease renewals leave the mark where it is and wake nobody.

A thread of the outbox, started by the first wait on ``added`` and ended when the store
closes, checks the mark while a task (the relay) waits on ``added``, and sets ``added`` in
the event loop when the mark passed ``known``. For ``CHECK_HOT`` seconds after a check
found such a row it checks as each wait begins and every ``CHECK_FIRST``; after that the
interval doubles with every check that finds nothing, up to ``CHECK_MAX``. A relay that
sends other processes' rows, or did a moment ago (hops of one message at a time), finds
the next a fraction of a millisecond after its commit; an idle one, or one that sends only
its own process's rows (which wake it in-process), checks ``1 / CHECK_MAX`` times a
second. A thread and not the event loop's timers: those fire a millisecond late or more
(``epoll`` waits whole milliseconds) and each check would cost a loop iteration, while the
thread sleeps between checks holding nothing and wakes the loop only when there is
something to send.

Adds made through this store set ``added`` themselves. A database in memory has no other
connection: nothing is checked.
"""

from __future__ import annotations

import asyncio
import sqlite3
import threading
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Literal

from ...envelope import Envelope
from ...leases import Lease
from ...ports import OutboxMessage, Transaction
from .db import SqliteDatabase
from .events import SqliteLeases
from .notify import Listener, address, announce

__all__ = ["CHECK_FIRST", "CHECK_HOT", "CHECK_MAX", "SqliteOutbox"]

CHECK_FIRST = 0.0002
"""Seconds between checks for other processes' adds while they keep coming."""
CHECK_HOT = 0.02
"""Seconds after a check last found another process's add during which checks are
``CHECK_FIRST`` apart."""
CHECK_MAX = 0.025
"""The longest interval between two checks while the relay stays idle."""


class _Watch:
    """The thread that checks the outbox's high-water mark while the relay waits (see the
    module docstring), with the connection it reads it on."""

    def __init__(self, path: str, added: _Added, loop: asyncio.AbstractEventLoop) -> None:
        self._path = path
        self._added = added
        self._loop = loop
        self._waiting = threading.Event()  # set while the relay waits on ``added``
        self._nudge = threading.Event()  # a wait began (or the end came): check now
        self._hot_until = 0.0  # checks are CHECK_FIRST apart until then (time.monotonic)
        self._stop = False
        self._thread = threading.Thread(
            target=self._run, name="eventflow-sqlite-outbox-watch", daemon=True
        )
        self._thread.start()

    def waiting(self, yes: bool) -> None:
        """The relay starts (True) or stops waiting on ``added``; while checks are frequent,
        the first comes at once."""
        if yes:
            self._waiting.set()
            if time.monotonic() < self._hot_until:
                self._nudge.set()
        else:
            self._waiting.clear()

    def stop(self) -> None:
        """End the thread (it returns within one check). Idempotent."""
        self._stop = True
        self._waiting.set()
        self._nudge.set()
        self._thread.join()

    def _run(self) -> None:
        conn: sqlite3.Connection | None = None
        added, waiting, nudge = self._added, self._waiting, self._nudge
        pause = CHECK_FIRST
        unheard = 0  # a mark found unseen while announcements are heard, checked again
        try:
            while True:
                waiting.wait()
                if self._stop:
                    return
                now = time.monotonic()
                pause = CHECK_FIRST if now < self._hot_until else min(pause * 2, CHECK_MAX)
                try:
                    if conn is None:
                        conn = sqlite3.connect(self._path, timeout=0, isolation_level=None)
                    mark = conn.execute("SELECT max(seq) FROM ef_outbox").fetchone()[0]
                except sqlite3.Error:
                    mark = None  # busy, or the file gone: the next check, or the poll, will
                    if conn is not None:
                        conn.close()
                        conn = None
                if mark is not None and mark > added.known and waiting.is_set():
                    if added.listening and mark != unheard:
                        # An announcement (notify.py) is likely on its way: look again soon,
                        # and wake the relay only if it still has not seen the row then.
                        unheard, pause = mark, CHECK_FIRST
                    else:
                        waiting.clear()  # one wake-up: the relay waits again after its look
                        self._hot_until = now + CHECK_HOT
                        self._loop.call_soon_threadsafe(added.set)
                nudge.wait(pause)
                nudge.clear()
        finally:
            if conn is not None:
                conn.close()


class _Added(asyncio.Event):
    """``outbox.added``: set by this store's adds and, while the relay waits on it, when
    the outbox's high-water mark passes ``known`` (see the module docstring)."""

    def __init__(self, db: SqliteDatabase) -> None:
        super().__init__()
        self._db = db
        self.known = 0
        """The highest ``seq`` the relay has seen (``pending`` returned)."""
        self.listening = False
        """The relay hears other processes' announcements (``notify.py``)."""
        self._watch: _Watch | None = None
        self._watched: asyncio.AbstractEventLoop | None = None  # the loop it wakes

    def _watching(self) -> _Watch | None:
        """The watch (started now if needed, for the running loop), or None when there is
        nothing to watch (a database in memory, or the store is closed)."""
        db = self._db
        if db.path == ":memory:" or not db.is_open:
            return None
        loop = asyncio.get_running_loop()
        if self._watch is not None and self._watched is not loop:
            self.stop()  # the store is used from another event loop now
        if self._watch is None:
            self._watch, self._watched = _Watch(db.path, self, loop), loop
        return self._watch

    def stop(self) -> None:
        """End the watch, if it runs (the store closes). Idempotent."""
        watch, self._watch, self._watched = self._watch, None, None
        if watch is not None:
            watch.stop()

    def seen(self, seqs: Sequence[int]) -> None:
        """``pending`` returned rows up to ``max(seqs)``."""
        if seqs:
            self.known = max(self.known, seqs[-1])

    async def wait(self) -> Literal[True]:
        """Return once set: by an add of this store, or by the watch finding rows above
        ``known``."""
        watch = None if self.is_set() else self._watching()
        if watch is None:
            return await super().wait()
        watch.waiting(True)
        try:
            return await super().wait()
        finally:
            watch.waiting(False)


INLINE_BYTES = 65536
"""Payload bytes up to which the relay's look reads the outbox in the event loop."""
# length() of a BLOB reads the row's header, not the payload.
_SIZES = "SELECT seq, length(payload) FROM ef_outbox ORDER BY seq LIMIT ?"
_ROWS = "SELECT seq, topic, msg_key, payload, message_id FROM ef_outbox"


def _insert(conn: sqlite3.Connection, rows: list[tuple[str, str | None, bytes, str]]) -> None:
    conn.executemany(
        "INSERT INTO ef_outbox (topic, msg_key, payload, message_id) VALUES (?, ?, ?, ?)", rows
    )


class SqliteOutbox:
    """Outgoing messages in ``ef_outbox``."""

    def __init__(self, db: SqliteDatabase) -> None:
        self._db = db
        self.added = _Added(db)
        self._relaying = 0
        self._name: bytes | None = None  # the relay's socket (notify.py), once known

    @asynccontextmanager
    async def relaying(self) -> AsyncIterator[None]:
        """While this store object's relay holds the lease: listen for other processes'
        announcements (``notify.py``), and make none (``added`` wakes the relay here; see
        ``Outbox.relaying``)."""
        listener = None
        name = self._name_of()
        if name is not None:
            listener = Listener(name, self.added.set)
            if not listener.start():
                listener = None
        self._relaying += 1
        self.added.listening = listener is not None
        try:
            yield
        finally:
            self._relaying -= 1
            if listener is not None:
                self.added.listening = False
                listener.stop()

    def _name_of(self) -> bytes | None:
        if self._name is None and self._db.is_open:
            self._name = address(self._db.path)
        return self._name

    def _announce(self) -> None:
        """On the database thread, after the commit: wake another process's relay."""
        announce(self._name)

    async def add(
        self, messages: Sequence[tuple[str, Envelope]], *, tx: Transaction | None = None
    ) -> None:
        """Queue messages; inside ``tx`` (or the context's open transaction) they are written
        with its next statement or its commit, and commit with it. Once committed, a relay
        listening in another process is told (``notify.py``), unless this one relays."""
        rows = [(topic, env.key, env.to_bytes(), env.id) for topic, env in messages]
        db = self._db
        await db.queue(tx, _insert, rows)
        self.added.set()
        if (
            not self._relaying
            and self._name_of() is not None
            and not db.after_commit(tx, self._announce)
        ):
            self._announce()  # written in a transaction of its own: committed

    async def pending(self, limit: int = 100) -> list[OutboxMessage]:
        """Oldest first. Read in the event loop (``db.lookup``, after this connection's
        transaction under way) when the rows are few and small, the relay's usual look
        (about 10 us against a trip to the database thread of about 40); on the thread
        otherwise."""
        db = self._db
        sizes = await db.lookup(_SIZES, (limit,), settled=True)
        if not sizes:
            rows = []
        elif sum(int(size) for _, size in sizes) <= INLINE_BYTES:
            last = int(sizes[-1][0])  # the same rows: later adds have higher seqs
            rows = await db.lookup(_ROWS + " WHERE seq <= ? ORDER BY seq", (last,), settled=True)
        else:
            rows = await db.query(_ROWS + " ORDER BY seq LIMIT ?", (limit,))
        self.added.seen([int(row[0]) for row in rows])
        return [
            OutboxMessage(int(s), str(t), None if k is None else str(k), bytes(p), str(m))
            for s, t, k, p, m in rows
        ]

    async def backlog(self, limit: int = 1000) -> tuple[int, OutboxMessage | None]:
        """Two reads; the relay's high-water mark (``added.known``) is left alone, so a
        message another process adds still wakes the relay."""
        counted = await self._db.query(
            "SELECT count(*) FROM (SELECT 1 FROM ef_outbox LIMIT ?)", (limit,)
        )
        rows = await self._db.query(
            "SELECT seq, topic, msg_key, payload, message_id FROM ef_outbox ORDER BY seq LIMIT 1"
        )
        oldest = [
            OutboxMessage(int(s), str(t), None if k is None else str(k), bytes(p), str(m))
            for s, t, k, p, m in rows
        ]
        return int(counted[0][0]), oldest[0] if oldest else None

    async def remove(self, seqs: Sequence[int], *, lease: Lease | None = None) -> None:
        """Delete sent messages; with ``lease``, fenced like ``checkpoints.set``."""
        rows = [(s,) for s in seqs]

        def write(conn: sqlite3.Connection) -> None:
            if lease is not None:
                SqliteLeases.check_epoch(conn, lease)
            conn.executemany("DELETE FROM ef_outbox WHERE seq = ?", rows)

        await self._db.run(write)

    def close(self) -> None:
        """End the thread that checks for other processes' adds (the store closes; a later
        wait starts it again). Idempotent."""
        self.added.stop()
