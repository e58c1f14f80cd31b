"""Opening the SQLite connection a ``SqliteDatabase`` drives (on its thread)."""

from __future__ import annotations

import sqlite3
import time

from ...errors import StoreError

__all__ = ["begin_immediate", "connect"]


def connect(path: str, busy_timeout: float, schema: str) -> sqlite3.Connection:
    """Open ``path`` in WAL mode (``synchronous=NORMAL``) and run ``schema``."""
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
    except BaseException:
        conn.close()
        raise
    return conn


# Seconds slept between tries of BEGIN IMMEDIATE while another connection holds the file's
# write lock, before SQLite's own wait takes over (about 6 ms in all).
_PAUSES = tuple(0.00005 * 2**k for k in range(7))


def begin_immediate(conn: sqlite3.Connection, busy_timeout: float) -> None:
    """``BEGIN IMMEDIATE``, waiting for another connection's write lock in short steps
    first. SQLite's own wait (the busy timeout) sleeps a whole millisecond at once, then 2,
    5, 10, ...: two instances on one file committing in turn (a handler's transaction and
    the other instance's relay removing what it sent) would each wait a millisecond or more
    for a lock held for tens of microseconds. Tries every 50 us, then 100, 200, ... 3.2 ms;
    after that SQLite waits as configured (``busy_timeout``)."""
    conn.execute("PRAGMA busy_timeout = 0")
    try:
        for pause in _PAUSES:
            try:
                conn.execute("BEGIN IMMEDIATE")
                return
            except sqlite3.OperationalError as exc:
                if exc.sqlite_errorcode & 0xFF != sqlite3.SQLITE_BUSY:
                    raise
            time.sleep(pause)
    finally:
        conn.execute(f"PRAGMA busy_timeout = {round(busy_timeout * 1000)}")
    conn.execute("BEGIN IMMEDIATE")
