"""One asyncpg pool per PostgreSQL store, and the ambient transaction of a context.

``PostgresDatabase.transaction()`` binds a connection in a transaction to the calling
context (a ``ContextVar``), so every store call made inside the block runs on that
connection and commits or rolls back with it: the user's own SQL, the dedup entry, the
checkpoint, the outbox rows and appended events. Tasks created inside the block inherit the
context and join the transaction too; since a connection runs one statement at a time, a
lock lets one ``connection()`` block (one statement, or a savepoint and its statements) use
it at a time. When the block exits, the transaction is marked ended: a task that outlives
the block goes back to the pool for its later store calls. The BEGIN goes with the
transaction's first statement: one that runs nothing sends neither BEGIN nor COMMIT, and
a write declared its last with nothing run before may be sent alone, as its own
transaction (``alone``, used by ``alone.py``). (The settings read from the store's URL:
``config.py``, re-exported here.)
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager, suppress
from typing import Any

from ...errors import ConfigurationError, MissingDependencyError, StoreError
from ...urls import redact_url
from .config import DEFAULT_CONNECT_TIMEOUT, PostgresConfig

try:
    import asyncpg
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise MissingDependencyError("asyncpg", "postgres") from exc

__all__ = [
    "DEFAULT_CONNECT_TIMEOUT",
    "DRIVER_ERRORS",
    "PostgresConfig",
    "PostgresDatabase",
    "PostgresTransaction",
    "reset_connection",
]

_log = logging.getLogger("eventflow.postgres")

DRIVER_ERRORS = (OSError, asyncpg.PostgresError, asyncpg.InterfaceError)
"""What the driver raises when the server cannot be reached or refuses a statement."""


async def reset_connection(conn: Any) -> None:
    """What a connection needs before it goes back to the pool: only leaving no transaction
    open (the store sets no session state on pooled connections, so asyncpg's default
    reset — a round trip per release — is not needed)."""
    if conn.is_in_transaction():
        await conn.execute("ROLLBACK")


_ENDED = (
    "this PostgreSQL transaction has ended (committed or rolled back): run its statements "
    "inside its `async with` block (a task that outlives the block uses the store directly)"
)
_ALONE = (
    "this PostgreSQL transaction was committed by its one statement (an append declared "
    "the last write of its transaction): nothing more can join it; write before that append"
)
_CHANGING = frozenset({"INSERT", "UPDATE", "DELETE", "MERGE"})


def _rows_changed(status: str) -> int:
    """The rows a statement changed, from its command status (``INSERT 0 3``, ``UPDATE 2``);
    0 for statements that change no rows (``SELECT 5``, ``CREATE TABLE``)."""
    verb, _, rest = status.partition(" ")
    if verb not in _CHANGING:
        return 0
    count = rest.rpartition(" ")[2]
    return int(count) if count.isdigit() else 0


class _Shared:
    """One open ``transaction()`` as the contexts that joined it see it: its connection,
    whether it is still open, the hooks to call on commit, and the lock that gives the
    connection to one task at a time (re-entrant for that task, so a store call made inside
    another's ``connection()`` block in the same task does not wait for itself)."""

    __slots__ = (
        "_depth",
        "_holder",
        "_lock",
        "alone",
        "begun",
        "conn",
        "doomed",
        "hooks",
        "marked",
        "open",
        "xact",
    )

    def __init__(self, conn: Any) -> None:
        self.conn = conn
        self.xact = conn.transaction()  # started (BEGIN) before its first statement
        self.begun = False
        self.alone = False  # committed by its one statement (``PostgresDatabase.alone``)
        self.open = True
        self.doomed: BaseException | None = None  # why its commit is refused (a fence)
        self.hooks: list[Callable[[], None]] | None = []
        self.marked: set[tuple[str, str]] | None = None  # dedup entries a rider wrote in it
        self._lock = asyncio.Lock()
        self._holder: asyncio.Task[Any] | None = None
        self._depth = 0

    async def take(self, *, begin: bool = True) -> bool:
        """Take the connection for the current task, sending the transaction's BEGIN
        first if it was not sent yet (unless not ``begin``); False (nothing taken) once
        ended."""
        task = asyncio.current_task()
        if self._holder is task and task is not None:
            self._depth += 1
        else:
            if not self.open:
                return False
            await self._lock.acquire()
            if not self.open:  # ended while this task waited
                self._lock.release()
                return False
            self._holder, self._depth = task, 1
        if self.alone:
            self.give()
            raise StoreError(_ALONE)
        if begin and not self.begun:
            try:
                await self.xact.start()
            except BaseException:
                self.give()
                raise
            self.begun = True
        return True

    def give(self) -> None:
        """Give back what ``take`` took."""
        self._depth -= 1
        if self._depth == 0:
            self._holder = None
            self._lock.release()

    async def end(self) -> None:
        """Mark the transaction ended once the statement a child task is running finishes,
        and keep the connection (``give`` it back after COMMIT or ROLLBACK)."""
        try:
            await self._lock.acquire()
        except asyncio.CancelledError:
            # A child task's statement is still running on the connection, so ROLLBACK cannot
            # run now: drop the connection (the server rolls back) rather than wait.
            self.open = False
            self.conn.terminate()
            raise
        self.open = False
        self._holder, self._depth = asyncio.current_task(), 1


def _forget(var: contextvars.ContextVar[Any], token: contextvars.Token[Any]) -> None:
    """Unbind a transaction from the context it was opened in. An ``__aexit__`` called from
    another context cannot reset it there, and need not: the transaction is ended, so that
    context no longer joins it."""
    with suppress(ValueError):
        var.reset(token)


class PostgresTransaction:
    """An open transaction on one connection. ``execute``/``fetch`` take ``$1, $2, ...``
    parameters and run in this transaction from any task (one statement at a time); once it
    has ended they raise ``StoreError``."""

    def __init__(self, shared: _Shared, db: PostgresDatabase) -> None:
        self._shared = shared
        self._db = db

    async def execute(self, sql: str, *args: Any) -> int:
        """Run one statement; return the number of rows it changed."""
        shared = self._shared
        if not await shared.take():
            raise StoreError(_ENDED)
        try:
            status: str = await shared.conn.execute(sql, *args)
        finally:
            shared.give()
        return _rows_changed(status)

    async def fetch(self, sql: str, *args: Any) -> list[tuple[Any, ...]]:
        """Run a query; return every row as a tuple."""
        shared = self._shared
        if not await shared.take():
            raise StoreError(_ENDED)
        try:
            rows = await shared.conn.fetch(sql, *args)
        finally:
            shared.give()
        return [tuple(r) for r in rows]


class PostgresDatabase:
    """An asyncpg pool with the store's schema on its search path."""

    def __init__(self, config: PostgresConfig) -> None:
        self.config = config
        self.pool: Any = None
        self._joined: contextvars.ContextVar[_Shared | None] = contextvars.ContextVar(
            f"eventflow-pg-{id(self)}", default=None
        )

    async def open(self, schema_sql: str) -> None:
        """Create the pool and the schema. Idempotent."""
        if self.pool is not None:
            return
        cfg = self.config
        conn = await self.connect("open the store")
        try:
            try:
                await conn.execute(f'CREATE SCHEMA IF NOT EXISTS "{cfg.schema}"')
                await conn.execute(f'SET search_path TO "{cfg.schema}"')
                # Serialise schema creation between processes starting together.
                async with conn.transaction():
                    await conn.execute("SELECT pg_advisory_xact_lock(1701147506)")
                    await conn.execute(schema_sql)
            finally:
                await conn.close()
            self.pool = await asyncpg.create_pool(
                cfg.dsn,
                min_size=cfg.min_pool,
                max_size=cfg.max_pool,
                timeout=cfg.connect_timeout,
                server_settings={"search_path": cfg.schema},
                reset=reset_connection,
            )
        except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
            # The schema's own errors carry their remedy as a hint (part of str(exc)).
            raise self._failure("open the store", exc) from exc

    async def connect(self, purpose: str, **kwargs: Any) -> Any:
        """A new connection of its own (outside the pool), within ``connect_timeout``.

        ``purpose`` says what it is for in the error: a ``StoreError`` naming the URL
        (without its password) and what to check; a ``ConfigurationError`` if asyncpg
        refuses a value of the URL."""
        cfg = self.config
        try:
            return await asyncpg.connect(cfg.dsn, timeout=cfg.connect_timeout, **kwargs)
        except ValueError as exc:  # asyncpg's ClientConfigurationError, a bad port, ...
            raise ConfigurationError(
                f"PostgreSQL URL {redact_url(cfg.dsn)!r} is not valid: {exc}; fix the URL"
            ) from exc
        except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
            raise self._failure(purpose, exc) from exc

    def _failure(self, purpose: str, exc: BaseException) -> StoreError:
        cfg = self.config
        where = f"PostgreSQL at {redact_url(cfg.dsn)!r} (schema {cfg.schema!r})"
        if isinstance(exc, TimeoutError):
            return StoreError(
                f"cannot {purpose}: {where} did not answer within {cfg.connect_timeout:g} s "
                "(connect_timeout); check that the server runs and listens at that host and "
                "port, that the URL is right and that no firewall drops the connection (raise "
                "?connect_timeout= for a slow network)"
            )
        advice = (
            ""
            if getattr(exc, "hint", None)
            else "; check that the server runs, the URL (host, port, user, password, "
            "database) is right and the user may connect"
        )
        return StoreError(f"cannot {purpose}: {where}: {exc}{advice}")

    async def close(self) -> None:
        """Close the pool. Idempotent."""
        pool, self.pool = self.pool, None
        if pool is not None:
            await pool.close()

    def _pool(self) -> Any:
        if self.pool is None:
            raise StoreError("the PostgreSQL store is not open: `await store.open()` first")
        return self.pool

    @property
    def current(self) -> Any:
        """The connection of the context's open transaction, or None. Use it only to ask
        whether one is open: statements go through ``connection()``, which serialises them."""
        shared = self._joined.get()
        return shared.conn if shared is not None and shared.open else None

    def is_current(self, tx: object) -> bool:
        """Whether ``tx`` is the context's open transaction (the one the store's calls
        without a ``tx`` argument, appends among them, run in)."""
        shared = self._joined.get()
        return isinstance(tx, PostgresTransaction) and tx._shared is shared and shared.open

    def _shared_of(self, tx: object) -> _Shared | None:
        """The transaction a store call runs in: ``tx`` when given (it must be one of this
        database's), else the context's open one, if any."""
        if tx is None:
            return self._joined.get()
        if not isinstance(tx, PostgresTransaction) or tx._db is not self:
            raise ConfigurationError(
                "a PostgreSQL store write was given another store's transaction: open it "
                "with this store's transaction()"
            )
        if not tx._shared.open:
            raise StoreError(_ENDED)
        return tx._shared

    @asynccontextmanager
    async def connection(self, tx: object = None) -> AsyncIterator[Any]:
        """The connection of ``tx`` (given by the caller), else of the context's open
        transaction, else a pooled one. Outside a transaction each statement commits on its
        own (every store operation is one statement), which saves the BEGIN and COMMIT round
        trips.

        Inside one, the block holds the connection: other tasks of the transaction wait
        until it exits, so keep it to the statements of one store operation (a savepoint
        with its statements is not interleaved with theirs)."""
        shared = self._shared_of(tx)
        if shared is not None and shared.open:
            if not await shared.take():
                # It ended while this call waited for its connection: the write was meant
                # for it, so it must not be made on its own (it would commit after the
                # transaction rolled back).
                raise StoreError(_ENDED)
            try:
                yield shared.conn
            finally:
                shared.give()
            return
        # No transaction, or one that ended before this call (a task that outlived it).
        async with self._pool().acquire() as conn:
            yield conn

    @asynccontextmanager
    async def transaction(self) -> AsyncIterator[PostgresTransaction]:
        """Open a transaction bound to this context until the block exits; tasks created
        inside the block join it. A transaction a fence refused (``doom``) rolls back even
        when the block exits normally, raising the fence's error."""
        outer = self._joined.get()
        if outer is not None and outer.open:
            raise StoreError(
                "a transaction is already open in this context (this task, or the task that "
                "created it, is inside `transaction()`): nest nothing, run the statements in "
                "the open one"
            )
        async with self._pool().acquire() as conn:
            # BEGIN goes with the first statement (``_Shared.take``): a transaction whose
            # one statement is declared its last runs it alone (``alone``), without BEGIN
            # and COMMIT; one that ran nothing sends neither.
            shared = _Shared(conn)
            tx = shared.xact
            token = self._joined.set(shared)
            try:
                try:
                    yield PostgresTransaction(shared, self)
                except BaseException as exc:
                    await shared.end()
                    try:
                        if shared.begun:
                            await tx.rollback()
                    except Exception as rollback_error:
                        # The block's error (a cancellation, say) is what the caller must
                        # see; a connection that cannot roll back is gone (the pool drops
                        # it), and the server rolls back what it had open.
                        _log.warning(
                            "rolling back a PostgreSQL transaction after %s failed (%s: %s); "
                            "the server rolls back what a lost connection had open",
                            type(exc).__name__,
                            type(rollback_error).__name__,
                            rollback_error,
                        )
                    finally:
                        shared.give()
                    raise
                await shared.end()
                try:
                    if shared.doomed is not None:
                        if shared.begun:
                            await tx.rollback()
                        raise shared.doomed.with_traceback(None)
                    if shared.begun:
                        await tx.commit()
                finally:
                    shared.give()
            finally:
                shared.open = False
                hooks, shared.hooks = shared.hooks, None
                _forget(self._joined, token)
        for hook in hooks or ():  # committed (a rollback raised above)
            hook()

    @asynccontextmanager
    async def alone(self) -> AsyncIterator[Any]:
        """For a write declared the last of the context's open transaction: its connection
        while nothing ran in the transaction yet (no BEGIN sent) and no fence doomed it,
        else None (send the write the usual way). A statement sent on it runs on its own,
        as its own transaction, so it must hold every write of the transaction and its
        checks; once one wrote, call :meth:`ended_alone`."""
        shared = self._joined.get()
        if shared is None or not shared.open:
            yield None
            return
        if not await shared.take(begin=False):
            raise StoreError(_ENDED)
        try:
            yield shared.conn if not shared.begun and shared.doomed is None else None
        finally:
            shared.give()

    def ended_alone(self) -> None:
        """:meth:`alone`'s statement wrote, so committed the context's transaction: later
        statements raise, its block sends no COMMIT (and, raising, cannot undo it)."""
        shared = self._joined.get()
        assert shared is not None and not shared.begun
        shared.alone = True

    def doom(self, tx: object, error: BaseException) -> None:
        """Refuse the commit of ``tx`` (or of the context's open transaction): leaving its
        block normally rolls it back and raises ``error``."""
        shared = self._shared_of(tx)
        if shared is not None and shared.doomed is None:
            shared.doomed = error

    def note_marked(self, group: str, message_id: str) -> None:
        """The dedup entry (``group``, ``message_id``) was written in the context's open
        transaction (by a rider of an append): :meth:`marked` says so until it ends."""
        shared = self._joined.get()
        if shared is not None and shared.open:
            if shared.marked is None:
                shared.marked = set()
            shared.marked.add((group, message_id))

    def marked(self, tx: object, group: str, message_id: str) -> bool:
        """Whether :meth:`note_marked` noted the entry in ``tx`` (or the context's open
        transaction)."""
        shared = self._shared_of(tx)
        marked = shared.marked if shared is not None else None
        return marked is not None and (group, message_id) in marked

    def after_commit(self, hook: Callable[[], None], tx: object = None) -> None:
        """Call ``hook`` once ``tx`` (or the context's open transaction) commits, now if
        there is none."""
        shared = self._shared_of(tx)
        if shared is None or shared.hooks is None:
            hook()
        else:
            shared.hooks.append(hook)
