"""A compensation that reaches a group before its command cancels the command instead.

A compensation names the command it undoes: the envelope id in its ``eventflow-compensates``
header (``ctx.compensates``). Brokers keep order per key within one topic only, and a
command and its compensation travel on two topics, so a compensation may reach the
participant's group first (the command still queued behind a backlog, or held by a stalled
member). Undoing first and doing afterwards leaves the command applied under a saga that
says compensated. So, for an idempotent subscription, a compensation's arrival decides:

- the group has handled the command (its dedup store has it): the compensation is handled
  as usual, its handler undoes the command;
- it has not: the compensation cancels it. The command is recorded for the group as
  cancelled by this compensation, the compensation as handled, and its handler is not
  called (``cancels``); when the command arrives it is skipped like a duplicate
  (``cancelled``);
- another compensation cancelled it already (a new attempt of one): there is nothing to
  undo; the compensation is recorded, its handler not called (``cancels``).

Atomicity. Where the dedup store is the app's store, both records are written in one store
transaction, whose insert of the command's record meets the command's own: a command handled
at the same time inside ``ctx.transaction()`` (by the group's subscription of the command's
topic, here or in another member) either commits first, and the compensation then undoes
it, or finds the record at its commit (``AlreadyHandled``) and rolls back with its effects.
Left open: a command handler whose effects are not in ``ctx.transaction()`` (they are done
by the time it is marked), and a dedup store apart from the store (Redis: records a
transaction cannot join). There a command handled while its compensation arrives may take
effect with its compensation skipped; ``mark`` notices it when it records the command (the
record is taken, by a cancellation), logs an error and counts ``applied_though_cancelled``.
"""

from __future__ import annotations

import enum
import logging
from typing import Any

from ..errors import AlreadyHandled, MalformedMessageError
from ..headers import COMPENSATES_HEADER
from ..ports import DedupStore, Store
from .stats import ConsumerStats

__all__ = ["Compensations", "Decision", "compensated_command", "decide"]

_log = logging.getLogger("eventflow.consumer")


class Decision(enum.Enum):
    """What the arrival of a compensation decided for its group."""

    UNDO = "undo"
    """The group handled the command: call the compensation's handler."""
    CANCELLED = "cancelled"
    """The group had not handled the command: it is cancelled, this compensation recorded."""
    NOTHING_TO_UNDO = "nothing-to-undo"
    """Another compensation cancelled the command before: this one is recorded."""
    DUPLICATE = "duplicate"
    """A copy of this compensation was recorded meanwhile."""


def compensated_command(fields: dict[str, Any], message_id: str) -> str | None:
    """The id of the command the message with envelope ``fields`` undoes, or None when it is
    no compensation. Raises ``MalformedMessageError`` for a header that names no command
    (empty) or the compensation itself."""
    headers: dict[str, str] = fields["headers"]
    if not headers:
        return None
    command = headers.get(COMPENSATES_HEADER)
    if command is None:
        return None
    if not command or command == message_id:
        raise MalformedMessageError(
            f"header {COMPENSATES_HEADER} is {command!r}: it must name the envelope id of the "
            "command this compensation undoes (ctx.envelope.id of that command), not be empty "
            "or the compensation's own id"
        )
    return command


async def decide(
    store: Store, dedup: DedupStore, group: str, compensation_id: str, command_id: str
) -> Decision:
    """Cancel ``command_id`` for ``group`` if the group has not handled it (recording the
    compensation too), or say what else to do (see ``Decision``)."""
    if dedup is store.dedup:
        # One transaction: the command's record and the compensation's, or neither. The
        # insert of the command's record waits for a concurrent transaction inserting it.
        try:
            async with store.transaction() as tx:
                await store.mark_handled(group, command_id, tx, cancelled_by=compensation_id)
                await store.mark_handled(group, compensation_id, tx)
            return Decision.CANCELLED
        except AlreadyHandled as exc:
            if exc.message_id == compensation_id:
                return Decision.DUPLICATE
    elif await dedup.mark_new(group, command_id, cancelled_by=compensation_id):
        # Two records in turn: a stop between them is resumed by the next delivery, which
        # finds the command cancelled by this very compensation.
        await dedup.mark(group, compensation_id)
        return Decision.CANCELLED
    # The command is recorded: handled, or cancelled.
    by = await dedup.cancelled_by(group, command_id)
    if by is None:
        return Decision.UNDO
    if not await dedup.mark_new(group, compensation_id):
        return Decision.DUPLICATE
    return Decision.CANCELLED if by == compensation_id else Decision.NOTHING_TO_UNDO


class Compensations:
    """The compensation rule in one consumer (one subscription of one group): the decision
    at a compensation's arrival, and what a cancellation means for the group's records."""

    def __init__(self, store: Store, group: str, *, idempotent: bool, name: str) -> None:
        self.store = store
        self.group = group
        self.idempotent = idempotent
        self.name = name
        self._warned = False  # logged once that idempotent=False cancels nothing

    async def arrived(
        self, dedup: DedupStore, compensation_id: str, command_id: str, stats: ConsumerStats
    ) -> bool:
        """A compensation arrived. True: it was settled without its handler (the caller acks
        it); False: call the handler."""
        if not self.idempotent:
            if not self._warned:
                self._warned = True
                _log.warning(
                    "%s: compensation %s (of %s) arrived at a subscription with "
                    "idempotent=False: it keeps no dedup records, so a compensation cannot "
                    "cancel a command it has not handled yet; its handler runs for every "
                    "compensation (logged once)",
                    self.name,
                    compensation_id,
                    command_id,
                )
            return False
        decision = await decide(self.store, dedup, self.group, compensation_id, command_id)
        if decision is Decision.UNDO:
            return False
        if decision is Decision.DUPLICATE:
            stats.duplicates += 1
            return True
        stats.cancels += 1
        if decision is Decision.CANCELLED:
            _log.info(
                "%s: compensation %s cancels command %s, which group %s has not handled: "
                "the command will be skipped when it arrives; the handler is not called",
                self.name,
                compensation_id,
                command_id,
                self.group,
            )
        else:
            _log.info(
                "%s: compensation %s has nothing to undo: command %s was cancelled before "
                "group %s handled it; the handler is not called",
                self.name,
                compensation_id,
                command_id,
                self.group,
            )
        return True

    async def skipped(
        self,
        dedup: DedupStore,
        message_id: str,
        stats: ConsumerStats,
        *,
        rolled_back: bool = False,
    ) -> None:
        """A message found recorded for the group, by the dedup check or at the commit of
        its transaction (``rolled_back``: ``AlreadyHandled``, its effects undone): count it
        as cancelled or as a duplicate."""
        by = await dedup.cancelled_by(self.group, message_id)
        if by is None:
            stats.duplicates += 1
            return
        stats.cancelled += 1
        _log.info(
            "%s: %s %s: compensation %s cancelled it before group %s handled it",
            self.name,
            "rolled back" if rolled_back else "skipping",
            message_id,
            by,
            self.group,
        )

    async def mark(self, dedup: DedupStore, message_id: str, stats: ConsumerStats) -> None:
        """Record a handled message outside its transaction; a record taken meanwhile by a
        cancellation means it took effect while its compensation was skipped: log an error."""
        if await dedup.mark_new(self.group, message_id):
            return
        by = await dedup.cancelled_by(self.group, message_id)
        if by is None:
            return  # a copy handled concurrently recorded it
        stats.applied_though_cancelled += 1
        _log.error(
            "%s: %s took effect although compensation %s cancelled it while it was being "
            "handled (its effects were not in ctx.transaction(), or the dedup store is not "
            "the app's store): the compensation's handler was not called, so nothing undid "
            "it; undo it by hand",
            self.name,
            message_id,
            by,
        )
