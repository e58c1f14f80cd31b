"""The NATS JetStream broker adapter.

``start`` connects (reconnecting forever after a server restart), then creates or checks the
stream and the two KV buckets it uses (partition leases, release counts). ``subscribe``
creates or checks the group's durable pull consumers, one per partition, then joins the
group (see :mod:`.subscription`). ``publish`` waits for the stream's ack (many publishes
wait at once: :mod:`.acks`); a failure that may pass (a timeout, no responders while the
server restarts) is retried with the same ``Nats-Msg-Id`` (the send id, else the envelope
id), so the server's duplicate window drops a copy that did get stored. Past
``publish_timeout`` the error says whether the message is maybe sent
(``PublishUnconfirmedError``: a request timed out) or not sent (``BrokerError``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
from collections.abc import Mapping
from datetime import UTC, datetime

from ..._logging import Throttled
from ...errors import (
    BackpressureError,
    BrokerError,
    MessageRefusedError,
    MissingDependencyError,
)
from ...groups import check_group, log_new_group
from ...patterns import validate_pattern, validate_topic
from ...ports import Lag, StartPosition, Subscription
from ...supervision import Supervisor
from .config import (
    TEMPORARY_INACTIVE,
    NatsBrokerConfig,
    consumer_name,
    group_id,
    partition_of,
)

try:
    from nats.aio.client import Client
    from nats.errors import ConnectionClosedError, MaxPayloadError, NoRespondersError
    from nats.errors import Error as NatsError
    from nats.js import JetStreamContext
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise MissingDependencyError("nats-py", "nats") from exc

from .acks import PubAcks
from .admin import (
    consumer_exists,
    delete_consumers,
    ensure_consumer,
    ensure_kv,
    ensure_stream,
)
from .answers import publish_error, too_large, unsent
from .connection import connect_first, discard, header_bytes
from .delivery import wire_headers
from .lag import group_lag
from .ledger import Leases, ReleaseLedger
from .refusals import Refusals
from .subscription import NatsSubscription
from .temporary import TemporarySubscription

__all__ = ["NatsBroker"]

_log = logging.getLogger("eventflow.nats")
_RETRY_PAUSE = 0.05
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
        self._acks: PubAcks | None = None
        self._leases: Leases | None = None
        self._releases: ReleaseLedger | None = None
        self._subs: set[NatsSubscription] = set()
        self._consumers: set[str] = set()
        self._topics: set[str] = set()
        self._refusals = Refusals(self.config.prefix)
        self._rr = 0
        self._closed = False
        self._lock = asyncio.Lock()
        self._supervisor: Supervisor | None = None
        self._own_supervisor: Supervisor | None = None  # when start() was given none
        self._warn = Throttled(_log)
        self._down_since: datetime | None = None  # disconnected from the servers since then
        self._last_error: Exception | None = None  # the client's latest error while down

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
            nc, js = await connect_first(
                self.config,
                self.url,
                self._setup,
                on_reconnected=self._on_reconnected,
                on_disconnected=self._on_disconnected,
                on_error=self._on_error,
            )
            acks = PubAcks(nc)
            try:
                await acks.start()
            except BaseException:  # leave nothing open
                await discard(nc)
                raise
            if supervisor is None:
                supervisor = self._own_supervisor = Supervisor(f"nats broker {self.url}")
            self._supervisor = supervisor
            self._nc, self._js, self._acks = nc, js, acks

    async def _setup(self, js: JetStreamContext) -> None:
        cfg = self.config
        await ensure_stream(js, cfg)
        leases = await ensure_kv(js, cfg, cfg.lease_bucket, cfg.effective_lease_ttl, strict=True)
        releases = await ensure_kv(js, cfg, cfg.release_bucket, cfg.release_ttl, strict=False)
        self._leases = Leases(leases, js, cfg.lease_bucket)
        self._releases = ReleaseLedger(releases)

    async def close(self) -> None:
        """Leave every group (held messages go back), then disconnect. Idempotent."""
        async with self._lock:
            self._closed = True
            nc, self._nc = self._nc, None
            acks, self._acks = self._acks, None
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
                if acks is not None:
                    await acks.close()
                await discard(nc)

    def problems(self) -> tuple[str, ...]:
        """``disconnected from NATS at URL since ...`` (with the client's last error) while
        the client reconnects; empty while connected."""
        since = self._down_since
        if since is None or self._closed:
            return ()
        error = self._last_error
        why = f"; last error: {type(error).__name__}: {error}" if error is not None else ""
        return (
            f"broker: disconnected from NATS at {self.url} since {since:%Y-%m-%d %H:%M:%SZ}, "
            f"reconnecting (publishes fail or wait until it is back){why}",
        )

    async def _on_reconnected(self) -> None:
        self._down_since = self._last_error = None
        _log.info("reconnected to NATS at %s", self.url)
        self._warn.clear("disconnected")
        self._warn.clear("error")
        for sub in list(self._subs):
            sub.on_reconnect()

    async def _on_disconnected(self) -> None:
        if self._nc is not None and not self._closed:
            self._down_since = self._down_since or datetime.now(UTC)
            self._warn.warning(
                "disconnected", "disconnected from NATS at %s; reconnecting", self.url
            )

    async def _on_error(self, exc: Exception) -> None:
        # The server refuses this client publishing to the subject; the request that
        # caused it only times out, so publish() learns it from here.
        self._refusals.note(exc)
        if self._nc is None:
            # Still connecting for the first time: the error goes into start's BrokerError.
            _log.debug("connecting to NATS at %s: %s", self.url, exc)
        elif not self._closed:
            if self._down_since is not None:
                self._last_error = exc
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
        full stream raises ``BackpressureError`` after that long. Past it, a publish that
        may have been stored (a request timed out) raises ``PublishUnconfirmedError``, one
        that was not (no JetStream, the broker closed before sending) a ``BrokerError``.
        """
        nc, acks = self._nc, self._acks
        if nc is None or acks is None:
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
        # The server's duplicate window knows a message by its send id: a deliberate
        # re-send's own (eventflow-send-id), else the envelope id, else one for this call.
        hdrs = wire_headers(headers, key, payload)
        size = len(payload) + header_bytes(hdrs)
        if size > nc.max_payload:
            # The server would answer a PUB over its max_payload by closing the connection.
            raise MessageRefusedError(too_large(topic, size, nc.max_payload))
        self._refusals.check(topic)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + cfg.publish_timeout
        pause = _RETRY_PAUSE
        full: str | None = None
        # True once an attempt may have been stored (its request timed out: while the server
        # is away the client buffers what it sends and sends it on reconnecting) and no later
        # JetStream answer said otherwise.
        maybe = False
        while True:
            remaining = deadline - loop.time()
            try:
                data = await acks.publish(
                    subject, payload, hdrs, max(0.05, min(cfg.request_timeout, remaining))
                )
            except ConnectionClosedError as exc:
                raise unsent(
                    self.config, topic, "the NATS broker is closed", headers or {}, maybe
                ) from exc
            except MaxPayloadError as exc:  # the limit of a server reconnected to meanwhile
                raise MessageRefusedError(too_large(topic, size, nc.max_payload)) from exc
            except (NoRespondersError, NatsError, TimeoutError) as exc:
                # Only a timeout leaves the attempt in doubt: the others fail before the
                # message leaves, or are the server saying nobody stores the subject yet.
                maybe = maybe or isinstance(exc, TimeoutError)
                problem: str = f"{type(exc).__name__}: {exc}"
            else:
                if b'"error"' not in data:
                    return
                # JetStream checks the message id before anything else: had an earlier
                # attempt been stored, this one would have been acked as a duplicate.
                maybe = False
                problem = publish_error(self.config, data, topic)
                full = problem
            if self._nc is None:
                raise unsent(
                    self.config,
                    topic,
                    "the NATS broker closed while publishing",
                    headers or {},
                    maybe,
                )
            self._refusals.check(topic)
            remaining = deadline - loop.time()
            if remaining <= 0:
                if full is not None and full == problem:
                    raise BackpressureError(
                        f"stream {cfg.stream!r} stayed full for {cfg.publish_timeout}s while "
                        f"publishing to {topic!r} ({problem}); add consumers, raise the stream "
                        "limits or slow the producer"
                    )
                why = f"JetStream did not confirm it within {cfg.publish_timeout}s ({problem})"
                raise unsent(self.config, topic, why, headers or {}, maybe)
            await asyncio.sleep(min(pause, remaining))
            pause = min(pause * 2, _MAX_RETRY_PAUSE)

    async def subscribe(
        self,
        pattern: str,
        *,
        group: str,
        start: StartPosition = "latest",
        temporary: bool = False,
    ) -> Subscription:
        """Join ``group`` on ``pattern`` (its consumers created at ``start`` if they do not
        exist); returns once this member holds its partitions. A ``temporary`` group's
        consumers begin at the end, expire ``TEMPORARY_INACTIVE`` seconds after their last
        pull and are deleted when this subscription closes."""
        nc = self._connection()
        js, supervisor, leases, releases = self._js, self._supervisor, self._leases, self._releases
        assert js is not None and supervisor is not None  # set with the connection
        assert leases is not None and releases is not None
        begin = check_group(pattern, group, "latest" if temporary else start)
        cfg = self.config
        gid = group_id(group, pattern)
        if temporary:
            await self._ensure_group(js, pattern, group, begin, inactive=TEMPORARY_INACTIVE)
        elif gid not in self._consumers:
            await self._ensure_group(js, pattern, group, begin)
        sub = NatsSubscription(
            cfg,
            nc,
            pattern=pattern,
            group=group,
            gid=gid,
            supervisor=supervisor,
            leases=leases,
            releases=releases,
            on_close=self._subs.discard,
        )
        self._subs.add(sub)
        try:
            await sub.start()
        except BaseException:
            await sub.close()
            raise
        if temporary:
            return TemporarySubscription(sub, functools.partial(self._forget, js, gid))
        return sub

    async def declare(
        self,
        pattern: str,
        *,
        group: str,
        start: StartPosition = "latest",
        create: bool = True,
    ) -> bool:
        """Whether ``group`` had consumers on ``pattern``; with ``create`` the missing ones
        are made (a new group at ``start``), without joining the group. They stay until
        deleted (or, with ``group_inactive_threshold``, until idle that long)."""
        self._connection()
        js = self._js
        assert js is not None  # set with the connection
        begin = check_group(pattern, group, start)
        if create:
            return await self._ensure_group(js, pattern, group, begin)
        cfg = self.config
        gid = group_id(group, pattern)
        found = await asyncio.gather(
            *(consumer_exists(js, cfg, consumer_name(gid, p)) for p in range(cfg.partitions))
        )
        return any(found)

    async def _forget(self, js: JetStreamContext, gid: str) -> None:
        """Delete a temporary group's consumers once its member left."""
        self._consumers.discard(gid)
        await delete_consumers(js, self.config, gid)

    async def _ensure_group(
        self,
        js: JetStreamContext,
        pattern: str,
        group: str,
        start: StartPosition,
        *,
        inactive: float | None = None,
    ) -> bool:
        """Create or update the group's partition consumers; whether any existed before (a
        group exists while its consumers do). A new group's creation is logged; consumers
        missing from an existing group (deleted by hand, or idle past
        ``group_inactive_threshold``) are made at ``start`` with a warning. ``inactive``
        overrides ``group_inactive_threshold`` (a temporary group's)."""
        cfg = self.config
        if inactive is not None:
            cfg = dataclasses.replace(cfg, group_inactive_threshold=inactive)
        gid = group_id(group, pattern)
        created = await asyncio.gather(
            *(ensure_consumer(js, cfg, gid, p, pattern, start) for p in range(cfg.partitions))
        )
        self._consumers.add(gid)
        if all(created):
            log_new_group(group, pattern, start)
            return False
        missing = [p for p, made in enumerate(created) if made]
        if missing:
            _log.warning(
                "group %s on %s had no NATS consumer for partitions %s (another member "
                "creating the group at this moment, or they were deleted or idle past "
                "group_inactive_threshold); made them at start=%r: messages of those "
                "partitions stored before now %s",
                group,
                pattern,
                missing,
                start,
                "are delivered" if start == "earliest" else "are not delivered",
            )
        return True

    async def lag(self, pattern: str, *, group: str) -> Lag:
        """What ``group`` has not handled yet on ``pattern`` and when the server stored the
        oldest of it: over its partition consumers, ``num_pending`` (not yet delivered)
        plus ``num_ack_pending`` (delivered and not acked: held by a member, live or dead,
        or waiting for redelivery), and the store time of the first message after each
        one's ack floor (see :mod:`.lag`). One consumer-info request per partition and one
        message get per partition with messages pending. A group nobody subscribed yet has
        ``Lag(0, None)``. Acks are sent without waiting, so one may count for a moment
        after ``ack`` returned."""
        self._connection()
        js = self._js
        assert js is not None  # set with the connection
        validate_pattern(pattern)
        return await group_lag(js, self.config, group_id(group, pattern), pattern)
