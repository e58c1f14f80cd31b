"""The SQLite store against the event store contract, lease losses included.

Leases on SQLite are rows of the file, renewed through the store's one connection; there is
no server session whose end could release them (what ``pg_terminate_backend`` does to a
PostgreSQL holder), so the connection-killed case is PostgreSQL's alone. A SQLite holder
loses its connection to the file only when its process dies, or when the file refuses its
writes: the killed-holder and renewal-failing cases are those, on SQLite.
"""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from eventflow.adapters.sqlite.store import SqliteStore
from eventflow.ports import Store
from eventflow.stores import store_for
from eventflow.testing.store_contract import (
    LeaseLossContract,
    StoreContract,
    StoreFactory,
    store_pool,
)

BUSY_TIMEOUT = 0.5  # a write blocked by another connection fails fast, and is tried again


def _sqlite_store(url: str) -> Store:
    store = store_for(url)
    if not hasattr(store, "append"):
        pytest.fail(
            f"the SQLite event store has not landed: store_for({url!r}) returned "
            f"{type(store).__name__}, which has no append()",
            pytrace=False,
        )
    return store


class SqliteFaults:
    """The lease-loss hooks on one SQLite file."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.stores: list[Store] = []

    async def store(self, *, ttl: float) -> Store:
        """An opened store on the file with leases of ``ttl``."""
        store = SqliteStore(str(self.path), busy_timeout=BUSY_TIMEOUT, lease_ttl=ttl)
        self.stores.append(store)
        await store.open()
        return store

    @asynccontextmanager
    async def block_renewals(self, name: str) -> AsyncIterator[None]:
        """Another connection holds an exclusive transaction: no store can write the file
        (renewals and takeovers fail after their busy timeout)."""
        conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        try:
            await asyncio.to_thread(conn.execute, "BEGIN EXCLUSIVE")
            try:
                yield
            finally:
                await asyncio.to_thread(conn.execute, "ROLLBACK")
        finally:
            conn.close()

    def child_source(self, *, ttl: float) -> str:
        """A store on the same file, in the child process."""
        return (
            "from eventflow.adapters.sqlite.store import SqliteStore\n"
            "def make_store():\n"
            f"    return SqliteStore({str(self.path)!r}, busy_timeout={BUSY_TIMEOUT!r}, "
            f"lease_ttl={ttl!r})\n"
        )

    async def close(self) -> None:
        """Close every store made."""
        for store in self.stores:
            await store.close()


class TestSqliteStore(StoreContract, LeaseLossContract):
    """The contract on a new SQLite file per test; each store is another connection to it
    (as another process would open it)."""

    @pytest.fixture
    async def store_factory(self, tmp_path: Path) -> AsyncIterator[StoreFactory]:
        """Stores on ``<tmp>/events.db``, a file that does not exist before the test."""
        url = f"sqlite:///{tmp_path / 'events.db'}"
        async with store_pool(lambda: _sqlite_store(url)) as factory:
            yield factory

    @pytest.fixture
    async def lease_faults(self, tmp_path: Path) -> AsyncIterator[SqliteFaults]:
        """The lease-loss hooks on ``<tmp>/leases.db``."""
        faults = SqliteFaults(tmp_path / "leases.db")
        try:
            yield faults
        finally:
            await faults.close()
