"""The saga tables on PostgreSQL: what a saga transition writes besides its stream, in one
statement.

The tables and their rows are those of :class:`~eventflow.sagas.tables.SqlSagaTables`
(which reads them); only ``save`` differs: the index row, the timers cancelled and the
timers set go to the server in one statement (data-modifying ``WITH`` queries), one round
trip where the generic code sends one per row. A saga's start and end each wrote two rows
(the index and its wait row) in two round trips: two fewer per saga.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from ...ports import Transaction
from ...sagas.tables import IndexRow, NewTimer, SqlSagaTables, tables_for
from .clock import CLOCK_SQL
from .store import PostgresStore

__all__ = ["PostgresSagaTables"]

# $7: whether to write the index row. The DELETE and the upsert never touch one row in the
# statement (a timer set is left out of the deletes: setting it replaces it), which
# PostgreSQL requires of data-modifying WITH queries.
_SAVE = (
    "WITH ix AS (INSERT INTO ef_sagas (id, name, key, status, started, updated) "
    "SELECT $1::text, $2::text, $3::text, $4::text, $5::float8, $6::float8 WHERE $7::boolean "
    "ON CONFLICT (id) DO UPDATE SET status = excluded.status, updated = excluded.updated), "
    "gone AS (DELETE FROM ef_saga_timers WHERE saga_id = $1 AND timer = ANY($8::text[])) "
    "INSERT INTO ef_saga_timers (saga_id, timer, name, key, due, token) "
    f"SELECT $1, u.t, $2, $3, {CLOCK_SQL} + u.d, u.k "
    "FROM unnest($9::text[], $10::float8[], $11::text[]) AS u(t, d, k) "
    "ON CONFLICT (saga_id, timer) DO UPDATE SET due = excluded.due, token = excluded.token"
)


class PostgresSagaTables(SqlSagaTables):
    """:class:`~eventflow.sagas.tables.SqlSagaTables` whose ``save`` is one statement."""

    async def save(
        self,
        tx: Transaction,
        row: IndexRow,
        timers: Sequence[NewTimer],
        cancelled: Iterable[str],
        *,
        index: bool = True,
    ) -> None:
        """The index row (when ``index``), the deletes and the upserts in one statement;
        none when there is nothing to write."""
        setting = {t.timer for t in timers}
        gone = [name for name in cancelled if name not in setting]
        if not (index or timers or gone):
            return
        await tx.execute(
            _SAVE,
            row.id,
            row.name,
            row.key,
            row.status,
            row.started.timestamp(),
            row.updated.timestamp(),
            index,
            gone,
            [t.timer for t in timers],
            [t.delay for t in timers],
            [t.token for t in timers],
        )


tables_for.register(PostgresStore, PostgresSagaTables)
