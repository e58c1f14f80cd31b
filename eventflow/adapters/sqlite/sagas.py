"""The saga tables on SQLite: what a saga transition writes besides its stream, without a
trip of its own to the database thread.

The tables and their rows are those of :class:`~eventflow.sagas.tables.SqlSagaTables`
(which reads them); only the writes differ: nobody waits for their outcome, so they are
queued (``SqliteDatabase.queue``, as the outbox rows and the dedup entry of a handling are)
and travel to the thread with the transaction's next statement or its ``COMMIT``. A write
that fails refuses the transaction, as one run at once would have. A trip costs more than
these small statements (``db.py``): a saga handling made three or four trips, now two.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from ...ports import Transaction
from ...sagas.tables import DROP_TIMER, IndexRow, NewTimer, SqlSagaTables, TimerRow, tables_for
from .params import to_sqlite
from .store import SqliteStore
from .transaction import changed

__all__ = ["SqliteSagaTables"]


class SqliteSagaTables(SqlSagaTables):
    """:class:`~eventflow.sagas.tables.SqlSagaTables` whose writes are queued."""

    def __init__(self, store: SqliteStore) -> None:
        super().__init__(store)
        self._db = store.db

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
