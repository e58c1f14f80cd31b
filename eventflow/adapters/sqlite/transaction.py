"""One open SQLite transaction as the contexts that joined it see it (``TxState``), and the
two statement runners of its handle (``SqliteTransaction`` in ``db.py``)."""

from __future__ import annotations

import logging
import sqlite3
from collections.abc import Callable
from functools import partial
from typing import Any

from .connect import busy_wait

__all__ = ["Queued", "TxState", "changed", "commit", "rows"]

_log = logging.getLogger("eventflow.sqlite")

Queued = list[tuple[Callable[..., object], tuple[Any, ...]]]
"""Writes queued for a transaction's next trip to the database thread: (fn, args)."""


class TxState:
    """One open ``transaction()`` as the contexts that joined it see it: ``open`` turns
    False when the block exits, so a task created inside the block that outlives it stops
    joining it (its store calls then take the lock like any other); ``doomed``: the error
    its commit is refused with (a fence refused it, or a queued write failed), if any;
    ``begun``: its ``BEGIN`` went to the thread; ``queued``: writes waiting for the next
    trip (see ``db.py``); ``after``: what the thread runs once it committed."""

    __slots__ = ("after", "begun", "doomed", "open", "queued")

    def __init__(self) -> None:
        self.open = True
        self.doomed: BaseException | None = None
        self.begun = False
        self.queued: Queued = []
        self.after: list[Callable[[], object]] = []

    def trip(self) -> tuple[bool, Queued]:
        """What the next trip to the thread carries before its own statement: the
        ``BEGIN`` (the first trip only) and the queued writes, taken off the queue."""
        begin, self.begun = not self.begun, True
        queued, self.queued = self.queued, []
        return begin, queued


def changed(conn: sqlite3.Connection, sql: str, args: tuple[Any, ...]) -> int:
    """Run ``sql``; the number of rows it changed."""
    cursor = conn.execute(sql, args)
    cursor.fetchall()  # rowcount counts the rows of INSERT ... RETURNING once they are read
    return max(cursor.rowcount, 0)  # -1: not an INSERT, UPDATE or DELETE


def rows(conn: sqlite3.Connection, sql: str, args: tuple[Any, ...]) -> list[tuple[Any, ...]]:
    """Run ``sql``; all its rows."""
    return conn.execute(sql, args).fetchall()


def commit(conn: sqlite3.Connection, path: str, busy_timeout: float) -> None:
    """COMMIT (which finds the file busy only outside WAL mode: then it waits, as
    ``busy_wait`` does); if that fails and leaves the transaction open (SQLite keeps it open
    after some errors), roll it back: the next transaction must not find the connection in
    it."""
    try:
        busy_wait(partial(conn.execute, "COMMIT"), busy_timeout)
    except sqlite3.Error:
        if conn.in_transaction:
            try:
                conn.execute("ROLLBACK")
            except sqlite3.Error as exc:
                _log.warning(
                    "SQLite ROLLBACK after a failed COMMIT on %r failed too (%s): the "
                    "connection is still inside a transaction; close and reopen the store",
                    path,
                    exc,
                )
        raise
