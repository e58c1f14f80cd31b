"""Transactions of the memory store: writes held until commit, all or nothing.

A :class:`MemoryTransaction` is bound to the context that opened it (``store.transaction()``,
a ``ContextVar``), as the SQL stores' are: store calls made in that context, and in tasks
created inside the block, join it until the block ends. What it holds:

- appends (``store.append``), staged per stream and given positions at commit, so readers
  outside the transaction never see them and a rollback leaves no gap (see
  :class:`~eventflow.adapters.memory.events.MemoryEventLog`);
- eventflow's other writes (checkpoints, outbox rows, dedup entries, saga rows), as actions
  run at commit (:meth:`MemoryTransaction.defer`);
- guards run at commit before any write (:meth:`MemoryTransaction.guard`): a fence whose
  lease changed hands since refuses the commit, and nothing is written.

A commit is one synchronous step (no ``await`` between its checks and its writes), so no
other task sees a transaction half applied.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Callable
from contextlib import suppress
from typing import Any

from ...envelope import Envelope
from ...errors import ConfigurationError, StoreError

__all__ = ["ENDED", "MemoryTransaction", "TransactionScope"]

ENDED = (
    "this memory store transaction has ended (committed or rolled back): make its writes "
    "inside its `async with` block (a task that outlives the block uses the store directly)"
)
_NESTED = (
    "a memory store transaction is already open in this context (this task, or the task "
    "that created it, is inside `transaction()`): nest nothing, make the writes in the open one"
)


class MemoryTransaction:
    """Buffers writes until commit; SQL is not available on the memory store."""

    def __init__(self) -> None:
        self.open = True
        self.staged: list[tuple[str, Envelope]] = []
        """Appends, in the order they were made: (stream, envelope)."""
        self.streams: dict[str, list[Envelope]] = {}
        """The same appends per stream, in version order."""
        self.staged_ids: set[str] = set()
        self.waiting_for: MemoryTransaction | None = None
        """The transaction whose stream this one waits for (to find deadlocks)."""
        self._guards: list[Callable[[], None]] = []
        self._on_commit: list[Callable[[], object]] = []
        self._on_end: list[Callable[[], None]] = []
        self._doomed: BaseException | None = None
        self._waiters: list[asyncio.Future[None]] = []

    def defer(self, action: Callable[[], object]) -> None:
        """Run ``action`` when the transaction commits (never if it rolls back)."""
        self._check_open()
        self._on_commit.append(action)

    def guard(self, check: Callable[[], None]) -> None:
        """Run ``check`` at commit before any write: if it raises, nothing is written and
        the commit raises its error."""
        self._check_open()
        self._guards.append(check)

    def doom(self, error: BaseException) -> None:
        """The transaction may only roll back: leaving its block normally raises ``error``
        (a fence refused it), and nothing is written."""
        if self._doomed is None:
            self._doomed = error

    def on_end(self, hook: Callable[[], None]) -> None:
        """Call ``hook`` when the transaction ends, committed or not."""
        self._on_end.append(hook)

    def commit(self) -> None:
        """Check the guards, then apply every write; raises (writing nothing) if the
        transaction is doomed or a guard refuses."""
        self._check_open()
        if self._doomed is not None:
            raise self._doomed.with_traceback(None)
        for check in self._guards:
            check()
        actions, self._on_commit = self._on_commit, []
        for action in actions:
            action()

    def end(self) -> None:
        """Close the transaction (after its commit or instead of it): later writes through
        it raise ``StoreError``, and whoever waits for it is woken. Idempotent."""
        if not self.open:
            return
        self.open = False
        self._on_commit, self._guards = [], []
        hooks, self._on_end = self._on_end, []
        for hook in hooks:
            hook()
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    async def ended(self) -> None:
        """Return once the transaction has ended."""
        if not self.open:
            return
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await waiter
        finally:
            with suppress(ValueError):
                self._waiters.remove(waiter)

    def _check_open(self) -> None:
        if not self.open:
            raise StoreError(ENDED)

    async def execute(self, sql: str, *args: Any) -> Any:
        """Not available: the memory store has no SQL."""
        raise ConfigurationError(
            "the memory:// store has no SQL; use sqlite:///path.db or postgresql://... to "
            "write your own tables in ctx.transaction()"
        )

    async def fetch(self, sql: str, *args: Any) -> list[tuple[Any, ...]]:
        """Not available: the memory store has no SQL."""
        return await self.execute(sql, *args)  # type: ignore[no-any-return]


class TransactionScope:
    """The transaction open in each context of one memory store."""

    def __init__(self, name: str) -> None:
        self._joined: contextvars.ContextVar[MemoryTransaction | None] = contextvars.ContextVar(
            name, default=None
        )

    def current(self) -> MemoryTransaction | None:
        """The open transaction this context joins, or None."""
        tx = self._joined.get()
        return tx if tx is not None and tx.open else None

    def of(self, tx: object) -> MemoryTransaction | None:
        """The transaction a write runs in: ``tx`` when given (a memory transaction that has
        not ended), else the context's open one, if any."""
        if tx is None:
            return self.current()
        if not isinstance(tx, MemoryTransaction):
            raise ConfigurationError(
                "a memory store write was given another store's transaction: open it with "
                "this store's transaction()"
            )
        if not tx.open:
            raise StoreError(ENDED)
        return tx

    def begin(self) -> tuple[MemoryTransaction, contextvars.Token[MemoryTransaction | None]]:
        """A new transaction bound to this context (refused inside an open one)."""
        if self.current() is not None:
            raise StoreError(_NESTED)
        tx = MemoryTransaction()
        return tx, self._joined.set(tx)

    def forget(self, token: contextvars.Token[MemoryTransaction | None]) -> None:
        """Unbind a transaction from the context it was opened in. An ``__aexit__`` run in
        another context cannot reset it there, and need not: the transaction has ended, so
        that context no longer joins it."""
        with suppress(ValueError):
            self._joined.reset(token)
