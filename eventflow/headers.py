"""The header names eventflow reads and writes, in one place.

Two kinds: broker headers travel beside the envelope and let a broker or a consumer act on
a message without decoding it; they live and die with one send. Envelope headers are in
the envelope's own ``headers`` field, part of the payload, so they travel wherever the
envelope does: through the outbox, dead letters and their replays, the event store and
the CloudEvents mapping.
"""

from __future__ import annotations

__all__ = [
    "COMPENSATES_HEADER",
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

COMPENSATES_HEADER = "eventflow-compensates"
"""Envelope header of a compensation: the envelope id of the command it undoes (read in a
handler as ``ctx.compensates``). A group that has not handled that command yet does not
call the compensation's handler: it records the command as cancelled by this compensation
(skipped when it arrives) and the compensation as handled, in one store transaction where
the dedup store is the app's store. A group that handled the command runs the handler as
usual. Idempotent subscriptions only: without dedup records (``idempotent=False``) the
header cancels nothing. See docs/semantics.md, "Compensations"."""
