"""One open SQLite transaction as the contexts that joined it see it (``TxState``), and the
two statement runners of its handle (``SqliteTransaction`` in ``db.py``)."""

from __future__ import annotations

import asyncio
import logging
import sqlite3
from collections.abc import Callable
from functools import partial
from typing import Any

from ...errors import StoreError
from .connect import busy_wait

__all__ = ["ENDED", "Queued", "TxState", "changed", "commit", "rows"]

_log = logging.getLogger("eventflow.sqlite")
ENDED = (
    "this SQLite transaction has ended (committed or rolled back): run its statements "
    "inside its `async with` block (a task that outlives the block uses the store directly)"
)

Queued = list[tuple[Callable[..., object], tuple[Any, ...]]]
"""Writes queued for a transaction's next trip to the database thread: (fn, args)."""


class TxState:
    """One open ``transaction()`` as the contexts that joined it see it: ``open`` turns
    False when the block exits, so a task created inside the block that outlives it stops
    joining it (its store calls then take the lock like any other); ``doomed``: the error
    its commit is refused with (a fence refused it, or a queued write failed), if any;
    ``begun``: its ``BEGIN`` went to the thread; ``queued``: writes waiting for the next
    trip (see ``db.py``); ``after``: what the thread runs once it committed; ``held``: it
    holds the database's lock (from its first trip until its ``COMMIT`` or ``ROLLBACK`` is
    on the thread, see ``hold``)."""

    __slots__ = ("_taking", "after", "begun", "doomed", "held", "open", "queued")

    def __init__(self) -> None:
        self.open = True
        self.doomed: BaseException | None = None
        self.begun = False
        self.queued: Queued = []
        self.after: list[Callable[[], object]] = []
        self.held = False
        self._taking: asyncio.Event | None = None

    async def hold(self, lock: asyncio.Lock, *, ending: bool = False) -> None:
        """Take ``lock`` for this transaction if it does not hold it yet: at its first
        trip to the thread (or its ``COMMIT`` when it made none), not when the block
        opens, so what a block computes before its first statement keeps nobody waiting.
        Tasks of the transaction that ask at once take it once. Unless ``ending`` (its
        ``COMMIT``), a transaction that ended while it waited lets the lock go and raises
        ``StoreError``."""
        took = False
        while not self.held:
            taking = self._taking
            if taking is not None:  # another task of this transaction is taking it
                await taking.wait()
                continue
            taking = self._taking = asyncio.Event()
            try:
                await lock.acquire()
                self.held = took = True
            finally:
                self._taking = None
                taking.set()
        if not self.open and not ending:
            if took:  # nobody else will: the block ended while this task waited
                self.let_go(lock)
            raise StoreError(ENDED)

    def let_go(self, lock: asyncio.Lock) -> None:
        """Release ``lock`` if this transaction holds it: its last job (``COMMIT`` or
        ``ROLLBACK``) is on the thread, which runs the next transaction's jobs after it."""
        if self.held:
            self.held = False
            lock.release()

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
