"""Settling a handling's inbox transaction (``ctx.transaction()``).

A handler that opened ``ctx.transaction()`` leaves it open when it returns. On success the
consumer writes the dedup entry (``store.mark_handled``) and the messages the handler
queued with ``ctx.publish`` (the outbox) into it and commits: the handler's writes, the
dedup entry and the outgoing messages happen exactly once together (a transactional inbox
and outbox; the outbox relay sends the messages). On failure, or if the block inside the
handler raised, everything rolls back.

Two copies of one message handled at once cannot both commit: the second finds the first's
dedup entry (``AlreadyHandled``), rolls back and is acked as a duplicate. So does a message
that a compensation cancelled while its handler ran (``compensation.py``): the
compensation's transaction recorded it first, and the handler's effects roll back. A
failure of eventflow's own writes or of the commit is a failure around the handler, not an
attempt: it raises, and the consumer gives the message back. But a stream found moved at
the commit (a version checked there: SQLite's saga appends, ``Writes.checked_at_commit``)
is ``MovedAtCommit``: rolled back, the message is applied again at once, in a fresh
transaction, without spending an attempt.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from ..context import Context
from ..errors import AlreadyHandled, ConcurrencyError
from ..ports import Store

if TYPE_CHECKING:
    from ..telemetry.tracing import Tracing

__all__ = ["MovedAtCommit", "Settlement"]

_log = logging.getLogger("eventflow.consumer")


class MovedAtCommit(Exception):
    """The commit found a stream moved since the handler read or guessed it (its version
    checked at the commit): everything rolled back; apply the message again."""


class Settlement:
    """Commits or rolls back the handlings' transactions of one consumer (one group)."""

    def __init__(
        self,
        store: Store,
        group: str,
        *,
        idempotent: bool,
        name: str,
        tracing: Tracing | None = None,
    ) -> None:
        self.store = store
        self.group = group
        self.idempotent = idempotent
        self.name = name
        self.tracing = tracing

    async def settle(
        self, ctx: Context, env_id: str, error: BaseException | None
    ) -> BaseException | None:
        """Finish the handler's store transaction: on success write the dedup entry and the
        queued messages into it and commit; on failure roll back. Returns the handler's error
        (or ``AlreadyHandled``: a copy committed first, or a compensation cancelled the
        message; everything rolled back). A failure of eventflow's own writes or of the
        commit raises. A dedup store apart from the store (Redis) is the caller's to mark
        after the commit."""
        if error is None and ctx._tx_failed is not None:
            failed = ctx._tx_failed
            error = RuntimeError(
                "the `async with ctx.transaction()` block raised "
                f"{type(failed).__name__}: {failed}; its transaction was rolled back"
            )
        if error is not None:
            await self.roll_back(ctx, error)
            return error
        store = self.store
        try:
            tx = ctx._tx
            assert tx is not None
            if self.idempotent:
                await store.mark_handled(self.group, env_id, tx)
            outbox = ctx._take_outbox()
            if outbox and self.tracing is not None:  # each in a send span it carries
                await self.tracing.send_to_outbox(outbox, lambda m: store.outbox.add(m, tx=tx))
            elif outbox:
                await store.outbox.add(outbox, tx=tx)
        except BaseException as exc:
            await self.roll_back(ctx, exc)
            if isinstance(exc, AlreadyHandled):
                # A copy handled concurrently elsewhere committed first, or a compensation
                # cancelled this message meanwhile: its effects rolled back with it.
                return exc
            raise
        try:
            await ctx._finish_transaction(None)
        except AlreadyHandled as exc:
            return exc  # found at the commit (SQLite sends its writes then): rolled back
        except ConcurrencyError as exc:
            return MovedAtCommit(str(exc))  # rolled back: to apply again
        ctx._committed = True
        return None

    async def roll_back(self, ctx: Context, cause: BaseException) -> None:
        """Roll back the handling's transaction after ``cause`` (a cancellation or a failed
        write); a rollback that fails is logged, and the transaction is gone either way
        (the server rolls back what a dropped connection had open)."""
        try:
            await ctx._finish_transaction(cause)
        except Exception as exc:
            _log.warning(
                "%s: rolling back the handler's transaction failed (%s: %s); the store drops "
                "it with its connection",
                self.name,
                type(exc).__name__,
                exc,
            )
