"""The two KV buckets a NATS consumer group keeps beside the stream: partition leases and
release counts.

Leases (bucket ``<stream>_leases``, TTL ``lease_ttl``): a member may pull from a partition
only while it holds the partition's lease, a KV entry ``<group id>.<partition>`` holding
the member id. It is taken with compare-and-set (created only if absent), refreshed by
updating it at the revision the member last wrote, and expires ``lease_ttl`` after the
last refresh. A refresh that finds another revision tells the member it lost the partition
(it stalled past ``lease_ttl`` and another member took it); a release deletes the entry at
the member's revision, so it never removes a lease someone else took meanwhile.
:meth:`Leases.holder` tells a member waiting for a partition who holds it and since when
(the time the server stored the last refresh), so it can say how long the wait will be.

Release counts (bucket ``<stream>_releases``, TTL ``release_ttl``): JetStream counts every
delivery, including those no handler saw (a member leaving gives back its buffered
messages; ``Delivery.release``). Each such give-back is recorded under
``<consumer>.<stream sequence>``, and a redelivery subtracts the recorded count from the
server's, so ``delivery_count`` counts only deliveries a handler saw. The entry is purged
once the message is acked.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from nats.errors import Error as NatsError
from nats.js import JetStreamContext
from nats.js.errors import APIError, KeyNotFoundError, KeyWrongLastSequenceError, NotFoundError
from nats.js.kv import KeyValue

from ..._logging import Throttled

__all__ = ["Holder", "Leases", "ReleaseLedger"]

_log = logging.getLogger("eventflow.nats")


@dataclass(frozen=True, slots=True)
class Holder:
    """Who holds a lease: the member id and when the lease was last written (refreshed),
    in Unix seconds on the server's clock."""

    member: str
    written_at: float


class Leases:
    """The partition leases of every group on one stream (see the module docstring).

    ``js`` and ``bucket`` serve :meth:`holder`, which reads the entry's stored message (a
    KV read does not tell when the entry was written)."""

    def __init__(self, kv: KeyValue, js: JetStreamContext, bucket: str) -> None:
        self._kv = kv
        self._js = js
        self._stream = f"KV_{bucket}"
        self._subject = f"$KV.{bucket}."

    async def holder(self, key: str) -> Holder | None:
        """Who holds lease ``key`` and since when, or ``None`` if nobody does."""
        try:
            msg = await self._js.get_msg(self._stream, subject=self._subject + key)
        except NotFoundError:
            return None
        if (msg.headers or {}).get("KV-Operation") or msg.time is None:
            return None  # deleted or purged: released
        return Holder((msg.data or b"").decode(), msg.time.timestamp())

    async def claim(self, key: str, member: str) -> int | None:
        """Take lease ``key`` for ``member``; its revision, or ``None`` if another holds it."""
        try:
            return await self._kv.create(key, member.encode())
        except KeyWrongLastSequenceError:
            return None

    async def refresh(self, key: str, member: str, revision: int) -> int | None:
        """Extend lease ``key`` held at ``revision``; the new revision, or ``None`` if the
        lease expired and someone else took it (the partition is lost)."""
        try:
            return await self._kv.update(key, member.encode(), last=revision)
        except KeyWrongLastSequenceError:
            return None

    async def release(self, key: str, revision: int) -> None:
        """Let go of lease ``key`` held at ``revision`` (nothing if it expired already)."""
        try:
            await self._kv.delete(key, last=revision)
        except (KeyWrongLastSequenceError, APIError) as exc:  # expired, maybe taken
            _log.debug("lease %s already gone: %s", key, exc)


class ReleaseLedger:
    """How often each message was given back unseen (see the module docstring)."""

    def __init__(self, kv: KeyValue) -> None:
        self._kv = kv
        self._warn = Throttled(_log)

    async def record(self, consumer: str, seq: int, count: int) -> None:
        """Remember that message ``seq`` of ``consumer`` was given back unseen ``count`` times."""
        await self._kv.put(f"{consumer}.{seq}", b"%d" % count)

    async def count(self, consumer: str, seq: int) -> int:
        """How many deliveries of ``seq`` were released (not to be counted); 0 when the
        bucket cannot be read (the delivery is then counted, as the server counts it)."""
        try:
            entry = await self._kv.get(f"{consumer}.{seq}")
        except KeyNotFoundError:
            return 0
        except NatsError as exc:
            self._warn.warning(
                "release-count", "could not read release count of %s/%d: %s", consumer, seq, exc
            )
            return 0
        return int(entry.value or b"0")

    async def forget(self, consumer: str, seq: int) -> None:
        """Drop the count of an acked message (it expires after ``release_ttl`` anyway)."""
        try:
            await self._kv.purge(f"{consumer}.{seq}")
        except NatsError as exc:
            _log.debug("could not purge release count: %s", exc)
