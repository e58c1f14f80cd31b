"""The event stores the sourcing tests run against: memory, SQLite (a file per test) and
PostgreSQL (an isolated schema per test, on the server ``eventflow.testing.postgres`` finds).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from eventflow.adapters.memory import MemoryStore
from eventflow.ports import Store
from eventflow.stores import store_for
from eventflow.testing.postgres import isolated_schema, postgres_url


@pytest.fixture(
    params=["memory", "sqlite", pytest.param("postgres", marks=pytest.mark.service("postgres"))]
)
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Store]:
    """An open, empty event store."""
    if request.param == "postgres":
        async with isolated_schema(postgres_url()) as url:
            pg = store_for(url)
            await pg.open()
            try:
                yield pg
            finally:
                await pg.close()
        return
    if request.param == "memory":
        opened: Store = MemoryStore()
    else:
        opened = store_for("sqlite:///" + str(tmp_path / "events.db"))
    await opened.open()
    try:
        yield opened
    finally:
        await opened.close()
