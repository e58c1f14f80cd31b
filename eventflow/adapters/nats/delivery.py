"""A JetStream delivery as the consumer sees it, and the NATS headers eventflow sets.

A delivery settles once: ``ack``, ``nack`` or ``release`` marks it settled and hands it to
the partition that received it (a :class:`Settler`), which keeps the partition's order
(see :mod:`.partition`); a second call is a no-op.

The envelope id travels once, as ``Nats-Msg-Id``, when it is also the send id (every send
but a deliberate re-send, which carries ``eventflow-id`` and ``eventflow-send-id`` as
given): a delivery gets its ``eventflow-id`` back from ``Nats-Msg-Id``. A publish without
an envelope id sends ``eventflow-id`` empty beside a random ``Nats-Msg-Id``, and its
delivery has no ``eventflow-id``. Each header costs the client a parse per delivery and a
build per publish; this one was the same 36 characters twice.

The key travels once too. An envelope in eventflow's wire form carries it (``"key":"..."``),
so ``eventflow-key`` is sent only where the payload does not give the publish's key by the
rule :func:`payload_key` reads it back with (raw bytes, another key, a key with a quote),
and ``eventflow-no-key`` where a keyless publish's payload would give one. A delivery's key
is the header's, else None under ``eventflow-no-key``, else :func:`payload_key` of its
payload, read when first asked for (a consumer with one worker never asks): the same rule
on the same bytes on both sides, so it is always the publish's key. A producer other than
eventflow that sends an envelope without these headers gets the key its payload names.
"""

from __future__ import annotations

import enum
import uuid
from collections.abc import Mapping
from typing import Any, Protocol

from ...headers import KEY_HEADER, MESSAGE_ID_HEADER, SEND_ID_HEADER

__all__ = [
    "IN_PAYLOAD",
    "MSG_ID_HEADER",
    "NO_KEY_HEADER",
    "NO_MESSAGE_ID",
    "NatsDelivery",
    "Settler",
    "parse_reply",
    "payload_key",
    "split_headers",
    "wire_headers",
]

MSG_ID_HEADER = "Nats-Msg-Id"
"""JetStream's de-duplication id (the send id), removed from ``Delivery.headers``."""
NO_MESSAGE_ID = ""
"""The ``eventflow-id`` of a publish without an envelope id (its ``Nats-Msg-Id`` is random)."""
NO_KEY_HEADER = "eventflow-no-key"
"""Sent on a keyless publish whose payload names a key: the delivery's key is None."""
_INTERNAL = frozenset((KEY_HEADER, MSG_ID_HEADER, NO_KEY_HEADER))
_KEY_FIELD = b',"key":"'


class _Key(enum.Enum):
    IN_PAYLOAD = enum.auto()


IN_PAYLOAD = _Key.IN_PAYLOAD
"""The key :func:`split_headers` gives a delivery whose key is its payload's."""
_EMPTY: Mapping[str, str] = {}


def parse_reply(reply: str) -> tuple[str, int, int, int]:
    """Consumer, delivery count, stream and consumer sequence of a delivery, read from its
    ack subject: ``$JS.ACK.<stream>.<consumer>.<count>.<seq>.<cseq>.<time>.<pending>``, or
    the same with ``<domain>.<account hash>`` after ``$JS.ACK`` and a random token at the
    end."""
    tokens = reply.split(".")
    if len(tokens) == 9:
        return tokens[3], int(tokens[4]), int(tokens[5]), int(tokens[6])
    return tokens[5], int(tokens[6]), int(tokens[7]), int(tokens[8])


def payload_key(payload: bytes) -> str | None:
    """The key of a delivery that no header names: the bytes after the payload's first
    ``,"key":"`` up to the next quote (in eventflow's wire form, the envelope's key), or
    None. Publishes whose key this would not give send it as a header."""
    at = payload.find(_KEY_FIELD)
    if at < 0:
        return None
    start = at + len(_KEY_FIELD)
    end = payload.find(b'"', start)
    return None if end < 0 else payload[start:end].decode("utf-8", "replace")


def wire_headers(
    headers: Mapping[str, str] | None, key: str | None, payload: bytes
) -> dict[str, str]:
    """The NATS headers of a publish of ``payload`` with ``key`` and the caller's
    ``headers``: the send id as ``Nats-Msg-Id`` (a deliberate re-send's own, else the
    envelope id, which then is not sent a second time, else a random one), and the key
    unless the payload gives it (see the module docstring); :func:`split_headers` undoes
    it."""
    hdrs: dict[str, str] = dict(headers) if headers else {}
    send_id = hdrs.get(SEND_ID_HEADER)
    if send_id:
        hdrs[MSG_ID_HEADER] = send_id
        hdrs.setdefault(MESSAGE_ID_HEADER, NO_MESSAGE_ID)  # else read back as the send id
    elif hdrs.get(MESSAGE_ID_HEADER):
        hdrs[MSG_ID_HEADER] = hdrs.pop(MESSAGE_ID_HEADER)
    else:
        hdrs[MESSAGE_ID_HEADER] = NO_MESSAGE_ID
        hdrs[MSG_ID_HEADER] = uuid.uuid4().hex
    if key is None:
        if payload_key(payload) is not None:
            hdrs[NO_KEY_HEADER] = "1"
    elif payload_key(payload) != key:  # the consumer would not read it back from the payload
        hdrs[KEY_HEADER] = key
    return hdrs


def split_headers(
    hdrs: Mapping[str, str] | None,
) -> tuple[str | _Key | None, Mapping[str, str]]:
    """The key and the headers of a received message as they were published: without the
    NATS adapter's own, ``eventflow-id`` back from ``Nats-Msg-Id`` where it was sent as
    that. The key is ``IN_PAYLOAD`` where no header names it (see the module docstring)."""
    if not hdrs:
        return IN_PAYLOAD, _EMPTY
    out = {k: v for k, v in hdrs.items() if k not in _INTERNAL}
    env_id = out.get(MESSAGE_ID_HEADER)
    if env_id is None:
        msg_id = hdrs.get(MSG_ID_HEADER)
        if msg_id is not None:
            out[MESSAGE_ID_HEADER] = msg_id
    elif env_id == NO_MESSAGE_ID:
        del out[MESSAGE_ID_HEADER]
    key = hdrs.get(KEY_HEADER)
    if key is None and NO_KEY_HEADER not in hdrs:
        return IN_PAYLOAD, out
    return key, out


class Settler(Protocol):
    """What a delivery needs of the partition that received it."""

    @property
    def stream(self) -> str:
        """The stream the message is stored in."""

    @property
    def consumer(self) -> str:
        """The durable consumer of the partition."""

    @property
    def index(self) -> int:
        """The partition number."""

    async def ack(self, d: NatsDelivery) -> None:
        """Ack ``d`` on the server (``d`` is marked settled already)."""

    async def nack(self, d: NatsDelivery, delay: float) -> None:
        """Give ``d`` back for a counted redelivery after ``delay``."""

    async def release(self, d: NatsDelivery) -> None:
        """Give ``d`` back unseen: it is handed out again, not counted."""

    async def in_progress(self, d: NatsDelivery) -> None:
        """Reset the server's ack timer of ``d``."""


class NatsDelivery:
    """A message pulled from a partition consumer; settled once (ack, nack or release).

    ``reply`` is the subject its acks go to; ``released`` how many earlier deliveries of it
    were given back unseen (see :mod:`.ledger`): ``delivery_count`` leaves them out.
    """

    __slots__ = (
        "_key",
        "_partition",
        "consumer_seq",
        "delivery_count",
        "headers",
        "payload",
        "released",
        "reply",
        "seq",
        "settled",
        "topic",
    )

    def __init__(
        self,
        partition: Settler,
        reply: str,
        topic: str,
        payload: bytes,
        key: str | _Key | None,
        headers: Mapping[str, str],
        seq: int,
        consumer_seq: int,
        count: int,
        released: int,
    ) -> None:
        self._partition = partition
        self.reply = reply
        self.settled = False
        self.released = released
        self.topic = topic
        self.payload = payload
        self._key = key
        self.headers = headers
        self.seq = seq
        self.consumer_seq = consumer_seq
        self.delivery_count = count

    @property
    def key(self) -> str | None:
        """The message's key (read from the payload the first time, where no header named
        it)."""
        key = self._key
        if key is IN_PAYLOAD:
            key = self._key = payload_key(self.payload)
        return key

    @property
    def metadata(self) -> Mapping[str, Any]:
        """Stream, consumer, stream sequence and partition of the message."""
        part = self._partition
        return {
            "broker": "nats",
            "stream": part.stream,
            "consumer": part.consumer,
            "partition": part.index,
            "stream_seq": self.seq,
            "consumer_seq": self.consumer_seq,
        }

    def again(self) -> NatsDelivery:
        """An unsettled copy of this delivery (a released message handed out again)."""
        return NatsDelivery(
            self._partition,
            self.reply,
            self.topic,
            self.payload,
            self._key,
            self.headers,
            self.seq,
            self.consumer_seq,
            self.delivery_count,
            self.released,
        )

    async def ack(self) -> None:
        """Ack the message (after the handler's effects)."""
        if not self.settled:
            self.settled = True
            await self._partition.ack(self)

    async def nack(self, delay: float = 0.0) -> None:
        """Give the message back, redelivered after ``delay``; its partition waits for it."""
        if not self.settled:
            self.settled = True
            await self._partition.nack(self, delay)

    async def release(self) -> None:
        """Give the message back without counting this delivery (no handler saw it)."""
        if not self.settled:
            self.settled = True
            await self._partition.release(self)

    async def in_progress(self) -> None:
        """Reset the server's ack timer for this message."""
        if not self.settled:
            await self._partition.in_progress(self)
