"""The store contract's tests of ``store.clock``: Unix seconds on every store, one clock in
Python (``now``) and in SQL (``sql``), and a due time kept in SQL that comes due on it."""

from __future__ import annotations

import asyncio
import time

from ...ports import Store
from ..broker_contract import unique_name
from .support import StoreContractBase

__all__ = ["ClockContract"]

_SAME_HOST = 5.0  # seconds: the test's services run on this host, their clocks agree
_DUE_IN = 0.3


class ClockContract(StoreContractBase):
    """``store.clock``: what durable timers are kept in."""

    async def test_the_clock_reads_unix_seconds(self, store: Store) -> None:
        """``now()`` outside and inside a transaction is the wall time (as this host sees
        it, give or take clock skew), and goes forward."""
        before = time.time()
        first = await store.clock.now()
        async with store.transaction() as tx:
            inside = await store.clock.now(tx)
        await asyncio.sleep(0.05)
        later = await store.clock.now()
        assert abs(first - before) < _SAME_HOST, (first, before)
        assert first <= inside <= later and later > first

    async def test_the_clock_in_sql_is_the_same_clock(self, store: Store) -> None:
        """``sql`` is an expression for the same clock in the store's SQL (None without
        SQL): read inside a transaction it agrees with ``now(tx)``."""
        sql = store.clock.sql
        assert (sql is not None) == store.supports_sql
        if sql is None:
            return
        async with store.transaction() as tx:
            [(value,)] = await tx.fetch(f"SELECT {sql}")
            now = await store.clock.now(tx)
        assert isinstance(value, float)
        assert abs(value - now) < 1.0, (value, now)

    async def test_a_due_time_kept_in_sql_comes_due_on_the_clock(self, store: Store) -> None:
        """A row written with ``due = {sql} + $1`` is not due (``due <= {sql}``) before that
        many seconds have passed, and is due after: the timer recipe, with no clock
        read of its own."""
        sql = store.clock.sql
        if sql is None:
            return
        table = unique_name("due")
        async with store.transaction() as tx:
            await tx.execute(f"CREATE TABLE {table} (id TEXT, due DOUBLE PRECISION NOT NULL)")
            await tx.execute(f"INSERT INTO {table} (id, due) VALUES ($1, {sql} + $2)", "a", _DUE_IN)
        written = time.monotonic()
        due_query = f"SELECT id FROM {table} WHERE due <= {sql}"
        async with store.transaction() as tx:
            assert await tx.fetch(due_query) == []
            [(left,)] = await tx.fetch(f"SELECT min(due) - {sql} FROM {table}")
        assert 0 < left <= _DUE_IN
        async with asyncio.timeout(self.timeout):
            while True:
                async with store.transaction() as tx:
                    found = await tx.fetch(due_query)
                if found:
                    break
                await asyncio.sleep(0.02)
        assert found == [("a",)]
        assert time.monotonic() - written >= _DUE_IN - 0.02  # not early (the clock's grain)
