"""An append that is the one write of its transaction, sent as a transaction of its own.

A saga's handling writes everything in one statement: its events, with its table rows,
commands and dedup entry riding on them (:mod:`.rider`). When nothing ran in the handling's
transaction before (no read: the saga was guessed) and nothing will after (the caller
declares the append its last write), that statement alone is the transaction: sent
without BEGIN and COMMIT (:meth:`.db.PostgresDatabase.alone`), it commits on its own, its
version check and every write atomic together, two round trips fewer.

Sent alone, a statement cannot skip a conflicting row and take the others out again, as
one inside a transaction does (they would be committed between): the alone form inserts
without ``ON CONFLICT``, so a conflict fails it whole (nothing written) and a version
guard that fails inserts nothing; either way the append then goes the usual way, inside
the transaction (which sends its BEGIN then).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Any

import asyncpg

from .db import PostgresDatabase
from .rider import Rider, refusing

__all__ = ["Alone", "append_alone"]


class Alone(enum.Enum):
    """What :func:`append_alone` did, when it did not commit."""

    NOT_ALONE = "not-alone"
    """Something ran in the transaction already: append inside it, from the fast path."""
    REFUSED = "refused"
    """The statement wrote nothing (a conflict, a version guard): take the slow path."""


async def append_alone(
    db: PostgresDatabase, sql: str, args: Sequence[Any], riders: Sequence[Rider], count: int
) -> int | Alone:
    """Send the append ``sql`` (with its riders, ``count`` events) as the context's
    transaction's one statement; returns the stream's new version once it committed (the
    riders' ``written`` and ``committed`` called), else what to do. A rider's
    ``conflict`` raises its error (nothing written)."""
    async with db.alone() as conn:
        if conn is None:
            return Alone.NOT_ALONE
        try:
            with refusing(riders):
                rows = await conn.fetch(sql, *args)
        except asyncpg.UniqueViolationError:
            return Alone.REFUSED
        if len(rows) != count:
            assert not rows, "an alone append inserts all of its rows or none"
            return Alone.REFUSED
        db.ended_alone()
    for rider in riders:
        if rider.written is not None:
            rider.written()
        if rider.committed is not None:
            rider.committed()  # committed now: no COMMIT follows
    return max(r[1] for r in rows)  # type: ignore[no-any-return]
