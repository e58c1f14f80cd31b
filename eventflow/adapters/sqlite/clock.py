"""The SQLite store's clock: the host's, which every process on the file shares."""

from __future__ import annotations

import time

from ...ports import Transaction

__all__ = ["CLOCK_SQL", "SqliteClock"]

CLOCK_SQL = "((julianday('now') - 2440587.5) * 86400.0)"
"""The host's clock in Unix seconds, in SQLite's SQL (``julianday`` counts days from noon,
4714 BC; SQLite reads the clock once per statement, to the millisecond)."""


class SqliteClock:
    """``store.clock`` of the SQLite store (``Store.clock``)."""

    sql: str | None = CLOCK_SQL

    async def now(self, tx: Transaction | None = None) -> float:
        """The host's clock (``time.time()``): no I/O."""
        return time.time()
