"""The broker contract suite on a real NATS JetStream server (``nats://``).

The server comes from ``EVENTFLOW_TEST_NATS_URL``, else the bundled ``nats-server`` started
for the session, else testcontainers; without any, the module skips (fails under CI=true).
Each test uses fresh topics and groups, so all share one server and one stream.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import pytest

from eventflow.adapters.nats import NatsBroker, NatsBrokerConfig
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
