"""The memory store's outbox: messages queued with a transaction, sent by the relay."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from contextlib import AbstractAsyncContextManager, nullcontext

from ...envelope import Envelope
from ...leases import Lease
from ...ports import OutboxMessage, Transaction
from .leases import MemoryLeases
from .transactions import TransactionScope

__all__ = ["MemoryOutbox"]


class MemoryOutbox:
    """Queued outgoing messages; adds and removals join the context's transaction (or
    ``tx``), and removals made with a lease are fenced by ``leases``."""

    def __init__(self, leases: MemoryLeases, scope: TransactionScope) -> None:
        self._messages: dict[int, OutboxMessage] = {}
        self._seq = 0
        self._leases = leases
        self._scope = scope
        self.added = asyncio.Event()

    def relaying(self) -> AbstractAsyncContextManager[None]:
        """Nothing to do: the outbox is this process's alone (see ``Outbox.relaying``)."""
        return nullcontext()

    async def add(
        self, messages: Sequence[tuple[str, Envelope]], *, tx: Transaction | None = None
    ) -> None:
        """Queue now, or when the transaction commits."""

        def apply() -> None:
            for topic, env in messages:
                self._seq += 1
                self._messages[self._seq] = OutboxMessage(
                    self._seq, topic, env.key, env.to_bytes(), env.id
                )
            self.added.set()

        joined = self._scope.of(tx)
        if joined is None:
            apply()
        else:
            joined.defer(apply)

    async def pending(self, limit: int = 100) -> list[OutboxMessage]:
        """Oldest first."""
        return list(self._messages.values())[:limit]

    async def backlog(self, limit: int = 1000) -> tuple[int, OutboxMessage | None]:
        """Counted in the dict."""
        oldest = next(iter(self._messages.values()), None)
        return min(limit, len(self._messages)), oldest

    async def remove(self, seqs: Sequence[int], *, lease: Lease | None = None) -> None:
        """Delete sent messages (when the context's transaction commits, if one is open);
        with ``lease``, refused unless it still holds."""
        leases = self._leases
        if lease is not None:
            leases.check(lease)

        def apply() -> None:
            for seq in seqs:
                self._messages.pop(seq, None)

        joined = self._scope.current()
        if joined is None:
            apply()
            return
        if lease is not None:
            joined.guard(lambda: leases.check(lease))
        joined.defer(apply)
