"""Opening the SQLite connection a ``SqliteDatabase`` drives (on its thread)."""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Callable
from functools import partial
from typing import TypeVar

from ...errors import StoreError

__all__ = ["begin_immediate", "busy_wait", "connect"]

T = TypeVar("T")


def connect(path: str, busy_timeout: float, schema: str) -> sqlite3.Connection:
    """Open ``path`` in WAL mode (``synchronous=NORMAL``) and run ``schema``; the
    connection then waits for a busy file only through ``busy_wait``."""
    # Several processes (or stores) opening a new file at once race to switch it to WAL
    # and create the tables; SQLite then answers "database is locked" at once rather
    # than waiting, so retry for up to the busy timeout.
    deadline = time.monotonic() + busy_timeout
    while True:
        try:
            return _connect_once(path, busy_timeout, schema)
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() > deadline:
                raise StoreError(
                    f"cannot open SQLite database {path!r}: {exc}; check the path, "
                    "that its directory is writable and that no other process holds it"
                ) from exc
            time.sleep(0.02)
        except sqlite3.Error as exc:
            raise StoreError(
                f"cannot open SQLite database {path!r}: {exc}; check the path and "
                "that its directory is writable"
            ) from exc


def _connect_once(path: str, busy_timeout: float, schema: str) -> sqlite3.Connection:
    conn = sqlite3.connect(
        path,
        timeout=busy_timeout,
        isolation_level=None,
        check_same_thread=False,
    )
    try:
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=NORMAL")
        if schema:
            conn.executescript(schema)
        conn.execute("PRAGMA busy_timeout = 0")  # waits are busy_wait's from now on
    except BaseException:
        conn.close()
        raise
    return conn


# Seconds slept between tries of a statement that found the file busy (another connection
# holds its write lock): 50 us, doubling up to _PAUSE_MAX, until the busy timeout.
_PAUSE_FIRST = 0.00005
_PAUSE_MAX = 0.01


def busy_wait(run: Callable[[], T], busy_timeout: float) -> T:
    """``run()``, tried again while it finds the file busy, for up to ``busy_timeout``
    seconds; then its "database is locked" error is raised. The connection's own busy
    timeout is 0 (``connect``): SQLite's wait sleeps a whole millisecond at once, then 2, 5,
    10, ..., so two instances on one file committing in turn (a handler's transaction and
    the other instance's relay removing what it sent) would each wait a millisecond or more
    for a lock held for tens of microseconds. Setting it to 0 and back around each BEGIN
    cost two statements per transaction; waiting here costs nothing when the file is free."""
    deadline = 0.0
    pause = _PAUSE_FIRST
    while True:
        try:
            return run()
        except sqlite3.OperationalError as exc:
            if getattr(exc, "sqlite_errorcode", 0) & 0xFF != sqlite3.SQLITE_BUSY:
                raise
            now = time.monotonic()
            if not deadline:
                deadline = now + busy_timeout
            elif now >= deadline:
                raise
        time.sleep(pause)
        pause = min(pause * 2, _PAUSE_MAX)


def begin_immediate(conn: sqlite3.Connection, busy_timeout: float) -> None:
    """``BEGIN IMMEDIATE``, waiting for another connection's write lock (``busy_wait``)."""
    busy_wait(partial(conn.execute, "BEGIN IMMEDIATE"), busy_timeout)
