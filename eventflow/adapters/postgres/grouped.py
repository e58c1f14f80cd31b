"""Grouped appends: concurrent appends to several streams written in one statement.

An append made outside a caller's transaction at a known version (``expected_version`` 0 or
N) normally runs its own ``INSERT`` and commit. While a statement of the store's appends is
in flight (``WRITERS``, one), it waits in a queue instead, and the next free writer takes the
whole queue (at most ``_GROUP_EVENTS`` events, one append per stream) into one statement: one
round trip, one commit, one WAL flush for the lot. While a group is being written the next
one gathers, so groups grow with the load and a lone append waits for nothing.

A statement in flight for longer than ``_STALL`` (it waits for another transaction's row
lock, say) lends its slot out: one more writer may start, up to ``MAX_WRITERS``, so a stream
held by a long transaction holds up its own appends, not every other stream's.

The statement checks each stream's version (a scalar subquery per stream, on the statement's
snapshot) and inserts the events of the streams that are where their caller expects; it
returns which those were. Every other append of the group (its stream had moved, or its ids
were stored already) is sent back to its caller, which appends alone and gets its own
``ConcurrencyError`` or its own no-op result: a conflict in one stream fails no other
caller. A statement that fails as a whole (a unique index: an id stored in another stream,
or a concurrent writer of one of the streams) sends every append of the group back the same
way; nothing of it was written.

Like every append, the statement takes its transaction id before it draws an event id, and
inserts each stream's events in version order, so the sequencer's rules hold unchanged
(docs/event-store.md).
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from .db import PostgresDatabase

__all__ = ["MAX_WRITERS", "WRITERS", "AppendGroups"]

WRITERS = 1
"""Statements in flight at once (each a lone append or a group); appends made meanwhile wait.
One: the server's commits then carry as many appends as possible (with two, one slot mostly
wrote a big group and the other one lone append after another)."""
MAX_WRITERS = 4
"""Statements in flight at most, counting those that lent their slot out (``_STALL``)."""
_STALL = 0.05  # seconds in flight after which a statement no longer counts against WRITERS
_LINGER = 1  # event-loop turns a writer waits for more appends before it takes a group
_GROUP_EVENTS = 2000  # events per group at most (a bigger queue makes several groups)

# $1/$2: each member's stream and expected version; $3..$7: each event's member (1-based),
# version offset, id, envelope, correlation id. The members whose stream is at the expected
# version come back; their events are inserted in the order given (ids follow versions).
_APPEND_GROUP = (
    "WITH m AS MATERIALIZED (SELECT k, s, b FROM unnest($1::text[], $2::bigint[]) "
    "WITH ORDINALITY AS m(s, b, k) WHERE COALESCE((SELECT max(stream_version) FROM ef_events "
    "WHERE stream_id = m.s), 0) = m.b), "
    "ins AS (INSERT INTO ef_events (event_id, stream_id, stream_version, envelope, "
    "correlation_id) SELECT u.i, m.s, m.b + u.o, u.e, u.c FROM unnest($3::bigint[], "
    "$4::bigint[], $5::text[], $6::bytea[], $7::text[]) WITH ORDINALITY AS u(k, o, i, e, c, n) "
    "JOIN m ON m.k = u.k WHERE pg_current_xact_id() IS NOT NULL ORDER BY u.n) "
    "SELECT array_agg(k) FROM m"
)

# A group whose appends each write one event (a command's usual append): the same in one
# INSERT from the arrays, each row checking its own stream (streams are unique in a group),
# without the join and sort above (ids follow the arrays' order, as in the one-stream
# append): a quarter less of the server's time per group of eight. $1..$5: each append's
# stream, expected version, event id, envelope, correlation id. The streams written come
# back.
_APPEND_ONES = (
    "WITH ins AS (INSERT INTO ef_events (event_id, stream_id, stream_version, envelope, "
    "correlation_id) SELECT i, s, b + 1, e, c FROM unnest($1::text[], $2::bigint[], "
    "$3::text[], $4::bytea[], $5::text[]) AS u(s, b, i, e, c) "
    "WHERE pg_current_xact_id() IS NOT NULL AND COALESCE((SELECT max(stream_version) "
    "FROM ef_events WHERE stream_id = u.s), 0) = u.b RETURNING stream_id) "
    "SELECT array_agg(stream_id) FROM ins"
)


@dataclass(eq=False, slots=True)
class _Append:
    """One waiting append: what to write, and where its caller waits for the new version
    (or None: append alone)."""

    stream: str
    expected: int
    ids: list[str]
    blobs: list[bytes]
    corrs: list[str]
    future: asyncio.Future[int | None] = field(default_factory=lambda: _loop().create_future())


def _loop() -> asyncio.AbstractEventLoop:
    return asyncio.get_running_loop()


class _Held:
    """The pooled connection a writer keeps from one group to the next (taking and giving
    back one per group was about a tenth of the client's work per group)."""

    __slots__ = ("conn", "pool")

    def __init__(self) -> None:
        self.pool: Any = None
        self.conn: Any = None

    async def acquire(self, pool: Any) -> Any:
        """Take a connection from ``pool`` and keep it."""
        self.pool, self.conn = pool, await pool.acquire()
        return self.conn

    def spare(self) -> bool:
        """Whether the pool could hand out another connection at once (one idle, or room
        for a new one): only then does the writer keep this one, or a small pool's other
        users (readers, the sequencer) would wait for as long as appends keep coming."""
        pool = self.pool
        return pool is not None and (
            pool.get_idle_size() > 0 or pool.get_size() < pool.get_max_size()
        )

    async def release(self) -> None:
        """Give the connection back, if one is kept."""
        conn, self.conn = self.conn, None
        if conn is not None:
            await self.pool.release(conn)


@dataclass(eq=False, slots=True)
class _Stall:
    """One statement in flight: when it started (the loop's clock), and whether it ran past
    ``_STALL``."""

    started: float
    stalled: bool = False


class AppendGroups:
    """The queue and writers of one store's grouped appends, and what they counted:
    ``groups`` (statements that wrote a group), ``combined`` (appends that went in as part
    of a group of two or more), ``fell_back`` (appends a group sent back to their caller),
    ``waiting`` (appends in the queue now)."""

    def __init__(self, db: PostgresDatabase) -> None:
        self._db = db
        self._queue: deque[_Append] = deque()
        self._busy = 0  # writer slots taken: lone appends and writer tasks
        self._stalled = 0  # statements in flight for longer than _STALL
        self._inflight: set[_Stall] = set()
        self._timer: asyncio.TimerHandle | None = None  # the next look for stalls
        self._tasks: set[asyncio.Task[None]] = set()
        self.groups = 0
        self.combined = 0
        self.fell_back = 0

    @property
    def waiting(self) -> int:
        """Appends in the queue now (cancelled ones not counted)."""
        return sum(1 for a in self._queue if not a.future.done())

    def free(self) -> bool:
        """Whether an append may go alone now: a writer slot is free and nothing waits."""
        return self._busy < self._slots() and not self._queue

    def hold(self) -> _Stall:
        """Take a writer slot for a lone append's statement (give it back with
        ``release``)."""
        self._busy += 1
        return self._watch()

    def release(self, stall: _Stall) -> None:
        """Give back a slot that ``hold`` took; a waiting queue gets a writer."""
        self._unwatch(stall)
        self._busy -= 1
        self._start()

    def _slots(self) -> int:
        return min(WRITERS + self._stalled, MAX_WRITERS)

    def _watch(self) -> _Stall:
        """Start timing a statement: past ``_STALL``, while appends wait, it lends its slot
        out (no timer unless an append waits: a lone writer sets none)."""
        stall = _Stall(_loop().time())
        self._inflight.add(stall)
        return stall

    def _unwatch(self, stall: _Stall) -> None:
        self._inflight.discard(stall)
        if stall.stalled:
            self._stalled -= 1

    def _look_later(self) -> None:
        """While appends wait for a slot, look again when the oldest statement in flight
        that still holds its slot reaches ``_STALL``."""
        if self._timer is not None or not self._queue or self._busy < self._slots():
            return
        holding = [s.started for s in self._inflight if not s.stalled]
        if holding:
            due = min(holding) + _STALL - _loop().time()
            self._timer = _loop().call_later(max(due, 0.0), self._look)

    def _look(self) -> None:
        self._timer = None
        now = _loop().time()
        for stall in self._inflight:
            if not stall.stalled and now - stall.started >= _STALL:
                stall.stalled = True
                self._stalled += 1
        self._start()
        self._look_later()

    async def append(
        self, stream: str, expected: int, ids: list[str], blobs: list[bytes], corrs: list[str]
    ) -> int | None:
        """Wait for a group to write this append: the new version, or None when the caller
        must append alone (its stream was not at ``expected``, or the group failed). A caller
        cancelled while it waits is taken out of the queue; once its group is being written,
        its events may go in (as with any statement cancelled in flight)."""
        item = _Append(stream, expected, ids, blobs, corrs)
        self._queue.append(item)
        self._start()
        return await item.future

    def _start(self) -> None:
        if self._queue and self._busy < self._slots():
            self._busy += 1
            task = asyncio.get_running_loop().create_task(self._write())
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        else:
            self._look_later()

    async def _write(self) -> None:
        """A writer: write groups until the queue is empty, then give its slot back (at
        once if more writers run than there are slots: a slot lent out came back)."""
        held = _Held()
        try:
            while self._busy <= self._slots():
                # A turn of the loop first, even with appends waiting: the callers the last
                # group answered append again meanwhile, and join the next group rather than
                # wait for the one after it (a caller out of step would stay out of step).
                for _ in range(_LINGER):
                    await asyncio.sleep(0)
                group = self._take()
                if not group:
                    break
                stall = self._watch()
                self._look_later()  # appends it left queued (a second one to a stream)
                try:
                    await self._write_group(group, held)
                finally:
                    self._unwatch(stall)
                if not held.spare():
                    await held.release()  # the pool has none to spare: others may wait for it
        finally:
            self._busy -= 1
            self._start()
            await held.release()

    def _take(self) -> list[_Append]:
        """The next group: waiting appends in queue order, one per stream, up to
        ``_GROUP_EVENTS`` events; the others stay queued, in order."""
        queue, group, streams, events, later = self._queue, [], set(), 0, []
        while queue and events < _GROUP_EVENTS:
            item = queue.popleft()
            if item.future.done():  # its caller was cancelled
                continue
            if item.stream in streams:
                later.append(item)
                continue
            streams.add(item.stream)
            group.append(item)
            events += len(item.ids)
        queue.extendleft(reversed(later))
        return group

    async def _write_group(self, group: list[_Append], held: _Held) -> None:
        """Write ``group`` in one statement on the writer's connection (``held``: taken from
        the pool for its first group) and answer its callers."""
        ones = all(len(item.ids) == 1 for item in group)
        sql, args = (_APPEND_ONES, _ones_arguments(group)) if ones else _group_arguments(group)
        written: Any = None
        failed = False
        try:
            conn = held.conn if held.conn is not None else await held.acquire(self._db._pool())
            written = await conn.fetchval(sql, *args)
        except Exception:  # nothing of it went in (or, if it did, its ids are stored):
            written = None  # each caller appends alone and learns its own outcome
            failed = True
        finally:
            self.groups += 1
            went_in = set(written or ())
            if ones:  # the streams written: their places in the group
                went_in = {k for k, item in enumerate(group, start=1) if item.stream in went_in}
            if len(group) > 1:
                self.combined += len(went_in)
            self.fell_back += len(group) - len(went_in)
            for k, item in enumerate(group, start=1):
                if not item.future.done():
                    item.future.set_result(item.expected + len(item.ids) if k in went_in else None)
        if failed:  # the connection may have broken: the pool replaces it if so
            await held.release()


def _ones_arguments(group: list[_Append]) -> tuple[list[Any], ...]:
    """``_APPEND_ONES``'s arrays for a group of one-event appends."""
    return (
        [item.stream for item in group],
        [item.expected for item in group],
        [item.ids[0] for item in group],
        [item.blobs[0] for item in group],
        [item.corrs[0] for item in group],
    )


def _group_arguments(group: list[_Append]) -> tuple[str, tuple[list[Any], ...]]:
    """``_APPEND_GROUP`` and its arrays for any group."""
    members: list[str] = []
    bases: list[int] = []
    ks: list[int] = []
    offsets: list[int] = []
    ids: list[str] = []
    blobs: list[bytes] = []
    corrs: list[str] = []
    for k, item in enumerate(group, start=1):
        members.append(item.stream)
        bases.append(item.expected)
        n = len(item.ids)
        ks.extend([k] * n)
        offsets.extend(range(1, n + 1))
        ids.extend(item.ids)
        blobs.extend(item.blobs)
        corrs.extend(item.corrs)
    return _APPEND_GROUP, (members, bases, ks, offsets, ids, blobs, corrs)
