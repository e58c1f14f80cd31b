"""What the Kafka adapter lets through of aiokafka's logs (``eventflow/adapters/kafka/logs.py``):
the refusal of the idempotent producer only outside the adapter's own try, and aiokafka's
INFO records only when the application gave the ``aiokafka`` logger a level."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

from eventflow.adapters.kafka import logs as kafka_logs
from eventflow.adapters.kafka.logs import (
    ClientLogThrottle,
    expect_idempotence_refusal,
    throttle_client_logs,
)


def _record(name: str, level: int, msg: str) -> logging.LogRecord:
    return logging.LogRecord(name, level, __file__, 1, msg, ("UnknownError",), None)


def test_the_idempotence_refusal_is_dropped_only_while_the_adapter_tries_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Inside ``expect_idempotence_refusal`` the sender's ERROR is dropped; outside (the
    same refusal at another time) and for other records it passes."""
    throttle = ClientLogThrottle()
    monkeypatch.setattr(kafka_logs, "CLIENT_LOG_THROTTLE", throttle)
    refusal = "Unexpected error during InitProducerIdRequest: %s"
    sender = "aiokafka.producer.sender"
    with expect_idempotence_refusal():
        assert throttle.filter(_record(sender, logging.ERROR, refusal)) is False
        assert throttle.filter(_record(sender, logging.ERROR, "Other failure: %s")) is True
    assert throttle.expecting == 0
    throttle.reset()
    assert throttle.filter(_record(sender, logging.ERROR, refusal)) is True


@pytest.fixture
def aiokafka_level() -> Iterator[logging.Logger]:
    """The ``aiokafka`` logger, its level restored after the test."""
    logger = logging.getLogger("aiokafka")
    level = logger.level
    yield logger
    logger.setLevel(level)


def test_aiokafka_info_is_held_back_unless_the_app_set_a_level(
    aiokafka_level: logging.Logger,
) -> None:
    """An ``aiokafka`` logger without a level gets WARNING; a level the app set stays."""
    aiokafka_level.setLevel(logging.NOTSET)
    throttle_client_logs()
    assert aiokafka_level.level == logging.WARNING
    aiokafka_level.setLevel(logging.INFO)
    throttle_client_logs()
    assert aiokafka_level.level == logging.INFO
