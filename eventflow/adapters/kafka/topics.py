"""Kafka topics: creating several in one request ("already exists" taken as done), and
the Kafka names of eventflow topics known to exist, each created once.

Concurrent first publishes to a new topic (a window of ``app.publish`` calls) share one
creation request: the first caller creates it, the others wait for it and then find the
name. If the creation fails, each waiting caller tries again itself, so every caller gets
its own answer (and its own error).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import KafkaError, for_code

from ...errors import BrokerError, ConfigurationError, MessageRefusedError
from .config import KafkaBrokerConfig, kafka_topic

__all__ = ["TopicNames", "create_topics"]

_TOPIC_EXISTS = 36
_MAX_NAMES = 4096
"""Topics whose Kafka name (and existence) are remembered: a bound, as topics may be made
per tenant or per id."""


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


class TopicNames:
    """Eventflow topic -> Kafka topic, for the topics known to exist (see the module
    docstring); ``admin`` returns the broker's live admin client."""

    def __init__(self, cfg: KafkaBrokerConfig, admin: Callable[[], AIOKafkaAdminClient]) -> None:
        self._cfg = cfg
        self._admin = admin
        self._known: dict[str, str] = {}
        self._creating: dict[str, asyncio.Future[None]] = {}  # done when the attempt ends

    def get(self, topic: str) -> str | None:
        """The Kafka name of ``topic`` if it is known to exist."""
        return self._known.get(topic)

    def __len__(self) -> int:
        """How many names are known (at most ``_MAX_NAMES``)."""
        return len(self._known)

    def clear(self) -> None:
        """Forget every name (the broker closed)."""
        self._known.clear()

    async def resolve(self, topic: str, refused: type[BrokerError] = BrokerError) -> str:
        """The Kafka name of ``topic``, the topic created first (with ``create_topics``)
        unless known to exist. Raises ``ConfigurationError`` for a name Kafka cannot carry
        (``MessageRefusedError`` when ``refused`` is that: a publish), ``refused`` when the
        broker refuses to create it, a ``BrokerError`` for a failure that may pass."""
        while True:
            name = self._known.get(topic)
            if name is not None:
                return name
            busy = self._creating.get(topic)
            if busy is None:
                break
            await asyncio.shield(busy)  # then known, or failed for that caller: try again
        done = self._creating[topic] = asyncio.get_running_loop().create_future()
        try:
            return await self._create(topic, refused)
        finally:
            del self._creating[topic]
            done.set_result(None)

    async def _create(self, topic: str, refused: type[BrokerError]) -> str:
        cfg = self._cfg
        try:
            name = kafka_topic(topic, cfg.topic_prefix)
        except ConfigurationError as exc:
            if refused is not MessageRefusedError:
                raise  # subscribing to it: a configuration mistake
            # A topic eventflow accepts but Kafka cannot name: every send of it would fail.
            raise MessageRefusedError(f"kafka cannot carry a message for {topic!r}: {exc}") from exc
        if cfg.create_topics:
            await create_topics(self._admin(), cfg, [name], refused)
        known = self._known
        if len(known) >= _MAX_NAMES:
            known.clear()  # one creation request per topic again: bounded memory instead
        known[topic] = name
        return name
