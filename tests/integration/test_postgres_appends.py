"""Appends to the PostgreSQL store under concurrency, inside callers' transactions.

An append with ``expected_version=None`` (any version) never raises ``ConcurrencyError``:
outside a transaction the store retries it, and inside ``store.transaction()`` too (a
savepoint keeps the transaction usable, and the retry sees the other append).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from eventflow import Event
from eventflow.adapters.postgres import PostgresStore
from eventflow.stores import store_for
from eventflow.testing.postgres import isolated_schema, postgres_url

pytestmark = pytest.mark.service("postgres")

TASKS = 8
APPENDS = 25


class Appended(Event, type="it.appends.item"):
    """One append's event."""

    task: int
    n: int


@pytest.fixture
async def store() -> AsyncIterator[PostgresStore]:
    async with isolated_schema(postgres_url()) as url:
        s = store_for(url)
        assert isinstance(s, PostgresStore)
        await s.open()
        try:
            yield s
        finally:
            await s.close()


async def test_appends_at_any_version_in_transactions_never_conflict(
    store: PostgresStore,
) -> None:
    async def task(t: int) -> list[int]:
        versions = []
        for n in range(APPENDS):
            async with store.transaction():
                versions.append(await store.append("shared", [Appended(task=t, n=n)]))
        return versions

    results = await asyncio.gather(*(task(t) for t in range(TASKS)))
    every = sorted(v for versions in results for v in versions)
    assert every == list(range(1, TASKS * APPENDS + 1))
    stored = [rec.event async for rec in store.read_stream("shared")]
    assert len(stored) == TASKS * APPENDS
    for t in range(TASKS):  # each task's events in its own order
        assert [e.n for e in stored if isinstance(e, Appended) and e.task == t] == list(
            range(APPENDS)
        )
