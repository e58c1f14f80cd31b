"""Relays: from the store to the broker, at least once, in order.

- ``OutboxRelay`` sends the messages handlers published inside ``ctx.transaction()`` (the
  transactional outbox), oldest first, then deletes them.
- ``EventRelay`` publishes every event appended to the store to the broker (topic = event
  type, key = stream id), following the global order from a checkpoint, so each stream's
  events reach the broker in version order.

Each relay holds a store lease while it runs, so one instance relays at a time across
processes; the others wait and take over if it dies. Its writes (the outbox removal, the
event relay's checkpoint) carry the lease, so a relay that lost its lease (paused, cut off)
cannot delete or move anything after another took over. A lost lease ends ``run()`` with
``LeaseLostError``; the owner's supervisor starts it again, and it waits for the lease. A
send that fails is retried with backoff; because message ids are fixed, consumers' dedup
drops a copy sent twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING

from ..errors import LeaseLostError
from ..ports import Broker, Store

if TYPE_CHECKING:
    from ..leases import Lease

__all__ = ["EVENT_RELAY_CHECKPOINT", "OUTBOX_RELAY_LEASE", "EventRelay", "OutboxRelay"]

EVENT_RELAY_CHECKPOINT = "eventflow:event-relay"
OUTBOX_RELAY_LEASE = "eventflow:outbox-relay"
_IDLE_POLL = 1.0
_BATCH = 200
_MAX_BACKOFF = 5.0
_RETRY = 0.1
_log = logging.getLogger("eventflow.relay")


def _id_headers(id_header: str | None, message_id: str) -> dict[str, str] | None:
    """The broker headers of a relayed message: its id, if the broker wants it."""
    return None if id_header is None else {id_header: message_id}


async def _publish(
    broker: Broker,
    topic: str,
    payload: bytes,
    key: str | None,
    headers: Mapping[str, str] | None,
) -> None:
    delay = 0.05
    while True:
        try:
            await broker.publish(topic, payload, key=key, headers=headers)
            return
        except Exception as exc:  # the broker is down: keep the order, wait, retry
            _log.warning("relay could not publish to %s (%s); retrying", topic, exc)
            await asyncio.sleep(delay)
            delay = min(delay * 2, _MAX_BACKOFF)


class OutboxRelay:
    """Sends ``store.outbox`` messages to the broker, oldest first."""

    def __init__(self, store: Store, broker: Broker, id_header: str | None) -> None:
        self.store = store
        self.broker = broker
        self.id_header = id_header
        self.sent = 0

    async def run(self) -> None:
        """Relay forever (cancel to stop) while holding the outbox relay's lease; raises
        ``LeaseLostError`` if it is lost."""
        outbox = self.store.outbox
        added: asyncio.Event | None = getattr(outbox, "added", None)
        async with self.store.leases.hold(OUTBOX_RELAY_LEASE) as lease:
            delay = _RETRY
            while True:
                if added is not None:
                    added.clear()
                try:
                    batch = await outbox.pending(_BATCH)
                    for msg in batch:
                        await _publish(
                            self.broker,
                            msg.topic,
                            msg.payload,
                            msg.key,
                            _id_headers(self.id_header, msg.message_id),
                        )
                    if batch:
                        await outbox.remove([m.seq for m in batch], lease=lease)
                        self.sent += len(batch)
                except LeaseLostError:
                    raise  # another relay took over: this one must stop
                except Exception as exc:  # the store failed: keep the relay alive, retry
                    _log.warning("outbox relay failed (%s); retrying in %.1fs", exc, delay)
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, _MAX_BACKOFF)
                    continue
                delay = _RETRY
                if batch:
                    continue
                try:
                    async with asyncio.timeout(_IDLE_POLL):
                        if added is None:
                            await asyncio.sleep(_IDLE_POLL)
                        else:
                            await added.wait()
                except TimeoutError:
                    pass  # another process may have added messages: look again


class EventRelay:
    """Publishes the store's events to the broker in global order from a checkpoint."""

    def __init__(
        self,
        store: Store,
        broker: Broker,
        id_header: str | None,
        checkpoint: str = EVENT_RELAY_CHECKPOINT,
        checkpoint_every: int = _BATCH,
    ) -> None:
        self.store = store
        self.broker = broker
        self.id_header = id_header
        self.checkpoint = checkpoint
        self.checkpoint_every = checkpoint_every
        self.sent = 0

    async def run(self) -> None:
        """Relay forever (cancel to stop) while holding the lease named after its checkpoint;
        raises ``LeaseLostError`` if it is lost."""
        async with self.store.leases.hold(self.checkpoint) as lease:
            delay = _RETRY
            while True:
                try:
                    await self._follow(lease)
                except LeaseLostError:
                    raise  # another relay took over: this one must stop
                except Exception as exc:  # the store failed: resume from the checkpoint
                    _log.warning("event relay failed (%s); retrying in %.1fs", exc, delay)
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, _MAX_BACKOFF)

    async def _follow(self, lease: Lease) -> None:
        """Publish from the checkpoint on; save the checkpoint (under ``lease``) every few
        events and on exit."""
        store = self.store
        position = await store.checkpoints.get(self.checkpoint)
        unsaved = 0
        try:
            async for rec in store.subscribe(after=position):
                env = rec.envelope
                await _publish(
                    self.broker,
                    env.type,
                    env.to_bytes(),
                    rec.stream_id,
                    _id_headers(self.id_header, env.id),
                )
                position = rec.position
                self.sent += 1
                unsaved += 1
                if unsaved >= self.checkpoint_every:
                    await store.checkpoints.set(self.checkpoint, position, lease=lease)
                    unsaved = 0
        finally:
            if unsaved:  # best effort (refused if the lease was lost): the rest is resent
                with contextlib.suppress(Exception):
                    await asyncio.shield(
                        store.checkpoints.set(self.checkpoint, position, lease=lease)
                    )
