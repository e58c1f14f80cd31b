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
from urllib.parse import urlencode, urlsplit, urlunsplit

from ...errors import ConfigurationError, MissingDependencyError, StoreError
from ...leases import DEFAULT_LEASE_TTL
from ...stores import count_option, redact_url, seconds_option, url_options

try:
    import asyncpg
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise MissingDependencyError("asyncpg", "postgres") from exc

__all__ = ["PostgresConfig", "PostgresDatabase", "PostgresTransaction", "reset_connection"]

DEFAULT_MIN_POOL = 2
DEFAULT_MAX_POOL = 10
DEFAULT_CONNECT_TIMEOUT = 10.0

OWN_OPTIONS = ("schema", "pool", "connect_timeout", "lease_ttl")
"""Query options eventflow reads itself (and removes from the driver's DSN)."""
DRIVER_OPTIONS = (
    "application_name",
    "dbname",
    "database",
    "gsslib",
    "host",
    "krbsrvname",
    "passfile",
    "password",
    "port",
    "service",
    "ssl_max_protocol_version",
    "ssl_min_protocol_version",
    "sslcert",
    "sslcrl",
    "sslkey",
    "sslmode",
    "sslnegotiation",
    "sslpassword",
    "sslrootcert",
    "target_session_attrs",
    "user",
)
"""libpq connection options asyncpg reads from a DSN's query, passed through unchanged.
(asyncpg would send any other name to the server as a setting, so a typo such as
``?sslmod=`` would surface only as a server error at connect time: it is refused here.)"""
_CHOICES = {
    "sslmode": ("disable", "allow", "prefer", "require", "verify-ca", "verify-full"),
    "target_session_attrs": (
        "any",
        "primary",
        "standby",
        "prefer-standby",
        "read-write",
        "read-only",
    ),
}


@dataclass(frozen=True, slots=True)
class PostgresConfig:
    """Where and how to connect. ``schema`` puts eventflow's tables in that schema.

    ``connect_timeout``: seconds a new connection may take (the first one at ``open()``
    included) before it fails with a ``StoreError``; ``lease_ttl``: seconds a dead holder
    keeps a lease before another process takes it.
    """

    dsn: str
    schema: str = "public"
    min_pool: int = DEFAULT_MIN_POOL
    max_pool: int = DEFAULT_MAX_POOL
    connect_timeout: float = DEFAULT_CONNECT_TIMEOUT
    lease_ttl: float = DEFAULT_LEASE_TTL

    @classmethod
    def from_url(cls, url: str) -> PostgresConfig:
        """``postgresql://user@host:5432/db?schema=NAME&pool=10&connect_timeout=10&lease_ttl=10``.

        The libpq options asyncpg understands (``sslmode``, ``sslrootcert``,
        ``application_name``, ... see ``DRIVER_OPTIONS``) go to the driver unchanged; any
        other option is refused with a ``ConfigurationError`` listing the known ones.
        """
        parts = urlsplit(url)
        if parts.scheme not in ("postgresql", "postgres"):
            raise ConfigurationError(
                f"not a PostgreSQL URL: {redact_url(url)!r} (use postgresql://user@host/db)"
            )
        options = url_options(url, OWN_OPTIONS + DRIVER_OPTIONS, kind="PostgreSQL")
        schema = options.get("schema", "public")
        if not schema.replace("_", "").isalnum():
            raise ConfigurationError(
                f"store URL option schema={schema!r} in {redact_url(url)!r} must be a schema "
                "name of letters, digits and _"
            )
        for name, allowed in _CHOICES.items():
            if name in options and options[name] not in allowed:
                raise ConfigurationError(
                    f"store URL option {name}={options[name]!r} in {redact_url(url)!r} must be "
                    f"one of {', '.join(allowed)}"
                )
        pool = count_option(url, options, "pool", DEFAULT_MAX_POOL)
        driver = [(k, v) for k, v in options.items() if k not in OWN_OPTIONS]
        dsn = urlunsplit(("postgresql", parts.netloc, parts.path, urlencode(driver), ""))
        return cls(
            dsn=dsn,
            schema=schema,
            min_pool=min(DEFAULT_MIN_POOL, pool),
            max_pool=pool,
            connect_timeout=seconds_option(
                url, options, "connect_timeout", DEFAULT_CONNECT_TIMEOUT
            ),
            lease_ttl=seconds_option(url, options, "lease_ttl", DEFAULT_LEASE_TTL),
        )


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
