"""The Kafka adapter against the Broker contract on a real Kafka-protocol broker (Tansu,
started on a free port, or ``EVENTFLOW_TEST_KAFKA_URL``), plus what only Kafka offers:
URL options, topic naming, contiguous commits and the idempotent-producer fallback."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator

import pytest

from eventflow.adapters.kafka import KafkaBroker, KafkaBrokerConfig
from eventflow.adapters.kafka.config import kafka_topic, pattern_regex
from eventflow.brokers import open_broker
from eventflow.errors import ConfigurationError
from eventflow.testing import (
    BrokerContract,
    BrokerFactory,
    broker_pool,
    collect,
    drain,
    unique_name,
)
from eventflow.testing.kafka_server import fast_test_url, kafka_service_url

pytestmark = pytest.mark.service("kafka")


@pytest.fixture(scope="session")
def kafka_url() -> Iterator[str]:
    """One Kafka-protocol broker for the whole session, with test timings in the URL."""
    with kafka_service_url() as url:
        yield fast_test_url(url)


@pytest.fixture
async def kafka(kafka_url: str) -> AsyncIterator[BrokerFactory]:
    """Start Kafka brokers (adapter instances) on the shared server; close them after."""
    async with broker_pool(lambda: KafkaBroker.from_url(kafka_url)) as factory:
        yield factory


class TestKafkaBroker(BrokerContract):
    """The Broker contract on the shared server; every test uses fresh topics and groups."""

    timeout = 15.0
    quiet_period = 1.0

    @pytest.fixture
    async def broker_factory(self, kafka: BrokerFactory) -> BrokerFactory:
        """Brokers on the session's Kafka server."""
        return kafka


# -- configuration and naming ------------------------------------------------------------------


def test_url_options_and_servers() -> None:
    """``kafka://`` takes several servers and typed options; unknown ones are refused."""
    cfg = KafkaBrokerConfig.from_url(
        "kafka://k1:9092,k2?partitions=3&session_timeout=10&create_topics=false&topic_prefix=p."
    )
    assert cfg.bootstrap_servers == ("k1:9092", "k2:9092")
    assert (cfg.partitions, cfg.session_timeout, cfg.create_topics) == (3, 10.0, False)
    assert cfg.topic_prefix == "p."
    assert KafkaBroker(cfg).url == "kafka://k1:9092,k2:9092"
    assert isinstance(open_broker("kafka://k1:9092"), KafkaBroker)
    with pytest.raises(ConfigurationError, match="valid options"):
        KafkaBrokerConfig.from_url("kafka://k1:9092?partitionz=3")
    with pytest.raises(ConfigurationError, match="not a valid int"):
        KafkaBrokerConfig.from_url("kafka://k1:9092?partitions=many")
    with pytest.raises(ConfigurationError, match="credentials"):
        KafkaBrokerConfig.from_url("kafka://user:secret@k1:9092")
    with pytest.raises(ConfigurationError, match="revoke_timeout"):
        KafkaBrokerConfig(revoke_timeout=60, rebalance_timeout=30)


def test_topic_names_and_pattern_regexes() -> None:
    """Topics map one to one (with the prefix); wildcards become anchored regexes."""
    import re

    assert kafka_topic("order.placed", "prod.") == "prod.order.placed"
    with pytest.raises(ConfigurationError, match="Kafka allows only"):
        kafka_topic("order.plücked")
    one = re.compile(pattern_regex("order.*", "p."))
    assert one.match("p.order.placed") and not one.match("p.order.a.b")
    assert not one.match("order.placed") and not one.match("p.orderx.placed")
    many = re.compile(pattern_regex("order.>"))
    assert many.match("order.a") and many.match("order.a.b.c") and not many.match("order")


# -- Kafka specifics ---------------------------------------------------------------------------


async def test_commits_only_contiguous_finished_offsets(kafka: BrokerFactory) -> None:
    """Acks out of order: only the offsets below the first unacked one are committed, so a
    new member gets the unacked message and every later one, and nothing acked before it."""
    broker = await kafka()
    topic, group = f"{unique_name()}.gap", unique_name("g")
    sub = await broker.subscribe(topic, group=group)
    for i in range(5):
        await broker.publish(topic, f"m{i}".encode(), key="k")
    got = await collect(sub, 5, ack=False, timeout=15)
    for i in (0, 1, 3, 4):  # m2 stays unacked
        await got[i].ack()
    await sub.close()
    again = await (await kafka()).subscribe(topic, group=group)
    redelivered = await collect(again, 3, timeout=15)
    assert [d.payload for d in redelivered] == [b"m2", b"m3", b"m4"]
    assert redelivered[0].delivery_count == 2
    assert await drain(again, 1.0) == []


async def test_idempotent_producer_is_used_or_the_fallback_is_reported(
    kafka_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """``idempotence=auto`` uses the idempotent producer where the broker has one and says
    so when it falls back; ``idempotence=on`` refuses a broker without it."""
    async with KafkaBroker.from_url(kafka_url) as broker:
        if broker.idempotent is False:
            assert "does not support the idempotent producer" in caplog.text
            strict = KafkaBroker.from_url(kafka_url + "&idempotence=on")
            with pytest.raises(Exception, match="idempotent producer"):
                await strict.start()
            await strict.close()
        else:
            assert broker.idempotent is True
        topic = f"{unique_name()}.idem"
        sub = await broker.subscribe(topic, group=unique_name("g"))
        await broker.publish(topic, b"once", key="k")
        assert [d.payload for d in await collect(sub, 1, timeout=15)] == [b"once"]


async def test_delivery_metadata_names_topic_partition_offset(kafka: BrokerFactory) -> None:
    """Dead letters get the Kafka position: topic, partition and offset."""
    broker = await kafka()
    topic, group = f"{unique_name()}.pos", unique_name("g")
    sub = await broker.subscribe(topic, group=group)
    await broker.publish(topic, b"a", key="k")
    await broker.publish(topic, b"b", key="k")
    first, second = await collect(sub, 2, timeout=15)
    assert first.metadata["topic"] == topic
    assert first.metadata["partition"] == second.metadata["partition"]
    assert second.metadata["offset"] == first.metadata["offset"] + 1


async def test_publish_after_server_goes_away_is_reported(kafka_url: str) -> None:
    """A broker that cannot be reached raises BrokerError with what to check."""
    from eventflow.errors import BrokerError

    broker = KafkaBroker.from_url("kafka://127.0.0.1:1?publish_timeout=1")
    with pytest.raises(BrokerError, match="reachable"):
        await asyncio.wait_for(broker.start(), 60)
    await broker.close()
