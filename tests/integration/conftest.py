"""Fixtures of the integration tests that need a PostgreSQL server."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from eventflow.adapters.postgres import PostgresStore
from eventflow.stores import store_for
from eventflow.testing.postgres import isolated_schema, postgres_url


@pytest.fixture
async def postgres_store() -> AsyncIterator[PostgresStore]:
    """An open PostgreSQL store in a schema of its own, dropped after the test."""
    async with isolated_schema(postgres_url()) as url:
        store = store_for(url)
        assert isinstance(store, PostgresStore)
        await store.open()
        try:
            yield store
        finally:
            await store.close()
