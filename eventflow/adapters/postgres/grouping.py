"""Concurrent PostgreSQL appends combined into one statement (group commit in the client).

Appends made outside a transaction at a known version (a new stream, or ``expected_version=N``)
that arrive while other appends are being written wait, and the next writer inserts every
waiting one in one ``INSERT``: one statement, one commit and one WAL flush for all of them
instead of one each. With 8 writers of single-event appends, the server's per-statement work
(parse of the parameters, executor start, commit) was most of an append's cost.

Each append stays atomic and keeps its own outcome: the combined statement inserts every
row or none (one transaction), and an append whose guard fails (its stream is not at the
expected version) inserts none of its rows, which the statement's ``RETURNING`` shows. When
the combined statement fails as a whole (a unique violation: a conflict or ids already
stored; a lost connection; cancellation of the writer), nothing of it was kept or, if its
commit was cut off, every id is stored: each append then runs on its own, as it would have
without grouping, and an append whose ids are stored already finds them (appends are
idempotent by event id). Members are ordered by stream id, so two combined statements lock
the streams they share in the same order and cannot deadlock.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

from .db import PostgresDatabase

__all__ = ["AppendGroups", "Single"]

_WRITERS = 1  # combined statements in flight at once (each on a connection of its own)
_MAX_EVENTS = 2000  # events per combined statement, at most
# Every row with the version the caller expects; an append at version g > 0 goes in only if
# its stream has version g. The one-time filter gives the transaction its id before the
# first event id is drawn, as every append does (ef_sequence_v3 relies on it).
_APPEND_GROUP = (
    "INSERT INTO ef_events (event_id, stream_id, stream_version, envelope, correlation_id) "
    "SELECT i, s, v, e, c FROM unnest($1::text[], $2::text[], $3::bigint[], $4::bytea[], "
    "$5::text[], $6::bigint[]) AS u(i, s, v, e, c, g) "
    "WHERE pg_current_xact_id() IS NOT NULL AND (g = 0 OR EXISTS "
    "(SELECT 1 FROM ef_events x WHERE x.stream_id = u.s AND x.stream_version = u.g)) "
    "RETURNING stream_id"
)

Single = Callable[[str, int, list[str], list[bytes], list[str]], Awaitable[int | None]]
"""An append on its own: (stream, expected version, ids, envelopes, correlation ids) -> the
new version, or None when the caller's slow path must decide."""

_LEAD = object()  # a waiter's outcome that says: write the next combined statement
_ALONE = object()  # ... that says: the combined statement failed, append on your own


class _Append:
    __slots__ = ("blobs", "corrs", "expected", "ids", "outcome", "stream")

    def __init__(
        self, stream: str, expected: int, ids: list[str], blobs: list[bytes], corrs: list[str]
    ) -> None:
        self.stream = stream
        self.expected = expected
        self.ids = ids
        self.blobs = blobs
        self.corrs = corrs
        self.outcome: asyncio.Future[Any] = asyncio.get_running_loop().create_future()


class AppendGroups:
    """Combines the concurrent appends of one store; ``single`` writes one on its own."""

    def __init__(self, db: PostgresDatabase, single: Single) -> None:
        self._db = db
        self._single = single
        self._waiting: list[_Append] = []
        self._writers = 0

    async def append(
        self, stream: str, expected: int, ids: list[str], blobs: list[bytes], corrs: list[str]
    ) -> int | None:
        """Append now if fewer than ``_WRITERS`` statements are in flight, else wait to be
        written with the others waiting; the new version, or None (see ``Single``)."""
        if self._writers < _WRITERS and not self._waiting:
            self._writers += 1
            try:
                return await self._single(stream, expected, ids, blobs, corrs)
            finally:
                self._next()
        mine = _Append(stream, expected, ids, blobs, corrs)
        self._waiting.append(mine)
        if self._writers < _WRITERS:
            self._writers += 1
            return await self._lead(mine)
        try:
            outcome = await mine.outcome
        except asyncio.CancelledError:
            if mine in self._waiting:
                self._waiting.remove(mine)
            elif (
                mine.outcome.done()
                and not mine.outcome.cancelled()
                and mine.outcome.result() is _LEAD
            ):
                self._next()  # it was to write next: hand that on
            raise
        if outcome is _LEAD:
            return await self._lead(mine)
        if outcome is _ALONE:
            return await self._single(stream, expected, ids, blobs, corrs)
        return outcome  # type: ignore[no-any-return]

    def _next(self) -> None:
        """A writer is done: the oldest waiter writes the next statement, or a slot frees."""
        while self._waiting:
            outcome = self._waiting.pop(0).outcome
            if not outcome.done():  # done: its caller was cancelled, and takes itself out
                outcome.set_result(_LEAD)
                return
        self._writers -= 1

    async def _lead(self, mine: _Append) -> int | None:
        """Write ``mine`` with as many waiters as fit, settle each, then hand on."""
        if mine in self._waiting:
            self._waiting.remove(mine)
        group, streams, events = [mine], {mine.stream}, len(mine.ids)
        kept: list[_Append] = []
        for other in self._waiting:
            # One append per stream in a statement (a second would only conflict).
            if other.stream in streams or events + len(other.ids) > _MAX_EVENTS:
                kept.append(other)
                continue
            group.append(other)
            streams.add(other.stream)
            events += len(other.ids)
        self._waiting = kept
        try:
            if len(group) == 1:
                return await self._single(
                    mine.stream, mine.expected, mine.ids, mine.blobs, mine.corrs
                )
            outcomes = await self._write(group)
        except BaseException:
            for other in group[1:]:
                if not other.outcome.done():
                    other.outcome.set_result(_ALONE)
            raise
        finally:
            self._next()
        for other in group[1:]:
            if not other.outcome.done():
                other.outcome.set_result(outcomes[other.stream])
        result = outcomes[mine.stream]
        return (
            await self._single(mine.stream, mine.expected, mine.ids, mine.blobs, mine.corrs)
            if result is _ALONE
            else result
        )

    async def _write(self, group: list[_Append]) -> dict[str, Any]:
        """One statement for ``group``; each stream's new version, None where the guard
        kept its rows out, or ``_ALONE`` for every member when the statement failed."""
        ids: list[str] = []
        streams: list[str] = []
        versions: list[int] = []
        blobs: list[bytes] = []
        corrs: list[str] = []
        guards: list[int] = []
        for a in sorted(group, key=lambda a: a.stream):
            n = len(a.ids)
            ids += a.ids
            blobs += a.blobs
            corrs += a.corrs
            streams += [a.stream] * n
            versions += range(a.expected + 1, a.expected + n + 1)
            guards += [a.expected] * n
        try:
            async with self._db._pool().acquire() as conn:
                rows = await conn.fetch(_APPEND_GROUP, ids, streams, versions, blobs, corrs, guards)
        except Exception:
            return dict.fromkeys((a.stream for a in group), _ALONE)
        inserted = Counter(r[0] for r in rows)
        return {
            a.stream: a.expected + len(a.ids) if inserted[a.stream] == len(a.ids) else None
            for a in group
        }
