"""Where a Kafka consumer group stands: whether it exists (it has a committed offset on the
topics a pattern matches), the end offsets a new group starts from, and committing start
positions for a group from a client that does not join it (``KafkaBroker.declare``)."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import CommitFailedError

from ...errors import BrokerError
from .connection import close_client

__all__ = ["commit_outside", "end_offsets", "has_position", "nothing_to_commit"]


async def end_offsets(
    admin: AIOKafkaAdminClient,
    consumer: AIOKafkaConsumer,
    regex: str,
    exact: str | None,
) -> dict[Any, int]:
    """End offsets of every partition of the topics matching now: a new group's start."""
    if exact is not None:
        names = [exact]
    else:
        match = re.compile(regex).match
        names = sorted(t for t in await consumer.topics() if match(t))
    if not names:
        return {}
    described = await admin.describe_topics(names)
    tps = [
        TopicPartition(entry["topic"], p["partition"])
        for entry in described
        if entry.get("error_code", 0) == 0
        for p in entry["partitions"]
    ]
    if not tps:
        return {}
    ends = await consumer.end_offsets(tps)
    return {tp: int(offset) for tp, offset in ends.items()}


async def has_position(admin: AIOKafkaAdminClient, group: str, partitions: Sequence[Any]) -> bool:
    """Whether ``group`` committed an offset on one of ``partitions``: then it exists."""
    if not partitions:
        return False
    committed = await admin.list_consumer_group_offsets(group, partitions=list(partitions))
    return any(tp in committed and committed[tp].offset >= 0 for tp in partitions)


async def commit_outside(client: AIOKafkaConsumer, positions: Mapping[Any, int]) -> bool:
    """Start ``client`` (unstarted, with the group's ``group_id``), commit ``positions``
    for the group without joining it, and close the client; False if Kafka refuses because
    the group has live members (it takes offsets only from a member then)."""
    try:
        await client.start()
        client.assign(list(positions))
        await client.commit(dict(positions))
    except CommitFailedError:
        return False
    finally:
        await close_client(client)
    return True


def nothing_to_commit(pattern: str, group: str) -> BrokerError:
    """The error of a declare whose wildcard matches no topic yet."""
    return BrokerError(
        f"kafka: no topic matches {pattern!r} yet, so group {group!r} has no partition to "
        "commit a start position on; create the topics first, or let the group's first "
        "member create it (a topic created after that member subscribed is read from its "
        "beginning)"
    )
