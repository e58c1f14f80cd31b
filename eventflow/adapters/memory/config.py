"""Settings of the in-memory broker."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["MemoryBrokerConfig"]

DEFAULT_PARTITIONS = 8
DEFAULT_MAX_PENDING = 10_000
DEFAULT_PUBLISH_TIMEOUT = 5.0
DEFAULT_MAX_MESSAGE_BYTES = 1024 * 1024
DEFAULT_RETAIN = 10_000
DEFAULT_RETAIN_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class MemoryBrokerConfig:
    """Settings of a memory broker.

    ``max_pending`` bounds each group's unacked messages (queued plus in flight); a publisher
    finding a group full waits up to ``publish_timeout`` seconds, then gets
    ``BackpressureError``. A payload over ``max_message_bytes`` (1 MiB, as NATS's and
    Kafka's defaults, so code tried here meets the same limit there) is refused with
    ``MessageRefusedError``.

    ``retain``: the hub keeps the newest this many messages published on it (every topic,
    acked or not, 0 for none), and at most ``retain_bytes`` of their payloads (64 MiB), as
    a stream with message and byte limits does: where a group created with
    ``start="earliest"`` begins. The hub takes the settings of the broker that
    created it.
    """

    name: str = ""
    partitions: int = DEFAULT_PARTITIONS
    max_pending: int = DEFAULT_MAX_PENDING
    publish_timeout: float = DEFAULT_PUBLISH_TIMEOUT
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    retain: int = DEFAULT_RETAIN
    retain_bytes: int = DEFAULT_RETAIN_BYTES
