"""The ``DedupStore`` port's contract suite, shared by every dedup store: the memory, SQLite
and PostgreSQL stores' own tables and Redis.

A test module subclasses :class:`DedupContract` and provides one fixture, ``dedup_factory``:
a :class:`DedupFactory` returning dedup stores on one fresh backend (the same store for a
single-process one), each like another process of the same deployment, all closed after
the test::

    class TestRedisDedup(DedupContract):
        @pytest.fixture
        async def dedup_factory(self) -> AsyncIterator[DedupFactory]:
            prefix = f"t{uuid.uuid4().hex}"
            async with dedup_pool(lambda: dedup_for(f"{redis_url()}?prefix={prefix}")) as f:
                yield f

Groups and ids are unique per test, so a shared backend is fine too.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Protocol

import pytest

from ..envelope import new_id
from ..ports import DedupStore
from .broker_contract import unique_name

__all__ = ["DedupContract", "DedupFactory", "dedup_pool"]


class DedupFactory(Protocol):
    """Returns an open dedup store on the test's backend; the fixture closes them all."""

    async def __call__(self) -> DedupStore:
        """A dedup store connected to the test's backend."""


@asynccontextmanager
async def dedup_pool(make: Callable[[], DedupStore]) -> AsyncIterator[DedupFactory]:
    """Yield a :class:`DedupFactory` over stores built (and opened) by ``make``; close them
    all at exit. ``make`` may return the same store every time (one process)."""
    stores: list[DedupStore] = []

    async def factory() -> DedupStore:
        store = make()
        if store not in stores:
            stores.append(store)
            await store.open()
        return store

    try:
        yield factory
    finally:
        for store in reversed(stores):
            await store.close()


class DedupContract:
    """What every dedup store guarantees (``eventflow.ports.DedupStore``)."""

    @pytest.fixture
    async def dedup(self, dedup_factory: DedupFactory) -> DedupStore:
        """One store of the test's backend."""
        return await dedup_factory()

    async def test_mark_then_seen_per_group(self, dedup_factory: DedupFactory) -> None:
        """A marked pair is seen, by every store of the backend; groups are separate."""
        dedup, other = await dedup_factory(), await dedup_factory()
        g1, g2, m1, m2 = unique_name("g"), unique_name("g"), new_id(), new_id()
        assert not await dedup.seen(g1, m1)
        await dedup.mark(g1, m1)
        assert await dedup.seen(g1, m1)
        assert await other.seen(g1, m1)
        assert not await dedup.seen(g2, m1)
        assert not await dedup.seen(g1, m2)

    async def test_mark_is_idempotent_and_close_is_repeatable(self, dedup: DedupStore) -> None:
        """Marking twice is fine; closing twice too."""
        group, message = unique_name("g"), new_id()
        await dedup.mark(group, message)
        await dedup.mark(group, message)
        assert await dedup.seen(group, message)
        await dedup.close()
        await dedup.close()

    async def test_mark_new_says_whether_it_recorded_the_pair(
        self, dedup_factory: DedupFactory
    ) -> None:
        """True the first time, False for a pair recorded by any call (``mark`` included)
        or any store of the backend; per group."""
        dedup, other = await dedup_factory(), await dedup_factory()
        group, message, marked = unique_name("g"), new_id(), new_id()
        assert await dedup.mark_new(group, message)
        assert await dedup.seen(group, message)
        assert not await dedup.mark_new(group, message)
        assert not await other.mark_new(group, message)
        assert await other.mark_new(unique_name("g"), message)
        await dedup.mark(group, marked)
        assert not await other.mark_new(group, marked)

    async def test_a_cancellation_is_recorded_with_its_compensation(
        self, dedup_factory: DedupFactory
    ) -> None:
        """``mark_new(cancelled_by=...)`` records who cancelled the pair, for every store of
        the backend; the first record of a pair is kept; a plain record has none."""
        dedup, other = await dedup_factory(), await dedup_factory()
        group, command, compensation, handled = unique_name("g"), new_id(), new_id(), new_id()
        assert await dedup.cancelled_by(group, command) is None  # not recorded
        assert await dedup.mark_new(group, command, cancelled_by=compensation)
        assert await other.seen(group, command)  # skipped like a handled message
        assert await dedup.cancelled_by(group, command) == compensation
        assert await other.cancelled_by(group, command) == compensation
        assert not await other.mark_new(group, command, cancelled_by=new_id())
        await other.mark(group, command)
        assert await dedup.cancelled_by(group, command) == compensation  # not replaced
        assert await dedup.cancelled_by(unique_name("g"), command) is None  # per group
        await dedup.mark(group, handled)
        assert await other.cancelled_by(group, handled) is None
        assert not await dedup.mark_new(group, handled, cancelled_by=compensation)
        assert await other.cancelled_by(group, handled) is None

    async def test_of_concurrent_mark_new_calls_exactly_one_records(
        self, dedup_factory: DedupFactory
    ) -> None:
        """Calls for one pair at once, from two stores of the backend (two processes): one
        returns True, and its ``cancelled_by`` is the one recorded."""
        stores = [await dedup_factory(), await dedup_factory()]
        for _ in range(5):
            group, message = unique_name("g"), new_id()
            by = [new_id() for _ in range(8)]
            won = await asyncio.gather(
                *(
                    stores[n % 2].mark_new(group, message, cancelled_by=by[n])
                    for n in range(len(by))
                )
            )
            assert sum(won) == 1, won
            assert await stores[1].cancelled_by(group, message) == by[won.index(True)]

    async def test_seen_many_answers_as_seen_does_in_one_call(
        self, dedup_factory: DedupFactory
    ) -> None:
        """``seen_many`` returns the ids ``seen`` says are recorded (handled or cancelled),
        by any store of the backend, per group; repeated and unknown ids, and none at all,
        are fine; a batch past SQLite's usual statement sizes too."""
        dedup, other = await dedup_factory(), await dedup_factory()
        group = unique_name("g")
        handled, cancelled, new = new_id(), new_id(), new_id()
        assert await dedup.seen_many(group, []) == set()
        assert await dedup.seen_many(group, [handled, new]) == set()
        await dedup.mark(group, handled)
        assert await other.mark_new(group, cancelled, cancelled_by=new_id())
        ids = [new, handled, cancelled, handled]
        assert await dedup.seen_many(group, ids) == {handled, cancelled}
        assert await other.seen_many(group, ids) == {handled, cancelled}
        assert await dedup.seen_many(unique_name("g"), ids) == set()
        many = [new_id() for _ in range(1200)]
        for message in many[::7]:
            await other.mark(group, message)
        assert await dedup.seen_many(group, [*many, handled]) == {*many[::7], handled}
