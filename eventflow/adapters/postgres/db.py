"""One asyncpg pool per PostgreSQL store, and the ambient transaction of a task.

``PostgresDatabase.transaction()`` binds a connection in a transaction to the calling
context (a ``ContextVar``), so every store call made inside the block runs on that
connection and commits or rolls back with it: the user's own SQL, the dedup entry, the
checkpoint, the outbox rows and appended events.
"""

from __future__ import annotations

import contextvars
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl, urlsplit, urlunsplit

from ...errors import ConfigurationError, MissingDependencyError, StoreError
from ...leases import DEFAULT_LEASE_TTL

try:
    import asyncpg
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise MissingDependencyError("asyncpg", "postgres") from exc

__all__ = ["PostgresConfig", "PostgresDatabase", "PostgresTransaction", "reset_connection"]

DEFAULT_MIN_POOL = 2
DEFAULT_MAX_POOL = 10


@dataclass(frozen=True, slots=True)
class PostgresConfig:
    """Where and how to connect. ``schema`` puts eventflow's tables in that schema."""

    dsn: str
    schema: str = "public"
    min_pool: int = DEFAULT_MIN_POOL
    max_pool: int = DEFAULT_MAX_POOL
    lease_ttl: float = DEFAULT_LEASE_TTL

    @classmethod
    def from_url(cls, url: str) -> PostgresConfig:
        """``postgresql://user@host:5432/db?schema=NAME&pool=10`` (other query options go to
        the driver)."""
        parts = urlsplit(url)
        if parts.scheme not in ("postgresql", "postgres"):
            raise ConfigurationError(f"not a PostgreSQL URL: {url!r}")
        options = dict(parse_qsl(parts.query))
        schema = options.pop("schema", "public")
        if not schema.replace("_", "").isalnum():
            raise ConfigurationError(f"schema name {schema!r} must be letters, digits and _")
        pool = int(options.pop("pool", DEFAULT_MAX_POOL))
        query = "&".join(f"{k}={v}" for k, v in options.items())
        dsn = urlunsplit(("postgresql", parts.netloc, parts.path, query, ""))
        return cls(dsn=dsn, schema=schema, min_pool=min(DEFAULT_MIN_POOL, pool), max_pool=pool)


async def reset_connection(conn: Any) -> None:
    """What a connection needs before it goes back to the pool: only leaving no transaction
    open (the store sets no session state on pooled connections, so asyncpg's default
    reset — a round trip per release — is not needed)."""
    if conn.is_in_transaction():
        await conn.execute("ROLLBACK")


class PostgresTransaction:
    """An open transaction on one connection: ``execute``/``fetch`` use ``$1`` parameters."""

    def __init__(self, conn: Any) -> None:
        self.connection = conn

    async def execute(self, sql: str, *args: Any) -> Any:
        """Run one statement; return asyncpg's status string."""
        return await self.connection.execute(sql, *args)

    async def fetch(self, sql: str, *args: Any) -> list[tuple[Any, ...]]:
        """Run a query; return every row as a tuple."""
        return [tuple(r) for r in await self.connection.fetch(sql, *args)]


class PostgresDatabase:
    """An asyncpg pool with the store's schema on its search path."""

    def __init__(self, config: PostgresConfig) -> None:
        self.config = config
        self.pool: Any = None
        self._current: contextvars.ContextVar[Any] = contextvars.ContextVar(
            f"eventflow-pg-{id(self)}", default=None
        )
        self._hooks: contextvars.ContextVar[list[Callable[[], None]] | None] = (
            contextvars.ContextVar(f"eventflow-pg-hooks-{id(self)}", default=None)
        )

    async def open(self, schema_sql: str) -> None:
        """Create the pool and the schema. Idempotent."""
        if self.pool is not None:
            return
        cfg = self.config
        try:
            conn = await asyncpg.connect(cfg.dsn)
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
                server_settings={"search_path": cfg.schema},
                reset=reset_connection,
            )
        except (OSError, asyncpg.PostgresError) as exc:
            # The schema's own errors carry their remedy as a hint (part of str(exc)); others
            # are connection or permission problems.
            advice = (
                ""
                if getattr(exc, "hint", None)
                else "; check that the server runs and the URL is right"
            )
            raise StoreError(
                f"cannot open PostgreSQL store {cfg.dsn!r} (schema {cfg.schema!r}): {exc}{advice}"
            ) from exc

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
        """The connection of the context's open transaction, or None."""
        return self._current.get()

    @asynccontextmanager
    async def connection(self) -> AsyncIterator[Any]:
        """The context's transaction connection, else a pooled one. Outside a transaction
        each statement commits on its own (every store operation is one statement), which
        saves the BEGIN and COMMIT round trips."""
        conn = self._current.get()
        if conn is not None:
            yield conn
            return
        async with self._pool().acquire() as conn:
            yield conn

    @asynccontextmanager
    async def transaction(self) -> AsyncIterator[PostgresTransaction]:
        """Open a transaction bound to this context until the block exits."""
        if self._current.get() is not None:
            raise StoreError("a transaction is already open in this context; nest nothing")
        hooks: list[Callable[[], None]] = []
        async with self._pool().acquire() as conn, conn.transaction():
            token = self._current.set(conn)
            hooks_token = self._hooks.set(hooks)
            try:
                yield PostgresTransaction(conn)
            finally:
                self._current.reset(token)
                self._hooks.reset(hooks_token)
        for hook in hooks:  # committed
            hook()

    def after_commit(self, hook: Callable[[], None]) -> None:
        """Call ``hook`` once the context's open transaction commits (now if none is open)."""
        hooks = self._hooks.get()
        if hooks is None:
            hook()
        else:
            hooks.append(hook)
