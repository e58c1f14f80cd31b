"""Settings of the NATS JetStream broker, URL parsing and the names derived from patterns.

Naming (see ``docs/nats.md``): one stream (``stream``, default ``EVENTFLOW``) captures
``<subject_prefix>.>``; a message for topic ``T`` with key ``K`` is stored on subject
``<prefix>.<partition(K)>.T``. A group ``G`` subscribed on pattern ``P`` owns one
durable pull consumer per partition ``i``, named ``<G'>_<hash(G, P)>_<i>`` and filtered on
``<prefix>.<i>.P``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
import zlib
from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import parse_qsl

from ...errors import ConfigurationError
from ...urls import redact_url, split_url

__all__ = [
    "DEFAULT_ACK_WAIT",
    "DEFAULT_PARTITIONS",
    "DEFAULT_STREAM",
    "LEASE_MARGIN",
    "TEMPORARY_INACTIVE",
    "NatsBrokerConfig",
    "consumer_name",
    "group_id",
    "partition_of",
]

DEFAULT_SERVERS = ("nats://127.0.0.1:4222",)
DEFAULT_STREAM = "EVENTFLOW"
DEFAULT_PARTITIONS = 8
DEFAULT_MAX_AGE = 7 * 24 * 3600.0
DEFAULT_DUPLICATE_WINDOW = 120.0
DEFAULT_ACK_WAIT = 4.0
DEFAULT_MAX_DELIVER = -1
DEFAULT_MAX_ACK_PENDING = 1000
DEFAULT_HEARTBEAT_INTERVAL = 1.0
DEFAULT_JOIN_TIMEOUT = 2.0
DEFAULT_PULL_EXPIRES = 1.0
TEMPORARY_INACTIVE = 60.0
"""Seconds after its last pull that the server removes a temporary group's consumer (its
process died without deleting it); a live member pulls every ``pull_expires``."""
DEFAULT_PUBLISH_TIMEOUT = 10.0
DEFAULT_REQUEST_TIMEOUT = 2.0
DEFAULT_CONNECT_TIMEOUT = 5.0
DEFAULT_RELEASE_TTL = 24 * 3600.0
LEASE_MARGIN = 0.5
"""Seconds a partition's lease must outlive the ack timers of every message its member
was handed (latency between the member's requests and the server's clocks)."""

_NAME_RE = re.compile(r"^[A-Za-z0-9_-]+$")
_TOKEN_RE = re.compile(r"^[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*$")
_UNSAFE = re.compile(r"[^A-Za-z0-9_-]")


@dataclass(frozen=True, slots=True)
class NatsBrokerConfig:
    """Settings of a :class:`~eventflow.adapters.nats.NatsBroker` (durations in seconds).

    Every app of one deployment must use the same ``stream``, ``subject_prefix``,
    ``partitions`` and ``lease_ttl``: they decide where messages go and who may read them.

    - ``ack_wait``: the server redelivers a message not acked (nor marked in progress) for
      this long; the adapter sends in-progress heartbeats every ``ack_wait / 3`` for every
      message it holds, so only a dead or stalled process loses its messages, and a killed
      member's messages come back after at most this long.
    - ``lease_ttl``: how long a partition stays claimed by a member that stopped refreshing
      its lease (a killed process): the failover time. A member refreshes its leases every
      ``ack_wait / 3`` and pulls only while its lease outlives the ack timers of what the
      pull may bring (``ack_wait + pull_expires`` + :data:`LEASE_MARGIN`), so a dead member's
      messages are redelivered before the partition's next messages (key order survives a
      crash). It defaults to, and must be at least, ``ack_wait + ack_wait / 3 +
      pull_expires + LEASE_MARGIN`` (6.8 s with the defaults).
    - ``max_deliver``: the server stops redelivering a message after this many deliveries and
      the message is gone without a trace. The default, ``-1``, is no limit: the consumer
      counts attempts from recorded handler failures and dead-letters a message itself, so a
      server-side limit could only drop messages silently. Set it (``>= 2``) only above the
      consumer's own bound on attempts, as a last safety net.
    - ``connect_timeout``: ``start`` fails with a ``BrokerError`` when the first connection
      (and the check of the stream and buckets) has not succeeded within this time; after
      that the client reconnects for ever.
    - ``max_ack_pending``: unacked messages per partition consumer (bounded buffers).
    - ``max_msgs`` / ``max_bytes``: stream limits (``-1`` none); a full stream refuses
      publishes, which wait up to ``publish_timeout`` and then raise ``BackpressureError``.
    """

    servers: tuple[str, ...] = DEFAULT_SERVERS
    user: str | None = None
    password: str | None = None
    token: str | None = None
    name: str = "eventflow"
    stream: str = DEFAULT_STREAM
    subject_prefix: str | None = None
    partitions: int = DEFAULT_PARTITIONS
    storage: Literal["file", "memory"] = "file"
    replicas: int = 1
    max_age: float = DEFAULT_MAX_AGE
    max_msgs: int = -1
    max_bytes: int = -1
    duplicate_window: float = DEFAULT_DUPLICATE_WINDOW
    ack_wait: float = DEFAULT_ACK_WAIT
    max_deliver: int = DEFAULT_MAX_DELIVER
    max_ack_pending: int = DEFAULT_MAX_ACK_PENDING
    lease_ttl: float | None = None
    heartbeat_interval: float = DEFAULT_HEARTBEAT_INTERVAL
    join_timeout: float = DEFAULT_JOIN_TIMEOUT
    pull_expires: float = DEFAULT_PULL_EXPIRES
    publish_timeout: float = DEFAULT_PUBLISH_TIMEOUT
    request_timeout: float = DEFAULT_REQUEST_TIMEOUT
    connect_timeout: float = DEFAULT_CONNECT_TIMEOUT
    release_ttl: float = DEFAULT_RELEASE_TTL
    group_inactive_threshold: float | None = None

    def __post_init__(self) -> None:
        if not self.servers:
            raise ConfigurationError("NATS broker needs at least one server URL")
        if not _NAME_RE.match(self.stream):
            raise ConfigurationError(
                f"invalid stream name {self.stream!r}: use letters, digits, '_' and '-'"
            )
        if self.subject_prefix is not None and not _TOKEN_RE.match(self.subject_prefix):
            raise ConfigurationError(
                f"invalid subject_prefix {self.subject_prefix!r}: use dot-separated tokens "
                "of letters, digits, '_' and '-'"
            )
        if self.partitions < 1 or self.partitions > 1024:
            raise ConfigurationError("partitions must be between 1 and 1024")
        if self.storage not in ("file", "memory"):
            raise ConfigurationError("storage must be 'file' or 'memory'")
        if self.max_deliver != -1 and self.max_deliver < 2:
            raise ConfigurationError(
                f"max_deliver must be -1 (no limit, the default) or at least 2, got "
                f"{self.max_deliver}; a limit must stay above the consumer's own bound on "
                "attempts, or the server drops messages before they are dead-lettered"
            )
        for field in (
            "ack_wait",
            "heartbeat_interval",
            "join_timeout",
            "pull_expires",
            "publish_timeout",
            "request_timeout",
            "connect_timeout",
            "duplicate_window",
            "release_ttl",
        ):
            if getattr(self, field) <= 0:
                raise ConfigurationError(f"{field} must be > 0 seconds")
        least = self.shortest_lease_ttl
        if self.lease_ttl is not None and self.lease_ttl < least:
            raise ConfigurationError(
                f"lease_ttl ({self.lease_ttl}s) must be at least ack_wait + ack_wait/3 + "
                f"pull_expires + {LEASE_MARGIN} = {least:.2f}s: a member refreshes its leases "
                "every ack_wait/3 and pulls only while its lease outlives the ack timers of "
                "what it pulls, so a killed member's messages are redelivered before its "
                "partitions move on; raise lease_ttl or leave it unset"
            )

    @property
    def prefix(self) -> str:
        """The subjects' first token(s): ``subject_prefix``, or the stream name in lower case
        (``EVENTFLOW`` -> ``eventflow``), so two streams on one server never overlap."""
        return self.subject_prefix if self.subject_prefix is not None else self.stream.lower()

    @property
    def keepalive_interval(self) -> float:
        """How often a member refreshes its leases and sends in-progress heartbeats for the
        messages it holds: ``ack_wait / 3``."""
        return self.ack_wait / 3

    @property
    def pull_guard(self) -> float:
        """The life a lease must have left, beyond a pull's expiry, for its member to pull
        (or to extend an ack timer): ``ack_wait`` + :data:`LEASE_MARGIN`."""
        return self.ack_wait + LEASE_MARGIN

    @property
    def shortest_lease_ttl(self) -> float:
        """``ack_wait + ack_wait/3 + pull_expires + LEASE_MARGIN``: with a shorter lease a
        member could not pull for the whole of each refresh interval."""
        return self.pull_guard + self.keepalive_interval + self.pull_expires

    @property
    def effective_lease_ttl(self) -> float:
        """``lease_ttl``, or :attr:`shortest_lease_ttl` (a partition of a killed member moves
        at most this long after the kill)."""
        if self.lease_ttl is not None:
            return self.lease_ttl
        return self.shortest_lease_ttl

    @property
    def lease_bucket(self) -> str:
        """The KV bucket holding partition leases: ``<stream>_leases``."""
        return f"{self.stream}_leases"

    @property
    def release_bucket(self) -> str:
        """The KV bucket counting releases per message: ``<stream>_releases``."""
        return f"{self.stream}_releases"

    @property
    def control_prefix(self) -> str:
        """Core-NATS subject prefix of group membership heartbeats (outside the stream)."""
        return f"_eventflow.{self.stream}"

    @classmethod
    def from_url(cls, url: str) -> NatsBrokerConfig:
        """Parse ``nats://[user:pass@]host:port[,host2:port][?option=value&...]``.

        Options are the field names of this class (``stream``, ``partitions``,
        ``ack_wait``, ...); ``token`` may also be given as a user without password.
        """
        parts = split_url(url, kind="NATS broker", form="nats://host:4222", port=4222)
        if parts.scheme not in ("nats", "tls"):
            raise ConfigurationError(f"not a NATS URL: {redact_url(url)!r} (use nats://host:4222)")
        netloc = parts.netloc
        userinfo, _, hosts_part = netloc.rpartition("@")
        hosts = [h.strip() for h in hosts_part.split(",") if h.strip()]
        if not hosts:
            raise ConfigurationError(
                f"NATS URL {redact_url(url)!r} names no host: use nats://host:4222"
            )
        values: dict[str, Any] = {
            "servers": tuple(f"{parts.scheme}://{h if ':' in h else h + ':4222'}" for h in hosts)
        }
        if userinfo:
            user, sep, password = userinfo.partition(":")
            if sep:
                values["user"], values["password"] = user, password
            else:
                values["token"] = user
        fields = {f.name: f for f in dataclasses.fields(cls)}
        for name, raw in parse_qsl(parts.query, keep_blank_values=True):
            field = fields.get(name)
            if field is None or name in ("servers", "user", "password"):
                known = ", ".join(sorted(n for n in fields if n not in ("servers",)))
                raise ConfigurationError(f"unknown NATS URL option {name!r}; known: {known}")
            values[name] = _convert(name, str(field.type), raw)
        return cls(**values)


def _convert(name: str, kind: str, raw: str) -> Any:
    try:
        if raw.lower() in ("", "none") and "None" in kind:
            return None
        if kind.startswith("int"):
            return int(raw)
        if kind.startswith("float"):
            return float(raw)
        return raw
    except ValueError as exc:
        raise ConfigurationError(f"NATS URL option {name}={raw!r} is not a {kind}") from exc


def partition_of(key: str, partitions: int) -> int:
    """The partition of ``key``: CRC-32 of its UTF-8 bytes modulo ``partitions``.

    Stable across processes and Python versions (unlike ``hash``), so every publisher of a
    deployment puts one key in the same partition.
    """
    return zlib.crc32(key.encode()) % partitions


def group_id(group: str, pattern: str) -> str:
    """The name stem of a (group, pattern) pair: readable group, then a hash of both."""
    digest = hashlib.sha256(f"{group}\0{pattern}".encode()).hexdigest()[:12]
    return f"{_UNSAFE.sub('_', group)[:40]}_{digest}"


def consumer_name(gid: str, partition: int) -> str:
    """The durable consumer of partition ``partition`` for the (group, pattern) ``gid``."""
    return f"{gid}_{partition}"
