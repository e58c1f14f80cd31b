"""The broker header names eventflow reads and writes, in one place.

Broker headers travel beside the envelope (the envelope's own ``headers`` field is part of
the payload): they let a broker or a consumer act on a message without decoding it.
"""

from __future__ import annotations

__all__ = [
    "KEY_HEADER",
    "MESSAGE_ID_HEADER",
    "SEND_ID_HEADER",
    "TARGET_GROUP_HEADER",
    "TRACEPARENT_HEADER",
]

MESSAGE_ID_HEADER = "eventflow-id"
"""Broker header carrying the envelope id, on every message eventflow sends. Unless
``eventflow-send-id`` is given, a broker that drops repeated sends knows the message by it
(NATS turns it into ``Nats-Msg-Id`` for the server's duplicate window), so a retried publish
of one envelope is stored once; other brokers may ignore it."""

SEND_ID_HEADER = "eventflow-send-id"
"""Broker header naming one deliberate send of a stored envelope (a dead-letter replay):
where it is present, a broker's duplicate detection knows the message by it instead of by
``eventflow-id``, so the re-send is stored as a new message while its payload and its
``eventflow-id`` stay the envelope's (consumers still deduplicate by the envelope id). A
repeat of one send id may still be dropped, so a retried replay is stored once too. Only
re-sends set it: a normal publish costs nothing more."""

KEY_HEADER = "eventflow-key"
"""Broker header carrying the message key where the broker has no key of its own (NATS);
the adapter removes it from ``Delivery.headers``."""

TARGET_GROUP_HEADER = "eventflow-target-group"
"""Broker header naming the only group that should handle a message (dead-letter replay);
consumers of other groups ack it unhandled, and it is left out of a new dead letter."""

TRACEPARENT_HEADER = "traceparent"
"""Envelope header with the W3C trace context of the message's ``send`` span."""
