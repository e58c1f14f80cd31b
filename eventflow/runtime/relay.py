"""Relays: from the store to the broker, at least once, in order.

- ``OutboxRelay`` sends the messages handlers published inside ``ctx.transaction()`` (the
  transactional outbox), oldest first, then deletes them.
- ``EventRelay`` publishes every event appended to the store to the broker (topic = event
  type, key = stream id), following the global order from a checkpoint, so each stream's
  events reach the broker in version order. eventflow's own records (types starting with
  ``eventflow.``, such as a saga's transitions: ``events.is_internal_type``) are not
  services' messages: it skips them, moving its checkpoint past them.

Each relay holds a store lease while it runs, so one instance relays at a time across
processes; the others wait and take over if it dies. The outbox relay is woken by
``outbox.added``, which the store sets for adds committed by any process sharing it
(PostgreSQL: a notification; SQLite: a check of the file), so a message another instance
wrote leaves within milliseconds; it also looks every ``_IDLE_POLL`` seconds, as a safety
net. It clears ``added`` before each look at the outbox, so after a look that did not fill
its batch it waits for ``added`` instead of looking again: a look per message sent one at a
time, not two. Its writes (the outbox removal, the event relay's checkpoint) carry the lease, so a
relay that lost its lease (paused, cut off) cannot delete or move anything after another
took over. A lost lease ends ``run()`` with ``LeaseLostError``; the owner's supervisor
starts it again, and it waits for the lease. A send that fails is retried with backoff;
because message ids are fixed, consumers' dedup drops a copy sent twice.

A message the broker refuses for good (``MessageRefusedError``: too large, not authorised)
is tried ``PARK_AFTER`` times, then parked: it becomes a dead letter of the group
``eventflow:outbox`` (or ``eventflow:event-relay``), in the same store transaction as its
removal, and the messages behind it go on. ``eventflow dlq`` lists it; a replay publishes it
to its topic again, for every group.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from contextlib import AbstractAsyncContextManager
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from .._logging import Throttled
from ..envelope import Envelope, new_id
from ..errors import ConfigurationError, LeaseLostError, MessageRefusedError
from ..events import is_internal_type
from ..headers import MESSAGE_ID_HEADER
from ..ports import Broker, DeadLetter, Outbox, OutboxMessage, RecordedEvent, Store, declared

if TYPE_CHECKING:
    from ..leases import Lease
    from ..telemetry.tracing import Tracing

__all__ = [
    "EVENT_RELAY_CHECKPOINT",
    "EVENT_RELAY_GROUP",
    "OUTBOX_GROUP",
    "OUTBOX_RELAY_LEASE",
    "PARK_AFTER",
    "RELAY_GROUPS",
    "EventRelay",
    "OutboxRelay",
]

EVENT_RELAY_CHECKPOINT = "eventflow:event-relay"
OUTBOX_RELAY_LEASE = "eventflow:outbox-relay"
OUTBOX_GROUP = "eventflow:outbox"
"""The dead-letter group of outbox messages the broker refused (no consumer group has them)."""
EVENT_RELAY_GROUP = "eventflow:event-relay"
"""The dead-letter group of stored events the broker refused."""
RELAY_GROUPS = frozenset({OUTBOX_GROUP, EVENT_RELAY_GROUP})
PARK_AFTER = 3
"""Refusals of one message after which a relay parks it in the dead-letter queue."""
_IDLE_POLL = 1.0
_BATCH = 200
_MAX_BACKOFF = 5.0
_RETRY = 0.1
_log = logging.getLogger("eventflow.relay")
_throttled = Throttled(_log)


async def _publish(
    broker: Broker,
    topic: str,
    payload: bytes,
    key: str | None,
    headers: Mapping[str, str] | None,
) -> None:
    """Send one message: a failure that may pass (the broker is down) is retried with
    backoff until it goes, keeping the order; a refusal is tried ``PARK_AFTER`` times, then
    raised (``MessageRefusedError``) for the caller to park the message."""
    delay = 0.05
    refused = 0
    while True:
        try:
            await broker.publish(topic, payload, key=key, headers=headers)
            _throttled.clear(topic)
            return
        except (MessageRefusedError, ConfigurationError) as exc:
            # ConfigurationError: the broker can never send it as it is (a topic it cannot
            # name), which is a refusal too.
            refused += 1
            if refused >= PARK_AFTER:
                if isinstance(exc, MessageRefusedError):
                    raise
                raise MessageRefusedError(f"the broker cannot send it: {exc}") from exc
        except Exception as exc:  # the broker is down: keep the order, wait, retry
            _throttled.warning(topic, "relay could not publish to %s (%s); retrying", topic, exc)
        await asyncio.sleep(delay)
        delay = min(delay * 2, _MAX_BACKOFF)


def _parked(
    group: str,
    topic: str,
    payload: bytes,
    key: str | None,
    message_id: str,
    error: MessageRefusedError,
    source: Mapping[str, object],
) -> DeadLetter:
    """The dead letter of a message a relay parks."""
    _log.error(
        "the broker refused message %s for %s %d times (%s); parked in the dead-letter queue "
        "(group %s): see `eventflow dlq list`",
        message_id,
        topic,
        PARK_AFTER,
        error,
        group,
    )
    return DeadLetter(
        id=new_id(),
        topic=topic,
        group=group,
        payload=payload,
        error=f"{type(error).__name__}: {error}",
        attempts=PARK_AFTER,
        failed_at=datetime.now(UTC),
        reason=error.reason,
        key=key,
        envelope_id=message_id,
        source=dict(source),
    )


class OutboxRelay:
    """Sends ``store.outbox`` messages to the broker, oldest first."""

    def __init__(self, store: Store, broker: Broker, *, tracing: Tracing | None = None) -> None:
        self.store = store
        self.broker = broker
        self.tracing = tracing
        self.sent = 0
        self.parked = 0
        # Checked here, so a store without it fails the app's start, not the relay later.
        self._added: asyncio.Event = declared(store.outbox, Outbox, "added")
        self._relaying: Callable[[], AbstractAsyncContextManager[None]] = declared(
            store.outbox, Outbox, "relaying"
        )

    async def run(self) -> None:
        """Relay forever (cancel to stop) while holding the outbox relay's lease; raises
        ``LeaseLostError`` if it is lost."""
        outbox = self.store.outbox
        added = self._added
        async with self.store.leases.hold(OUTBOX_RELAY_LEASE) as lease, self._relaying():
            delay = _RETRY
            while True:
                added.clear()
                try:
                    batch = await outbox.pending(_BATCH)
                    sent: list[int] = []
                    for msg in batch:
                        try:
                            if self.tracing is None:
                                await _publish(
                                    self.broker,
                                    msg.topic,
                                    msg.payload,
                                    msg.key,
                                    {MESSAGE_ID_HEADER: msg.message_id},
                                )
                            else:  # continues the trace of the row's send span
                                with self.tracing.relaying(msg.topic, msg.payload, msg.message_id):
                                    await self._send(msg)
                        except MessageRefusedError as exc:
                            await self._park(msg, exc, sent, lease)
                            sent = []
                            continue
                        sent.append(msg.seq)
                    if sent:
                        await outbox.remove(sent, lease=lease)
                        self.sent += len(sent)
                except LeaseLostError:
                    raise  # another relay took over: this one must stop
                except Exception as exc:  # the store failed: keep the relay alive, retry
                    _log.warning("outbox relay failed (%s); retrying in %.1fs", exc, delay)
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, _MAX_BACKOFF)
                    continue
                delay = _RETRY
                if len(batch) >= _BATCH:
                    continue  # more may wait behind it
                # It sent all there was when it looked; what was added since has set
                # ``added`` (cleared before the look).
                try:
                    async with asyncio.timeout(_IDLE_POLL):
                        await added.wait()  # set by adds in every process the store can tell
                except TimeoutError:
                    pass  # the safety net: a wake-up the store could not give, or lost

    async def _send(self, msg: OutboxMessage) -> None:
        await _publish(
            self.broker, msg.topic, msg.payload, msg.key, {MESSAGE_ID_HEADER: msg.message_id}
        )

    async def _park(
        self, msg: OutboxMessage, error: MessageRefusedError, sent: list[int], lease: Lease
    ) -> None:
        """Move a refused row to the dead-letter queue, in one transaction with the removal
        of it and of the rows sent before it (fenced by the relay's lease)."""
        store = self.store
        letter = _parked(
            OUTBOX_GROUP,
            msg.topic,
            msg.payload,
            msg.key,
            msg.message_id,
            error,
            {"outbox_seq": msg.seq},
        )
        async with store.transaction():
            await store.dead_letters.add(letter)
            await store.outbox.remove([*sent, msg.seq], lease=lease)
        self.sent += len(sent)
        self.parked += 1


class EventRelay:
    """Publishes the store's events to the broker in global order from a checkpoint."""

    def __init__(
        self,
        store: Store,
        broker: Broker,
        checkpoint: str = EVENT_RELAY_CHECKPOINT,
        checkpoint_every: int = _BATCH,
        *,
        tracing: Tracing | None = None,
    ) -> None:
        self.store = store
        self.broker = broker
        self.tracing = tracing
        self.checkpoint = checkpoint
        self.checkpoint_every = checkpoint_every
        self.sent = 0
        self.parked = 0
        self.skipped = 0
        """eventflow's own records passed over (see the module docstring)."""

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
                if is_internal_type(env.type):
                    self.skipped += 1  # eventflow's own record: passed, not sent
                else:
                    if not await self._send(rec, lease):
                        position, unsaved = rec.position, 0  # saved with the dead letter
                        continue
                    self.sent += 1
                position = rec.position
                unsaved += 1
                if unsaved >= self.checkpoint_every:
                    await store.checkpoints.set(self.checkpoint, position, lease=lease)
                    unsaved = 0
        finally:
            if unsaved:  # best effort (refused if the lease was lost): the rest is resent
                try:
                    await asyncio.shield(
                        store.checkpoints.set(self.checkpoint, position, lease=lease)
                    )
                except Exception as exc:
                    _log.warning(
                        "event relay could not save its checkpoint at %d (%s); the events "
                        "after the last saved one are sent again (consumers drop copies)",
                        position,
                        exc,
                    )

    async def _send(self, rec: RecordedEvent, lease: Lease) -> bool:
        """Publish ``rec`` (True); one the broker refuses for good is parked in the
        dead-letter queue instead, with the checkpoint moved past it in the same
        transaction (False)."""
        env = rec.envelope
        try:
            if self.tracing is None:
                await self._publish(env, rec.stream_id)
            else:  # a send span continuing the event's trace, whose context it carries
                with self.tracing.sending_stored(env.type, env) as env:
                    await self._publish(env, rec.stream_id)
        except MessageRefusedError as exc:
            payload = env.to_bytes()
            letter = _parked(
                EVENT_RELAY_GROUP,
                env.type,
                payload,
                rec.stream_id,
                env.id,
                exc,
                {"position": rec.position, "stream_id": rec.stream_id},
            )
            store = self.store
            async with store.transaction() as tx:
                await store.dead_letters.add(letter)
                await store.checkpoints.set(self.checkpoint, rec.position, tx=tx, lease=lease)
            self.parked += 1
            return False
        return True

    async def _publish(self, env: Envelope, key: str) -> None:
        await _publish(self.broker, env.type, env.to_bytes(), key, {MESSAGE_ID_HEADER: env.id})
