"""Opening the SQLite connection a ``SqliteDatabase`` drives (on its thread)."""

from __future__ import annotations

import sqlite3
import time

from ...errors import StoreError

__all__ = ["connect"]


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
