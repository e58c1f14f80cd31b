"""Settings of the Kafka broker adapter, ``kafka://`` URL parsing and topic naming.

This module does not import aiokafka, so configurations can be built and checked without it.

Topic naming: an eventflow topic ``order.placed`` is the Kafka topic ``<topic_prefix>order.placed``.
Kafka topic names allow only ``[a-zA-Z0-9._-]`` (at most 249 characters), so an eventflow
topic using other characters is refused with a :class:`~eventflow.errors.ConfigurationError`.
A pattern with wildcards becomes an anchored topic regex: ``*`` is ``[^.]+`` (one token) and
``>`` is ``[^.]+(\\.[^.]+)*`` (one or more tokens).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl

from ...errors import ConfigurationError
from ...patterns import is_wildcard, validate_pattern, validate_topic
from ...urls import split_url

__all__ = [
    "DEFAULT_BATCH_BYTES",
    "DEFAULT_COMMIT_INTERVAL",
    "DEFAULT_CONNECT_TIMEOUT",
    "DEFAULT_HEARTBEAT_INTERVAL",
    "DEFAULT_MAX_BUFFER",
    "DEFAULT_MAX_MESSAGE_BYTES",
    "DEFAULT_MAX_POLL_INTERVAL",
    "DEFAULT_METADATA_MAX_AGE",
    "DEFAULT_PARTITIONS",
    "DEFAULT_PUBLISH_TIMEOUT",
    "DEFAULT_REBALANCE_TIMEOUT",
    "DEFAULT_REVOKE_TIMEOUT",
    "DEFAULT_SESSION_TIMEOUT",
    "EXACT_METADATA_MAX_AGE",
    "KafkaBrokerConfig",
    "kafka_topic",
    "pattern_regex",
]

DEFAULT_PARTITIONS = 8
DEFAULT_PUBLISH_TIMEOUT = 30.0
DEFAULT_SESSION_TIMEOUT = 6.0
DEFAULT_HEARTBEAT_INTERVAL = 0.5
DEFAULT_MAX_POLL_INTERVAL = 300.0
DEFAULT_REBALANCE_TIMEOUT = 60.0
DEFAULT_REVOKE_TIMEOUT = 30.0
DEFAULT_COMMIT_INTERVAL = 0.5
DEFAULT_METADATA_MAX_AGE = 2.0
EXACT_METADATA_MAX_AGE = 30.0
DEFAULT_MAX_BUFFER = 2000
DEFAULT_CONNECT_TIMEOUT = 10.0
DEFAULT_MAX_MESSAGE_BYTES = 1024 * 1024
DEFAULT_BATCH_BYTES = 64 * 1024
_IDEMPOTENCE = ("auto", "on", "off")
_LEGAL = re.compile(r"^[A-Za-z0-9._-]+$")


@dataclass(frozen=True, slots=True)
class KafkaBrokerConfig:
    """Settings of a :class:`~eventflow.adapters.kafka.KafkaBroker`; durations in seconds.

    - ``bootstrap_servers``: ``host:port`` of one or more brokers.
    - ``topic_prefix``: prepended to every Kafka topic name (``"prod."``), stripped on delivery.
    - ``partitions`` / ``replication_factor``: used when the adapter creates a topic (on the
      first publish or subscribe naming it, if ``create_topics``). Production: 3 replicas.
    - ``idempotence``: ``"auto"`` uses the idempotent producer when the broker supports it
      and falls back (with a warning) when it does not; ``"on"`` fails instead; ``"off"``.
    - ``session_timeout`` / ``heartbeat_interval``: how soon a dead member's partitions move:
      the group drops a member that sent no heartbeat for ``session_timeout`` (6 s), and the
      others learn of the rebalance at their next heartbeat (every 0.5 s), so a killed
      member's partitions are consumed again within about 7 s of the kill (Tansu holds each
      rebalance half a session timeout: about 9 s there). Apache Kafka refuses a session
      timeout below the brokers' ``group.min.session.timeout.ms``, 6 s by default: the
      default is the shortest it accepts.
    - ``max_poll_interval``: Kafka's poll deadline. The adapter polls from a background task
      whatever the handlers do, so slow handlers cannot trip it.
    - ``rebalance_timeout``: how long the group waits for members to rejoin a rebalance.
    - ``revoke_timeout``: on a rebalance, how long a member waits for its in-flight messages
      to be acked before committing and giving up its partitions (keep it below
      ``rebalance_timeout``). Messages still unacked then are redelivered elsewhere.
    - ``commit_interval``: how often acked offsets (and delivery counts) are committed.
    - ``metadata_max_age``: how often a wildcard subscription's consumer asks for the
      topics there are (2 s), so how soon a new topic matching it is seen (plus a rebalance
      of its group); a subscription to one topic asks every ``EXACT_METADATA_MAX_AGE``
      (30 s), or ``metadata_max_age`` if longer.
    - ``max_buffer``: records prefetched per subscription before its partitions are paused.
    - ``publish_timeout``: a publish not accepted in this time raises ``BackpressureError``.
    - ``connect_timeout``: ``start`` fails with a ``BrokerError`` when no bootstrap server
      has answered and the clients have not connected within this time (aiokafka's own
      timeouts are far longer); after that the clients reconnect for ever.
    - ``max_message_bytes``: the producer refuses a record larger than this (key, value and
      headers, as encoded) with ``MessageRefusedError``, before sending it. Kafka's own
      default limit (``message.max.bytes``) is about 1 MB too; raise both together.
    - ``batch_bytes``: the producer's batch per partition (aiokafka's ``max_batch_size``),
      also the most it buffers per partition while a request is in flight. aiokafka sends
      one request per broker at a time, one batch per partition in it; a publish that finds
      its partition's batch full waits for it to go. 64 KiB (aiokafka's default is 16 KiB)
      lets a window of concurrent publishes join the next request instead of waiting.
    """

    bootstrap_servers: tuple[str, ...] = ("127.0.0.1:9092",)
    client_id: str = "eventflow"
    topic_prefix: str = ""
    create_topics: bool = True
    partitions: int = DEFAULT_PARTITIONS
    replication_factor: int = 1
    idempotence: str = "auto"
    linger: float = 0.0
    publish_timeout: float = DEFAULT_PUBLISH_TIMEOUT
    session_timeout: float = DEFAULT_SESSION_TIMEOUT
    heartbeat_interval: float = DEFAULT_HEARTBEAT_INTERVAL
    max_poll_interval: float = DEFAULT_MAX_POLL_INTERVAL
    rebalance_timeout: float = DEFAULT_REBALANCE_TIMEOUT
    revoke_timeout: float = DEFAULT_REVOKE_TIMEOUT
    commit_interval: float = DEFAULT_COMMIT_INTERVAL
    metadata_max_age: float = DEFAULT_METADATA_MAX_AGE
    max_buffer: int = DEFAULT_MAX_BUFFER
    connect_timeout: float = DEFAULT_CONNECT_TIMEOUT
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    batch_bytes: int = DEFAULT_BATCH_BYTES

    def __post_init__(self) -> None:
        if not self.bootstrap_servers or not all(self.bootstrap_servers):
            raise ConfigurationError("kafka: give at least one bootstrap server as host:port")
        if self.idempotence not in _IDEMPOTENCE:
            raise ConfigurationError(
                f"kafka: idempotence must be one of {', '.join(_IDEMPOTENCE)}, "
                f"got {self.idempotence!r}"
            )
        if self.partitions < 1 or self.replication_factor < 1 or self.max_buffer < 1:
            raise ConfigurationError(
                "kafka: partitions, replication_factor and max_buffer must be >= 1"
            )
        if self.connect_timeout <= 0 or self.max_message_bytes < 1 or self.batch_bytes < 1:
            raise ConfigurationError(
                "kafka: connect_timeout must be > 0 seconds, max_message_bytes and batch_bytes >= 1"
            )
        if self.heartbeat_interval >= self.session_timeout:
            raise ConfigurationError(
                f"kafka: heartbeat_interval ({self.heartbeat_interval}s) must be below "
                f"session_timeout ({self.session_timeout}s); a third of it is usual"
            )
        if self.revoke_timeout >= self.rebalance_timeout:
            raise ConfigurationError(
                f"kafka: revoke_timeout ({self.revoke_timeout}s) must be below "
                f"rebalance_timeout ({self.rebalance_timeout}s), or the group evicts members "
                "that wait for their in-flight messages"
            )
        if self.topic_prefix and not _LEGAL.match(self.topic_prefix):
            raise ConfigurationError(
                f"kafka: topic_prefix {self.topic_prefix!r} may only use letters, digits, "
                "'.', '_' and '-'"
            )

    @classmethod
    def from_url(cls, url: str) -> KafkaBrokerConfig:
        """Parse ``kafka://host:9092[,host2:9092][?option=value&...]``.

        Options are the field names of this class (``?partitions=3&session_timeout=10``);
        booleans take ``true``/``false``.
        """
        parts = split_url(url, kind="Kafka broker", form="kafka://host:9092", port=9092)
        if parts.scheme != "kafka":
            raise ConfigurationError(f"not a kafka:// URL: {url!r}")
        if "@" in parts.netloc:
            raise ConfigurationError(
                "kafka:// URLs with credentials are not supported yet; "
                "use a broker on a trusted network or build the adapter with your own client"
            )
        servers = tuple(s.strip() for s in parts.netloc.split(",") if s.strip())
        if not servers:
            raise ConfigurationError(f"kafka URL {url!r} names no broker: use kafka://host:9092")
        servers = tuple(s if ":" in s else f"{s}:9092" for s in servers)
        fields = {f.name: f for f in dataclasses.fields(cls)}
        values: dict[str, Any] = {"bootstrap_servers": servers}
        for name, raw in parse_qsl(parts.query, keep_blank_values=True):
            field = fields.get(name)
            if field is None or name == "bootstrap_servers":
                options = ", ".join(sorted(n for n in fields if n != "bootstrap_servers"))
                raise ConfigurationError(
                    f"unknown kafka URL option {name!r}; valid options: {options}"
                )
            values[name] = _convert(name, str(field.type), raw)
        return cls(**values)

    @property
    def url(self) -> str:
        """``kafka://host:port[,host:port]`` (settings other than the servers left out)."""
        return "kafka://" + ",".join(self.bootstrap_servers)


def _convert(name: str, kind: str, raw: str) -> Any:
    try:
        if kind == "bool":
            if raw.lower() in ("1", "true", "yes", "on"):
                return True
            if raw.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(raw)
        if kind == "int":
            return int(raw)
        if kind == "float":
            return float(raw)
    except ValueError:
        raise ConfigurationError(f"kafka URL option {name}={raw!r} is not a valid {kind}") from None
    return raw


def kafka_topic(topic: str, prefix: str = "") -> str:
    """The Kafka topic name of eventflow topic ``topic``; raises ``ConfigurationError``."""
    validate_topic(topic)
    name = prefix + topic
    if len(name) > 249 or not _LEGAL.match(name):
        raise ConfigurationError(
            f"topic {topic!r} cannot be a Kafka topic: Kafka allows only letters, digits, "
            "'.', '_' and '-' (at most 249 characters); rename the topic or pass topic="
        )
    return name


def pattern_regex(pattern: str, prefix: str = "") -> str:
    """The anchored Kafka topic regex of ``pattern`` (wildcards) after the prefix."""
    validate_pattern(pattern)
    if not is_wildcard(pattern):
        return "^" + re.escape(kafka_topic(pattern, prefix)) + "$"
    out = []
    for token in pattern.split("."):
        if token == "*":
            out.append("[^.]+")
        elif token == ">":
            out.append(r"[^.]+(?:\.[^.]+)*")
        else:
            if not _LEGAL.match(token):
                raise ConfigurationError(
                    f"pattern {pattern!r} cannot match Kafka topics: token {token!r} uses "
                    "characters Kafka does not allow in topic names"
                )
            out.append(re.escape(token))
    return "^" + re.escape(prefix) + r"\.".join(out) + "$"
