"""One SQLite connection driven by one worker thread.

Every statement runs on that thread, in order, so the connection is never shared between
threads and a group of statements passed as one function runs as one transaction. WAL mode
lets other processes (the CLI) read while the app writes.
"""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import Any, TypeVar

from ...errors import StoreError

__all__ = ["SqliteDatabase", "SqliteTransaction"]

T = TypeVar("T")
DEFAULT_BUSY_TIMEOUT = 5.0


class SqliteDatabase:
    """An async front for a single ``sqlite3`` connection."""

    def __init__(self, path: str, *, busy_timeout: float = DEFAULT_BUSY_TIMEOUT) -> None:
        self.path = path
        self.busy_timeout = busy_timeout
        self._executor: ThreadPoolExecutor | None = None
        self._conn: sqlite3.Connection | None = None
        # One transaction at a time on the one connection; the task holding an explicit
        # transaction() is its owner, and its own store calls run inside it.
        self._lock = asyncio.Lock()
        self._owner: asyncio.Task[Any] | None = None

    async def open(self, schema: str = "") -> None:
        """Open the file (creating it) and run ``schema``. Idempotent."""
        if self._conn is not None:
            return
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="eventflow-sqlite")
        try:
            self._conn = await self._submit(self._connect, schema)
        except BaseException:
            self._executor.shutdown(wait=False)
            self._executor = None
            raise

    def _connect(self, schema: str) -> sqlite3.Connection:
        # Several processes (or stores) opening a new file at once race to switch it to WAL
        # and create the tables; SQLite then answers "database is locked" at once rather
        # than waiting, so retry for up to the busy timeout.
        deadline = time.monotonic() + self.busy_timeout
        while True:
            try:
                return self._connect_once(schema)
            except sqlite3.OperationalError as exc:
                if "locked" not in str(exc) or time.monotonic() > deadline:
                    raise StoreError(
                        f"cannot open SQLite database {self.path!r}: {exc}; check the path, "
                        "that its directory is writable and that no other process holds it"
                    ) from exc
                time.sleep(0.02)
            except sqlite3.Error as exc:
                raise StoreError(
                    f"cannot open SQLite database {self.path!r}: {exc}; check the path and "
                    "that its directory is writable"
                ) from exc

    def _connect_once(self, schema: str) -> sqlite3.Connection:
        conn = sqlite3.connect(
            self.path,
            timeout=self.busy_timeout,
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

    async def close(self) -> None:
        """Close the connection and stop the thread. Idempotent."""
        if self._executor is None:
            return
        conn, self._conn = self._conn, None
        if conn is not None:
            await self._submit(conn.close)
        self._executor.shutdown(wait=True)
        self._executor = None

    async def _submit(self, fn: Callable[..., T], *args: Any) -> T:
        if self._executor is None:
            raise StoreError(
                f"SQLite database {self.path!r} is not open: open the store first "
                "(`await store.open()` or `async with app`)"
            )
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(conn, *args)`` on the database thread in a transaction of its own, or, when
        the calling task has a ``transaction()`` open, inside that one."""
        if self._owner is not None and self._owner is asyncio.current_task():
            return await self._submit(self._guarded, fn, args)
        async with self._lock:
            return await self._submit(self._in_tx, fn, args)

    def _guarded(self, fn: Callable[..., T], args: tuple[Any, ...]) -> T:
        conn = self._conn
        if conn is None:
            raise StoreError(f"SQLite database {self.path!r} was closed")
        try:
            return fn(conn, *args)
        except sqlite3.Error as exc:
            raise StoreError(f"SQLite error on {self.path!r}: {exc}") from exc

    @asynccontextmanager
    async def transaction(self) -> AsyncIterator[SqliteTransaction]:
        """Hold the connection in one transaction until the block exits (commit) or raises
        (rollback). Store calls made by the same task inside the block join it."""
        if self._owner is not None and self._owner is asyncio.current_task():
            raise StoreError("a SQLite transaction is already open in this task; nest nothing")
        async with self._lock:
            # The statements run on the database thread whatever happens to this task: if
            # it is cancelled while BEGIN waits (another process holds the write lock), the
            # BEGIN still completes, so roll it back before releasing the lock.
            await self._settled(self._exec, "BEGIN IMMEDIATE", on_cancel="ROLLBACK")
            self._owner = asyncio.current_task()
            try:
                yield SqliteTransaction(self)
            except BaseException:
                self._owner = None
                await self._settled(self._exec, "ROLLBACK")
                raise
            self._owner = None
            await self._settled(self._exec, "COMMIT", on_cancel=None)

    async def _settled(
        self, fn: Callable[..., Any], sql: str, *, on_cancel: str | None = None
    ) -> None:
        """Run ``fn(sql)`` on the thread and wait for it even if cancelled (then run
        ``on_cancel`` too, and re-raise): the connection never stays mid-transaction."""
        job = asyncio.ensure_future(self._submit(fn, sql))
        try:
            await asyncio.shield(job)
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                await job
                if on_cancel is not None:
                    await self._submit(fn, on_cancel)
            raise

    def _exec(self, sql: str) -> None:
        conn = self._conn
        if conn is None:
            raise StoreError(f"SQLite database {self.path!r} was closed")
        try:
            conn.execute(sql)
        except sqlite3.Error as exc:
            raise StoreError(f"SQLite error on {self.path!r}: {exc}") from exc

    def _in_tx(self, fn: Callable[..., T], args: tuple[Any, ...]) -> T:
        conn = self._conn
        if conn is None:
            raise StoreError(f"SQLite database {self.path!r} was closed")
        try:
            conn.execute("BEGIN IMMEDIATE")
            try:
                result = fn(conn, *args)
            except BaseException:
                conn.execute("ROLLBACK")
                raise
            conn.execute("COMMIT")
            return result
        except sqlite3.Error as exc:
            raise StoreError(f"SQLite error on {self.path!r}: {exc}") from exc

    async def query(self, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        """Run one read statement and return all rows (inside the task's transaction, if any)."""
        if self._owner is not None and self._owner is asyncio.current_task():
            return await self._submit(self._query, sql, params)
        async with self._lock:
            return await self._submit(self._query, sql, params)

    def _query(self, sql: str, params: tuple[Any, ...]) -> list[tuple[Any, ...]]:
        conn = self._conn
        if conn is None:
            raise StoreError(f"SQLite database {self.path!r} was closed")
        try:
            return conn.execute(sql, params).fetchall()
        except sqlite3.Error as exc:
            raise StoreError(f"SQLite error on {self.path!r}: {exc}") from exc


class SqliteTransaction:
    """An open SQLite transaction: ``execute``/``fetch`` use ``?`` parameters."""

    def __init__(self, db: SqliteDatabase) -> None:
        self.db = db

    async def execute(self, sql: str, *args: Any) -> int:
        """Run one statement in the transaction; return the rows it changed."""
        return await self.db.run(lambda conn: conn.execute(sql, args).rowcount)

    async def fetch(self, sql: str, *args: Any) -> list[tuple[Any, ...]]:
        """Run a query in the transaction; return all rows."""
        return await self.db.query(sql, args)
