"""The saga tables on SQLite: what a saga transition writes besides its stream, without a
trip of its own to the database thread.

The tables and their rows are those of :class:`~eventflow.sagas.tables.SqlSagaTables`
(which reads them); only the writes differ: nobody waits for their outcome, so they are
queued (``SqliteDatabase.queue``, as the outbox rows and the dedup entry of a handling are)
and travel to the thread with the transaction's next statement or its ``COMMIT``. A write
that fails refuses the transaction, as one run at once would have. A trip costs more than
these small statements (``db.py``): a saga handling made three or four trips, then two.

The append itself is queued too when its caller applies the input again on a conflict
found at the commit (``Writes.checked_at_commit``: the consumer's pipeline does): the
version check and the events travel with the ``COMMIT``, so a handling that guessed its
saga makes one trip. A wrong guess then raises ``ConcurrencyError`` from the commit
(everything rolled back); events stored already (a copy of a message whose handling
committed: the transition ids come from the message's) raise ``AlreadyHandled`` there.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from ...envelope import Envelope
from ...ports import Transaction
from ...sagas.tables import (
    DROP_TIMER,
    IndexRow,
    NewTimer,
    SqlSagaTables,
    TimerRow,
    Writes,
    tables_for,
)
from .params import to_sqlite
from .store import SqliteStore
from .transaction import changed

__all__ = ["SqliteSagaTables"]


class SqliteSagaTables(SqlSagaTables):
    """:class:`~eventflow.sagas.tables.SqlSagaTables` whose writes are queued."""

    def __init__(self, store: SqliteStore) -> None:
        super().__init__(store)
        self._sqlite = store
        self._db = store.db

    async def _append_events(
        self,
        tx: Transaction,
        stream_id: str,
        envelopes: Sequence[Envelope],
        expected_version: int,
        writes: Writes,
    ) -> int:
        """With ``writes.checked_at_commit`` (and ``handled``): the append queued for the
        ``COMMIT``, as the table writes and the commands are (see the module docstring);
        returns the version the commit gives the stream. Otherwise the store's append."""
        handled = writes.handled
        if not writes.checked_at_commit or handled is None or tx is None:
            return await super()._append_events(tx, stream_id, envelopes, expected_version, writes)
        return await self._sqlite.append_at_commit(
            tx, stream_id, envelopes, expected_version, handled
        )

    async def save(
        self,
        tx: Transaction,
        row: IndexRow,
        timers: Sequence[NewTimer],
        cancelled: Iterable[str],
        *,
        index: bool = True,
    ) -> None:
        """The statements of :meth:`~eventflow.sagas.tables.SqlSagaTables.writes`,
        queued in ``tx`` in that order."""
        queue = self._db.queue
        for sql, args in self.writes(row, timers, cancelled, index=index):
            await queue(tx, changed, to_sqlite(sql), args)

    async def drop_timer(self, tx: Transaction, row: TimerRow) -> None:
        """Only the setting that fired (its token); queued in ``tx``."""
        args = (row.saga_id, row.timer, row.token)
        await self._db.queue(tx, changed, to_sqlite(DROP_TIMER), args)


tables_for.register(SqliteStore, SqliteSagaTables)
