"""The store contract's ``subscribe`` tests: catch-up, live following, several subscribers
and clean cancellation."""

from __future__ import annotations

import asyncio

from ...ports import RecordedEvent, Store
from .support import (
    Follower,
    StoreContractBase,
    StoreFactory,
    _stream,
    _versions,
    following,
    happened,
    read_all,
    read_stream,
)

__all__ = ["SubscribeContract"]


class SubscribeContract(StoreContractBase):
    """Following the log with ``subscribe``: catch-up, live appends, cancellation."""

    # -- subscribe ---------------------------------------------------------------------------

    async def test_subscribe_catches_up_then_follows_live_appends(self, store: Store) -> None:
        """A subscriber gets the stored events, then events appended (by another task)
        after it started, each once, in position order."""
        a, b = _stream(), _stream()
        await store.append(a, happened(2))
        await store.append(b, happened(1))
        async with following(store) as follower:
            await follower.wait_for(3, timeout=self.timeout)
            assert follower.positions() == [1, 2, 3]

            async def writer() -> None:
                await store.append(a, happened(1, start=2))
                await store.append(b, happened(2, start=1))
                await store.append(a, happened(1, start=3))

            async with asyncio.TaskGroup() as tg:
                tg.create_task(writer())
            await follower.wait_for(7, timeout=self.timeout)
            # one more live append, after the subscriber has gone idle
            await store.append(b, happened(1, start=3))
            await follower.wait_for(8, timeout=self.timeout)
        assert follower.records == await read_all(store)
        assert follower.positions() == list(range(1, 9))

    async def test_subscribe_after_a_position(self, store: Store) -> None:
        """``after`` skips what came before; ``after=last_position`` gets only new events."""
        s = _stream()
        await store.append(s, happened(5))
        last = await store.last_position()
        async with following(store, after=3) as middle, following(store, after=last) as tail:
            await middle.wait_for(2, timeout=self.timeout)
            assert middle.positions() == [4, 5]
            await store.append(s, happened(2, start=5))
            await middle.wait_for(4, timeout=self.timeout)
            await tail.wait_for(2, timeout=self.timeout)
        assert middle.positions() == [4, 5, 6, 7]
        assert tail.positions() == [6, 7]
        assert _versions(tail.records) == [6, 7]

    async def test_subscribe_on_an_empty_store_waits_for_the_first_event(
        self, store: Store
    ) -> None:
        """A subscriber started before anything was stored gets the first event."""
        async with following(store) as follower:
            s = _stream()
            await store.append(s, happened(1))
            await follower.wait_for(1, timeout=self.timeout)
        assert follower.positions() == [1]
        assert follower.records[0].stream_id == s

    async def test_two_subscribers_see_the_same_order(self, store: Store) -> None:
        """Subscribers started at different times deliver the same records in one order."""
        streams = [_stream() for _ in range(3)]
        await store.append(streams[0], happened(2))
        async with following(store) as early:
            for i in range(6):
                await store.append(streams[i % 3], happened(i % 2 + 1))
            async with following(store) as late:
                await store.append(streams[1], happened(1))
                total = await store.last_position()
                await early.wait_for(total, timeout=self.timeout)
                await late.wait_for(total, timeout=self.timeout)
        assert early.records == late.records
        assert early.positions() == list(range(1, total + 1))

    async def test_subscriber_sees_appends_from_another_connection(
        self, store_factory: StoreFactory
    ) -> None:
        """A subscriber on one store follows events appended through another store on the
        same backend (another process)."""
        reader, writer = await store_factory(), await store_factory()
        s = _stream()
        await writer.append(s, happened(1))
        async with following(reader) as follower:
            await follower.wait_for(1, timeout=self.timeout)
            await writer.append(s, happened(2, start=1))
            await follower.wait_for(3, timeout=self.timeout)
        assert follower.positions() == [1, 2, 3]
        assert _versions(follower.records) == [1, 2, 3]

    async def test_cancelling_a_subscriber_stops_it_cleanly(self, store: Store) -> None:
        """Cancelling the task iterating ``subscribe`` ends it promptly, whether it is
        waiting for events or not, and releases what it held: many cancelled subscribers
        later, the store still appends, reads and serves new subscribers."""
        s = _stream()
        await store.append(s, happened(1))
        for _ in range(20):
            follower = Follower(store, 0)
            task = asyncio.create_task(follower.run())
            follower.task = task
            await follower.wait_for(1, timeout=self.timeout)  # now waiting for more
            task.cancel()
            [outcome] = await asyncio.wait_for(
                asyncio.gather(task, return_exceptions=True), self.timeout
            )
            assert isinstance(outcome, asyncio.CancelledError)
            assert task.cancelled()
        async with asyncio.timeout(self.timeout):
            await store.append(s, happened(1, start=1))
            assert len(await read_stream(store, s)) == 2
            async with following(store) as follower:
                await follower.wait_for(2, timeout=self.timeout)
        assert follower.positions() == [1, 2]

    async def test_breaking_out_of_subscribe_and_closing_it(self, store: Store) -> None:
        """A consumer may stop iterating and close the iterator (``aclose``) when done."""
        s = _stream()
        await store.append(s, happened(3))
        iterator = store.subscribe(after=1)
        got: list[RecordedEvent] = []
        async with asyncio.timeout(self.timeout):
            async for rec in iterator:
                got.append(rec)
                if len(got) == 2:
                    break
        aclose = getattr(iterator, "aclose", None)
        if aclose is not None:
            await aclose()
        assert [rec.position for rec in got] == [2, 3]
