"""Appends to the PostgreSQL store under concurrency, inside callers' transactions.

An append with ``expected_version=None`` (any version) never raises ``ConcurrencyError``:
outside a transaction the store retries it, and inside ``postgres_store.transaction()`` too (a
savepoint keeps the transaction usable, and the retry sees the other append).
"""

from __future__ import annotations

import asyncio

import pytest

from eventflow import Event
from eventflow.adapters.postgres import PostgresStore

pytestmark = pytest.mark.service("postgres")

TASKS = 8
APPENDS = 25


class Appended(Event, type="it.appends.item"):
    """One append's event."""

    task: int
    n: int


async def test_appends_at_any_version_in_transactions_never_conflict(
    postgres_store: PostgresStore,
) -> None:
    async def task(t: int) -> list[int]:
        versions = []
        for n in range(APPENDS):
            async with postgres_store.transaction():
                versions.append(await postgres_store.append("shared", [Appended(task=t, n=n)]))
        return versions

    results = await asyncio.gather(*(task(t) for t in range(TASKS)))
    every = sorted(v for versions in results for v in versions)
    assert every == list(range(1, TASKS * APPENDS + 1))
    stored = [rec.event async for rec in postgres_store.read_stream("shared")]
    assert len(stored) == TASKS * APPENDS
    for t in range(TASKS):  # each task's events in its own order
        assert [e.n for e in stored if isinstance(e, Appended) and e.task == t] == list(
            range(APPENDS)
        )
