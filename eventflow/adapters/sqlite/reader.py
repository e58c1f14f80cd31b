"""Lookups by key that run in the event loop, on a read-only connection of their own.

A trip to the database thread and back costs about 40 us of CPU on the project's 2-core
machine (two thread wake-ups), while reading one row by its primary key costs about 5. A
handling asks the dedup store whether it saw the message before anything else; that
lookup runs here. In WAL mode a reader never waits for a writer (it reads the last
committed state), and this connection has a busy timeout of 0: when it cannot read at once
(the file is being recovered, say) ``read`` returns None and the caller goes to the
thread, so the event loop never waits on the file. Only statements that read a handful of
rows by key belong here; anything that may scan or wait goes to the thread.
"""

from __future__ import annotations

import sqlite3
from typing import Any

__all__ = ["Reader"]


class Reader:
    """A read-only connection to ``path`` used from the event loop's thread."""

    def __init__(self, path: str) -> None:
        self._path = path
        self._conn: sqlite3.Connection | None = None

    def read(self, sql: str, params: tuple[Any, ...]) -> list[tuple[Any, ...]] | None:
        """The rows of ``sql``, or None if it could not run at once (then run it on the
        database thread, which reports any error in full)."""
        try:
            conn = self._conn
            if conn is None:
                conn = self._conn = sqlite3.connect(
                    self._path, timeout=0, isolation_level=None, check_same_thread=False
                )
                conn.execute("PRAGMA query_only = ON")
            return conn.execute(sql, params).fetchall()
        except sqlite3.Error:
            self.close()  # opened again by the next read
            return None

    def close(self) -> None:
        """Close the connection, if open. Idempotent."""
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()
