"""The broker header names eventflow reads and writes, in one place.

Broker headers travel beside the envelope (the envelope's own ``headers`` field is part of
the payload): they let a broker or a consumer act on a message without decoding it.
"""

from __future__ import annotations

__all__ = ["KEY_HEADER", "MESSAGE_ID_HEADER", "TARGET_GROUP_HEADER", "TRACEPARENT_HEADER"]

MESSAGE_ID_HEADER = "eventflow-id"
"""Broker header carrying the envelope id, on every message eventflow sends (NATS turns it
into ``Nats-Msg-Id`` for the server's duplicate window; other brokers may ignore it)."""

KEY_HEADER = "eventflow-key"
"""Broker header carrying the message key where the broker has no key of its own (NATS);
the adapter removes it from ``Delivery.headers``."""

TARGET_GROUP_HEADER = "eventflow-target-group"
"""Broker header naming the only group that should handle a message (dead-letter replay);
consumers of other groups ack it unhandled, and it is left out of a new dead letter."""

TRACEPARENT_HEADER = "traceparent"
"""Envelope header with the W3C trace context of the message's ``send`` span."""
