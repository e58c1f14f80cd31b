"""The PostgreSQL store against the event store contract, lease losses included.

Needs a server (see ``eventflow.testing.postgres``): skipped without one, except under CI.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from urllib.parse import parse_qsl, urlsplit

import asyncpg
import pytest

from eventflow.adapters.postgres import PostgresStore
from eventflow.adapters.postgres.db import PostgresConfig
from eventflow.errors import ConfigurationError
from eventflow.ports import Store
from eventflow.stores import store_for
from eventflow.testing.postgres import isolated_schema, postgres_url
from eventflow.testing.store_contract import (
    ConnectionLossContract,
    LeaseLossContract,
    StoreContract,
    StoreFactory,
    store_pool,
)

pytestmark = pytest.mark.service("postgres")


def _postgres_store(url: str) -> Store:
    try:
        store = store_for(url)
    except ConfigurationError as exc:
        pytest.fail(f"the PostgreSQL event store has not landed: {exc}", pytrace=False)
    if not hasattr(store, "append"):
        pytest.fail(
            f"the PostgreSQL event store has not landed: store_for() returned "
            f"{type(store).__name__}, which has no append()",
            pytrace=False,
        )
    return store


class PostgresFaults:
    """The lease-loss hooks on one schema. Each store gets an ``application_name`` of its
    own (a URL option asyncpg passes to the server), which is how ``kill_connections``
    finds its sessions in ``pg_stat_activity``."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.config = PostgresConfig.from_url(url)
        self.stores: list[PostgresStore] = []

    async def store(self, *, ttl: float) -> Store:
        """An opened store on the schema with leases of ``ttl``."""
        name = f"ef_lease_test_{uuid.uuid4().hex[:12]}"
        config = PostgresConfig.from_url(f"{self.url}&application_name={name}")
        store = PostgresStore(dataclasses.replace(config, lease_ttl=ttl))
        self.stores.append(store)
        await store.open()
        return store

    async def kill_connections(self, store: Store) -> int:
        """``pg_terminate_backend`` every session of ``store``."""
        assert isinstance(store, PostgresStore)
        [name] = [v for k, v in _dsn_options(store.config.dsn) if k == "application_name"]
        conn = await asyncpg.connect(self.config.dsn)
        try:
            killed: int = await conn.fetchval(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                "WHERE application_name = $1",
                name,
            )
        finally:
            await conn.close()
        return killed

    @asynccontextmanager
    async def block_renewals(self, name: str) -> AsyncIterator[None]:
        """Another transaction locks the lease's row (``FOR UPDATE``): renewals and
        takeovers wait for it."""
        conn = await asyncpg.connect(
            self.config.dsn, server_settings={"search_path": self.config.schema}
        )
        try:
            async with conn.transaction():
                locked = await conn.fetchval(
                    "SELECT 1 FROM ef_leases WHERE name = $1 FOR UPDATE", name
                )
                assert locked == 1, f"no lease row {name!r} to lock"
                yield
        finally:
            await conn.close()

    def child_source(self, *, ttl: float) -> str:
        """A store on the same schema, in the child process."""
        return (
            "import dataclasses\n"
            "from eventflow.adapters.postgres import PostgresStore\n"
            "from eventflow.adapters.postgres.db import PostgresConfig\n"
            "def make_store():\n"
            f"    config = PostgresConfig.from_url({self.url!r})\n"
            f"    return PostgresStore(dataclasses.replace(config, lease_ttl={ttl!r}))\n"
        )

    async def close(self) -> None:
        """Close every store made."""
        for store in self.stores:
            await store.close()


def _dsn_options(dsn: str) -> list[tuple[str, str]]:
    return parse_qsl(urlsplit(dsn).query)


class TestPostgresStore(StoreContract, LeaseLossContract, ConnectionLossContract):
    """The contract on a new, empty schema per test (``?schema=NAME``), dropped afterwards;
    each store is another connection pool on it (as another process would open it)."""

    @pytest.fixture
    async def store_factory(self) -> AsyncIterator[StoreFactory]:
        """Stores on a schema of their own on the test server."""
        async with (
            isolated_schema(postgres_url()) as url,
            store_pool(lambda: _postgres_store(url)) as factory,
        ):
            yield factory

    @pytest.fixture
    async def lease_faults(self) -> AsyncIterator[PostgresFaults]:
        """The lease-loss hooks on a schema of their own."""
        async with isolated_schema(postgres_url()) as url:
            faults = PostgresFaults(url)
            try:
                yield faults
            finally:
                await faults.close()


@pytest.mark.service("postgres")
async def test_a_store_closed_in_one_event_loop_opens_again_in_another(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """``eventflow status --watch`` opens and closes one store object in an event loop per
    round; on PostgreSQL the second round failed with ``postgres sequencer failed and
    cannot recover: ... Event ... is bound to a different event loop`` once the sequencer
    had waited for work in the first round's loop."""
    import asyncio

    from eventflow import Event
    from eventflow.testing.postgres import isolated_schema

    class Reopened(Event, type="pg.reopened"):
        n: int

    def rounds(url: str) -> list[int]:
        store = store_for(url)
        seen: list[int] = []

        async def one(n: int) -> None:
            await store.open()
            try:
                await asyncio.sleep(0.3)  # the sequencer's pass ends and it waits for work
                await store.append(f"reopened-{n}", [Reopened(n=n)])
                seen.extend([r.stream_version async for r in store.read_all()])
            finally:
                await store.close()

        for n in range(2):
            asyncio.run(one(n))
        return seen

    async with isolated_schema(postgres_url()) as url:
        assert await asyncio.to_thread(rounds, url) == [1, 1, 1]
    failed = [r.getMessage() for r in caplog.records if "cannot recover" in r.getMessage()]
    assert failed == []
