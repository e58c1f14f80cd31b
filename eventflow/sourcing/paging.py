"""Reading a store in pages: what the SQL event stores share.

Both ``read_stream`` and ``read_all`` fetch up to ``batch`` rows after a cursor, yield them,
and move the cursor to the last row, until a short page or the caller's ``limit``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
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
    records: Callable[[Sequence[Any]], Iterable[RecordedEvent]],
    next_cursor: Callable[[Any], Any],
    batch: int = READ_BATCH,
    *,
    ahead: Callable[[], bool] | None = None,
) -> AsyncIterator[RecordedEvent]:
    """Yield the records of ``fetch(cursor, size)`` pages until a short page or ``limit``
    rows; ``records(rows)`` makes a page's records (one envelope decoder per page, see
    ``stored_envelopes``); ``next_cursor(last_row)`` moves the cursor.

    When ``ahead()`` says so (checked before each page is yielded), the next page is fetched
    in a task of its own while this one is read, so the server works on it meanwhile; the
    task is the generator's own, cancelled if the reader stops early.
    """
    remaining = limit
    if remaining is not None and remaining <= 0:
        return
    size = batch if remaining is None else min(batch, remaining)
    rows = await fetch(cursor, size)
    pending: asyncio.Future[Sequence[Any]] | None = None
    try:
        while True:
            more = len(rows) == size
            if more:
                cursor = next_cursor(rows[-1])
                if remaining is not None:
                    remaining -= len(rows)
                    more = remaining > 0
            if more:
                size = batch if remaining is None else min(batch, remaining)
                if ahead is not None and ahead():
                    pending = asyncio.ensure_future(fetch(cursor, size))
                    await asyncio.sleep(0)  # let it send its query before the page is read
            for rec in records(rows):
                yield rec
            if not more:
                return
            if pending is not None:
                rows, pending = await pending, None
            else:
                rows = await fetch(cursor, size)
    finally:
        if pending is not None:
            pending.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await pending
