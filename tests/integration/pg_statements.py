"""The statements a PostgreSQL store sends on the context's open transaction, for tests
that count round trips (riders, a handling sent alone)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from eventflow.adapters.postgres import PostgresStore


@contextmanager
def statements(store: PostgresStore) -> Iterator[list[str]]:
    """The statements sent on the context's open transaction's connection meanwhile."""
    conn: Any = store.db.current
    seen: list[str] = []

    def log(record: Any) -> None:
        seen.append(record.query)

    conn.add_query_logger(log)
    try:
        yield seen
    finally:
        conn.remove_query_logger(log)
