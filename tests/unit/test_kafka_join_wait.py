"""Joining a Kafka group (``eventflow/adapters/kafka/subscription.py``): a join that waits
longer than a normal one (a killed member still counts in the group until its session times
out) says once what it waits for, and how long it may take; a join that ends in time says
nothing; a session timeout the brokers refuse is named with their limits."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest
from aiokafka.errors import InvalidSessionTimeoutError

from eventflow.adapters.kafka import subscription as kafka_subscription
from eventflow.adapters.kafka.config import KafkaBrokerConfig
from eventflow.adapters.kafka.subscription import KafkaSubscription
from eventflow.errors import BrokerError
from eventflow.supervision import Supervisor


class StuckConsumer:
    """A consumer whose group never assigns it anything."""

    async def getmany(self, timeout_ms: int = 0, max_records: int | None = None) -> dict[Any, Any]:
        await asyncio.sleep(timeout_ms / 1000)
        return {}

    def assignment(self) -> set[Any]:
        return set()

    async def stop(self) -> None:
        pass


async def _join(timeout: float) -> None:
    config = KafkaBrokerConfig(session_timeout=0.3, heartbeat_interval=0.1)
    consumer: Any = StuckConsumer()
    sub = KafkaSubscription(config, "jobs", "billing", consumer, consumer, {}, lambda s: None)
    supervisor = Supervisor("test")
    try:
        await sub.start(supervisor, timeout)
    finally:
        await sub.close()
        await supervisor.close()


async def test_a_long_join_is_explained_once(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(kafka_subscription, "_JOIN_NOTE", 0.2)
    caplog.set_level(logging.WARNING, logger="eventflow.kafka")
    with pytest.raises(BrokerError, match="no partition assignment"):
        await _join(timeout=1.0)
    notes = [r.getMessage() for r in caplog.records if "no partitions assigned" in r.getMessage()]
    assert len(notes) == 1, notes
    assert "'billing'" in notes[0] and "session_timeout (0.3s)" in notes[0]
    assert "stopped heartbeating" in notes[0]


async def test_a_join_within_the_session_timeout_says_nothing(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(kafka_subscription, "_JOIN_NOTE", 0.2)
    caplog.set_level(logging.WARNING, logger="eventflow.kafka")
    with pytest.raises(BrokerError):
        await _join(timeout=0.25)  # gave up before the session timeout: no note yet
    assert not [r for r in caplog.records if "no partitions assigned" in r.getMessage()]


async def test_a_session_timeout_the_brokers_refuse_is_named_with_their_limits() -> None:
    config = KafkaBrokerConfig(session_timeout=3.0, heartbeat_interval=1.0)
    consumer: Any = StuckConsumer()
    sub = KafkaSubscription(config, "jobs", "billing", consumer, consumer, {}, lambda s: None)
    sub._failure = InvalidSessionTimeoutError()
    with pytest.raises(BrokerError, match=r"session_timeout=3s.*group\.min\.session\.timeout\.ms"):
        sub._check()
