"""The PostgreSQL store against the event store contract.

Needs a server (see ``eventflow.testing.postgres``): skipped without one, except under CI.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from eventflow.errors import ConfigurationError
from eventflow.ports import Store
from eventflow.stores import store_for
from eventflow.testing.postgres import isolated_schema, postgres_url
from eventflow.testing.store_contract import StoreContract, StoreFactory, store_pool

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


class TestPostgresStore(StoreContract):
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
