"""Failures around the handler do not stop an app, and concurrent copies of one message
commit their effects once (regressions found in review)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from eventflow import App, Context, Event, RetryPolicy, subscribe
from eventflow.adapters.sqlite import SqliteStore
from eventflow.events import to_envelope
from eventflow.stores import store_for
from eventflow.testing.postgres import isolated_schema, postgres_url

Wait = Callable[..., Awaitable[None]]


class ResPing(Event, type="it.res.ping"):
    """A test event."""

    n: int


class _FlakyDedup:
    """A dedup store whose second check fails like a dropped connection."""

    def __init__(self) -> None:
        self.calls = 0
        self.marked: set[tuple[str, str]] = set()

    async def seen(self, group: str, message_id: str) -> bool:
        self.calls += 1
        if self.calls == 2:
            raise OSError("connection reset by peer")
        return (group, message_id) in self.marked

    async def mark(self, group: str, message_id: str) -> None:
        await self.mark_new(group, message_id)

    async def mark_new(
        self, group: str, message_id: str, *, cancelled_by: str | None = None
    ) -> bool:
        new = (group, message_id) not in self.marked
        self.marked.add((group, message_id))
        return new

    async def cancelled_by(self, group: str, message_id: str) -> str | None:
        return None

    async def open(self) -> None:
        return None

    async def close(self) -> None:
        return None


async def test_a_store_error_around_the_handler_does_not_stop_the_app(
    broker_url: str, waiter: Wait
) -> None:
    handled: list[int] = []

    @subscribe("it.res.ping", group="g", concurrency=1)
    async def handle(event: ResPing) -> None:
        handled.append(event.n)

    app = App("it-res", broker=broker_url, handlers=[handle], dedup=_FlakyDedup())
    async with app:
        for n in range(5):
            await app.publish(ResPing(n=n), key="k")
        await waiter(lambda: len(handled) == 5, what="every message, the failed one again")
        assert handled == [0, 1, 2, 3, 4]  # redelivered in key order after the failure


async def test_a_bad_outgoing_topic_is_dead_lettered_not_fatal(
    broker_url: str, waiter: Wait
) -> None:
    @subscribe("it.res.ping", group="g", retry=RetryPolicy(2, initial_delay=0.01))
    async def handle(event: ResPing, ctx: Context) -> None:
        await ctx.publish(ResPing(n=event.n + 1), topic="orders.*")

    app = App("it-res-topic", broker=broker_url, handlers=[handle])
    async with app:
        await app.publish(ResPing(n=1))
        await waiter(lambda: app.stats()["g:it.res.ping"]["dead_lettered"] == 1)
        [letter] = await app.dead_letters.list()
        assert "invalid topic 'orders.*'" in letter.error


@pytest.fixture(params=["sqlite", "postgres"])
async def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'res.db'}"
        return
    async with isolated_schema(postgres_url()) as url:
        yield url


async def test_concurrent_copies_commit_their_effects_once(
    store_url: str, broker_url: str, waiter: Wait
) -> None:
    @subscribe("it.res.ping", group="ledger")
    async def book(event: ResPing, ctx: Context) -> None:
        await asyncio.sleep(0.2)  # slow: the copy is picked up by the other member meanwhile
        async with ctx.transaction() as tx:
            await tx.execute("INSERT INTO it_res_ledger (n) VALUES ($1)", event.n)

    store = store_for(store_url)
    a = App("it-res-a", broker=broker_url, store=store, handlers=[book])
    b = App("it-res-b", broker=broker_url, store=store_url, handlers=[book])
    async with a, b:
        async with a.store.transaction() as tx:
            await tx.execute("CREATE TABLE IF NOT EXISTS it_res_ledger (n INTEGER)")
        env = to_envelope(ResPing(n=1), source="t")
        await a.publish(env)  # keyless: spread over the members' partitions
        await a.publish(env)  # the same id again, handled at the same time by the other

        def totals(field: str) -> int:
            return sum(app.stats()["ledger:it.res.ping"][field] for app in (a, b))

        await waiter(lambda: totals("received") == 2)
        await waiter(lambda: totals("handled") + totals("duplicates") == 2)
        async with a.store.transaction() as tx:
            rows = await tx.fetch("SELECT COUNT(*) FROM it_res_ledger")
        assert rows[0][0] == 1
        assert totals("duplicates") == 1


async def test_sqlite_transaction_cancelled_while_beginning_leaves_the_store_usable(
    tmp_path: Path,
) -> None:
    path = str(tmp_path / "busy.db")
    store = SqliteStore(path)
    other = SqliteStore(path)
    await store.open()
    await other.open()
    try:
        # Another connection holds the write lock, so BEGIN IMMEDIATE waits; cancel it.
        async with other.transaction() as tx:
            await tx.execute("CREATE TABLE IF NOT EXISTS t (x INTEGER)")

            async def begin() -> None:
                async with store.transaction():
                    pass

            task = asyncio.create_task(begin())
            await asyncio.sleep(0.2)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        assert await store.append(f"s-{uuid.uuid4().hex}", [ResPing(n=1)]) == 1
    finally:
        await store.close()
        await other.close()


class _Paused(Event, type="it.resilience.paused"):
    """A message of the one key whose worker pauses."""

    n: int


async def test_shutdown_during_a_pause_does_not_count_unseen_messages(
    monkeypatch: pytest.MonkeyPatch, waiter: Wait
) -> None:
    """A worker pauses after an infrastructure failure (the dedup store fails once) while its
    key's given-back message comes back into the lane; the app stops during the pause. No
    handler saw that message, so it is released, not counted, and the failure around the
    handler spent no attempt: every message is handled at attempt 1, none dead-lettered."""
    from eventflow.adapters.memory import broker as memory_broker
    from eventflow.adapters.memory.groups import MemoryDelivery, MemorySubscription

    name = f"it-pause-{uuid.uuid4().hex[:6]}"
    seen: list[tuple[int, int]] = []

    @subscribe("it.resilience.paused", group="g", concurrency=2, retry=2)
    async def handle(event: _Paused, ctx: Context) -> None:
        seen.append((event.n, ctx.attempt))

    release = MemoryDelivery.release

    async def slow_release(self: Any) -> None:
        await asyncio.sleep(0.03)  # a broker round trip
        await release(self)

    monkeypatch.setattr(MemoryDelivery, "release", slow_release)
    # Offsets given back, and those fetched again after being given back: the lane of the
    # pausing worker's key fills again while it pauses.
    given_back: set[int] = set()
    fetched_again: set[int] = set()
    fetch = MemorySubscription.fetch

    async def recording_fetch(self: Any, max_messages: int, timeout: float) -> Any:
        out = await fetch(self, max_messages, timeout)
        fetched_again.update(d.offset for d in out if d.offset in given_back)
        return out

    releasing = 0  # releases under way: none once the worker gave its lane back

    async def recording_release(self: Any) -> None:
        nonlocal releasing
        releasing += 1
        try:
            await slow_release(self)
        finally:
            releasing -= 1
        given_back.add(self.offset)

    monkeypatch.setattr(MemoryDelivery, "release", recording_release)
    monkeypatch.setattr(MemorySubscription, "fetch", recording_fetch)
    keep = memory_broker.MemoryBroker(memory_broker.MemoryBrokerConfig(name=name))
    await keep.start()  # the hub outlives the first app
    try:
        app = App("a", broker=f"memory://{name}", handlers=[handle], grace_period=1)
        await app.start()
        consumer = app.consumers[0]
        # Fail the dedup store's check once.
        real_seen = consumer.dedup.seen
        failed: list[bool] = []

        async def seen_once_failing(group: str, message_id: str) -> bool:
            if not failed:
                failed.append(True)
                raise ConnectionError("dedup store down (once)")
            return await real_seen(group, message_id)

        async def no_batch_lookups(group: str, message_ids: Any) -> set[str]:
            raise ConnectionError("no batch lookups: each message is checked by seen")

        monkeypatch.setattr(consumer.dedup, "seen", seen_once_failing)
        monkeypatch.setattr(consumer.dedup, "seen_many", no_batch_lookups)
        for n in range(10):
            await app.publish(_Paused(n=n), key="K")
        await waiter(lambda: bool(failed), what="the dedup store's one failure")
        seen_before_the_pause = list(seen)
        await waiter(
            lambda: bool(given_back) and not releasing and fetched_again == given_back,
            what="the lane given back, then fetched again while its worker pauses",
        )
        await app.stop()
        # The stop came during the pause: no message of the paused key was handled since.
        assert seen == seen_before_the_pause
        again = App("a", broker=f"memory://{name}", handlers=[handle], grace_period=1)
        async with again:
            await waiter(lambda: {n for n, _ in seen} == set(range(10)), what="every message")
            letters = await again.dead_letters.list()
            # Released at the stop, not left out to a member that left (counted as a start).
            assert again.stats()["g:it.resilience.paused"]["redelivered"] == 0
    finally:
        await keep.close()
    assert letters == []
    assert sorted(seen) == [(n, 1) for n in range(10)]
