"""The NATS JetStream broker adapter.

``start`` connects (reconnecting forever after a server restart), then creates or checks the
stream and the two KV buckets it uses (partition leases, release counts). ``subscribe``
creates or checks the group's durable pull consumers, one per partition, then joins the
group (see :mod:`.subscription`). ``publish`` waits for the stream's ack; an ambiguous
failure (timeout, no responders while the server restarts) is retried with the same
``Nats-Msg-Id``, so the server's duplicate window drops a copy that did get stored.
"""

from __future__ import annotations

import asyncio
import logging
import re
import uuid
from collections.abc import Mapping
from typing import Any

from ..._logging import Throttled
from ...errors import (
    BackpressureError,
    BrokerError,
    ConfigurationError,
    MessageRefusedError,
    MissingDependencyError,
)
from ...patterns import validate_pattern, validate_topic
from ...ports import Subscription
from ...supervision import Supervisor
from .config import NatsBrokerConfig, consumer_name, group_id, partition_of

try:
    from nats.aio.client import Client
    from nats.errors import ConnectionClosedError, MaxPayloadError, NoRespondersError
    from nats.errors import Error as NatsError
    from nats.js import JetStreamContext
    from nats.js.api import (
        AckPolicy,
        ConsumerConfig,
        DeliverPolicy,
        DiscardPolicy,
        KeyValueConfig,
        RetentionPolicy,
        StorageType,
        StreamConfig,
    )
    from nats.js.errors import APIError, BucketNotFoundError, KeyNotFoundError, NotFoundError
    from nats.js.kv import KeyValue
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise MissingDependencyError("nats-py", "nats") from exc

from .connection import connect_first, discard, header_bytes
from .subscription import KEY_HEADER, MSG_ID_HEADER, NatsSubscription

__all__ = ["NatsBroker"]

_log = logging.getLogger("eventflow.nats")
_ENVELOPE_ID_HEADER = "eventflow-id"
_PARTITIONS_META = "eventflow.partitions"
_RETRY_PAUSE = 0.05
_DENIED = re.compile(r'permissions violation for publish to "([^"]+)"', re.IGNORECASE)
_DENIED_FOR = 60.0
_MAX_DENIED = 1024
_MAX_RETRY_PAUSE = 0.5


class NatsBroker:
    """A :class:`~eventflow.ports.Broker` on NATS JetStream.

    ``NatsBroker(NatsBrokerConfig(servers=("nats://host:4222",)))`` or
    ``NatsBroker.from_url("nats://host:4222,host2:4222?stream=ORDERS&partitions=16")``.
    See ``docs/nats.md`` for names, settings and guarantees.
    """

    def __init__(self, config: NatsBrokerConfig | None = None) -> None:
        self.config = config or NatsBrokerConfig()
        self._nc: Client | None = None
        self._js: JetStreamContext | None = None
        self._lease_kv: KeyValue | None = None
        self._release_kv: KeyValue | None = None
        self._subs: set[NatsSubscription] = set()
        self._consumers: set[str] = set()
        self._topics: set[str] = set()
        self._denied: dict[str, float] = {}  # topic -> when the server refused a publish
        self._rr = 0
        self._closed = False
        self._lock = asyncio.Lock()
        self._supervisor: Supervisor | None = None
        self._own_supervisor: Supervisor | None = None  # when start() was given none
        self._connect_error: Exception | None = None  # the last error of the first connect
        self._warn = Throttled(_log)

    @classmethod
    def from_url(cls, url: str) -> NatsBroker:
        """Build a broker from ``nats://host:port[,host2:port][?option=value&...]``."""
        return cls(NatsBrokerConfig.from_url(url))

    @property
    def url(self) -> str:
        """``nats://host:port[,...]?stream=NAME`` (no credentials)."""
        hosts = ",".join(s.split("://", 1)[-1].rpartition("@")[2] for s in self.config.servers)
        return f"nats://{hosts}?stream={self.config.stream}"

    async def __aenter__(self) -> NatsBroker:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self, supervisor: Supervisor | None = None) -> None:
        """Connect and create or check the stream and KV buckets, within ``connect_timeout``
        (then a ``BrokerError`` names the URL and what to check); cancelling it stops it at
        once and leaves nothing open. Group coordination runs as components of
        ``supervisor``, or of a supervisor of the broker's own. Idempotent."""
        async with self._lock:
            if self._nc is not None:
                return
            if self._closed:
                raise BrokerError("this NATS broker was closed; create a new one")
            self._connect_error = None
            nc, js = await connect_first(self, self._setup)
            if supervisor is None:
                supervisor = self._own_supervisor = Supervisor(f"nats broker {self.url}")
            self._supervisor = supervisor
            self._nc, self._js = nc, js

    async def _setup(self, js: JetStreamContext) -> None:
        cfg = self.config
        await self._ensure_stream(js)
        self._lease_kv = await self._ensure_kv(
            js, cfg.lease_bucket, cfg.effective_lease_ttl, strict=True
        )
        self._release_kv = await self._ensure_kv(
            js, cfg.release_bucket, cfg.release_ttl, strict=False
        )

    async def close(self) -> None:
        """Leave every group (held messages go back), then disconnect. Idempotent."""
        async with self._lock:
            self._closed = True
            nc, self._nc = self._nc, None
            own, self._own_supervisor = self._own_supervisor, None
            if nc is None:
                return
            try:
                for sub in list(self._subs):
                    await sub.close()
                self._subs.clear()
            finally:
                if own is not None:
                    await own.close()
                await discard(nc)

    async def _on_reconnected(self) -> None:
        _log.info("reconnected to NATS at %s", self.url)
        self._warn.clear("disconnected")
        self._warn.clear("error")
        for sub in list(self._subs):
            sub.on_reconnect()

    async def _on_disconnected(self) -> None:
        if self._nc is not None and not self._closed:
            self._warn.warning(
                "disconnected", "disconnected from NATS at %s; reconnecting", self.url
            )

    async def _on_error(self, exc: Exception) -> None:
        denied = _DENIED.search(str(exc))
        if denied is not None:
            # The server refuses this client publishing to the subject; the request that
            # caused it only times out, so publish() learns it from here, per topic (its
            # subjects differ by partition).
            subject, head = denied.group(1), f"{self.config.prefix}."
            topic = subject[len(head) :].partition(".")[2] if subject.startswith(head) else ""
            if topic:
                if len(self._denied) >= _MAX_DENIED:
                    self._denied.clear()
                self._denied[topic] = asyncio.get_running_loop().time()
        if self._nc is None:
            # Still connecting for the first time: the error goes into start's BrokerError.
            self._connect_error = exc
            _log.debug("connecting to NATS at %s: %s", self.url, exc)
        elif not self._closed:
            self._warn.warning("error", "NATS client error (%s): %s", self.url, exc)

    def _connection(self) -> Client:
        nc = self._nc
        if nc is None:
            raise BrokerError(
                "NATS broker is closed"
                if self._closed
                else "NATS broker is not started: call `await broker.start()` first"
            )
        return nc

    # -- setup -------------------------------------------------------------------------------

    async def _ensure_stream(self, js: JetStreamContext) -> None:
        cfg = self.config
        subject = f"{cfg.prefix}.>"
        try:
            info = await js.stream_info(cfg.stream)
        except NotFoundError:
            stream = StreamConfig(
                name=cfg.stream,
                description="eventflow messages: <prefix>.<partition>.<topic>",
                subjects=[subject],
                retention=RetentionPolicy.LIMITS,
                storage=StorageType.FILE if cfg.storage == "file" else StorageType.MEMORY,
                num_replicas=cfg.replicas,
                max_age=cfg.max_age,
                max_msgs=cfg.max_msgs,
                max_bytes=cfg.max_bytes,
                discard=DiscardPolicy.NEW,  # a full stream refuses publishes: none is dropped
                duplicate_window=cfg.duplicate_window,
                metadata={_PARTITIONS_META: str(cfg.partitions)},
            )
            try:
                info = await js.add_stream(stream)
            except APIError as exc:
                if "overlap" in str(exc):
                    raise ConfigurationError(
                        f"cannot create NATS stream {cfg.stream!r} on {subject!r}: another "
                        "stream captures those subjects; choose another subject_prefix="
                    ) from exc
                info = await js.stream_info(cfg.stream)  # created concurrently by another app
        subjects = info.config.subjects or []
        if subject not in subjects:
            raise ConfigurationError(
                f"NATS stream {cfg.stream!r} exists with subjects {subjects}, not {subject!r}; "
                "choose another stream= or subject_prefix= (or delete the stream)"
            )
        stored = (info.config.metadata or {}).get(_PARTITIONS_META)
        if stored is not None and int(stored) != cfg.partitions:
            raise ConfigurationError(
                f"NATS stream {cfg.stream!r} was created with {stored} partitions, this broker "
                f"uses {cfg.partitions}; every app must use the same partitions= (changing it "
                "needs a new stream)"
            )

    async def _ensure_kv(
        self, js: JetStreamContext, bucket: str, ttl: float, *, strict: bool
    ) -> KeyValue:
        try:
            kv = await js.key_value(bucket)
        except BucketNotFoundError:
            cfg = self.config
            storage = StorageType.FILE if cfg.storage == "file" else StorageType.MEMORY
            try:
                return await js.create_key_value(
                    KeyValueConfig(
                        bucket=bucket,
                        history=1,
                        ttl=ttl,
                        storage=storage,
                        replicas=cfg.replicas,
                    )
                )
            except APIError:
                kv = await js.key_value(bucket)
        if strict:
            status = await kv.status()
            have = status.ttl or 0.0
            if abs(have - ttl) > 0.01 * ttl:
                raise ConfigurationError(
                    f"KV bucket {bucket!r} has a TTL of {have}s but this broker's lease TTL is "
                    f"{ttl}s; use the same ack_wait/lease_ttl in every app of the deployment "
                    f"(or delete the bucket when no app runs)"
                )
        return kv

    async def _ensure_consumers(self, gid: str, pattern: str) -> None:
        if gid in self._consumers:
            return
        js = self._js
        assert js is not None
        await asyncio.gather(
            *(self._ensure_consumer(js, gid, p, pattern) for p in range(self.config.partitions))
        )
        self._consumers.add(gid)

    async def _ensure_consumer(
        self, js: JetStreamContext, gid: str, partition: int, pattern: str
    ) -> None:
        cfg = self.config
        name = consumer_name(gid, partition)
        subject = f"{cfg.prefix}.{partition}.{pattern}"
        config = ConsumerConfig(
            name=name,
            durable_name=name,
            description=f"eventflow group partition {partition} on {pattern}",
            deliver_policy=DeliverPolicy.NEW,
            ack_policy=AckPolicy.EXPLICIT,
            ack_wait=cfg.ack_wait,
            max_deliver=cfg.max_deliver,
            max_ack_pending=cfg.max_ack_pending,
            filter_subject=subject,
            inactive_threshold=cfg.group_inactive_threshold,
        )
        try:
            # The server updates an existing consumer whose editable settings differ (such
            # as max_deliver), so a deployment upgraded to new settings gets them.
            await js.add_consumer(cfg.stream, config=config)
            return
        except APIError as exc:
            error = exc
        try:
            info = await js.consumer_info(cfg.stream, name)
        except NotFoundError:
            raise BrokerError(f"cannot create NATS consumer {name!r}: {error}") from error
        if info.config.filter_subject != subject:
            raise ConfigurationError(
                f"NATS consumer {name!r} exists with filter {info.config.filter_subject!r}, "
                f"not {subject!r}; delete it (nats consumer rm {cfg.stream} {name})"
            )
        have = info.config.max_deliver
        if have is not None and have != cfg.max_deliver:
            _log.warning(
                "NATS consumer %s keeps max_deliver=%s and could not be updated to %s (%s): "
                "the server drops a message delivered that often without a trace; change it "
                "(nats consumer edit %s %s --max-deliver=%s) or delete the consumer",
                name,
                have,
                cfg.max_deliver,
                error,
                cfg.stream,
                name,
                cfg.max_deliver,
            )
            return
        _log.warning("NATS consumer %s exists with other settings (%s); using it", name, error)

    # -- KV helpers used by subscriptions -----------------------------------------------------

    def _leases(self) -> KeyValue:
        if self._lease_kv is None:
            raise BrokerError("NATS broker is not started")
        return self._lease_kv

    async def _record_release(self, consumer: str, seq: int, count: int) -> None:
        """Remember that message ``seq`` of ``consumer`` was given back unseen ``count`` times."""
        kv = self._release_kv
        if kv is not None:
            await kv.put(f"{consumer}.{seq}", b"%d" % count)

    async def _released(self, consumer: str, seq: int) -> int:
        """How many deliveries of ``seq`` were released (not to be counted)."""
        kv = self._release_kv
        if kv is None:
            return 0
        try:
            entry = await kv.get(f"{consumer}.{seq}")
        except KeyNotFoundError:
            return 0
        except NatsError as exc:
            self._warn.warning(
                "release-count", "could not read release count of %s/%d: %s", consumer, seq, exc
            )
            return 0
        return int(entry.value or b"0")

    async def _forget_release(self, consumer: str, seq: int) -> None:
        kv = self._release_kv
        if kv is not None:
            try:
                await kv.purge(f"{consumer}.{seq}")
            except NatsError as exc:
                _log.debug("could not purge release count: %s", exc)

    def _forget(self, sub: NatsSubscription) -> None:
        self._subs.discard(sub)

    # -- the port ----------------------------------------------------------------------------

    async def publish(
        self,
        topic: str,
        payload: bytes,
        *,
        key: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        """Store ``payload`` in the stream; returns once JetStream acked it.

        Retries ambiguous failures with the same message id until ``publish_timeout``; a
        full stream raises ``BackpressureError`` after that long.
        """
        nc = self._nc
        if nc is None:
            self._connection()
            raise AssertionError  # unreachable: _connection raised
        cfg = self.config
        if topic not in self._topics:
            validate_topic(topic)
            if len(self._topics) < 10_000:
                self._topics.add(topic)
        if key is not None:
            partition = partition_of(key, cfg.partitions)
        else:
            partition = self._rr = (self._rr + 1) % cfg.partitions
        subject = f"{cfg.prefix}.{partition}.{topic}"
        hdrs: dict[str, str] = dict(headers) if headers else {}
        hdrs[MSG_ID_HEADER] = hdrs.get(_ENVELOPE_ID_HEADER) or uuid.uuid4().hex
        if key is not None:
            hdrs[KEY_HEADER] = key
        size = len(payload) + header_bytes(hdrs)
        if size > nc.max_payload:
            # The server would answer a PUB over its max_payload by closing the connection.
            raise MessageRefusedError(self._too_large(topic, size, nc.max_payload))
        self._check_allowed(topic)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + cfg.publish_timeout
        pause = _RETRY_PAUSE
        full: str | None = None
        while True:
            remaining = deadline - loop.time()
            try:
                reply = await nc.request(
                    subject,
                    payload,
                    timeout=max(0.05, min(cfg.request_timeout, remaining)),
                    headers=hdrs,
                )
            except ConnectionClosedError as exc:
                raise BrokerError("NATS broker is closed; cannot publish") from exc
            except MaxPayloadError as exc:  # the limit of a server reconnected to meanwhile
                raise MessageRefusedError(self._too_large(topic, size, nc.max_payload)) from exc
            except (NoRespondersError, NatsError, TimeoutError) as exc:
                problem: str = f"{type(exc).__name__}: {exc}"
            else:
                data = reply.data
                if b'"error"' not in data:
                    return
                problem = self._publish_error(data, topic)
                full = problem
            if self._nc is None:
                raise BrokerError("NATS broker closed while publishing")
            self._check_allowed(topic)
            remaining = deadline - loop.time()
            if remaining <= 0:
                if full is not None and full == problem:
                    raise BackpressureError(
                        f"stream {cfg.stream!r} stayed full for {cfg.publish_timeout}s while "
                        f"publishing to {topic!r} ({problem}); add consumers, raise the stream "
                        "limits or slow the producer"
                    )
                raise BrokerError(
                    f"publish to {topic!r} not confirmed by JetStream within "
                    f"{cfg.publish_timeout}s ({problem}); is the server up? it is safe to "
                    "retry: the message id makes a retry a no-op if the first copy was stored"
                )
            await asyncio.sleep(min(pause, remaining))
            pause = min(pause * 2, _MAX_RETRY_PAUSE)

    def _check_allowed(self, topic: str) -> None:
        """Raise ``MessageRefusedError`` if the server refused this client a publish to
        ``topic`` lately (permissions may change with a reload, so a refusal is believed
        for ``_DENIED_FOR`` seconds)."""
        at = self._denied.get(topic)
        if at is None:
            return
        if asyncio.get_running_loop().time() - at > _DENIED_FOR:
            del self._denied[topic]
            return
        raise MessageRefusedError(
            f"NATS refuses this client publishing to {topic!r} (a permissions violation on "
            f"its subjects {self.config.prefix}.<partition>.{topic}); it is not retried: "
            "grant the user publish permission on them in the server's configuration"
        )

    def _too_large(self, topic: str, size: int, limit: int) -> str:
        return (
            f"NATS refuses the message for {topic!r}: {size} bytes with its headers, over the "
            f"server's max_payload of {limit} bytes; it is not retried: make the message "
            "smaller (or store the data elsewhere and send a reference), or raise max_payload "
            "in the server's configuration"
        )

    def _publish_error(self, data: bytes, topic: str) -> str:
        """The problem JetStream's error reply names, if it may pass (retried until the
        deadline); raise ``MessageRefusedError`` for a refusal that will not."""
        import orjson

        try:
            error: dict[str, Any] = orjson.loads(data)["error"]
        except (orjson.JSONDecodeError, KeyError, TypeError):
            return data.decode(errors="replace")
        text = str(error.get("description", error))
        code = error.get("code")
        if (
            code == 503
            or "maximum messages" in text
            or "maximum bytes" in text
            or "insufficient resources" in text
        ):
            return text  # stream full, or the server not ready: retried until the deadline
        if isinstance(code, int) and 400 <= code < 500:
            raise MessageRefusedError(
                f"JetStream refused a message for {topic!r} for good: {text} (error "
                f"{error.get('err_code', code)}); it is not retried: fix the message, or the "
                f"limits of stream {self.config.stream!r} (max_msg_size)"
            )
        raise BrokerError(
            f"JetStream could not store a message for {topic!r}: {text}; this may pass, "
            "publish it again later"
        )

    async def subscribe(self, pattern: str, *, group: str) -> Subscription:
        """Join ``group`` on ``pattern``; returns once this member holds its partitions."""
        self._connection()
        validate_pattern(pattern)
        if not group:
            raise ConfigurationError("a consumer group name must be non-empty")
        gid = group_id(group, pattern)
        await self._ensure_consumers(gid, pattern)
        sub = NatsSubscription(self, pattern, group, gid)
        self._subs.add(sub)
        try:
            await sub.start()
        except BaseException:
            await sub.close()
            raise
        return sub
