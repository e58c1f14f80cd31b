"""The Kafka broker adapter on aiokafka: publish with acks=all, consumer groups, commits.

See ``docs/kafka.md`` for topic naming, partitions, commits and rebalances, and
:mod:`eventflow.adapters.kafka.subscription` for how one group member works.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import KafkaError

from ...errors import (
    BrokerError,
    MessageRefusedError,
)
from ...groups import check_group, log_new_group
from ...patterns import is_wildcard, validate_pattern, validate_topic
from ...ports import Lag, StartPosition
from ...supervision import Supervisor
from .config import EXACT_METADATA_MAX_AGE, KafkaBrokerConfig, kafka_topic, pattern_regex
from .connection import close_client, probe
from .groups import commit_outside, end_offsets, has_position, nothing_to_commit
from .lag import LAG_TIMEOUT, PEEK_OPTIONS, group_lag
from .logs import expect_idempotence_refusal, throttle_client_logs
from .partition import attempts_group
from .publishing import publish_failure
from .subscription import KafkaSubscription
from .topics import TopicNames, create_topics

__all__ = ["KafkaBroker"]

_log = logging.getLogger("eventflow.kafka")


def _ms(seconds: float) -> int:
    return max(1, int(seconds * 1000))


class KafkaBroker:
    """A :class:`~eventflow.ports.Broker` on Apache Kafka (or any Kafka-protocol broker).

    ``KafkaBroker(KafkaBrokerConfig(bootstrap_servers=("kafka1:9092",)))`` or
    ``KafkaBroker.from_url("kafka://kafka1:9092,kafka2:9092?partitions=12")``.
    """

    def __init__(self, config: KafkaBrokerConfig | None = None) -> None:
        self.config = config or KafkaBrokerConfig()
        self.idempotent: bool | None = None
        """Whether the producer is idempotent (None until started)."""
        self._producer: AIOKafkaProducer | None = None
        self._admin: AIOKafkaAdminClient | None = None
        self._offsets: AIOKafkaConsumer | None = None  # group-less: offsets, lag()
        self._peeking = asyncio.Lock()  # the assignment of _offsets, while lag() fetches
        self._subs: set[KafkaSubscription] = set()
        self._names = TopicNames(self.config, self._live_admin)  # Kafka names known to exist
        self._lock = asyncio.Lock()
        self._supervisor: Supervisor | None = None
        self._own_supervisor: Supervisor | None = None  # when start() was given none
        self._failing = ""  # what fails since when: from a failed publish to a good one

    @classmethod
    def from_url(cls, url: str) -> KafkaBroker:
        """Build an (unstarted) broker from ``kafka://host:9092[,host2:9092][?options]``."""
        return cls(KafkaBrokerConfig.from_url(url))

    @property
    def url(self) -> str:
        """``kafka://host:port[,host:port]``."""
        return self.config.url

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self, supervisor: Supervisor | None = None) -> None:
        """Connect the producer and the admin client within ``connect_timeout`` (then a
        ``BrokerError`` names the URL and what to check); cancelling it stops it at once and
        leaves no client open. Each subscription's pump runs as a component of
        ``supervisor``, or of a supervisor of the broker's own. Idempotent."""
        async with self._lock:
            if self._producer is not None:
                return
            cfg = self.config
            throttle_client_logs()
            loop = asyncio.get_running_loop()
            deadline = loop.time() + cfg.connect_timeout
            await probe(cfg.bootstrap_servers, cfg.client_id, self.url, cfg.connect_timeout)
            admin = AIOKafkaAdminClient(
                bootstrap_servers=list(cfg.bootstrap_servers),
                client_id=cfg.client_id,
            )
            opened: list[AIOKafkaAdminClient | AIOKafkaProducer] = [admin]
            try:
                async with asyncio.timeout_at(deadline):
                    await admin.start()
                    producer = await self._start_producer(opened)
            except BaseException as exc:
                for client in reversed(opened):
                    await close_client(client)
                if isinstance(exc, TimeoutError):
                    raise BrokerError(
                        f"kafka: a broker at {self.url} answered, but the clients did not "
                        f"connect within connect_timeout={cfg.connect_timeout:g}s; check that "
                        "the addresses the brokers advertise (advertised.listeners) are "
                        "reachable from here, or raise connect_timeout="
                    ) from exc
                if not isinstance(exc, KafkaError):
                    raise
                raise BrokerError(
                    f"kafka: cannot connect to {self.url}: {exc!r}; check that the brokers "
                    "are running and reachable"
                ) from exc
            if supervisor is None:
                supervisor = self._own_supervisor = Supervisor(f"kafka broker {self.url}")
            self._supervisor = supervisor
            self._admin, self._producer = admin, producer

    def _make_producer(self, idempotent: bool) -> AIOKafkaProducer:
        cfg = self.config
        return AIOKafkaProducer(
            bootstrap_servers=list(cfg.bootstrap_servers),
            client_id=cfg.client_id,
            acks="all",
            enable_idempotence=idempotent,
            linger_ms=_ms(cfg.linger) if cfg.linger > 0 else 0,
            request_timeout_ms=_ms(cfg.publish_timeout),
            max_request_size=cfg.max_message_bytes,
            max_batch_size=cfg.batch_bytes,
        )

    async def _start_producer(
        self, opened: list[AIOKafkaAdminClient | AIOKafkaProducer]
    ) -> AIOKafkaProducer:
        """Start the producer (idempotent if asked and possible); every producer made is
        put in ``opened`` first, so the caller closes it whatever happens."""
        mode = self.config.idempotence
        if mode != "off":
            producer = self._make_producer(True)
            opened.append(producer)
            try:
                if mode == "auto":
                    with expect_idempotence_refusal():
                        await producer.start()
                else:
                    await producer.start()
            except KafkaError as exc:
                await producer.stop()
                opened.remove(producer)
                if mode == "on":
                    raise BrokerError(
                        f"kafka: the broker at {self.url} refused the idempotent producer "
                        f"({exc!r}); use idempotence=auto or off with this broker"
                    ) from exc
                _log.warning(
                    "kafka: the broker at %s refused the idempotent producer (%r to "
                    "InitProducerId; Tansu has none); publishing with acks=all without it, "
                    "so a retried send may store a message twice (consumers skip the copy by "
                    "its envelope id); ?idempotence=off skips this try",
                    self.url,
                    exc,
                )
            else:
                self.idempotent = True
                return producer
        producer = self._make_producer(False)
        opened.append(producer)
        await producer.start()
        self.idempotent = False
        return producer

    async def close(self) -> None:
        """Close every subscription (committing finished work), then disconnect. Idempotent."""
        async with self._lock:
            own, self._own_supervisor = self._own_supervisor, None
            producer, admin, offsets = self._producer, self._admin, self._offsets
            self._producer = self._admin = self._offsets = None
            self._names.clear()
            try:
                for sub in list(self._subs):
                    try:
                        await sub.close()
                    except Exception as exc:
                        _log.warning("kafka: closing a subscription failed: %s", exc)
                self._subs.clear()
            finally:
                if own is not None:
                    await own.close()
                if producer is not None:
                    await producer.stop()
                if offsets is not None:
                    await close_client(offsets)
                if admin is not None:
                    await admin.close()

    async def __aenter__(self) -> KafkaBroker:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- topics ------------------------------------------------------------------------------

    def _live_admin(self) -> AIOKafkaAdminClient:
        if self._admin is None:
            raise BrokerError("kafka broker is not started: call `await broker.start()` first")
        return self._admin

    async def ensure_topics(self, names: Sequence[str]) -> None:
        """Create the Kafka topics ``names`` (with ``partitions``) unless they exist."""
        await create_topics(self._live_admin(), self.config, names, BrokerError)

    async def _kafka_name(self, topic: str, refused: type[BrokerError] = BrokerError) -> str:
        return await self._names.resolve(topic, refused)

    # -- publishing --------------------------------------------------------------------------

    async def publish(
        self,
        topic: str,
        payload: bytes,
        *,
        key: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        """Send ``payload`` to ``topic`` (partition by key); returns once all replicas have it.

        Until the producer has the record a failure means it was not sent (no room:
        ``BackpressureError``; no metadata: ``BrokerError``); after, the producer may have
        sent it (it retries on its own), so a failure other than a refusal for good is
        ``PublishUnconfirmedError``: maybe sent."""
        producer = self._producer
        if producer is None:
            raise BrokerError("kafka broker is not started: call `await broker.start()` first")
        name = self._names.get(topic)
        if name is None:
            validate_topic(topic)  # not an eventflow topic at all: a ConfigurationError
            name = await self._kafka_name(topic, MessageRefusedError)
        taken = False
        try:
            # aiokafka bounds both the wait for buffer space and the wait for the broker's
            # acknowledgement by request_timeout_ms (= publish_timeout): no timer per message.
            future = await producer.send(
                name,
                payload,
                key=key.encode() if key is not None else None,
                headers=[(k, v.encode()) for k, v in headers.items()] if headers else None,
            )
            taken = True
            await future
        except KafkaError as exc:
            error = publish_failure(exc, topic, taken=taken, timeout=self.config.publish_timeout)
            if not self._failing and not isinstance(error, MessageRefusedError):
                stamp = f"{datetime.now(UTC):%Y-%m-%d %H:%M:%SZ}"  # the brokers away or slow
                self._failing = f"broker: publishes to {self.url} fail since {stamp} ({exc!r})"
            raise error  # noqa: B904 (its cause is set by publish_failure)
        self._failing = ""

    # -- subscribing -------------------------------------------------------------------------

    async def subscribe(
        self, pattern: str, *, group: str, start: StartPosition = "latest", temporary: bool = False
    ) -> KafkaSubscription:
        """Join consumer group ``group`` on ``pattern``; returns once partitions are assigned
        and their start positions committed. A new group (no committed offset on the topics
        matching ``pattern``) starts at the end of the topics that exist now with ``start=
        "latest"``, else at their beginning; a partition never committed in a group that
        exists (a topic created since), and any topic created later, at its beginning. A
        ``temporary`` group starts at the end (its offsets stay until offsets retention)."""
        start = "latest" if temporary else start
        admin = self._live_admin()
        supervisor = self._supervisor  # set by start() together with the admin client
        if supervisor is None:
            raise BrokerError("kafka broker is not started: call `await broker.start()` first")
        begin = check_group(pattern, group, start)
        cfg = self.config
        regex = pattern_regex(pattern, cfg.topic_prefix)
        exact = None if is_wildcard(pattern) else await self._kafka_name(pattern)
        # A wildcard sees new topics at its consumer's metadata refresh: often (a request
        # for every topic's metadata each time); an exact topic only needs partition changes.
        refresh = cfg.metadata_max_age
        if exact is not None:
            refresh = max(refresh, EXACT_METADATA_MAX_AGE)
        consumer = self._new_consumer(
            group_id=group,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            session_timeout_ms=_ms(cfg.session_timeout),
            heartbeat_interval_ms=_ms(cfg.heartbeat_interval),
            max_poll_interval_ms=_ms(cfg.max_poll_interval),
            rebalance_timeout_ms=_ms(cfg.rebalance_timeout),
            metadata_max_age_ms=_ms(refresh),
            max_poll_records=cfg.max_buffer,
        )
        companion = self._new_consumer(
            group_id=attempts_group(group),
            enable_auto_commit=False,
        )
        try:
            for client in (consumer, companion):
                await client.start()
            ends = await end_offsets(admin, consumer, regex, exact)
            existed = await has_position(admin, group, list(ends))
            # A never-committed partition starts at its start offset here, else at its
            # beginning: only a new group told "latest" skips what is there already.
            start_offsets = ends if begin == "latest" and not existed else {}
            sub = KafkaSubscription(
                cfg, pattern, group, consumer, companion, start_offsets, self._subs.discard
            )
            if exact is not None:
                consumer.subscribe(topics=[exact], listener=sub.listener)
            else:
                consumer.subscribe(pattern=regex, listener=sub.listener)
            self._subs.add(sub)
        except BaseException as exc:  # cancelled too: no client is left running
            for client in (consumer, companion):
                await close_client(client)
            if not isinstance(exc, KafkaError):
                raise
            raise BrokerError(f"kafka: cannot join group {group!r}: {exc!r}") from exc
        try:
            await sub.start(supervisor, cfg.rebalance_timeout + cfg.session_timeout)
        except BaseException:
            await sub.close()
            raise
        if not existed:
            log_new_group(group, pattern, begin)
        return sub

    async def declare(
        self,
        pattern: str,
        *,
        group: str,
        start: StartPosition = "latest",
        create: bool = True,
    ) -> bool:
        """Whether ``group`` had a committed offset on the topics matching ``pattern``; with
        ``create`` one that had none gets its start positions committed without joining it
        (if it has live members, Kafka takes offsets only from a member: then it joins for a
        moment, one rebalance). See ``docs/kafka.md``."""
        admin = self._live_admin()
        begin = check_group(pattern, group, start)
        if create and not is_wildcard(pattern):
            await self._kafka_name(pattern)  # created, with create_topics
        try:
            consumer, ends = await self._ends_now(admin, pattern)
            if await has_position(admin, group, list(ends)):
                return True
            if not create:
                return False
            if not ends:
                raise nothing_to_commit(pattern, group)
            positions = ends if begin == "latest" else await consumer.beginning_offsets(list(ends))
            outside = self._new_consumer(group_id=group, enable_auto_commit=False)
            committed = await commit_outside(outside, positions)
        except KafkaError as exc:
            raise BrokerError(f"kafka: cannot declare group {group!r}: {exc!r}") from exc
        if committed:
            log_new_group(group, pattern, begin)
        else:
            await (await self.subscribe(pattern, group=group, start=begin)).close()
        return False

    def problems(self) -> tuple[str, ...]:
        """From a failed publish until one succeeds (aiokafka reconnects silently)."""
        return (self._failing,) if self._failing else ()

    async def lag(self, pattern: str, *, group: str) -> Lag:
        """What ``group`` has not committed yet on ``pattern`` and the timestamp of the
        oldest such record, over the partitions of the topics matching it now (see
        :mod:`.lag`), within ``LAG_TIMEOUT`` (10 s). A message counts until the member's
        commit after its ack (``commit_interval``)."""
        admin = self._live_admin()
        validate_pattern(pattern)
        try:
            async with asyncio.timeout(LAG_TIMEOUT):
                client, ends = await self._ends_now(admin, pattern)
                return await group_lag(admin, client, self._peeking, group, ends)
        except (KafkaError, TimeoutError) as exc:
            why = repr(exc) if isinstance(exc, KafkaError) else f"none within {LAG_TIMEOUT:g}s"
            raise BrokerError(
                f"kafka: no answer about the lag of group {group!r} on {pattern!r} ({why}); "
                "are the brokers up?"
            ) from exc

    async def _ends_now(
        self, admin: AIOKafkaAdminClient, pattern: str
    ) -> tuple[AIOKafkaConsumer, dict[Any, int]]:
        """The offsets client, and the end offsets of the partitions of the topics matching
        ``pattern`` now (``declare`` and ``lag``; a ``KafkaError`` passes through)."""
        cfg = self.config
        exact = None if is_wildcard(pattern) else kafka_topic(pattern, cfg.topic_prefix)
        consumer = await self._offsets_client()
        regex = pattern_regex(pattern, cfg.topic_prefix)
        return consumer, await end_offsets(admin, consumer, regex, exact)

    async def _offsets_client(self) -> AIOKafkaConsumer:
        """A group-less consumer client for end and beginning offsets and the records
        ``lag`` reads (made on first use)."""
        async with self._lock:
            if self._producer is None:
                raise BrokerError("kafka broker is not started: call `await broker.start()` first")
            if self._offsets is None:
                client = self._new_consumer(enable_auto_commit=False, **PEEK_OPTIONS)
                try:
                    await client.start()
                except BaseException:
                    await close_client(client)
                    raise
                self._offsets = client
            return self._offsets

    def _new_consumer(self, **options: Any) -> AIOKafkaConsumer:
        """A consumer client of the brokers (one place, so a fault test can wrap it)."""
        cfg = self.config
        return AIOKafkaConsumer(
            bootstrap_servers=list(cfg.bootstrap_servers), client_id=cfg.client_id, **options
        )
