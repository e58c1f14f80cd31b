"""The PostgreSQL event log: appends in one statement, positions from a sequencer.

Appends only insert events; the sequencer (:mod:`.sequencer`) gives committed events their
positions later, in insertion order. Because it only ever numbers committed rows, a
position is never handed out before an earlier one is visible: readers that follow
``position > last`` never skip an event committed late, no lock is taken around appends,
and an open unrelated transaction delays nothing. See docs/event-store.md.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from typing import Any

import asyncpg
import orjson

from ...envelope import Envelope, stored_envelopes
from ...errors import ConcurrencyError, StoreError
from ...events import Event
from ...ports import RecordedEvent, Snapshot
from ...sourcing.append import prepare_append
from ...sourcing.paging import paged, stream_range
from ...supervision import Supervisor
from .alone import Alone, append_alone
from .db import PostgresDatabase
from .grouped import AppendGroups
from .rider import Rider, alone, arguments, refusing, riding
from .sequencer import Sequencer, number_committed

__all__ = ["PostgresEventLog"]

_SUBSCRIBE_POLL = 1.0  # a subscriber re-reads at least this often, notification or not
_CONFLICT = "EF409"
# Retries of an append at any version in the caller's READ COMMITTED transaction: each lost
# race is another append committed, so they make progress (under load one of eight tasks lost
# over 100 in a row); the bound only stops a runaway. Other isolation levels never retry.
_ANY_RETRIES = 100_000
_COLUMNS = "e.stream_id, e.stream_version, e.envelope"
# An event's position: from the run that holds its id (NULL while it is not numbered yet).
_POSITION = (
    "(SELECT CASE WHEN e.id < r.id + r.n THEN r.position + (e.id - r.id) END "
    "FROM ef_runs r WHERE r.id <= e.id ORDER BY r.id DESC LIMIT 1)"
)


# The correlation_id column, or for rows stored without it (by an earlier version), the id
# in the envelope: one partial index each (see schema.py).
_CORRELATED = (
    f"SELECT {_POSITION}, {_COLUMNS} FROM ef_events e WHERE e.correlation_id = $1 "
    "OR (e.correlation_id IS NULL AND ef_correlation_v1(e.envelope) = $1) "
    "ORDER BY e.id LIMIT $2"
)
_STREAM_VERSION = "SELECT COALESCE(MAX(stream_version), 0) FROM ef_events WHERE stream_id = $1"


def _append_sql(base: str, guard: str = "") -> str:
    # The one-time filter gives the transaction its id before the first event id is drawn:
    # ef_sequence_v3 relies on that (see schema.py). `guard` is checked once, before any row.
    # $4: the events' correlation ids (trace's index reads the column, not the envelope).
    return (
        "INSERT INTO ef_events (event_id, stream_id, stream_version, envelope, correlation_id) "
        f"SELECT i, $1, {base} + o, e, c FROM unnest($2::text[], $3::bytea[], $4::text[]) "
        f"WITH ORDINALITY AS u(i, e, c, o) WHERE pg_current_xact_id() IS NOT NULL{guard}"
    )


# The fast-path appends. A new stream, or one at version $5 (which must exist): the caller
# knows the new version, and reads the rows inserted from the command status (none when the
# guard fails). Any version: the new version comes back from the statement.
_APPEND_NEW = _append_sql("0")
_APPEND_AT = _append_sql(
    "$5::bigint",
    " AND EXISTS (SELECT 1 FROM ef_events WHERE stream_id = $1 AND stream_version = $5)",
)
_APPEND_ANY = (
    f"WITH ins AS ({_append_sql(f'({_STREAM_VERSION})')} RETURNING stream_version) "
    "SELECT MAX(stream_version) FROM ins"
)
# The same inside the caller's transaction, where a unique violation would abort it: a
# conflicting row is skipped instead, and the rows inserted come back, so a batch that did
# not go in whole is taken out again (then the slow path sorts it out, in a savepoint). No
# savepoint around the common case: two round trips fewer per append.
_SKIP = " ON CONFLICT DO NOTHING RETURNING event_id, stream_version"
_IN_TX = {
    "new": _APPEND_NEW + _SKIP,
    "at": _APPEND_AT + _SKIP,
    "any": _append_sql(f"({_STREAM_VERSION})") + _SKIP,
}
_OUTSIDE_TX = {"new": _APPEND_NEW, "at": _APPEND_AT, "any": _APPEND_ANY}
_ALONE = {k: _IN_TX[k].replace(_SKIP, " RETURNING event_id, stream_version") for k in _IN_TX}
_TAKE_OUT = "DELETE FROM ef_events WHERE event_id = ANY($1::text[])"


# From the run that holds position $1 + 1 on, in position order, an id range of at most a
# page from each run (every id of a run exists): each page reads about a page of events,
# however long the run and whatever the planner knows of the tables, and the incremental
# sort that orders each run's rows never holds more than a page.
_READ_ALL = (
    f"SELECT r.position + (e.id - r.id), {_COLUMNS} FROM ef_runs r "
    "CROSS JOIN LATERAL (SELECT GREATEST(r.id, r.id + ($1::bigint + 1 - r.position)) "
    "AS lo) b JOIN ef_events e ON e.id >= b.lo "
    "AND e.id < LEAST(r.id + r.n, b.lo + $2::bigint) "
    "WHERE r.position >= COALESCE((SELECT max(position) FROM ef_runs "
    "WHERE position <= $1::bigint + 1), 0) ORDER BY r.position, e.id LIMIT $2"
)

_SLOW_APPEND = "SELECT ef_append_v4($1, $2, $3, $4, $5)"
_READ_COMMITTED = "SELECT current_setting('transaction_isolation') = 'read committed'"


def _records(rows: Sequence[Any]) -> Iterator[RecordedEvent]:
    """A page of rows (position, stream_id, stream_version, envelope) as records, made as
    they are read."""
    envelopes = stored_envelopes(r[3] for r in rows)
    for r, env in zip(rows, envelopes, strict=True):
        yield RecordedEvent(r[1], r[2], r[0] or 0, env)


def _columns(
    stream_id: str, events: Sequence[Event | Envelope]
) -> tuple[list[str], list[bytes], list[str]]:
    """The events of an append, checked and enveloped (``prepare_append``), as the
    statement's columns: their ids, stored bytes and correlation ids."""
    envelopes = prepare_append(stream_id, events)
    return (
        [e.id for e in envelopes],
        [e.to_bytes() for e in envelopes],
        [e.correlation_id for e in envelopes],
    )


def _kind(stream_id: str, expected: int | None, *columns: list[Any]) -> tuple[str, tuple[Any, ...]]:
    """Which fast-path append (any version, a new stream, at a version) and its arguments."""
    if expected is None:
        return "any", (stream_id, *columns)
    if expected == 0:
        return "new", (stream_id, *columns)
    return "at", (stream_id, *columns, int(expected))


class PostgresEventLog:
    """Event-store methods over a :class:`PostgresDatabase` (mixed into the store)."""

    db: PostgresDatabase

    def _init_events(
        self,
        channels: Mapping[str, Callable[[str], None]] | None = None,
        reconnected: Sequence[Callable[[], None]] = (),
    ) -> None:
        """Set up the sequencer; ``channels``: other notification channels its listener
        follows (the leases' releases, the outbox's adds), each with the callback given the
        payload; ``reconnected``: called when the listener connected again (notifications
        sent while it was away are lost)."""
        self._sequencer = Sequencer(self.db, channels, reconnected)
        self.append_groups = AppendGroups(self.db)

    async def _start_events(self, supervisor: Supervisor | None) -> None:
        await self._sequencer.start(supervisor)

    async def _stop_events(self) -> None:
        await self._sequencer.stop()

    async def append(
        self,
        stream_id: str,
        events: Sequence[Event | Envelope],
        *,
        expected_version: int | None = None,
    ) -> int:
        """Append atomically, usually in one ``INSERT``; see ``EventStore.append``.

        The fast path inserts with the versions the caller expects and lets the unique
        indexes reject conflicts; anything unusual (a conflict, ids already stored, a
        version the stream has not reached) goes through ``ef_append_v4``, which sorts it out.
        Outside a transaction, at a known version, an append made while another is being
        written waits and is written with the others waiting (``grouped.py``).
        """
        ids, blobs, corrs = _columns(stream_id, events)
        ambient = self.db.current is not None
        version: int | None = None
        groups = self.append_groups
        if not ids:
            pass
        elif ambient or expected_version is None:
            version = await self._fast_append(stream_id, expected_version, ids, blobs, corrs)
        elif groups.free():
            slot = groups.hold()
            try:
                version = await self._fast_append(stream_id, expected_version, ids, blobs, corrs)
            finally:
                groups.release(slot)
        else:
            version = await groups.append(stream_id, expected_version, ids, blobs, corrs)
        if version is None:
            version = await self._slow_append(stream_id, expected_version, ids, blobs, corrs)
        if ambient:
            self.db.after_commit(self._sequencer.appended)
        else:
            self._sequencer.appended()
        return version

    async def append_riding(
        self,
        stream_id: str,
        events: Sequence[Event | Envelope],
        riders: Sequence[Rider],
        *,
        expected_version: int | None = None,
        last: bool = False,
    ) -> int:
        """Append as :meth:`append` does, and write ``riders`` (:mod:`.rider`) in the same
        transaction if the append succeeds: in its statement, or after the slow path in one
        of their own. A conflict raises ``ConcurrencyError``, nothing written; a rider's
        ``conflict`` its error (roll back). Outside a transaction it opens one. ``last``:
        nothing is written after it; if nothing ran before, it is the transaction (.alone)."""
        if self.db.current is None:
            async with self.db.transaction():
                return await self.append_riding(
                    stream_id, events, riders, expected_version=expected_version, last=last
                )
        ids, blobs, corrs = _columns(stream_id, events)
        kind, args = _kind(stream_id, expected_version, ids, blobs, corrs)
        every = (*args, *arguments(riders))
        version: int | None = None
        tried: int | Alone = Alone.NOT_ALONE
        if ids and last and kind != "any":
            sql = riding(_ALONE[kind], len(args), riders)
            tried = await append_alone(self.db, sql, every, riders, len(ids))
            if not isinstance(tried, Alone):
                self._sequencer.appended()
                return tried
        with refusing(riders):
            if ids and tried is Alone.NOT_ALONE:
                sql = riding(_IN_TX[kind], len(args), riders)
                version = await self._fast_append_in_tx(sql, every)
            if version is None:
                version = await self._slow_append(stream_id, expected_version, ids, blobs, corrs)
                if riders:
                    async with self.db.connection() as conn:
                        await conn.execute(alone(riders), *arguments(riders))
        for rider in riders:
            if rider.written is not None:
                rider.written()
            if rider.committed is not None:
                self.db.after_commit(rider.committed)
        self.db.after_commit(self._sequencer.appended)
        return version

    async def _fast_append(
        self,
        stream_id: str,
        expected: int | None,
        ids: list[str],
        blobs: list[bytes],
        corrs: list[str],
    ) -> int | None:
        # Constant statements (the expected version is a parameter): asyncpg's statement
        # cache serves every append after a connection's first. Any version: the statement
        # returns the new version (fetchval); otherwise the caller knows it, and the command
        # status says whether every row went in (execute).
        kind, args = _kind(stream_id, expected, ids, blobs, corrs)
        sql = _OUTSIDE_TX[kind]
        if self.db.current is not None:
            return await self._fast_append_in_tx(_IN_TX[kind], args)
        try:
            async with self.db._pool().acquire() as conn:  # the hot path: no generator CM
                run = conn.fetchval if expected is None else conn.execute
                result = await run(sql, *args)
        except asyncpg.UniqueViolationError:
            return None  # a conflict or a retried append: the slow path tells which
        if expected is None:
            return result  # type: ignore[no-any-return]
        # "INSERT 0 <rows>": no rows when the stream is not at the expected version
        return expected + len(ids) if result == f"INSERT 0 {len(ids)}" else None

    async def _fast_append_in_tx(self, sql: str, args: tuple[Any, ...]) -> int | None:
        """The fast path inside the context's transaction: one statement that skips a
        conflicting row instead of failing (which would abort the transaction); a batch
        that did not go in whole is taken out again, and None sends it to the slow path."""
        # The connection is held for both statements: its transaction's other tasks wait.
        async with self.db.connection() as conn:
            rows = await conn.fetch(sql, *args)
            if len(rows) == len(args[1]):
                return max(r[1] for r in rows)  # type: ignore[no-any-return]
            if rows:
                await conn.execute(_TAKE_OUT, [r[0] for r in rows])
        return None

    async def _slow_append(
        self,
        stream_id: str,
        expected: int | None,
        ids: list[str],
        blobs: list[bytes],
        corrs: list[str],
    ) -> int:
        ambient = self.db.current is not None
        retries = 0
        moves: bool | None = None  # whether the transaction's snapshot moves (READ COMMITTED)
        while True:
            try:
                async with (
                    self.db.connection() as conn,
                    conn.transaction() if ambient else contextlib.nullcontext(),  # savepoint
                ):
                    version: int = await conn.fetchval(
                        _SLOW_APPEND, stream_id, expected, ids, blobs, corrs
                    )
                return version
            except asyncpg.UniqueViolationError as exc:  # another append took the version or ids
                if ambient and expected is None and retries < _ANY_RETRIES:
                    if moves is None:  # a snapshot of its own per statement, or one for all?
                        async with self.db.connection() as conn:
                            moves = await conn.fetchval(_READ_COMMITTED)
                    if moves:  # any version will do: the next statement sees the other append
                        retries += 1
                        continue
                if ambient:
                    raise ConcurrencyError(
                        stream_id, expected, await self._version_outside(stream_id)
                    ) from exc
                if expected is not None and "event_id" not in str(exc.constraint_name):
                    raise ConcurrencyError(
                        stream_id, expected, await self.stream_version(stream_id)
                    ) from exc
            except asyncpg.PostgresError as exc:
                if getattr(exc, "sqlstate", None) == _CONFLICT:
                    raise ConcurrencyError(stream_id, expected, int(str(exc))) from None
                raise StoreError(f"append to {stream_id!r} failed: {exc}") from exc

    async def _version_outside(self, stream_id: str) -> int:
        # Outside the context's transaction: after a conflict it is aborted.
        async with self.db._pool().acquire() as conn:
            return int(await conn.fetchval(_STREAM_VERSION, stream_id))

    def read_stream(
        self,
        stream_id: str,
        *,
        from_version: int | None = None,
        backwards: bool = False,
        limit: int | None = None,
    ) -> AsyncIterator[RecordedEvent]:
        """One stream's events in version order (or reversed), read in pages."""
        cursor, cmp, order = stream_range(from_version, backwards)
        sql = (
            f"SELECT {_POSITION}, {_COLUMNS} FROM ef_events e "
            f"WHERE e.stream_id = $1 AND e.stream_version {cmp} $2 "
            f"ORDER BY e.stream_version {order} LIMIT $3"
        )

        async def fetch(after: int, size: int) -> list[Any]:
            async with self.db.connection() as conn:
                rows: list[Any] = await conn.fetch(sql, stream_id, after, size)
                if any(r[0] is None for r in rows) and self.db.current is None:
                    # Just committed, not numbered yet: number now so positions are real.
                    await number_committed(conn)
                    rows = await conn.fetch(sql, stream_id, after, size)
            return rows

        return paged(fetch, cursor, limit, _records, lambda row: row[2])

    async def correlated(self, correlation_id: str, *, limit: int = 100_000) -> list[RecordedEvent]:
        """The events of one correlation in commit order, through ``ef_events_correlation``."""
        await self._sync()  # so that committed events have their positions
        async with self.db.connection() as conn:
            rows = await conn.fetch(_CORRELATED, correlation_id, limit)
        return list(_records(rows))

    async def read_all(
        self, *, after: int = 0, limit: int | None = None
    ) -> AsyncIterator[RecordedEvent]:
        """Sequenced events after ``after`` in global order, read in pages."""
        await self._sync()

        async def fetch(cursor: int, size: int) -> list[Any]:
            async with self.db.connection() as conn:
                rows: list[Any] = await conn.fetch(_READ_ALL, cursor, size)
            return rows

        def ahead() -> bool:
            # Outside a transaction only: a page read ahead inside one would hold its
            # connection, and could run beside the reader's own statements on it.
            return self.db.current is None

        async for rec in paged(fetch, after, limit, _records, lambda row: row[0], ahead=ahead):
            yield rec

    async def subscribe(self, *, after: int = 0) -> AsyncIterator[RecordedEvent]:
        """Catch up, then follow: woken by ``ef_sequenced`` notifications (LISTEN), with a
        slow re-read as a safety net."""
        position = after
        while True:
            tick = self._sequencer.tick
            async for rec in self.read_all(after=position):
                position = rec.position
                yield rec
            if tick is None:
                raise StoreError("the PostgreSQL store is not open: `await store.open()` first")
            try:
                async with asyncio.timeout(_SUBSCRIBE_POLL):
                    await asyncio.shield(tick)
            except TimeoutError:
                pass

    async def stream_version(self, stream_id: str) -> int:
        """0 when the stream does not exist."""
        async with self.db.connection() as conn:
            return int(await conn.fetchval(_STREAM_VERSION, stream_id))

    async def _sync(self) -> None:
        """Sequence what is committed now, so a read right after an append sees it (in as
        many passes as it takes: one numbers at most ``_SEQUENCE_BATCH`` ids)."""
        if self.db.current is None:
            async with self.db.connection() as conn:
                await number_committed(conn)

    async def last_position(self) -> int:
        """The position of the newest committed event (0 when empty)."""
        await self._sync()
        async with self.db.connection() as conn:
            return int(await conn.fetchval("SELECT last FROM ef_sequence"))

    async def save_snapshot(self, snapshot: Snapshot) -> None:
        """Replace the stream's snapshot."""
        async with self.db.connection() as conn:
            await conn.execute(
                "INSERT INTO ef_snapshots (stream_id, version, state, taken_at) "
                "VALUES ($1, $2, $3::jsonb, $4) ON CONFLICT (stream_id) DO UPDATE SET "
                "version = excluded.version, state = excluded.state, taken_at = excluded.taken_at",
                snapshot.stream_id,
                snapshot.version,
                orjson.dumps(dict(snapshot.state)).decode(),
                snapshot.taken_at,
            )

    async def load_snapshot(self, stream_id: str) -> Snapshot | None:
        """The stream's snapshot, if any."""
        async with self.db.connection() as conn:
            row = await conn.fetchrow(
                "SELECT version, state::text, taken_at FROM ef_snapshots WHERE stream_id = $1",
                stream_id,
            )
        if row is None:
            return None
        return Snapshot(stream_id, row[0], orjson.loads(row[1]), row[2])
