"""The SQLite store against the event store contract."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from eventflow.ports import Store
from eventflow.stores import store_for
from eventflow.testing.store_contract import StoreContract, StoreFactory, store_pool


def _sqlite_store(url: str) -> Store:
    store = store_for(url)
    if not hasattr(store, "append"):
        pytest.fail(
            f"the SQLite event store has not landed: store_for({url!r}) returned "
            f"{type(store).__name__}, which has no append()",
            pytrace=False,
        )
    return store


class TestSqliteStore(StoreContract):
    """The contract on a new SQLite file per test; each store is another connection to it
    (as another process would open it)."""

    @pytest.fixture
    async def store_factory(self, tmp_path: Path) -> AsyncIterator[StoreFactory]:
        """Stores on ``<tmp>/events.db``, a file that does not exist before the test."""
        url = f"sqlite:///{tmp_path / 'events.db'}"
        async with store_pool(lambda: _sqlite_store(url)) as factory:
            yield factory
