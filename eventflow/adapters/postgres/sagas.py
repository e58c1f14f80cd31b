"""The saga tables on PostgreSQL: what a saga transition writes besides its stream, in the
statement of the stream's append.

The tables and their rows are those of :class:`~eventflow.sagas.tables.SqlSagaTables`
(which reads them); the writes differ. ``append`` sends the transition's events, its index
row, the timers it cancels and sets, and its commands' outbox rows in one statement: the
tables, the outbox and the input's dedup entry ride on the append (:mod:`.rider`,
data-modifying ``WITH`` queries guarded on every event having gone in), so a conflicting
append writes none of them, a copy of an input handled first fails it whole
(``AlreadyHandled``), and one round trip does what took four. ``save`` sends the same
table writes in one statement of their own.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from ...envelope import Envelope
from ...ports import Transaction
from ...sagas.tables import IndexRow, NewTimer, SqlSagaTables, Writes, tables_for
from .clock import CLOCK_SQL
from .rider import APPENDED, Rider, alone, arguments
from .store import PostgresStore

__all__ = ["PostgresSagaTables"]

# The index row ($7: whether to write it), the timers cancelled, the timers set: three
# riders that never touch one row in a statement (a timer set is left out of the deletes:
# setting it replaces it), which PostgreSQL requires of data-modifying WITH queries.
_INDEX = (
    "INSERT INTO ef_sagas (id, name, key, status, started, updated) "
    "SELECT $1::text, $2::text, $3::text, $4::text, $5::float8, $6::float8 "
    f"WHERE $7::boolean AND {APPENDED} "
    "ON CONFLICT (id) DO UPDATE SET status = excluded.status, updated = excluded.updated"
)
_CANCEL = (
    f"DELETE FROM ef_saga_timers WHERE saga_id = $1 AND timer = ANY($2::text[]) AND {APPENDED}"
)
_SET = (
    "INSERT INTO ef_saga_timers (saga_id, timer, name, key, due, token) "
    f"SELECT $1::text, u.t, $2::text, $3::text, {CLOCK_SQL} + u.d, u.k "
    f"FROM unnest($4::text[], $5::float8[], $6::text[]) AS u(t, d, k) WHERE {APPENDED} "
    "ON CONFLICT (saga_id, timer) DO UPDATE SET due = excluded.due, token = excluded.token"
)


def _riders(
    row: IndexRow, timers: Sequence[NewTimer], cancelled: Iterable[str], index: bool
) -> list[Rider]:
    """The table writes of one transition as riders; none when there is nothing to write
    (the three are kept together otherwise: one statement shape, one prepared statement)."""
    setting = {t.timer for t in timers}
    gone = [name for name in cancelled if name not in setting]
    if not (index or timers or gone):
        return []
    started, updated = row.started.timestamp(), row.updated.timestamp()
    return [
        Rider(_INDEX, (row.id, row.name, row.key, row.status, started, updated, index)),
        Rider(_CANCEL, (row.id, gone)),
        Rider(
            _SET,
            (
                row.id,
                row.name,
                row.key,
                [t.timer for t in timers],
                [t.delay for t in timers],
                [t.token for t in timers],
            ),
        ),
    ]


class PostgresSagaTables(SqlSagaTables):
    """:class:`~eventflow.sagas.tables.SqlSagaTables` whose writes ride on the append."""

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
        riders = _riders(row, timers, cancelled, index)
        if riders:
            await tx.execute(alone(riders), *arguments(riders))

    async def append(
        self,
        tx: Transaction,
        stream_id: str,
        envelopes: Sequence[Envelope],
        expected_version: int,
        writes: Writes,
        sends: Sequence[tuple[str, Envelope]] = (),
    ) -> int:
        """The events, the table writes and the outbox rows in one statement (in one of
        their own after an append that took the slow path); a conflict writes nothing.
        ``tx`` must be the context's open transaction, where the store's append runs;
        another is written the generic way."""
        store = self.store
        assert isinstance(store, PostgresStore)  # registered for it
        if not store.db.is_current(tx):
            return await super().append(tx, stream_id, envelopes, expected_version, writes, sends)
        w = writes
        riders = _riders(w.row, w.timers, w.cancelled, w.index)
        if sends:
            riders.append(store.outbox.rider(sends))
        if w.handled is not None:
            riders.append(store.handled_rider(*w.handled))
        return await store.append_riding(
            stream_id, envelopes, riders, expected_version=expected_version, last=w.last
        )


tables_for.register(PostgresStore, PostgresSagaTables)
