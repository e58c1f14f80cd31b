"""The broker contract suite on a real NATS JetStream server (``nats://``).

The server comes from ``EVENTFLOW_TEST_NATS_URL``, else the bundled ``nats-server`` started
for the session, else testcontainers; without any, the module skips (fails under CI=true).
Each test uses fresh topics and groups, so all share one server and one stream.
"""

from __future__ import annotations

import zlib
from collections.abc import AsyncIterator, Iterator

import pytest

from eventflow.adapters.nats import NatsBroker, NatsBrokerConfig
from eventflow.adapters.nats.config import partition_of
from eventflow.brokers import open_broker
from eventflow.errors import ConfigurationError
from eventflow.testing.broker_contract import BrokerContract, BrokerFactory, broker_pool
from eventflow.testing.nats_server import nats_service_url

pytestmark = pytest.mark.service("nats")


@pytest.fixture(scope="session")
def nats_url() -> Iterator[str]:
    """A NATS server with JetStream for the whole session."""
    with nats_service_url() as url:
        yield url


class TestNatsBroker(BrokerContract):
    """Every guarantee of the Broker port, on JetStream."""

    @pytest.fixture
    async def broker_factory(self, nats_url: str) -> AsyncIterator[BrokerFactory]:
        config = NatsBrokerConfig.from_url(f"{nats_url}?stream=EF_CONTRACT&storage=memory")
        async with broker_pool(lambda: NatsBroker(config)) as factory:
            yield factory


def test_from_url_parses_servers_credentials_and_options() -> None:
    """Several hosts, credentials and typed query options; the broker URL hides the password."""
    broker = NatsBroker.from_url(
        "nats://alice:s3cret@h1:4222,h2?stream=ORDERS&partitions=16&ack_wait=12.5&lease_ttl=20"
    )
    cfg = broker.config
    assert cfg.servers == ("nats://h1:4222", "nats://h2:4222")
    assert (cfg.user, cfg.password) == ("alice", "s3cret")
    assert (cfg.stream, cfg.partitions, cfg.ack_wait, cfg.lease_ttl) == ("ORDERS", 16, 12.5, 20.0)
    assert cfg.prefix == "orders"
    assert "s3cret" not in broker.url
    assert broker.url.startswith("nats://h1:4222,h2:4222")


def test_open_broker_builds_a_nats_broker() -> None:
    """``open_broker("nats://...")`` returns the NATS adapter, unstarted."""
    broker = open_broker("nats://127.0.0.1:4222")
    assert isinstance(broker, NatsBroker)
    assert broker.config.stream == "EVENTFLOW"


@pytest.mark.parametrize(
    "url",
    [
        "nats://h:4222?nope=1",
        "nats://h:4222?partitions=zero",
        "nats://h:4222?partitions=0",
        "nats://h:4222?stream=has.dot",
        "nats://h:4222?ack_wait=30&lease_ttl=10",
        "nats://h:4222?max_deliver=1",
        "kafka://h:9092",
    ],
)
def test_bad_urls_raise_configuration_error(url: str) -> None:
    """Unknown options, bad values and inconsistent timings are refused with a reason."""
    with pytest.raises(ConfigurationError):
        NatsBrokerConfig.from_url(url)


def test_partition_of_is_stable() -> None:
    """A key's partition does not depend on the process (CRC-32, not ``hash``)."""
    assert partition_of("order-1", 8) == zlib.crc32(b"order-1") % 8
    assert [partition_of(k, 8) for k in ("a", "b", "c")] == [
        zlib.crc32(k.encode()) % 8 for k in "abc"
    ]
