"""The broker contract's settling and lifecycle tests: ack, redelivery, ``nack`` (with and
without a delay), ``release``, ``in_progress``, ``url`` and closing."""

from __future__ import annotations

import asyncio
from urllib.parse import urlsplit

import pytest

from ...errors import BrokerError
from ...ports import Delivery
from .support import BrokerContractBase, BrokerFactory, _texts, collect, drain, unique_name

__all__ = ["RedeliveryContract"]


class RedeliveryContract(BrokerContractBase):
    """Settling deliveries (ack, nack, release, in_progress), redelivery and closing."""

    # -- acknowledgement and redelivery ------------------------------------------------------

    async def test_unacked_delivery_is_redelivered_after_close(
        self, broker_factory: BrokerFactory
    ) -> None:
        """Deliveries left unacked when a subscription closes go to another member, in order."""
        publisher = await broker_factory()
        topic, group = f"{unique_name()}.redeliver", unique_name("g")
        first = await (await broker_factory()).subscribe(topic, group=group)
        for i in range(3):
            await publisher.publish(topic, f"m{i}".encode(), key="k")
        held = await collect(first, 3, timeout=self.timeout, ack=False)
        assert [d.delivery_count for d in held] == [1, 1, 1]
        second = await (await broker_factory()).subscribe(topic, group=group)
        await first.close()
        again = await collect(second, 3, timeout=self.timeout)
        assert _texts(again) == ["m0", "m1", "m2"]
        assert all(d.delivery_count >= 2 for d in again), [d.delivery_count for d in again]
        assert await drain(second, self.quiet_period) == []

    async def test_unacked_delivery_is_redelivered_after_broker_close(
        self, broker_factory: BrokerFactory
    ) -> None:
        """Closing a broker (a process going away) gives its unacked deliveries back."""
        publisher = await broker_factory()
        topic, group = f"{unique_name()}.crash", unique_name("g")
        doomed = await broker_factory()
        first = await doomed.subscribe(topic, group=group)
        await publisher.publish(topic, b"m0", key="k")
        [held] = await collect(first, 1, timeout=self.timeout, ack=False)
        assert held.delivery_count == 1
        second = await (await broker_factory()).subscribe(topic, group=group)
        await doomed.close()
        [again] = await collect(second, 1, timeout=self.timeout)
        assert again.payload == b"m0"
        assert again.delivery_count >= 2

    async def test_acked_messages_are_never_redelivered(
        self, broker_factory: BrokerFactory
    ) -> None:
        """After close and resubscribe (same or new broker) only unacked messages come back."""
        publisher = await broker_factory()
        consumer = await broker_factory()
        topic, group = f"{unique_name()}.acked", unique_name("g")
        sub = await consumer.subscribe(topic, group=group)
        for i in range(6):
            await publisher.publish(topic, f"m{i}".encode(), key="k")
        got = await collect(sub, 6, timeout=self.timeout, ack=False)
        assert _texts(got) == [f"m{i}" for i in range(6)]
        for d in got[:3]:
            await d.ack()
        await sub.close()

        sub = await consumer.subscribe(topic, group=group)
        again = await collect(sub, 3, timeout=self.timeout)
        assert _texts(again) == ["m3", "m4", "m5"]
        assert await drain(sub, self.quiet_period) == []
        await sub.close()

        fresh = await (await broker_factory()).subscribe(topic, group=group)
        assert await drain(fresh, self.quiet_period) == []

    async def test_nack_redelivers_at_once(self, broker_factory: BrokerFactory) -> None:
        """``nack()`` gives the message back before the key's later messages."""
        broker = await broker_factory()
        topic, group = f"{unique_name()}.nack", unique_name("g")
        sub = await broker.subscribe(topic, group=group)
        await broker.publish(topic, b"m0", key="k")
        await broker.publish(topic, b"m1", key="k")
        [first] = await collect(sub, 1, timeout=self.timeout, ack=False, max_messages=1)
        assert first.payload == b"m0"
        await first.nack()
        got = await collect(sub, 2, timeout=self.timeout, max_messages=1)
        assert _texts(got) == ["m0", "m1"]
        assert got[0].delivery_count == 2
        assert got[1].delivery_count == 1

    async def test_nack_with_delay_redelivers_after_the_delay(
        self, broker_factory: BrokerFactory
    ) -> None:
        """``nack(delay)`` redelivers no sooner than about ``delay`` seconds later."""
        broker = await broker_factory()
        topic, group = f"{unique_name()}.later", unique_name("g")
        sub = await broker.subscribe(topic, group=group)
        await broker.publish(topic, b"m0", key="k")
        [first] = await collect(sub, 1, timeout=self.timeout, ack=False)
        loop = asyncio.get_running_loop()
        start = loop.time()
        await first.nack(self.nack_delay)
        [again] = await collect(sub, 1, timeout=self.nack_delay + self.timeout)
        elapsed = loop.time() - start
        assert again.payload == b"m0"
        assert again.delivery_count == 2
        assert self.nack_delay * 0.8 <= elapsed <= self.nack_delay + self.timeout

    async def test_nack_with_delay_keeps_key_order(self, broker_factory: BrokerFactory) -> None:
        """While a message waits out its ``nack(delay)``, later messages of its key wait too."""
        broker = await broker_factory()
        topic, group = f"{unique_name()}.ordernack", unique_name("g")
        sub = await broker.subscribe(topic, group=group)
        for i in range(3):
            await broker.publish(topic, f"m{i}".encode(), key="k")
        [first] = await collect(sub, 1, timeout=self.timeout, ack=False, max_messages=1)
        assert first.payload == b"m0"
        await first.nack(self.nack_delay)
        got = await collect(sub, 3, timeout=self.nack_delay + self.timeout, max_messages=1)
        assert _texts(got) == ["m0", "m1", "m2"]
        assert [d.delivery_count for d in got] == [2, 1, 1]

    async def test_nack_with_delay_holds_back_only_its_key(
        self, broker_factory: BrokerFactory
    ) -> None:
        """While a message waits out its ``nack(delay)``, the messages of other keys keep
        coming, those of its partition included; its key's later message still waits."""
        broker = await broker_factory()
        topic, group = f"{unique_name()}.otherkeys", unique_name("g")
        sub = await broker.subscribe(topic, group=group)
        await broker.publish(topic, b"a0", key="a")
        await broker.publish(topic, b"a1", key="a")
        [first] = await collect(sub, 1, timeout=self.timeout, ack=False, max_messages=1)
        assert first.payload == b"a0"
        await first.nack(600.0)  # far longer than the test: it never comes back meanwhile
        # Enough keys that some share the partition of "a" on any partitioning.
        others = {f"o{i}".encode() for i in range(200)}
        for i in range(200):
            await broker.publish(topic, f"o{i}".encode(), key=f"key-{i}")
        got = await collect(sub, len(others), timeout=self.timeout, max_messages=50)
        assert {d.payload for d in got} == others
        assert await drain(sub, self.quiet_period) == []  # a1 waits behind a0

    async def test_pending_nack_of_a_closed_member_does_not_duplicate(
        self, broker_factory: BrokerFactory
    ) -> None:
        """A member that nacks with a delay and leaves causes one redelivery, not two."""
        publisher = await broker_factory()
        topic, group = f"{unique_name()}.leave", unique_name("g")
        first = await (await broker_factory()).subscribe(topic, group=group)
        await publisher.publish(topic, b"m0", key="k")
        [held] = await collect(first, 1, timeout=self.timeout, ack=False)
        await held.nack(self.nack_delay)
        second = await (await broker_factory()).subscribe(topic, group=group)
        await first.close()
        [again] = await collect(second, 1, timeout=self.nack_delay + self.timeout, ack=False)
        assert again.payload == b"m0"
        # while `second` holds it unacked, past the nack delay, it must not come again
        extra = await drain(second, self.nack_delay + self.quiet_period, ack=False)
        assert [(d.payload, d.delivery_count) for d in extra] == []
        await again.ack()

    async def test_delayed_redelivery_wakes_another_members_waiting_fetch(
        self, broker_factory: BrokerFactory
    ) -> None:
        """A message nacked with a delay by a member that then left reaches the member now
        waiting in ``fetch`` when the delay ends, not when that fetch times out."""
        publisher = await broker_factory()
        topic, group = f"{unique_name()}.wake", unique_name("g")
        first = await (await broker_factory()).subscribe(topic, group=group)
        await publisher.publish(topic, b"m0", key="k")
        [held] = await collect(first, 1, timeout=self.timeout, ack=False)
        loop = asyncio.get_running_loop()
        start = loop.time()
        await held.nack(self.nack_delay)
        second = await (await broker_factory()).subscribe(topic, group=group)
        await first.close()
        got: list[Delivery] = []
        wait = self.nack_delay + self.timeout
        while not got and loop.time() - start < wait:  # fetch may return early, empty
            got = list(await second.fetch(1, wait))
        elapsed = loop.time() - start
        assert [d.payload for d in got] == [b"m0"]
        assert elapsed < self.nack_delay + self.timeout / 2, f"redelivered after {elapsed:.1f}s"
        await got[0].ack()

    async def test_release_gives_back_without_counting(self, broker_factory: BrokerFactory) -> None:
        """``release()`` redelivers at once, ahead of the key's later messages, with the same
        ``delivery_count``: no handler saw it."""
        broker = await broker_factory()
        topic, group = f"{unique_name()}.release", unique_name("g")
        sub = await broker.subscribe(topic, group=group)
        await broker.publish(topic, b"m0", key="k")
        await broker.publish(topic, b"m1", key="k")
        [first] = await collect(sub, 1, timeout=self.timeout, ack=False, max_messages=1)
        assert (first.payload, first.delivery_count) == (b"m0", 1)
        await first.release()
        got = await collect(sub, 2, timeout=self.timeout, max_messages=1)
        assert [(d.payload, d.delivery_count) for d in got] == [(b"m0", 1), (b"m1", 1)]
        assert await drain(sub, self.quiet_period) == []

    async def test_a_delivery_settles_only_once(self, broker_factory: BrokerFactory) -> None:
        """After ack, nack or release, further settling calls on that delivery change nothing:
        no extra redelivery, and ``delivery_count`` keeps counting real deliveries."""
        broker = await broker_factory()
        topic, group = f"{unique_name()}.once", unique_name("g")
        sub = await broker.subscribe(topic, group=group)

        await broker.publish(topic, b"released twice", key="a")
        [d] = await collect(sub, 1, timeout=self.timeout, ack=False)
        await d.release()
        await d.release()
        [again] = await collect(sub, 1, timeout=self.timeout)
        assert (again.payload, again.delivery_count) == (b"released twice", 1)

        await broker.publish(topic, b"nacked then released", key="b")
        [d] = await collect(sub, 1, timeout=self.timeout, ack=False)
        await d.nack()
        await d.release()
        [again] = await collect(sub, 1, timeout=self.timeout)
        assert (again.payload, again.delivery_count) == (b"nacked then released", 2)

        await broker.publish(topic, b"acked then given back", key="c")
        [d] = await collect(sub, 1, timeout=self.timeout, ack=False)
        await d.ack()
        await d.release()
        await d.nack()
        assert await drain(sub, self.quiet_period) == []

    async def test_broker_url_names_the_broker(self, broker_factory: BrokerFactory) -> None:
        """``broker.url`` is a URL with a scheme and no password."""
        broker = await broker_factory()
        parts = urlsplit(broker.url)
        assert parts.scheme
        assert parts.password is None

    async def test_in_progress_then_ack(self, broker_factory: BrokerFactory) -> None:
        """``in_progress()`` is accepted and the acked message is not redelivered."""
        broker = await broker_factory()
        topic, group = f"{unique_name()}.slow", unique_name("g")
        sub = await broker.subscribe(topic, group=group)
        await broker.publish(topic, b"m0")
        [d] = await collect(sub, 1, timeout=self.timeout, ack=False)
        await d.in_progress()
        await d.ack()
        assert await drain(sub, self.quiet_period) == []

    # -- lifecycle ---------------------------------------------------------------------------

    async def test_close_is_idempotent(self, broker_factory: BrokerFactory) -> None:
        """start/close can be repeated; a closed subscription or broker refuses further use."""
        broker = await broker_factory()
        await broker.start()  # already started by the factory
        topic = f"{unique_name()}.close"
        sub = await broker.subscribe(topic, group=unique_name("g"))
        await sub.close()
        await sub.close()
        with pytest.raises(BrokerError):
            await sub.fetch(1, 0.1)
        other = await broker.subscribe(topic, group=unique_name("g"))
        await broker.close()
        await broker.close()
        with pytest.raises(BrokerError):
            await other.fetch(1, 0.1)  # closing the broker closed its subscriptions
        await other.close()
        with pytest.raises(BrokerError):
            await broker.publish(topic, b"late")
