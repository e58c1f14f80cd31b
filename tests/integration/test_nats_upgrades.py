"""Upgrading a NATS deployment made with the older defaults (``ack_wait`` 30 s, lease TTL
37.5 s): the lease bucket is set to the new TTL with a warning (not refused), the group's
consumers get the new ``ack_wait`` when it subscribes again, and two apps of this version
that disagree on the TTL are still refused."""

from __future__ import annotations

import logging

import nats
import pytest
from nats.js.api import KeyValueConfig, StorageType

from eventflow.adapters.nats import NatsBroker, NatsBrokerConfig
from eventflow.adapters.nats.admin import ensure_consumer, ensure_stream
from eventflow.adapters.nats.config import consumer_name, group_id
from eventflow.errors import ConfigurationError
from eventflow.testing import unique_name

pytestmark = pytest.mark.service("nats")

PARTITIONS = 2


async def test_a_deployment_of_the_old_defaults_is_upgraded_not_refused(
    nats_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    stream, topic, group = unique_name("EF").upper(), f"{unique_name()}.up", "billing"
    base = f"{nats_url}?stream={stream}&storage=memory&partitions={PARTITIONS}"
    old = NatsBrokerConfig.from_url(f"{base}&ack_wait=30&lease_ttl=41.5")
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    try:
        # What an older eventflow left: its stream, a lease bucket of TTL 37.5 s that does
        # not record it, and the group's consumers with ack_wait 30 s.
        await ensure_stream(js, old)
        await js.create_key_value(
            KeyValueConfig(bucket=old.lease_bucket, history=1, ttl=37.5, storage=StorageType.MEMORY)
        )
        gid = group_id(group, topic)
        for p in range(PARTITIONS):
            await ensure_consumer(js, old, gid, p, topic)

        caplog.set_level(logging.WARNING, logger="eventflow.nats")
        new = NatsBroker.from_url(base)
        await new.start()
        try:
            ttl = new.config.effective_lease_ttl
            status = await (await js.key_value(old.lease_bucket)).status()
            assert status.ttl == pytest.approx(ttl)
            assert any("older eventflow" in r.getMessage() for r in caplog.records)
            await (await new.subscribe(topic, group=group)).close()
            waits = {
                (await js.consumer_info(stream, consumer_name(gid, p))).config.ack_wait
                for p in range(PARTITIONS)
            }
            assert waits == {new.config.ack_wait}

            # An app of this version with other timings is refused, as before.
            other = NatsBroker.from_url(f"{base}&ack_wait=10")
            with pytest.raises(ConfigurationError, match="lease TTL"):
                await other.start()
            await other.close()
        finally:
            await new.close()
        # Started again, the upgraded bucket is taken as it is, without a warning.
        caplog.clear()
        again = NatsBroker.from_url(base)
        await again.start()
        await again.close()
        assert not caplog.records
    finally:
        await nc.close()
