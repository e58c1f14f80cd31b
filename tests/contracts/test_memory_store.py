"""The memory store against the event store contract."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from eventflow.adapters.memory.store import MemoryStore
from eventflow.stores import store_for
from eventflow.testing.store_contract import StoreContract, StoreFactory, store_pool


class TestMemoryStore(StoreContract):
    """The contract on one fresh ``memory://`` store per test.

    The memory store lives in one process, so every "connection" the factory hands out is
    that same store.
    """

    @pytest.fixture
    async def store_factory(self) -> AsyncIterator[StoreFactory]:
        """The same fresh memory store on every call."""
        store = store_for("memory://")
        assert isinstance(store, MemoryStore)
        async with store_pool(lambda: store) as factory:
            yield factory
