"""Appends to the PostgreSQL store under concurrency, inside callers' transactions.

An append with ``expected_version=None`` (any version) never raises ``ConcurrencyError``:
outside a transaction the store retries it, and inside ``postgres_store.transaction()`` too (the
first try skips conflicting rows, a savepoint keeps the retries usable, and a retry sees the
other append).
"""

from __future__ import annotations

import asyncio

import pytest

from eventflow import ConcurrencyError, Event
from eventflow.adapters.postgres import PostgresStore
from eventflow.events import envelope_for

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


async def test_a_batch_that_goes_in_only_in_part_inside_a_transaction_leaves_nothing(
    postgres_store: PostgresStore,
) -> None:
    """Inside a transaction the first try skips conflicting rows instead of failing (no
    savepoint): a batch that went in only in part is taken out again before the slow path
    decides, and the transaction goes on."""
    await postgres_store.append("partial", [Appended(task=0, n=0)], expected_version=0)
    stored = envelope_for(Appended(task=0, n=1), source="test")
    await postgres_store.append("partial-ids", [stored], expected_version=0)
    fresh = envelope_for(Appended(task=2, n=0), source="test")
    async with postgres_store.transaction():
        # Version 1 is taken, version 2 is free: only the second row could go in.
        with pytest.raises(ConcurrencyError) as conflict:
            await postgres_store.append(
                "partial", [Appended(task=1, n=0), Appended(task=1, n=1)], expected_version=0
            )
        assert (conflict.value.expected, conflict.value.actual) == (0, 1)
        # An id already stored beside a new one: the stored one is skipped, the new one
        # goes in at the next version.
        assert await postgres_store.append("partial-ids", [stored, fresh], expected_version=1) == 2
        assert await postgres_store.append("partial", [Appended(task=3, n=0)]) == 2
    events = [rec.event async for rec in postgres_store.read_stream("partial")]
    assert [e.task for e in events if isinstance(e, Appended)] == [0, 3]
    records = [rec async for rec in postgres_store.read_stream("partial-ids")]
    assert [(r.envelope.id, r.stream_version) for r in records] == [(stored.id, 1), (fresh.id, 2)]
