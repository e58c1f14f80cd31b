"""The PostgreSQL store's clock: the server's, the same for every process on the store."""

from __future__ import annotations

from ...errors import StoreError
from ...ports import Transaction
from .db import DRIVER_ERRORS, PostgresDatabase

__all__ = ["CLOCK_SQL", "PostgresClock"]

CLOCK_SQL = "(extract(epoch from statement_timestamp())::float8)"
"""The server's clock in Unix seconds: when the statement began (stable within a statement,
so an index on a due time serves ``WHERE due <= {CLOCK_SQL}``; ``now()`` would stay at the
transaction's start, ``clock_timestamp()`` changes row by row)."""


class PostgresClock:
    """``store.clock`` of the PostgreSQL store (``Store.clock``)."""

    sql: str | None = CLOCK_SQL

    def __init__(self, db: PostgresDatabase) -> None:
        self._db = db

    async def now(self, tx: Transaction | None = None) -> float:
        """The server's clock: one statement, in ``tx`` (or the context's transaction)."""
        try:
            async with self._db.connection(tx) as conn:
                value = await conn.fetchval(f"SELECT {CLOCK_SQL}")
        except DRIVER_ERRORS as exc:
            raise StoreError(
                f"could not read the PostgreSQL server's clock: {type(exc).__name__}: {exc}; "
                "check that the server answers"
            ) from exc
        return float(value)
