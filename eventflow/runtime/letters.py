"""Filing a message in the dead-letter queue: the letter, the log line, the ack.

A letter keeps the delivery's bytes, topic, key and broker headers (but a replay's own,
which its replay sets again), the error with a short traceback (bad input has none worth
keeping), the attempts, the time, the reason and the broker position. A subscription with
``dead_letter=False`` drops the message with an error log instead.
"""

from __future__ import annotations

import logging
import traceback
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from ..envelope import new_id
from ..errors import DecodeError
from ..headers import SEND_ID_HEADER, TARGET_GROUP_HEADER
from ..ports import DeadLetter, Delivery, Store
from .stats import ConsumerStats

if TYPE_CHECKING:
    from ..telemetry.tracing import Tracing

__all__ = ["Letters"]

_log = logging.getLogger("eventflow.consumer")
# A replay's own headers, not kept in a new letter of its message (its replay sets its own).
_REPLAY_HEADERS = frozenset((TARGET_GROUP_HEADER, SEND_ID_HEADER))


class Letters:
    """Files the dead letters of one consumer (one group), counting them in its stats."""

    def __init__(
        self,
        store: Store,
        group: str,
        name: str,
        stats: ConsumerStats,
        *,
        keep: bool,
        tracing: Tracing | None = None,
    ) -> None:
        self.store = store
        self.group = group
        self.name = name
        self.stats = stats
        self.keep = keep
        self.tracing = tracing

    async def file(
        self,
        delivery: Delivery,
        envelope_id: str | None,
        error: BaseException,
        *,
        attempts: int,
        reason: str | None = None,
    ) -> None:
        """Store the delivery as a dead letter with its error and ``reason`` (by default the
        error's own, as bad input and crash loops have), or drop it with a log line
        (``dead_letter=False``), then ack it."""
        if reason is None:
            reason = getattr(error, "reason", "handler-failed")
        if self.tracing is not None:
            self.tracing.failed(error)  # the delivery's process span
        text = f"{type(error).__name__}: {error}"
        if not isinstance(error, DecodeError) and error.__traceback__ is not None:
            tb = "".join(traceback.format_exception(error, limit=5))
            text = f"{text}\n{tb}"
        if not self.keep:
            self.stats.dropped += 1
            _log.error(
                "%s: dropping message %s after %d attempts (dead_letter=False): %s",
                self.name,
                envelope_id or "?",
                attempts,
                text,
            )
            await delivery.ack()
            return
        letter = DeadLetter(
            id=new_id(),
            topic=delivery.topic,
            group=self.group,
            payload=bytes(delivery.payload),
            error=text,
            attempts=attempts,
            failed_at=datetime.now(UTC),
            reason=reason,
            key=delivery.key,
            headers={k: v for k, v in delivery.headers.items() if k not in _REPLAY_HEADERS},
            envelope_id=envelope_id,
            source=dict(delivery.metadata),
        )
        await self.store.dead_letters.add(letter)
        self.stats.dead_lettered += 1
        _log.warning(
            "%s: dead-lettered %s (%s) after %d attempts: %s",
            self.name,
            envelope_id or "undecodable message",
            reason,
            attempts,
            f"{type(error).__name__}: {error}",
        )
        await delivery.ack()
