"""Reading a store in pages: what the SQL event stores share.

Both ``read_stream`` and ``read_all`` fetch up to ``batch`` rows after a cursor, yield them,
and move the cursor to the last row, until a short page or the caller's ``limit``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

from ..ports import RecordedEvent

__all__ = ["READ_BATCH", "paged", "stream_range"]

READ_BATCH = 1000


def stream_range(from_version: int | None, backwards: bool) -> tuple[int, str, str]:
    """(cursor, comparison, order) for reading one stream from ``from_version``.

    Forwards the cursor is the version before the first one wanted (``>``); backwards it is
    the one after (``<``), and the end of the stream when ``from_version`` is None.
    """
    if backwards:
        return (from_version if from_version is not None else 2**62) + 1, "<", "DESC"
    return (from_version or 1) - 1, ">", "ASC"


async def paged(
    fetch: Callable[[Any, int], Awaitable[Sequence[Any]]],
    cursor: Any,
    limit: int | None,
    record: Callable[[Any], RecordedEvent],
    next_cursor: Callable[[Any], Any],
    batch: int = READ_BATCH,
) -> AsyncIterator[RecordedEvent]:
    """Yield ``record(row)`` for rows of ``fetch(cursor, size)`` pages until a short page or
    ``limit`` rows; ``next_cursor(last_row)`` moves the cursor."""
    remaining = limit
    while remaining is None or remaining > 0:
        size = batch if remaining is None else min(batch, remaining)
        rows = await fetch(cursor, size)
        for row in rows:
            yield record(row)
        if len(rows) < size:
            return
        cursor = next_cursor(rows[-1])
        if remaining is not None:
            remaining -= len(rows)
