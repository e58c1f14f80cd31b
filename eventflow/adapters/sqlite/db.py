"""One SQLite connection driven by one worker thread.

Every statement runs on that thread, in order, so the connection is never shared between
threads and a group of statements passed as one function runs as one transaction. WAL mode
lets other processes (the CLI) read while the app writes.

``transaction()`` holds the connection for a block, bound to the calling context (a
``ContextVar``): store calls made inside it, also from tasks created inside it, run in it
(the thread runs them one at a time); the others wait for it to end. User SQL takes
``$1, $2, ...`` (``params.py``).

A trip to the thread and back costs more than a small statement (about 40 us against a few
on a 2-core machine), so short reads by key that must not wait (``lookup``: the dedup
check, the relay's look) run in the event loop on a read-only connection, and a
transaction makes as few trips as it can: its ``BEGIN IMMEDIATE``
travels with its first statement, the writes whose outcome nobody waits for (``queue``:
the outbox rows of a handling) travel with the next statement or the ``COMMIT``, and a
block that ran no statement makes no trip at all. What runs, and in which order, is the
same as with one trip per statement.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import sqlite3
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager, suppress
from typing import Any, TypeVar

from ...errors import ConfigurationError, StoreError
from .connect import begin_immediate, busy_wait, connect
from .params import to_sqlite
from .reader import Reader
from .transaction import Queued, TxState, changed, commit, rows
from .worker import Worker

__all__ = ["SqliteDatabase", "SqliteTransaction"]

T = TypeVar("T")
DEFAULT_BUSY_TIMEOUT = 5.0
_log = logging.getLogger("eventflow.sqlite")
_ENDED = (
    "this SQLite transaction has ended (committed or rolled back): run its statements "
    "inside its `async with` block (a task that outlives the block uses the store directly)"
)


def _forget(var: contextvars.ContextVar[Any], token: contextvars.Token[Any]) -> None:
    """Unbind a transaction from the context it was opened in. An ``__aexit__`` called from
    another context cannot reset it there, and need not: the transaction is closed, so that
    context no longer joins it."""
    with suppress(ValueError):
        var.reset(token)


class SqliteDatabase:
    """An async front for a single ``sqlite3`` connection."""

    def __init__(self, path: str, *, busy_timeout: float = DEFAULT_BUSY_TIMEOUT) -> None:
        self.path = path
        self.busy_timeout = busy_timeout
        self._worker: Worker | None = None
        self._conn: sqlite3.Connection | None = None
        # Lookups by key read in the event loop (reader.py); not for a database in memory.
        self._reader = Reader(path) if path != ":memory:" else None
        # One transaction at a time on the one connection. An explicit transaction() is
        # bound to the context that opened it (and so to the tasks created inside it): their
        # store calls run inside it, the others wait for the lock.
        self._lock = asyncio.Lock()
        self._joined: contextvars.ContextVar[TxState | None] = contextvars.ContextVar(
            f"eventflow-sqlite-{id(self)}", default=None
        )

    @property
    def is_open(self) -> bool:
        """True between ``open`` and ``close``."""
        return self._conn is not None

    async def open(self, schema: str = "") -> None:
        """Open the file (creating it) and run ``schema``. Idempotent."""
        if self._conn is not None:
            return
        self._worker = Worker("eventflow-sqlite")
        try:
            self._conn = await self._submit(connect, self.path, self.busy_timeout, schema)
        except BaseException:
            worker, self._worker = self._worker, None
            worker.stop()
            raise

    async def close(self) -> None:
        """Close the connection and stop the thread. Idempotent."""
        if self._worker is None:
            return
        conn, self._conn = self._conn, None
        if self._reader is not None:
            self._reader.close()
        if conn is not None:
            await self._submit(conn.close)
        worker, self._worker = self._worker, None
        worker.stop()

    def _job(self, fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        if self._worker is None:
            raise StoreError(
                f"SQLite database {self.path!r} is not open: open the store first "
                "(`await store.open()` or `async with app`)"
            )
        return self._worker.submit(fn, *args)

    async def _submit(self, fn: Callable[..., T], *args: Any) -> T:
        return await self._job(fn, *args)

    async def _behind(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(*args)`` on the thread after the transaction under way (the lock), but
        without holding the lock while it runs: the thread runs jobs in order, so what is
        given to it later (the next transaction's first trip) runs after it anyway, and
        need not wait for its outcome to reach the event loop first."""
        async with self._lock:
            job = self._job(fn, *args)
        return await job

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(conn, *args)`` on the database thread in a transaction of its own, or, when
        the calling context has a ``transaction()`` open, inside that one."""
        joined = self._joined.get()
        if joined is not None and joined.open:
            return await self._run_in(joined, fn, *args)
        return await self._behind(self._in_tx, fn, args)

    async def run_in(self, tx: object, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(conn, *args)`` in ``tx`` when given (one of this database's transactions,
        whichever context opened it), else as ``run`` does: a store call given the caller's
        transaction commits with it even from a context that did not open it."""
        if tx is None:
            return await self.run(fn, *args)
        return await self._run_in(self._shared_of(tx), fn, *args)

    def _shared_of(self, tx: object) -> TxState:
        if not isinstance(tx, SqliteTransaction) or tx.db is not self:
            raise ConfigurationError(
                f"a write to SQLite database {self.path!r} was given another store's "
                "transaction: open it with this store's transaction()"
            )
        return tx._shared

    def doom(self, tx: object, error: BaseException) -> None:
        """Refuse the commit of ``tx`` (one of this database's transactions): leaving its
        block normally rolls it back and raises ``error``."""
        shared = self._shared_of(tx)
        if shared.doomed is None:
            shared.doomed = error

    async def queue(self, tx: object, fn: Callable[..., object], *args: Any) -> None:
        """Run ``fn(conn, *args)`` in ``tx`` (or the context's open transaction) with its
        next statement or its ``COMMIT``, in the same trip to the thread; without a
        transaction, now, in one of its own. For writes whose outcome the caller does not
        wait for: if one fails, the transaction is refused (rolled back, raising its error
        where it ends) and the statement that carried it raises that error too."""
        shared = self._shared_of(tx) if tx is not None else self._joined.get()
        if shared is None or (tx is None and not shared.open):
            await self.run(fn, *args)
            return
        if not shared.open:
            raise StoreError(_ENDED)
        shared.queued.append((fn, args))

    def after_commit(self, tx: object, fn: Callable[[], object]) -> bool:
        """Have the database thread run ``fn()`` (once, however often given) right after
        ``tx`` (or the context's open transaction) commits; errors are ignored. False when
        there is no such transaction: what the caller wrote has committed, run it now."""
        shared = self._shared_of(tx) if tx is not None else self._joined.get()
        if shared is None or not shared.open:
            return False
        if fn not in shared.after:
            shared.after.append(fn)
        return True

    async def _run_in(self, shared: TxState, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(conn, *args)`` in the transaction ``shared`` (a ``SqliteTransaction``'s)."""
        if not shared.open:
            raise StoreError(_ENDED)
        # No await between the check and the submission: the statement is queued on the
        # thread before the COMMIT or ROLLBACK that closes the transaction.
        begin, queued = shared.trip()
        return await self._submit(self._step, shared, begin, queued, fn, args)

    def _step(
        self,
        shared: TxState,
        begin: bool,
        queued: Queued,
        fn: Callable[..., T],
        args: tuple[Any, ...],
    ) -> T:
        """On the thread: one trip of a transaction (``BEGIN``, queued writes, ``fn``)."""
        conn = self._live()
        try:
            if begin:
                begin_immediate(conn, self.busy_timeout)
            self._flush(conn, shared, queued)
            return fn(conn, *args)
        except sqlite3.Error as exc:
            raise StoreError(f"SQLite error on {self.path!r}: {exc}") from exc

    def _flush(
        self,
        conn: sqlite3.Connection,
        shared: TxState,
        queued: Queued,
    ) -> None:
        """On the thread: the queued writes; one that fails refuses the transaction."""
        try:
            for fn, args in queued:
                fn(conn, *args)
        except sqlite3.Error as exc:
            error = StoreError(f"SQLite error on {self.path!r}: {exc}")
            error.__cause__ = exc
            if shared.doomed is None:
                shared.doomed = error
            raise error from exc
        except BaseException as exc:
            if shared.doomed is None:
                shared.doomed = exc
            raise

    def _live(self) -> sqlite3.Connection:
        conn = self._conn
        if conn is None:
            raise StoreError(f"SQLite database {self.path!r} was closed")
        return conn

    @asynccontextmanager
    async def transaction(self) -> AsyncIterator[SqliteTransaction]:
        """Hold the connection in one transaction until the block exits (commit) or raises
        (rollback); one a fence refused (``doom``) rolls back either way, raising the
        fence's error. Store calls made in this context inside the block join it, including
        those of tasks created inside it (``gather``, a ``TaskGroup``, ``wait_for``): the one
        database thread runs their statements one at a time. A task that is still running
        when the block exits no longer joins it: its later store calls run on their own."""
        outer = self._joined.get()
        if outer is not None and outer.open:
            raise StoreError(
                "a SQLite transaction is already open in this context (this task, or the "
                "task that created it, is inside `transaction()`): nest nothing, run the "
                "statements in the open one"
            )
        async with self._lock:
            shared = TxState()
            token = self._joined.set(shared)
            try:
                try:
                    yield SqliteTransaction(self, shared)
                except BaseException as exc:
                    shared.open = False
                    try:
                        await self._roll_back(shared)
                    except Exception as rollback_error:
                        # The block's error (a cancellation, say) is what the caller must
                        # see; the failed ROLLBACK is logged with what it left behind.
                        _log.warning(
                            "SQLite ROLLBACK on %r after %s failed: %s; %s",
                            self.path,
                            type(exc).__name__,
                            rollback_error,
                            await self._left_in(),
                        )
                    raise
                shared.open = False
                if shared.doomed is not None:
                    await self._roll_back(shared)
                    raise shared.doomed.with_traceback(None)
                if shared.begun or shared.queued:
                    begin, queued = shared.trip()
                    await self._settled("COMMIT", self._end, shared, begin, queued)
            finally:
                shared.open = False
                _forget(self._joined, token)

    async def _roll_back(self, shared: TxState) -> None:
        """End ``shared`` without committing: a ``ROLLBACK`` if its ``BEGIN`` went to the
        thread (the thread runs it after any trip of the transaction still under way),
        nothing otherwise (its queued writes are dropped)."""
        shared.queued = []
        if shared.begun:
            await self._settled("ROLLBACK", self._undo)

    async def _settled(self, what: str, fn: Callable[..., None], *args: Any) -> None:
        """Run ``fn(*args)`` (the ``what``: COMMIT or ROLLBACK) on the thread and wait for
        it even if cancelled (then let the cancellation through): the connection never
        stays mid-transaction."""
        job = self._job(fn, *args)
        try:
            await asyncio.shield(job)
        except asyncio.CancelledError:
            cleanup = asyncio.ensure_future(self._after_cancel(job, what))
            while not cleanup.done():
                try:
                    await asyncio.shield(cleanup)
                except asyncio.CancelledError:
                    continue  # cancelled again: the first cancellation is raised below
            raise

    async def _after_cancel(self, job: asyncio.Future[None], what: str) -> None:
        """Wait for ``what`` (the cancelled caller no longer does); its error reaches nobody
        else, so it is logged with what it means."""
        try:
            await job
        except Exception as exc:
            _log.warning(
                "SQLite %s on %r failed after its caller was cancelled: %s; %s",
                what,
                self.path,
                exc,
                await self._left_in(),
            )

    async def _left_in(self) -> str:
        """What a failed BEGIN, COMMIT or ROLLBACK left behind, for the log."""
        try:
            inside = await self._submit(self._in_transaction)
        except Exception as exc:  # closed meanwhile: nothing is left open
            return f"the connection is gone ({exc}): nothing was committed"
        if inside:
            return (
                "the connection is still inside a transaction, so this store's next "
                "transactions fail with 'cannot start a transaction within a transaction': "
                "close and reopen the store (restart the app)"
            )
        return "no transaction is left open: the store goes on (what was not committed is lost)"

    def _in_transaction(self) -> bool:
        return self._conn is not None and self._conn.in_transaction

    def _end(
        self,
        shared: TxState,
        begin: bool,
        queued: Queued,
    ) -> None:
        """On the thread: the last trip of ``transaction()``: the ``BEGIN`` and the queued
        writes if still to run, then ``COMMIT`` (``_commit``), or ``ROLLBACK`` if a queued
        write failed (raising its error)."""
        conn = self._live()
        try:
            try:
                if begin:
                    begin_immediate(conn, self.busy_timeout)
                self._flush(conn, shared, queued)
                if shared.doomed is not None:  # a queued write an earlier trip carried failed
                    raise shared.doomed.with_traceback(None)
            except BaseException:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise
            commit(conn, self.path, self.busy_timeout)
        except sqlite3.Error as exc:
            raise StoreError(f"SQLite error on {self.path!r}: {exc}") from exc
        for fn in shared.after:
            with suppress(Exception):
                fn()

    def _undo(self) -> None:
        """On the thread: ``ROLLBACK`` the transaction, if one is open."""
        conn = self._live()
        try:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
        except sqlite3.Error as exc:
            raise StoreError(f"SQLite error on {self.path!r}: {exc}") from exc

    def _in_tx(self, fn: Callable[..., T], args: tuple[Any, ...]) -> T:
        conn = self._conn
        if conn is None:
            raise StoreError(f"SQLite database {self.path!r} was closed")
        try:
            begin_immediate(conn, self.busy_timeout)
            try:
                result = fn(conn, *args)
            except BaseException:
                conn.execute("ROLLBACK")
                raise
            commit(conn, self.path, self.busy_timeout)
            return result
        except sqlite3.Error as exc:
            raise StoreError(f"SQLite error on {self.path!r}: {exc}") from exc

    async def query(self, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        """Run one read statement and return all rows (inside the context's transaction, if
        any)."""
        joined = self._joined.get()
        if joined is not None and joined.open:
            return await self._run_in(joined, rows, sql, params)
        return await self._behind(self._query, sql, params)

    async def lookup(
        self, sql: str, params: tuple[Any, ...] = (), *, settled: bool = False
    ) -> list[tuple[Any, ...]]:
        """Run one short read (a few rows by key) as ``query`` does, but in the event loop
        on a read-only connection (``reader.py``) when it can read at once: no trip to the
        thread. It reads what is committed; with ``settled`` it first waits for this
        connection's transaction under way (as ``query`` does), so it sees what that
        commits. Inside the context's open transaction it runs there."""
        joined = self._joined.get()
        if joined is not None and joined.open:
            return await self._run_in(joined, rows, sql, params)
        reader = self._reader
        if reader is None or self._conn is None:
            return await self.query(sql, params)
        if not settled:
            found = reader.read(sql, params)
            return found if found is not None else await self.query(sql, params)
        async with self._lock:
            # Jobs still on the thread (one-trip transactions given to it, see ``_behind``)
            # may commit what the read must see: it follows them there.
            idle = self._worker is not None and self._worker.idle
            found = reader.read(sql, params) if idle else None
            if found is not None:
                return found
            job = self._job(self._query, sql, params)
        return await job

    def _query(self, sql: str, params: tuple[Any, ...]) -> list[tuple[Any, ...]]:
        conn = self._conn
        if conn is None:
            raise StoreError(f"SQLite database {self.path!r} was closed")
        try:
            return busy_wait(lambda: conn.execute(sql, params).fetchall(), self.busy_timeout)
        except sqlite3.Error as exc:
            raise StoreError(f"SQLite error on {self.path!r}: {exc}") from exc


class SqliteTransaction:
    """An open SQLite transaction. ``execute``/``fetch`` take ``$1, $2, ...`` parameters, as
    every eventflow SQL store does (see ``params.py``), and run in this transaction from any
    task; once it has ended they raise ``StoreError``."""

    def __init__(self, db: SqliteDatabase, shared: TxState) -> None:
        self.db = db
        self._shared = shared

    async def execute(self, sql: str, *args: Any) -> int:
        """Run one statement in the transaction; return the number of rows it changed."""
        return await self.db._run_in(self._shared, changed, to_sqlite(sql), args)

    async def fetch(self, sql: str, *args: Any) -> list[tuple[Any, ...]]:
        """Run a query in the transaction; return all rows."""
        return await self.db._run_in(self._shared, rows, to_sqlite(sql), args)
