"""Creating Kafka topics: one request for several, "already exists" taken as done."""

from __future__ import annotations

from collections.abc import Sequence

from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import KafkaError, for_code

from ...errors import BrokerError
from .config import KafkaBrokerConfig

__all__ = ["create_topics"]

_TOPIC_EXISTS = 36


async def create_topics(
    admin: AIOKafkaAdminClient,
    cfg: KafkaBrokerConfig,
    names: Sequence[str],
    refused: type[BrokerError],
) -> None:
    """Create the Kafka topics ``names`` (with ``cfg.partitions``) unless they exist;
    raise ``refused`` when the broker refuses for good (not authorised, an invalid topic, a
    policy), a ``BrokerError`` for a failure that may pass."""
    topics = [NewTopic(n, cfg.partitions, cfg.replication_factor) for n in names]
    try:
        response = await admin.create_topics(topics)
    except KafkaError as exc:
        raise BrokerError(f"kafka: could not create topics {list(names)}: {exc!r}") from exc
    for entry in getattr(response, "topic_errors", ()):
        name, code = entry[0], entry[1]
        if code not in (0, _TOPIC_EXISTS):
            error = for_code(code)
            kind = BrokerError if error.retriable else refused
            raise kind(
                f"kafka: could not create topic {name!r} ({error.__name__}, error code "
                f"{code}); create it yourself or check the broker's permissions"
            )
