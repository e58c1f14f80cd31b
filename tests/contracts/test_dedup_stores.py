"""The DedupStore port on every adapter: memory, SQLite, PostgreSQL and Redis (the contract of
``eventflow.testing.dedup_contract``), and the consumer's use of a dedup store."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path

import pytest

from eventflow import App, Event, StoreError, subscribe
from eventflow.adapters.redis import RedisDedupStore
from eventflow.ports import DedupStore, Store
from eventflow.stores import dedup_for, store_for
from eventflow.testing.broker_contract import SilentServer
from eventflow.testing.dedup_contract import DedupContract, DedupFactory, dedup_pool
from eventflow.testing.postgres import isolated_schema, postgres_url
from eventflow.testing.redis import redis_url
from eventflow.testing.services import free_port
from eventflow.testing.store_contract import store_pool

Wait = Callable[..., Awaitable[None]]


class RedisDupe(Event, type="contract.redis.dupe"):
    """A test event."""

    n: int


class TestMemoryDedup(DedupContract):
    """The memory store's dedup: one process, so every "store" is the same one."""

    @pytest.fixture
    async def dedup_factory(self) -> AsyncIterator[DedupFactory]:
        store: Store = store_for("memory://")
        await store.open()
        async with dedup_pool(lambda: store.dedup) as factory:
            yield factory
        await store.close()


class TestSqliteDedup(DedupContract):
    """The ``ef_dedup`` table of one SQLite file, opened by a store per "process"."""

    @pytest.fixture
    async def dedup_factory(self, tmp_path: Path) -> AsyncIterator[DedupFactory]:
        url = f"sqlite:///{tmp_path / 'd.db'}"
        async with store_pool(lambda: store_for(url)) as stores:

            async def factory() -> DedupStore:
                return (await stores()).dedup

            yield factory


class TestPostgresDedup(DedupContract):
    """The ``ef_dedup`` table of a schema of the test's own, one store per "process"."""

    @pytest.fixture
    async def dedup_factory(self) -> AsyncIterator[DedupFactory]:
        async with (
            isolated_schema(postgres_url()) as url,
            store_pool(lambda: store_for(url)) as stores,
        ):

            async def factory() -> DedupStore:
                return (await stores()).dedup

            yield factory


class TestRedisDedup(DedupContract):
    """Redis, keys under a prefix of the test's own, one client per "process"."""

    @pytest.fixture
    async def dedup_factory(self) -> AsyncIterator[DedupFactory]:
        url = f"{redis_url()}?prefix=t{uuid.uuid4().hex}&retention=60"
        async with dedup_pool(lambda: dedup_for(url)) as factory:
            yield factory


async def test_redis_entries_expire(tmp_path: Path) -> None:
    store = RedisDedupStore.from_url(f"{redis_url()}?prefix=t{uuid.uuid4().hex}&retention=1")
    try:
        await store.mark("g", "m")
        client = store._redis()
        ttl = await client.ttl(store._key("g", "m"))
        assert 0 < ttl <= 1
    finally:
        await store.close()


def test_redis_url_options_are_checked() -> None:
    with pytest.raises(Exception, match="unknown option 'retension'"):
        RedisDedupStore.from_url("redis://127.0.0.1:6379/0?retension=5")
    with pytest.raises(Exception, match="unsupported dedup URL"):
        dedup_for("http://x")


async def test_app_with_redis_dedup_skips_duplicates(broker_url: str, waiter: Wait) -> None:
    calls: list[int] = []

    @subscribe("contract.redis.dupe", group="r")
    async def handle(event: RedisDupe) -> None:
        calls.append(event.n)

    url = f"{redis_url()}?prefix=t{uuid.uuid4().hex}&retention=60"
    async with App("redis-dedup", broker=broker_url, dedup=url, handlers=[handle]) as app:
        env = await app.publish(RedisDupe(n=1), key="k")
        await app.publish(env)
        await app.publish(env)
        # Wait for each copy's outcome, not its arrival: "received" counts a copy before
        # its dedup check, so the last one may still be checking when it reads 3.
        stats = app.stats
        await waiter(
            lambda: (
                stats()["r:contract.redis.dupe"]["handled"]
                + stats()["r:contract.redis.dupe"]["duplicates"]
                == 3
            ),
            what="an outcome for each of the three copies",
        )
        assert calls == [1]
        assert app.stats()["r:contract.redis.dupe"]["duplicates"] == 2


async def test_memory_dedup_forgets_the_oldest_past_its_capacity() -> None:
    """Bounded: past ``capacity`` pairs the oldest is forgotten, one per new pair (a
    re-mark neither moves a pair nor counts twice), for many rounds of eviction."""
    from eventflow.adapters.memory.store import MemoryDedupStore

    dedup = MemoryDedupStore(capacity=100)
    for n in range(100):
        await dedup.mark("g", f"m-{n}")
    await dedup.mark("g", "m-0")  # already there: still the oldest
    for n in range(100, 10_100):
        await dedup.mark("g", f"m-{n}")
    assert len(dedup) == 100
    assert not await dedup.seen("g", "m-0")
    assert not await dedup.seen("g", "m-9999")
    assert all([await dedup.seen("g", f"m-{n}") for n in range(10_000, 10_100)])


class _CountingDedup:
    """Counts the awaited calls of the store it forwards to (through ``__getattr__``)."""

    def __init__(self, inner: DedupStore) -> None:
        self.inner = inner
        self.calls: list[str] = []

    async def seen(self, group: str, message_id: str) -> bool:
        self.calls.append("seen")
        return await self.inner.seen(group, message_id)

    async def mark_new(
        self, group: str, message_id: str, *, cancelled_by: str | None = None
    ) -> bool:
        self.calls.append("mark_new")
        return await self.inner.mark_new(group, message_id, cancelled_by=cancelled_by)

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)


async def test_the_consumer_keeps_a_dedup_stores_own_seen_and_mark(waiter: Wait) -> None:
    """The consumer asks the dedup store it is given through ``seen``/``mark_new``: a subclass
    overriding them, a forwarding wrapper, and a store swapped in later; an app's own empty
    memory store is used (it has no length yet, and is still the one given)."""
    from eventflow.adapters.memory.store import MemoryDedupStore

    class Logging(MemoryDedupStore):
        calls: list[str]

        async def seen(self, group: str, message_id: str) -> bool:
            self.calls.append("seen")
            return await super().seen(group, message_id)

        async def mark_new(
            self, group: str, message_id: str, *, cancelled_by: str | None = None
        ) -> bool:
            self.calls.append("mark_new")
            return await super().mark_new(group, message_id, cancelled_by=cancelled_by)

    @subscribe("contract.redis.dupe", group="g")
    async def handle(event: RedisDupe) -> None:
        pass

    logging = Logging()
    logging.calls = []
    wrapper = _CountingDedup(MemoryDedupStore())
    for store in (logging, wrapper):
        async with App(
            "a", broker=f"memory://dd-{uuid.uuid4().hex}", dedup=store, handlers=[handle]
        ) as app:
            assert app.dedup is store
            await app.publish(RedisDupe(n=1))
            await waiter(lambda: app.stats()["g:contract.redis.dupe"]["handled"] == 1)
        assert store.calls == ["seen", "mark_new"]

    plain = MemoryDedupStore()
    async with App(
        "a", broker=f"memory://dd-{uuid.uuid4().hex}", dedup=plain, handlers=[handle]
    ) as app:
        assert app.dedup is plain
        consumer = app.consumers[0]
        swapped = _CountingDedup(MemoryDedupStore())
        consumer.dedup = swapped
        await app.publish(RedisDupe(n=2))
        await waiter(lambda: app.stats()["g:contract.redis.dupe"]["handled"] == 1)
    assert swapped.calls == ["seen", "mark_new"]


@pytest.mark.parametrize("answers", [False, True], ids=["nothing-listens", "silent-server"])
async def test_an_unreachable_redis_fails_the_app_start_within_its_connect_timeout(
    answers: bool, broker_url: str
) -> None:
    """A dedup store that cannot be reached fails ``async with app`` at once, naming the
    URL (its password hidden), instead of giving every message back for ever."""
    async with contextlib.AsyncExitStack() as stack:
        silent = await stack.enter_async_context(SilentServer()) if answers else None
        port = silent.port if silent is not None else free_port()
        url = f"redis://:secret@127.0.0.1:{port}/0?connect_timeout=0.5&timeout=0.5"
        loop = asyncio.get_running_loop()
        began = loop.time()
        with pytest.raises(StoreError, match="cannot reach the Redis dedup store") as info:
            async with App("redis-down", broker=broker_url, dedup=url):
                pass
        assert loop.time() - began < 5
        assert "secret" not in str(info.value) and "127.0.0.1" in str(info.value)


def test_redis_options_are_typed() -> None:
    store = RedisDedupStore.from_url("redis://h:6379/1?retention=60&connect_timeout=2&timeout=3")
    assert (store.retention, store.connect_timeout, store.timeout) == (60, 2.0, 3.0)
    with pytest.raises(Exception, match="retention='soon'"):
        RedisDedupStore.from_url("redis://h:6379/1?retention=soon")


class _BatchEvent(Event, type="contract.dedup.batch"):
    """A test event."""

    n: int


async def test_a_fetched_batch_is_looked_up_at_once(
    broker_url: str, hub: object, waiter: Wait
) -> None:
    """A backlog fetched in batches is checked with ``seen_many`` (a batch per call, not a
    ``seen`` per message); copies within one batch are still handled once: the second copy
    is checked on its own after the first copy's outcome; a copy of a handled message is
    skipped on the batch's verdict."""
    from eventflow.adapters.memory.store import MemoryDedupStore

    class Counting(MemoryDedupStore):
        seen_calls = 0
        batches: list[int]

        async def seen(self, group: str, message_id: str) -> bool:
            self.seen_calls += 1
            return await super().seen(group, message_id)

        async def seen_many(self, group: str, message_ids: Sequence[str]) -> set[str]:
            self.batches.append(len(message_ids))
            return await super().seen_many(group, message_ids)

    calls: list[int] = []

    @subscribe("contract.dedup.batch", group="batch", concurrency=4, start="earliest")
    async def handle(event: _BatchEvent) -> None:
        calls.append(event.n)

    store = Counting()
    store.batches = []
    await store.mark("batch", "handled-before")  # a copy of it comes in the backlog
    async with App("pub", broker=broker_url) as publisher:
        sent = [await publisher.publish(_BatchEvent(n=n), key=f"k{n % 5}") for n in range(40)]
        for env in sent[:3]:
            await publisher.publish(env)  # copies, in the same backlog
        before = sent[3].model_copy(update={"id": "handled-before"})
        await publisher.publish(before)
    async with App("batch", broker=broker_url, dedup=store, handlers=[handle]) as app:
        stats = app.stats
        await waiter(
            lambda: (
                stats()["batch:contract.dedup.batch"]["handled"] == 40
                and stats()["batch:contract.dedup.batch"]["duplicates"] == 4
            ),
            what="40 handled, 4 copies skipped",
        )
    assert sorted(calls) == list(range(40))
    assert sum(store.batches) >= 40 and max(store.batches) > 1
    assert store.seen_calls <= 3 + store.batches.count(1), (store.seen_calls, store.batches)
