"""The broker contract's delivery tests: publish and subscribe round trips, ``fetch`` and
topic patterns."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

import orjson
import pytest

from ...errors import BrokerError, ConfigurationError, MessageRefusedError
from ...headers import MESSAGE_ID_HEADER, SEND_ID_HEADER
from ...ports import Broker, Delivery, Subscription
from .support import BrokerContractBase, BrokerFactory, _texts, collect, drain, unique_name

__all__ = ["DeliveryContract"]


class DeliveryContract(BrokerContractBase):
    """Publish and subscribe: what arrives, ``fetch`` and topic patterns."""

    # -- publish and subscribe ---------------------------------------------------------------

    async def test_round_trip_preserves_payload_key_and_headers(
        self, broker_factory: BrokerFactory
    ) -> None:
        """Payload bytes, topic, key and headers arrive unchanged; metadata is a mapping."""
        broker = await broker_factory()
        topic, group = f"{unique_name()}.order.placed", unique_name("g")
        sub = await broker.subscribe(topic, group=group)
        headers = {
            "traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "content-type": "application/json",
            "x-note": "a value with spaces = and ;",
        }
        payload = b'{"order_id": "o-1", "qty": 2}'
        await broker.publish(topic, payload, key="o-1", headers=headers)

        [d] = await collect(sub, 1, timeout=self.timeout, ack=False)
        assert d.topic == topic
        assert d.payload == payload
        assert isinstance(d.payload, bytes)
        assert d.key == "o-1"
        assert dict(d.headers) == headers
        assert d.delivery_count == 1
        assert isinstance(d.metadata, Mapping)
        assert isinstance(d, Delivery)
        assert isinstance(sub, Subscription)
        assert isinstance(broker, Broker)
        assert sub.pattern == topic
        assert sub.group == group
        await d.ack()
        assert await drain(sub, self.quiet_period) == []

    async def test_message_without_key_or_headers(self, broker_factory: BrokerFactory) -> None:
        """A keyless message arrives with ``key`` None and empty headers."""
        broker = await broker_factory()
        topic, group = f"{unique_name()}.ping", unique_name("g")
        sub = await broker.subscribe(topic, group=group)
        await broker.publish(topic, b"ping")
        [d] = await collect(sub, 1, timeout=self.timeout)
        assert d.payload == b"ping"
        assert d.key is None
        assert dict(d.headers) == {}

    async def test_payload_is_opaque_bytes(self, broker_factory: BrokerFactory) -> None:
        """Bytes that are not JSON, not UTF-8, empty or large are carried unchanged."""
        broker = await broker_factory()
        topic, group = f"{unique_name()}.raw", unique_name("g")
        sub = await broker.subscribe(topic, group=group)
        payloads = [
            b"not json {",
            bytes(range(256)),
            b"\xff\xfe\x00\x00garbage",
            b"",
            b"\x00" * 1024 + b"x" * (100 * 1024),
        ]
        for payload in payloads:
            await broker.publish(topic, payload, key="same")
        got = await collect(sub, len(payloads), timeout=self.timeout)
        assert [d.payload for d in got] == payloads

    async def test_message_over_the_limit_is_refused_and_the_broker_keeps_working(
        self, broker_factory: BrokerFactory
    ) -> None:
        """A payload over the broker's limit raises ``MessageRefusedError`` (a ``BrokerError``
        saying it will not pass), is never delivered, and the next message goes through."""
        broker = await broker_factory()
        topic, group = f"{unique_name()}.big", unique_name("g")
        sub = await broker.subscribe(topic, group=group)
        await broker.publish(topic, b"before", key="k")
        with pytest.raises(MessageRefusedError) as refused:
            await broker.publish(topic, b"x" * (self.max_message_bytes + 1), key="k")
        assert isinstance(refused.value, BrokerError)
        assert refused.value.reason == "publish-refused"
        await broker.publish(topic, b"after", key="k")
        got = await collect(sub, 2, timeout=self.timeout)
        assert _texts(got) == ["before", "after"]
        assert await drain(sub, self.quiet_period) == []

    async def test_a_deliberate_resend_arrives_as_a_new_message(
        self, broker_factory: BrokerFactory
    ) -> None:
        """The same bytes with the same ``eventflow-id``, sent again at once with a new
        ``eventflow-send-id`` each time (a dead-letter replay), are delivered each time: a
        broker's own duplicate detection (JetStream's window) must not drop a deliberate
        re-send, and the envelope id still reaches the consumer, which deduplicates by it."""
        broker = await broker_factory()
        topic, group = f"{unique_name()}.resend", unique_name("g")
        sub = await broker.subscribe(topic, group=group)
        envelope_id = unique_name("id")
        payload = b'{"the": "same bytes"}'
        await broker.publish(topic, payload, key="k", headers={MESSAGE_ID_HEADER: envelope_id})
        first = await collect(sub, 1, timeout=self.timeout)
        for _ in range(2):
            resend = {MESSAGE_ID_HEADER: envelope_id, SEND_ID_HEADER: unique_name("send")}
            await broker.publish(topic, payload, key="k", headers=resend)
        again = await collect(sub, 2, timeout=self.timeout)
        assert [d.payload for d in again] == [payload, payload]
        assert [d.headers[MESSAGE_ID_HEADER] for d in [*first, *again]] == [envelope_id] * 3
        assert await drain(sub, self.quiet_period) == []

    async def test_metadata_identifies_the_message(self, broker_factory: BrokerFactory) -> None:
        """``metadata`` is a JSON-serialisable mapping that differs between two messages."""
        broker = await broker_factory()
        topic, group = f"{unique_name()}.meta", unique_name("g")
        sub = await broker.subscribe(topic, group=group)
        await broker.publish(topic, b"one", key="k")
        await broker.publish(topic, b"two", key="k")
        first, second = await collect(sub, 2, timeout=self.timeout)
        for d in (first, second):
            assert isinstance(d.metadata, Mapping)
            assert all(isinstance(k, str) for k in d.metadata)
            orjson.dumps(dict(d.metadata))  # dead-letter stores persist it as JSON
        assert dict(first.metadata) != dict(second.metadata)

    async def test_only_messages_published_after_subscribe_are_received(
        self, broker_factory: BrokerFactory
    ) -> None:
        """A new group gets what was published after ``subscribe`` returned, and nothing before."""
        publisher = await broker_factory()
        consumer = await broker_factory()
        topic, group = f"{unique_name()}.evt", unique_name("g")
        await publisher.publish(topic, b"before", key="k")  # no subscriber yet: accepted, unseen
        sub = await consumer.subscribe(topic, group=group)
        await publisher.publish(topic, b"after", key="k")
        got = await collect(sub, 1, timeout=self.timeout)
        assert _texts(got) == ["after"]
        assert await drain(sub, self.quiet_period) == []

    async def test_fetch_returns_empty_after_timeout(self, broker_factory: BrokerFactory) -> None:
        """With nothing to deliver, ``fetch`` waits about its timeout and returns nothing."""
        broker = await broker_factory()
        sub = await broker.subscribe(f"{unique_name()}.idle", group=unique_name("g"))
        loop = asyncio.get_running_loop()
        start = loop.time()
        got = await sub.fetch(10, 0.5)
        elapsed = loop.time() - start
        assert list(got) == []
        assert 0.4 <= elapsed < self.timeout

    async def test_fetch_returns_at_most_max_messages(self, broker_factory: BrokerFactory) -> None:
        """``fetch(n, ...)`` returns between 1 and n deliveries when messages are waiting."""
        broker = await broker_factory()
        topic, group = f"{unique_name()}.batch", unique_name("g")
        sub = await broker.subscribe(topic, group=group)
        for i in range(5):
            await broker.publish(topic, f"m{i}".encode(), key="k")
        got = list(await sub.fetch(2, self.timeout))
        assert 1 <= len(got) <= 2
        for d in got:
            await d.ack()
        rest = await collect(sub, 5 - len(got), timeout=self.timeout)
        assert _texts([*got, *rest]) == [f"m{i}" for i in range(5)]

    # -- patterns ----------------------------------------------------------------------------

    async def test_single_token_wildcard(self, broker_factory: BrokerFactory) -> None:
        """``*`` matches exactly one token; other topics are not delivered."""
        broker = await broker_factory()
        root, group = unique_name(), unique_name("g")
        sub = await broker.subscribe(f"{root}.*.created", group=group)
        for topic in (
            f"{root}.created",
            f"{root}.a.b.created",
            f"{root}.a.deleted",
            f"{unique_name()}.a.created",
        ):
            await broker.publish(topic, b"no", key="k")
        await broker.publish(f"{root}.order.created", b"yes-1", key="k")
        await broker.publish(f"{root}.user.created", b"yes-2", key="k")
        got = await collect(sub, 2, timeout=self.timeout)
        assert sorted((d.topic, d.payload) for d in got) == [
            (f"{root}.order.created", b"yes-1"),
            (f"{root}.user.created", b"yes-2"),
        ]
        assert await drain(sub, self.quiet_period) == []

    async def test_multi_token_wildcard(self, broker_factory: BrokerFactory) -> None:
        """``>`` matches one or more trailing tokens; the bare prefix and other roots do not."""
        broker = await broker_factory()
        root, group = unique_name(), unique_name("g")
        sub = await broker.subscribe(f"{root}.order.>", group=group)
        for topic in (f"{root}.order", f"{root}.user.placed", f"{unique_name()}.order.placed"):
            await broker.publish(topic, b"no", key="k")
        wanted = [f"{root}.order.placed", f"{root}.order.item.added", f"{root}.order.a.b.c"]
        for topic in wanted:
            await broker.publish(topic, topic.encode(), key="k")
        got = await collect(sub, len(wanted), timeout=self.timeout)
        assert sorted(d.topic for d in got) == sorted(wanted)
        assert all(d.payload == d.topic.encode() for d in got)
        assert await drain(sub, self.quiet_period) == []

    async def test_invalid_patterns_and_topics_raise_configuration_error(
        self, broker_factory: BrokerFactory
    ) -> None:
        """Malformed patterns, topics and group names raise ``ConfigurationError``."""
        broker = await broker_factory()
        root = unique_name()
        for pattern in ("", f"{root}..x", f"{root}.a*", f"{root}.>.x", f"{root}.x>", "a b"):
            with pytest.raises(ConfigurationError):
                await broker.subscribe(pattern, group=unique_name("g"))
        with pytest.raises(ConfigurationError):
            await broker.subscribe(f"{root}.ok", group="")
        for topic in ("", f"{root}.*", f"{root}.>", f"{root}..x", f"{root}.", "a b"):
            with pytest.raises(ConfigurationError):
                await broker.publish(topic, b"x")
        # the broker still works after refusing them
        sub = await broker.subscribe(f"{root}.ok", group=unique_name("g"))
        await broker.publish(f"{root}.ok", b"fine")
        assert _texts(await collect(sub, 1, timeout=self.timeout)) == ["fine"]
