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
from ...sagas.tables import IndexRow, NewTimer, SqlSagaTables, TimerRow, tables_for
from .clock import CLOCK_SQL
from .store import SqliteStore
from .transaction import changed

__all__ = ["SqliteSagaTables"]

_INDEX = (
    "INSERT INTO ef_sagas (id, name, key, status, started, updated) "
    "VALUES (?1, ?2, ?3, ?4, ?5, ?6) "
    "ON CONFLICT (id) DO UPDATE SET status = excluded.status, updated = excluded.updated"
)
_CANCEL = "DELETE FROM ef_saga_timers WHERE saga_id = ?1 AND timer = ?2"
_SET = (
    "INSERT INTO ef_saga_timers (saga_id, timer, name, key, due, token) "
    f"VALUES (?1, ?2, ?3, ?4, {CLOCK_SQL} + ?5, ?6) ON CONFLICT (saga_id, timer) "
    "DO UPDATE SET due = excluded.due, token = excluded.token"
)
_DROP = "DELETE FROM ef_saga_timers WHERE saga_id = ?1 AND timer = ?2 AND token = ?3"


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
        """The index row (when ``index``), the deletes, then the upserts, queued in ``tx``
        in that order."""
        queue = self._db.queue
        if index:
            args = (
                row.id,
                row.name,
                row.key,
                row.status,
                row.started.timestamp(),
                row.updated.timestamp(),
            )
            await queue(tx, changed, _INDEX, args)
        for timer in cancelled:
            await queue(tx, changed, _CANCEL, (row.id, timer))
        for t in timers:
            await queue(tx, changed, _SET, (row.id, t.timer, row.name, row.key, t.delay, t.token))

    async def drop_timer(self, tx: Transaction, row: TimerRow) -> None:
        """Only the setting that fired (its token); queued in ``tx``."""
        await self._db.queue(tx, changed, _DROP, (row.saga_id, row.timer, row.token))


tables_for.register(SqliteStore, SqliteSagaTables)
