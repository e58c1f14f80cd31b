"""Kafka topic names (``eventflow/adapters/kafka/topics.py``): concurrent first publishes
to a new topic share one creation request; a failed creation is each caller's to retry,
so every caller gets its own answer."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from eventflow.adapters.kafka.config import KafkaBrokerConfig
from eventflow.adapters.kafka.topics import TopicNames
from eventflow.errors import BrokerError, MessageRefusedError


class SlowAdmin:
    """Answers CreateTopics after a pause, failing the first ``fail`` requests."""

    def __init__(self, fail: int = 0) -> None:
        self.requests: list[list[str]] = []
        self.fail = fail

    async def create_topics(self, topics: list[Any]) -> object:
        self.requests.append([t.name for t in topics])
        await asyncio.sleep(0.01)
        if self.fail:
            self.fail -= 1
            from aiokafka.errors import KafkaConnectionError

            raise KafkaConnectionError("down")
        return object()


async def test_concurrent_first_publishes_share_one_creation() -> None:
    admin = SlowAdmin()
    names = TopicNames(KafkaBrokerConfig(topic_prefix="p."), lambda: admin)  # type: ignore[arg-type, return-value]
    got = await asyncio.gather(
        *(names.resolve("order.placed", MessageRefusedError) for _ in range(50))
    )
    assert got == ["p.order.placed"] * 50
    assert admin.requests == [["p.order.placed"]]
    assert names.get("order.placed") == "p.order.placed"


async def test_a_failed_creation_is_tried_again_by_each_waiting_caller() -> None:
    admin = SlowAdmin(fail=1)
    names = TopicNames(KafkaBrokerConfig(), lambda: admin)  # type: ignore[arg-type, return-value]
    results = await asyncio.gather(
        *(names.resolve("order.placed", MessageRefusedError) for _ in range(3)),
        return_exceptions=True,
    )
    failed = [r for r in results if isinstance(r, BaseException)]
    assert len(failed) == 1 and isinstance(failed[0], BrokerError)
    assert results.count("order.placed") == 2
    assert len(admin.requests) == 2  # the failed one, then one for both waiters


async def test_a_name_kafka_cannot_carry_is_refused_for_a_publish() -> None:
    names = TopicNames(KafkaBrokerConfig(), lambda: SlowAdmin())  # type: ignore[arg-type, return-value]
    with pytest.raises(MessageRefusedError):
        await names.resolve("order.pl@ced", MessageRefusedError)
